//! `cargo xtask conformance [--backend cpu,torch,wgpu] [--filter TEXT]`:
//! ONNX's own backend node test cases on each of Rookery's executors.
//!
//! The pinned `onnx` (`setup::ONNX_VERSION`, in the cache's `onnx-venv`)
//! writes its cases into `target/onnx-cases/` (once per version, with
//! `xtask/python/onnx_node_cases.py`); the `onnx_conformance` example of
//! `rookery-server` runs every case whose ops the importer knows on the CPU
//! reference, libtorch and wgpu (lavapipe in CI) and prints a per-op table
//! and `N passed, M failed, K skipped` per backend. Any failure fails the
//! command.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Result, bail};

use crate::setup::{self, Env};
use crate::util::{repo_root, run, step, target_dir};

/// Every backend, the default.
const ALL_BACKENDS: &str = "cpu,torch,wgpu";

pub fn main(args: &[String]) -> Result<()> {
    let mut backends = ALL_BACKENDS.to_string();
    let mut filter = None;
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match (arg.as_str(), rest.next()) {
            ("--backend", Some(list)) => backends = list.clone(),
            ("--filter", Some(text)) => filter = Some(text.clone()),
            _ => bail!("usage: cargo xtask conformance [--backend cpu,torch,wgpu] [--filter TEXT]"),
        }
    }
    let env = setup::ensure()?;
    step("build the conformance runner", || build(&env))?;
    run_cases(&env, &backends, filter.as_deref())
}

/// Builds the runner with the workspace's features all on, as `cargo test
/// --workspace --all-features` builds it, so the test run reuses its build.
pub fn build(env: &Env) -> Result<()> {
    run(env.cargo().args([
        "build",
        "--workspace",
        "--all-features",
        "--example",
        "onnx_conformance",
    ]))
}

/// Generates the cases if needed and runs the built runner over them.
pub fn run_cases(env: &Env, backends: &str, filter: Option<&str>) -> Result<()> {
    let cases = step("ONNX node cases", ensure_cases)?;
    let mut cmd = env.command(target_dir().join("debug/examples/onnx_conformance"));
    cmd.arg(&cases).args(["--backend", backends]);
    if let Some(text) = filter {
        cmd.args(["--filter", text]);
    }
    run(&mut cmd)
}

/// `target/onnx-cases/`, written by the pinned `onnx` unless already there.
fn ensure_cases() -> Result<PathBuf> {
    let dir = target_dir().join("onnx-cases");
    if written_by_pinned_onnx(&dir) {
        println!(
            "{} has the cases of onnx {}",
            dir.display(),
            setup::ONNX_VERSION
        );
        return Ok(dir);
    }
    let python = setup::ensure_onnx_python()?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    run(Command::new(python)
        .arg(repo_root().join("xtask/python/onnx_node_cases.py"))
        .arg(&dir))?;
    Ok(dir)
}

fn written_by_pinned_onnx(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("onnx_version.txt"))
        .is_ok_and(|v| v.trim() == setup::ONNX_VERSION)
}
