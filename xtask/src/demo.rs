//! `cargo xtask demo [--addr HOST:PORT] [--providers N]`: a real model trained
//! across local providers, then a local Rookery to click through.
//!
//! Builds the server, the provider (with libtorch) and the release dashboard,
//! starts `rookery serve` with its data in `target/demo-data`, waits until its API
//! answers, starts N native providers (default 6), submits
//! `examples/mnist-job.toml` (the MNIST CNN on the 10,000 real digits in
//! `datasets/mnist-10k`, two clusters of Root -> Stem -> Leaf) with `rookery
//! submit`, follows it with `rookery watch`, downloads the weights to
//! `target/demo-out/weights.safetensors`, prints the test accuracy, and keeps
//! the server up for the dashboard.
//! Ctrl-C in the terminal reaches every process of the foreground group, so it
//! stops the server and the providers too; if xtask fails instead, it kills the
//! processes it started.

use crate::setup;
use crate::util::{run, show, step, target_dir};
use crate::web;
use anyhow::{Context, Result, bail};
use std::io::{self, BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::Child;
use std::time::{Duration, Instant};

/// How long the server may take to answer its first request.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

pub fn main(args: &[String]) -> Result<()> {
    let mut addr = "127.0.0.1:8080".to_owned();
    let mut providers = 6;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--addr" => addr = args.next().context("`--addr` needs HOST:PORT")?.clone(),
            "--providers" => {
                let n = args.next().context("`--providers` needs a number")?;
                providers = n
                    .parse()
                    .with_context(|| format!("`--providers {n}`: not a number"))?;
            }
            other => bail!("`demo` takes `--addr HOST:PORT` and `--providers N`, got `{other}`"),
        }
    }
    demo(&addr, providers)
}

/// Children killed when dropped, i.e. when the demo ends or fails early.
#[derive(Default)]
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            // Errors only mean it is already gone.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn demo(addr: &str, providers: usize) -> Result<()> {
    let env = step("setup", setup::ensure)?;
    step("build server and provider", || {
        let mut cmd = env.cargo();
        cmd.args(["build", "-p", "rookery-server", "-p", "rookery-provider"]);
        run(cmd.args(["--features", "rookery-provider/torch"]))
    })?;
    step("dashboard", || web::build(&env, true))?;
    let target = target_dir();
    let mut children = Children::default();
    step("start server", || {
        let mut cmd = env.command(target.join("debug/rookery"));
        cmd.args(["serve", "--addr", addr, "--data-dir"])
            .arg(target.join("demo-data"));
        cmd.arg("--web-dir").arg(target.join("web"));
        println!("$ {}", show(&cmd));
        children
            .0
            .push(cmd.spawn().context("cannot start the server")?);
        wait_until_up(addr, &mut children.0[0])
    })?;
    step("start providers", || {
        for n in 1..=providers {
            let mut cmd = env.command(target.join("debug/rookery-provider"));
            let name = format!("demo-provider-{n}");
            cmd.args(["--server", &format!("ws://{addr}"), "--name", &name]);
            println!("$ {}", show(&cmd));
            children.0.push(
                cmd.spawn()
                    .with_context(|| format!("cannot start {name}"))?,
            );
        }
        Ok(())
    })?;
    let token = std::fs::read_to_string(target.join("demo-data/api-token"))
        .context("reading the server's API token")?;
    let rookery = |args: &[&str]| {
        let mut cmd = env.command(target.join("debug/rookery"));
        cmd.args(args)
            .args(["--server", &format!("http://{addr}")])
            .env("ROOKERY_TOKEN", token.trim());
        cmd
    };
    let job = crate::util::repo_root().join("examples/mnist-job.toml");
    let id = step("submit the MNIST job", || {
        let mut cmd = rookery(&["submit", &job.display().to_string()]);
        println!("$ {}", show(&cmd));
        let output = cmd.output().context("cannot run rookery submit")?;
        if !output.status.success() {
            bail!(
                "rookery submit failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
    })?;
    println!(
        "job {id}: follow it on http://{addr}/jobs/{id} too (sign in with the token {})",
        token.trim()
    );
    step("train", || run(&mut rookery(&["watch", &id])))?;
    let weights = target.join("demo-out/weights.safetensors");
    step("download the weights", || {
        run(&mut rookery(&[
            "download",
            &id,
            "-o",
            &weights.display().to_string(),
        ]))
    })?;
    println!("\nTrained weights: {}", weights.display());
    println!("Rookery is running: open http://{addr}/ (Ctrl-C stops everything)\n");
    let status = children.0[0].wait().context("cannot wait for the server")?;
    if !status.success() {
        bail!("the server stopped ({status})");
    }
    Ok(())
}

/// Polls `GET /api/providers` until it answers 2xx, failing early if the server exits.
fn wait_until_up(addr: &str, server: &mut Child) -> Result<()> {
    let start = Instant::now();
    loop {
        if let Some(status) = server.try_wait()? {
            bail!("the server exited before answering ({status})");
        }
        let last = match http_status(addr, "/api/providers") {
            Ok(code) if (200..300).contains(&code) => return Ok(()),
            Ok(code) => format!("HTTP {code}"),
            Err(err) => err.to_string(),
        };
        if start.elapsed() > STARTUP_TIMEOUT {
            bail!("http://{addr}/api/providers did not answer within {STARTUP_TIMEOUT:?}: {last}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The status code of a plain HTTP/1.0 GET: enough to tell that the server is up.
fn http_status(addr: &str, path: &str) -> io::Result<u16> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    // One write, so the request leaves in one segment rather than piece by piece.
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())?;
    let mut status_line = String::new();
    BufReader::new(stream).read_line(&mut status_line)?;
    // "HTTP/1.1 200 OK"
    status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| io::Error::other(format!("not an HTTP answer: {status_line:?}")))
}

#[cfg(test)]
mod tests {
    use super::http_status;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    #[test]
    fn reads_the_status_code() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = [0; 512];
            let n = stream.read(&mut request).unwrap();
            stream
                .write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
                .unwrap();
            String::from_utf8_lossy(&request[..n]).into_owned()
        });
        assert_eq!(http_status(&addr, "/api/providers").unwrap(), 204);
        assert!(
            server
                .join()
                .unwrap()
                .starts_with("GET /api/providers HTTP/1.0\r\n")
        );
    }
}
