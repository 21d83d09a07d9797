//! Helpers shared by the subcommands: timed steps, running commands, paths.

use anyhow::{Context, Result, bail};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The repository root. xtask sits one folder below it, and every command runs
/// from the root so relative paths (target/, frontend/) mean the same everywhere.
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// Cargo's target folder, honouring CARGO_TARGET_DIR like cargo itself does.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => repo_root().join(dir),
        None => repo_root().join("target"),
    }
}

/// The cargo that started us (set by `cargo run`), so nested calls use the same toolchain.
pub fn cargo_bin() -> OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into())
}

/// Runs `f` as a named step: prints its start, its outcome and its duration, and
/// names the step in the error so a failure in a long log is easy to place.
pub fn step<T>(name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    println!("==> {name}");
    let start = Instant::now();
    let result = f();
    let outcome = if result.is_ok() { "ok" } else { "FAILED" };
    println!("<== {name}: {outcome} ({})", secs(start.elapsed()));
    result.with_context(|| format!("step `{name}` failed"))
}

pub fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// Records steps for a closing summary table (used by `test`, whose log is long).
#[derive(Default)]
pub struct Summary {
    rows: Vec<(String, String, &'static str, String)>,
}

/// Free space on the filesystem holding the target folder, as `df` reports it,
/// so a step that fails for want of disk says so in the summary.
fn free_disk() -> String {
    let out = Command::new("df").arg("-Pk").arg(target_dir()).output();
    let avail_kib = out.ok().and_then(|out| {
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines()
            .nth(1)?
            .split_whitespace()
            .nth(3)?
            .parse::<f64>()
            .ok()
    });
    match avail_kib {
        Some(kib) => format!("{:.1} GiB", kib / (1024.0 * 1024.0)),
        None => "?".to_owned(),
    }
}

impl Summary {
    pub fn step<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let start = Instant::now();
        let result = step(name, f);
        let outcome = if result.is_ok() { "ok" } else { "FAILED" };
        self.rows
            .push((name.to_owned(), secs(start.elapsed()), outcome, free_disk()));
        result
    }

    pub fn skipped(&mut self, name: &str) {
        println!("--- {name}: skipped");
        self.rows
            .push((name.to_owned(), "-".to_owned(), "skipped", free_disk()));
    }

    pub fn print(&self) {
        let width = self
            .rows
            .iter()
            .map(|(name, ..)| name.len())
            .max()
            .unwrap_or(0);
        println!(
            "\n{:<width$}  {:>9}  {:<7}  disk free after",
            "step", "time", "result"
        );
        for (name, time, outcome, free) in &self.rows {
            println!("{name:<width$}  {time:>9}  {outcome:<7}  {free}");
        }
    }
}

/// How a command is shown in logs and errors; an inline script shows as `<script>`.
pub fn show(cmd: &Command) -> String {
    // The cargo from CARGO is a long toolchain path; "cargo" says the same.
    let program = cmd.get_program();
    let mut line = if program == cargo_bin() {
        "cargo".into()
    } else {
        program.to_string_lossy().into_owned()
    };
    for arg in cmd.get_args() {
        let arg = arg.to_string_lossy();
        line.push(' ');
        line.push_str(if arg.contains('\n') { "<script>" } else { &arg });
    }
    line
}

/// Runs a command with inherited stdio (its output stays visible) and fails on a
/// non-zero exit.
pub fn run(cmd: &mut Command) -> Result<()> {
    println!("$ {}", show(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{}`", show(cmd)))?;
    if !status.success() {
        bail!("`{}` failed ({status})", show(cmd));
    }
    Ok(())
}

/// Runs a command quietly and returns its stdout; `None` when it cannot start or
/// fails, which the checks treat as "not installed".
pub fn probe(cmd: &mut Command) -> Option<String> {
    let out = cmd.stderr(Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}
