//! `cargo xtask bench <name>`: benchmarks that print ratios measured in one run.
//!
//! Each benchmark is a release-mode example of the crate it measures, so it
//! times optimised code without a benchmarking framework. Benchmarks that run
//! the real binaries get release builds of them first (`ROOKERY_BIN_DIR`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::setup::{self, Env, WASM_TARGET};
use crate::util::{probe, run, target_dir};

struct Bench {
    name: &'static str,
    package: &'static str,
    example: &'static str,
    features: &'static [&'static str],
    /// Whether it starts `rookery` and `rookery-provider` processes.
    needs_binaries: bool,
    /// Release build with overflow checks and debug assertions, as cargo-fuzz
    /// builds: an overflow on a hostile input must show up as a panic.
    checked: bool,
    /// Exports models with PyTorch: gets the cache's torch venv
    /// (`ROOKERY_PYTHON`).
    needs_torch_python: bool,
    /// Also reports the web provider's wasm size as donors download it
    /// (after wasm-bindgen and wasm-opt, gzip-compressed) against its 1 MiB
    /// target.
    wasm_size: bool,
}

const BENCHES: &[Bench] = &[
    Bench {
        name: "gpt",
        package: "rookery-e2e",
        example: "bench_gpt",
        features: &["rookery-e2e/torch"],
        needs_binaries: true,
        checked: false,
        needs_torch_python: true,
        wasm_size: false,
    },
    Bench {
        name: "plan",
        package: "rookery-model",
        example: "bench_plan",
        features: &[],
        needs_binaries: false,
        checked: false,
        needs_torch_python: false,
        wasm_size: false,
    },
    Bench {
        name: "pipeline",
        package: "rookery-e2e",
        example: "bench_pipeline",
        features: &["rookery-e2e/torch"],
        needs_binaries: true,
        checked: false,
        needs_torch_python: true,
        wasm_size: false,
    },
    Bench {
        name: "sync",
        package: "rookery-e2e",
        example: "bench_sync",
        features: &[],
        needs_binaries: true,
        checked: false,
        needs_torch_python: false,
        wasm_size: false,
    },
    Bench {
        name: "load",
        package: "rookery-e2e",
        example: "bench_load",
        features: &[],
        needs_binaries: true,
        checked: false,
        needs_torch_python: false,
        wasm_size: false,
    },
    Bench {
        name: "relay",
        package: "rookery-e2e",
        example: "bench_relay",
        features: &[],
        needs_binaries: false,
        checked: false,
        needs_torch_python: false,
        wasm_size: false,
    },
    Bench {
        name: "fuzz",
        package: "rookery-fuzz",
        example: "bench_fuzz",
        features: &[],
        needs_binaries: false,
        checked: true,
        needs_torch_python: false,
        wasm_size: false,
    },
    Bench {
        name: "kernels",
        package: "rookery-e2e",
        example: "bench_kernels",
        features: &["rookery-e2e/torch"],
        needs_binaries: false,
        checked: false,
        needs_torch_python: false,
        wasm_size: true,
    },
];

pub fn main(args: &[String]) -> Result<()> {
    let names: Vec<&str> = BENCHES.iter().map(|b| b.name).collect();
    let [name, rest @ ..] = args else {
        bail!(
            "usage: cargo xtask bench <{}> [ARGS for the benchmark]",
            names.join(" | ")
        );
    };
    let Some(bench) = BENCHES.iter().find(|b| b.name == name) else {
        bail!("no benchmark `{name}`; available: {}", names.join(", "));
    };
    let env = setup::ensure()?;
    if bench.needs_binaries {
        build_release_binaries(&env)?;
    }
    let mut cargo = env.cargo();
    cargo.args([
        "run",
        "--release",
        "--quiet",
        "-p",
        bench.package,
        "--example",
        bench.example,
    ]);
    for feature in bench.features {
        cargo.args(["--features", feature]);
    }
    if bench.checked {
        cargo
            .env("CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS", "true")
            .env("CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS", "true");
    }
    if !rest.is_empty() {
        cargo.arg("--").args(rest);
    }
    cargo.env("ROOKERY_BIN_DIR", target_dir().join("release"));
    if bench.needs_torch_python {
        cargo.env("ROOKERY_PYTHON", setup::ensure_torch_python()?);
    }
    run(&mut cargo)?;
    if bench.wasm_size {
        wasm_size(&env)?;
        donate_latency(&env)?;
    }
    Ok(())
}

/// `rookery` and the libtorch `rookery-provider`, release builds, for the
/// benchmarks that start them (`ROOKERY_BIN_DIR`).
fn build_release_binaries(env: &Env) -> Result<()> {
    let mut cargo = env.cargo();
    cargo.args([
        "build",
        "--release",
        "--quiet",
        "-p",
        "rookery-server",
        "-p",
        "rookery-provider",
        "--features",
        "rookery-provider/torch,rookery-server/bench-latency",
    ]);
    run(&mut cargo)
}

