//! `cargo xtask bench <name>`: benchmarks that print ratios measured in one run.
//!
//! Each benchmark is a release-mode example of the crate it measures, so it
//! times optimised code without a benchmarking framework. Benchmarks that run
//! the real binaries get release builds of them first (`ROOKERY_BIN_DIR`).

use anyhow::{Result, bail};

use crate::setup;
use crate::util::{run, target_dir};

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
}

const BENCHES: &[Bench] = &[
    Bench {
        name: "plan",
        package: "rookery-model",
        example: "bench_plan",
        features: &[],
        needs_binaries: false,
        checked: false,
    },
    Bench {
        name: "pipeline",
        package: "rookery-e2e",
        example: "bench_pipeline",
        features: &["rookery-e2e/torch"],
        needs_binaries: true,
        checked: false,
    },
    Bench {
        name: "load",
        package: "rookery-e2e",
        example: "bench_load",
        features: &[],
        needs_binaries: true,
        checked: false,
    },
    Bench {
        name: "relay",
        package: "rookery-e2e",
        example: "bench_relay",
        features: &[],
        needs_binaries: false,
        checked: false,
    },
    Bench {
        name: "fuzz",
        package: "rookery-fuzz",
        example: "bench_fuzz",
        features: &[],
        needs_binaries: false,
        checked: true,
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
            "rookery-provider/torch",
        ]);
        run(&mut cargo)?;
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
    run(&mut cargo)
}
