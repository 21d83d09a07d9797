//! Harness for Rookery's end-to-end tests: real `rookery` and
//! `rookery-provider` processes and a real headless Chromium, all on loopback.
//!
//! The binaries and the dashboard must be built first; `cargo xtask test`
//! does that and points `ROOKERY_BIN_DIR` and `ROOKERY_WEB_DIR` at them.
//! Every process is killed when its handle drops, so a failing test leaves
//! nothing running.

pub mod gpt;
#[cfg(feature = "torch")]
pub mod reference;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rookery_proto::api::{ProviderInfo, ProviderList};
use rookery_test_support::workspace_root;

fn dir_from_env(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(default))
}

pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let path = dir_from_env("ROOKERY_BIN_DIR", "target/debug").join(name);
    if !path.is_file() {
        bail!(
            "{} is missing: build it first (`cargo xtask test` does, with \
             `cargo build --workspace --all-features --bins`)",
            path.display()
        );
    }
    Ok(path)
}

/// Where tests leave screenshots for people to look at.
pub fn screenshot_dir() -> PathBuf {
    let dir = workspace_root().join("target/screenshots");
    let _ = std::fs::create_dir_all(&dir);
    dir
}

/// A child process that dies with its handle.
#[derive(Debug)]
pub struct Process(Child);

impl Process {
    pub fn spawn(command: &mut Command) -> anyhow::Result<Self> {
        Ok(Self(command.spawn().context("starting a process")?))
    }

    /// SIGKILL, the way a crashed or unplugged machine leaves.
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    /// SIGTERM, and waits for the process to end: a provider then closes
    /// its socket with a close frame, as a browser does for a closed tab.
    pub fn terminate(&mut self) -> anyhow::Result<()> {
        let status = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status()
            .context("running kill -TERM")?;
        if !status.success() {
            bail!("kill -TERM {} failed: {status}", self.0.id());
        }
        self.0.wait().context("waiting for the process to end")?;
        Ok(())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A child that leads a process group of its own; the whole group dies with
/// the handle.
#[derive(Debug)]
pub struct ProcessGroup(Process);

impl ProcessGroup {
    /// Starts `command` as the leader of a new process group: whatever it
    /// starts (a `rookery train`'s providers) dies with it.
    pub fn spawn(command: &mut Command) -> anyhow::Result<Self> {
        Ok(Self(Process::spawn(command.process_group(0))?))
    }

    /// The leader's process id.
    pub fn id(&self) -> u32 {
        self.0.0.id()
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0.0.id())])
            .stderr(Stdio::null())
            .status();
    }
}

impl From<Child> for Process {
    fn from(child: Child) -> Self {
        Self(child)
    }
}

/// A `rookery serve` process on a free loopback port with its own data dir.
#[derive(Debug)]
pub struct Server {
    pub addr: SocketAddr,
    _process: Process,
    _data_dir: tempfile::TempDir,
}

impl Server {
    pub fn start(heartbeat_timeout_ms: u64) -> anyhow::Result<Self> {
        Self::start_with(heartbeat_timeout_ms, &[])
    }

    /// [`Server::start`] with more `rookery serve` arguments.
    pub fn start_with(heartbeat_timeout_ms: u64, extra: &[&str]) -> anyhow::Result<Self> {
        Self::start_in(
            tempfile::tempdir()?,
            "127.0.0.1:0",
            heartbeat_timeout_ms,
            extra,
        )
    }