/// The time from opening the Donate page to the tab's first micro-batch
/// done, with release builds of the server, the providers and the dashboard.
fn donate_latency(env: &Env) -> Result<()> {
    build_release_binaries(env)?;
    crate::web::build(env, true)?;
    let mut cargo = env.cargo();
    cargo.args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "rookery-e2e",
        "--example",
        "bench_donate",
    ]);
    cargo
        .env("ROOKERY_BIN_DIR", target_dir().join("release"))
        .env("ROOKERY_WEB_DIR", target_dir().join("web"));
    run(&mut cargo)
}

/// The compressed-size target of the web provider's wasm.
const WASM_TARGET_BYTES: u64 = 1 << 20;
/// The binaryen release `wasm-opt` comes from (npm package `binaryen`).
const BINARYEN_VERSION: &str = "132";

/// Builds what a donor's browser downloads, the dashboard's wasm (the web
/// provider is compiled into it: its own cdylib exports nothing to
/// JavaScript, so on its own it shrinks to nothing), in release mode; runs
/// wasm-bindgen and wasm-opt -Oz on it and prints raw and gzip -9 sizes
/// against the target.
fn wasm_size(env: &Env) -> Result<()> {
    let mut cargo = env.cargo();
    cargo.args([
        "build",
        "--release",
        "--quiet",
        "-p",
        "rookery-frontend",
        "--target",
        WASM_TARGET,
    ]);
    run(&mut cargo)?;
    let out = target_dir().join("bench-web-provider");
    if out.exists() {
        std::fs::remove_dir_all(&out)?;
    }
    let wasm = target_dir()
        .join(WASM_TARGET)
        .join("release")
        .join("rookery-frontend.wasm");
    let mut bindgen = env.command(env.wasm_bindgen());
    bindgen
        .args(["--target", "web", "--no-typescript", "--out-dir"])
        .arg(&out)
        .args(["--out-name", "rookery_frontend"])
        .arg(&wasm);
    run(&mut bindgen)?;
    let bound = out.join("rookery_frontend_bg.wasm");
    let (optimised, how) = match wasm_opt() {
        Some(wasm_opt) => {
            let opt = out.join("rookery_frontend_opt.wasm");
            // -all: accept every feature rustc may have emitted.
            let mut cmd = Command::new(&wasm_opt);
            cmd.args(["-Oz", "-all"]).arg(&bound).arg("-o").arg(&opt);
            run(&mut cmd)?;
            (
                opt,
                format!("wasm-bindgen + wasm-opt -Oz (binaryen {BINARYEN_VERSION})"),
            )
        }
        None => (
            bound.clone(),
            "wasm-bindgen only: no wasm-opt (binaryen) found or installable".to_string(),
        ),
    };
    let raw = std::fs::metadata(&optimised)?.len();
    let gz = gzip_size(&optimised)?;
    println!("\nweb provider as donors download it, inside the dashboard's wasm ({how}):");
    println!(
        "  {:.1} KiB raw, {:.1} KiB gzip -9",
        raw as f64 / 1024.0,
        gz as f64 / 1024.0
    );
    println!(
        "  target: under {} KiB compressed: {} ({:.0}% of it)",
        WASM_TARGET_BYTES / 1024,
        if gz < WASM_TARGET_BYTES {
            "met"
        } else {
            "MISSED"
        },
        gz as f64 * 100.0 / WASM_TARGET_BYTES as f64
    );
    Ok(())
}

/// `wasm-opt` from npm's `binaryen` package in the cache folder, installed
/// there with npm on first use; else one on PATH; else none.
fn wasm_opt() -> Option<PathBuf> {
    let prefix = setup::cache_dir()
        .ok()?
        .join(format!("binaryen-{BINARYEN_VERSION}"));
    let bin = prefix.join("node_modules/.bin/wasm-opt");
    if !bin.exists() {
        let mut npm = Command::new("npm");
        npm.args(["install", "--no-audit", "--no-fund", "--prefix"])
            .arg(&prefix)
            .arg(format!("binaryen@{BINARYEN_VERSION}"));
        probe(&mut npm);
    }
    if bin.exists() {
        return Some(bin);
    }
    probe(Command::new("wasm-opt").arg("--version")).map(|_| PathBuf::from("wasm-opt"))
}

/// Bytes of `path` after `gzip -9`.
fn gzip_size(path: &Path) -> Result<u64> {
    let out = Command::new("gzip")
        .args(["-9", "-c"])
        .arg(path)
        .output()
        .context("could not run gzip")?;
    if !out.status.success() {
        bail!("gzip failed on {}", path.display());
    }
    Ok(out.stdout.len() as u64)
}
