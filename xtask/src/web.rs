//! `cargo xtask web [--release]`: builds the dashboard into `target/web/`.
//!
//! The frontend crate is compiled to wasm32, wasm-bindgen (the CLI version that
//! matches Cargo.lock, from setup) writes the JS glue into `target/web/pkg/`, and
//! the static files from `frontend/` are copied next to it. The server serves
//! that folder with `--web-dir`.

use crate::setup::{self, Env, WASM_TARGET};
use crate::util::{run, step, target_dir};
use anyhow::{Context, Result, bail};
use std::fs;
use std::path::Path;

pub fn main(args: &[String]) -> Result<()> {
    let release = match args {
        [] => false,
        [flag] if flag == "--release" => true,
        _ => bail!("`web` takes only `--release`, got `{}`", args.join(" ")),
    };
    let env = step("setup", setup::ensure)?;
    build(&env, release)
}

/// Builds the dashboard with an environment from [`setup::ensure`].
pub fn build(env: &Env, release: bool) -> Result<()> {
    let profile = if release { "release" } else { "debug" };
    let web = target_dir().join("web");
    let pkg = web.join("pkg");
    step("frontend wasm", || {
        let mut cmd = env.cargo();
        cmd.args(["build", "-p", "rookery-frontend", "--target", WASM_TARGET]);
        if release {
            cmd.arg("--release");
        }
        run(&mut cmd)
    })?;
    step("wasm-bindgen", || {
        // Start empty so files of an older build (e.g. JS snippets) do not linger.
        if pkg.exists() {
            fs::remove_dir_all(&pkg)?;
        }
        let wasm = target_dir()
            .join(WASM_TARGET)
            .join(profile)
            .join("rookery-frontend.wasm");
        let mut cmd = env.command(env.wasm_bindgen());
        cmd.args(["--target", "web", "--no-typescript", "--out-dir"])
            .arg(&pkg);
        run(cmd.args(["--out-name", "rookery_frontend"]).arg(wasm))
    })?;
    step("static files", || {
        let frontend = crate::util::repo_root().join("frontend");
        for file in ["index.html", "style.css"] {
            let from = frontend.join(file);
            if from.exists() {
                fs::copy(&from, web.join(file))
                    .with_context(|| format!("cannot copy {}", from.display()))?;
            } else {
                // Not fatal: the dashboard is still being written; the e2e tests
                // catch a dashboard that does not load.
                println!("warning: {} does not exist, not copied", from.display());
            }
        }
        let assets = frontend.join("static");
        if assets.is_dir() {
            copy_dir(&assets, &web)
        } else {
            Ok(())
        }
    })?;
    let wasm = pkg.join("rookery_frontend_bg.wasm");
    let size = fs::metadata(&wasm)
        .with_context(|| format!("{} is missing", wasm.display()))?
        .len();
    println!(
        "dashboard in {} ({}: {:.1} KiB)",
        web.display(),
        wasm.display(),
        size as f64 / 1024.0
    );
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            fs::copy(entry.path(), &target)
                .with_context(|| format!("cannot copy {}", entry.path().display()))?;
        }
    }
    Ok(())
}