    /// SIGKILLs the server and starts a new one on the same data dir and
    /// address (so providers find it again), as after a crash and a restart.
    pub fn kill_and_restart(self, heartbeat_timeout_ms: u64) -> anyhow::Result<Self> {
        let Server {
            addr,
            _process: mut process,
            _data_dir: data_dir,
        } = self;
        process.kill();
        let addr = addr.to_string();
        // The port may linger for a moment after the kill.
        let started = Instant::now();
        loop {
            match std::net::TcpListener::bind(&addr) {
                Ok(probe) => {
                    drop(probe);
                    break;
                }
                Err(error) if started.elapsed() > Duration::from_secs(10) => {
                    bail!("port {addr} stays taken after the kill: {error}")
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
        Self::start_in(data_dir, &addr, heartbeat_timeout_ms, &[])
    }

    fn start_in(
        data_dir: tempfile::TempDir,
        addr: &str,
        heartbeat_timeout_ms: u64,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let web_dir = dir_from_env("ROOKERY_WEB_DIR", "target/web");
        let mut child = Command::new(binary("rookery")?)
            .args(["serve", "--addr", addr, "--data-dir"])
            .arg(data_dir.path())
            .arg("--web-dir")
            .arg(&web_dir)
            .args(["--heartbeat-timeout-ms", &heartbeat_timeout_ms.to_string()])
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .context("starting rookery serve")?;
        let stdout = child.stdout.take().context("server stdout")?;
        let process = Process(child);
        let mut lines = BufReader::new(stdout).lines();
        let addr = loop {
            let line = lines
                .next()
                .context("the server exited before saying where it listens")??;
            if let Some(rest) = line.strip_prefix("Rookery server listening on http://") {
                let addr = rest.split('/').next().unwrap_or_default();
                break addr.parse().with_context(|| format!("parsing {line:?}"))?;
            }
        };
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Ok(Self {
            addr,
            _process: process,
            _data_dir: data_dir,
        })
    }

    /// The server process's id (for reading its memory in `/proc`).
    pub fn pid(&self) -> u32 {
        self._process.0.id()
    }

    /// The server's data dir (database, job folders, `datasets/`, the first
    /// Requester's `api-token`).
    pub fn data_dir(&self) -> &Path {
        self._data_dir.path()
    }

    /// The Requester's API token the server created in its data dir.
    pub fn api_token(&self) -> anyhow::Result<String> {
        let path = self._data_dir.path().join("api-token");
        let token = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        Ok(token.trim().to_string())
    }

    pub fn http_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The provider list as the Requester sees it (names and work).
    pub async fn providers(&self) -> anyhow::Result<Vec<ProviderInfo>> {
        let response = reqwest::Client::new()
            .get(self.http_url("/api/providers"))
            .bearer_auth(self.api_token()?)
            .send()
            .await?;
        let list: ProviderList = response.error_for_status()?.json().await?;
        Ok(list.providers)
    }

    /// Polls `/api/providers` until `done` holds, or fails after `timeout`
    /// showing what the server last said.
    pub async fn wait_for_providers(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&[ProviderInfo]) -> bool,
    ) -> anyhow::Result<Vec<ProviderInfo>> {
        let started = Instant::now();
        loop {
            let providers = self.providers().await?;
            if done(&providers) {
                return Ok(providers);
            }
            if started.elapsed() > timeout {
                bail!("timed out after {timeout:?} waiting for {what}; providers: {providers:#?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A `rookery-provider` process (libtorch build) connected to `server`.
pub fn start_native_provider(server: &Server, name: &str) -> anyhow::Result<Process> {
    Ok(Process(
        provider_command(server, name, &[])?
            .spawn()
            .context("starting rookery-provider")?,
    ))
}

/// The command line of a `rookery-provider` for `server`, with `extra` arguments.
pub fn provider_command(server: &Server, name: &str, extra: &[&str]) -> anyhow::Result<Command> {
    let mut command = Command::new(binary("rookery-provider")?);
    command
        .args([
            "--server",
            &format!("ws://{}", server.addr),
            "--device",
            "cpu",
            "--name",
            name,
        ])
        .args(extra)
        .stdout(Stdio::null());
    // Each test's server is new; a credential kept for it would only litter
    // the user's state folder.
    if !extra.contains(&"--identity-file") {
        command.arg("--ephemeral-identity");
    }
    Ok(command)
}

/// Runs `rookery ARGS` to the end: (success, stdout, stderr).
pub fn rookery(args: &[&str]) -> anyhow::Result<(bool, String, String)> {
    let output = Command::new(binary("rookery")?)
        .args(args)
        .output()
        .context("running rookery")?;
    Ok((
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    ))
}

/// Runs `rookery train JOB --local-providers N --out OUT` to the end and
/// returns the metrics it wrote; fails with the command's output if it fails.
pub fn rookery_train(
    job: &Path,
    providers: usize,
    out: &Path,
) -> anyhow::Result<rookery_proto::api::JobMetrics> {
    rookery_train_with(job, providers, out, &[], Duration::from_secs(3600))
}

/// [`rookery_train`] with more `rookery train` arguments, killed and failed
/// if it runs past `deadline` (a job that stalls fails its test instead of
/// hanging it). Its output goes to `OUT/train.log`.
pub fn rookery_train_with(
    job: &Path,
    providers: usize,
    out: &Path,
    extra: &[&str],
    deadline: Duration,
) -> anyhow::Result<rookery_proto::api::JobMetrics> {
    std::fs::create_dir_all(out).context("creating the output folder")?;
    let log_path = out.join("train.log");
    let log = std::fs::File::create(&log_path).context("creating train.log")?;
    let mut child: Process = Command::new(binary("rookery")?)
        .args([
            "train",
            &job.display().to_string(),
            "--local-providers",
            &providers.to_string(),
            "--out",
            &out.display().to_string(),
        ])
        .args(extra)
        .env("ROOKERY_PROVIDER_BIN", binary("rookery-provider")?)
        .env("RUST_LOG", "warn")
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("running rookery train")?
        .into();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.0.try_wait()? {
            break status;
        }
        if started.elapsed() > deadline {
            child.kill();
            bail!(
                "rookery train ran past {} s:\n{}",
                deadline.as_secs(),
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if !status.success() {
        bail!(
            "rookery train failed ({status}):\n{}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
    }
    let text = std::fs::read_to_string(out.join("metrics.json")).context("reading metrics.json")?;
    Ok(serde_json::from_str(&text)?)
}

/// Flags every headless Chromium of ours needs: WebGPU on (SwiftShader in
/// CI), and nothing that reaches beyond this machine.
pub const CHROMIUM_FLAGS: &[&str] = &[
    "--headless=new",
    "--enable-unsafe-webgpu",
    "--no-sandbox",
    "--disable-gpu-sandbox",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
];

/// Headless Chromium driven through chromedriver over WebDriver.
#[derive(Debug)]
pub struct Browser {
    pub client: fantoccini::Client,
    _driver: ProcessGroup,
    _profile: tempfile::TempDir,
}

impl Browser {
    pub async fn start() -> anyhow::Result<Self> {
        Self::launch(None, true).await
    }

    /// A browser that saves downloads into `dir` without asking.
    pub async fn start_with_downloads(dir: &Path) -> anyhow::Result<Self> {
        Self::launch(Some(dir), true).await
    }

    /// A browser without WebGPU, as most browsers still are.
    pub async fn start_without_webgpu() -> anyhow::Result<Self> {
        Self::launch(None, false).await
    }

    async fn launch(downloads: Option<&Path>, webgpu: bool) -> anyhow::Result<Self> {
        let chromedriver =
            std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "/usr/bin/chromedriver".into());
        let chromium =
            std::env::var("ROOKERY_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        let port = free_port()?;
        let driver = ProcessGroup(Process(
            Command::new(&chromedriver)
                .arg(format!("--port={port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                // Chromium is chromedriver's child: a test that fails before
                // closing its session must not leave it running.
                .process_group(0)
                .spawn()
                .with_context(|| {
                    format!("starting {chromedriver} (cargo xtask setup installs it)")
                })?,
        ));
        let profile = tempfile::tempdir()?;
        let mut args: Vec<String> = CHROMIUM_FLAGS
            .iter()
            .filter(|f| webgpu || !f.contains("webgpu"))
            .map(|f| f.to_string())
            .collect();
        args.push(format!("--user-data-dir={}", profile.path().display()));
        let mut capabilities = serde_json::Map::new();
        let mut options = serde_json::json!({ "binary": chromium, "args": args });
        if let Some(dir) = downloads {
            options["prefs"] = serde_json::json!({
                "download.default_directory": dir.display().to_string(),
                "download.prompt_for_download": false,
            });
        }
        capabilities.insert("goog:chromeOptions".into(), options);
        let started = Instant::now();
        let client = loop {
            let attempt = fantoccini::ClientBuilder::rustls()?
                .capabilities(capabilities.clone())
                .connect(&format!("http://127.0.0.1:{port}"))
                .await;
            match attempt {
                Ok(client) => break client,
                Err(error) if started.elapsed() < Duration::from_secs(20) => {
                    let _ = error;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(error) => return Err(error).context("starting a Chromium session"),
            }
        };
        Ok(Self {
            client,
            _driver: driver,
            _profile: profile,
        })
    }

    /// Opens `server`'s Donate page, presses the button and waits until the
    /// server has welcomed the tab. The tab keeps donating when hidden (the
    /// tests open other pages in other tabs), as a donor who unticks the
    /// box does.
    pub async fn start_donating(&self, server: &Server) -> anyhow::Result<()> {
        self.client.goto(&server.http_url("/donate")).await?;
        let hidden_pauses = self
            .client
            .wait()
            .at_most(Duration::from_secs(30))
            .for_element(fantoccini::Locator::Css("#pause-when-hidden"))
            .await?;
        if hidden_pauses.prop("checked").await?.as_deref() == Some("true") {
            hidden_pauses.click().await?;
        }
        self.client
            .wait()
            .at_most(Duration::from_secs(30))
            .for_element(fantoccini::Locator::Css("#donate-start"))
            .await?
            .click()
            .await?;
        self.wait_for_attr(
            "#donate-status",
            "data-state",
            "connected",
            Duration::from_secs(90),
        )
        .await
    }

    /// A fresh server with two native providers (`native-a`, `native-b`)
    /// and this browser's tab donating to it, every link measured: where
    /// the browser-stage tests start. The providers live as long as the
    /// returned processes.
    pub async fn beside_two_natives(&self) -> anyhow::Result<(Server, [Process; 2])> {
        let server = Server::start(10_000)?;
        let natives = [
            start_native_provider(&server, "native-a")?,
            start_native_provider(&server, "native-b")?,
        ];
        self.start_donating(&server).await?;
        server
            .wait_for_providers(
                "two native and one browser provider, links measured",
                Duration::from_secs(60),
                |all| all.len() == 3 && all.iter().all(|p| p.bandwidth_mbps.is_some()),
            )
            .await?;
        Ok((server, natives))
    }

    /// Saves a PNG of the current page under `target/screenshots/`.
    pub async fn screenshot(&self, name: &str) -> anyhow::Result<PathBuf> {
        let png = self.client.screenshot().await?;
        let path = screenshot_dir().join(format!("{name}.png"));
        std::fs::write(&path, png)?;
        Ok(path)
    }

    /// Waits until the element matching `css` has `attribute` equal to one
    /// of `wanted`, failing early if it takes one of `fatal`.
    pub async fn wait_for_attr(
        &self,
        css: &str,
        attribute: &str,
        wanted: &str,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let started = Instant::now();
        let mut last = None;
        while started.elapsed() < timeout {
            if let Ok(element) = self.client.find(fantoccini::Locator::Css(css)).await {
                let value = element.attr(attribute).await?;
                if value.as_deref() == Some(wanted) {
                    return Ok(());
                }
                let text = element.text().await.unwrap_or_default();
                last = Some(format!("{attribute}={value:?}, text {text:?}"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        bail!("{css} never had {attribute}={wanted:?} within {timeout:?}; last seen: {last:?}")
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
