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
}

const BENCHES: &[Bench] = &[
    Bench {
        name: "plan",
        package: "rookery-model",
        example: "bench_plan",
        features: &[],
        needs_binaries: false,
    },
    Bench {
        name: "pipeline",
        package: "rookery-e2e",
        example: "bench_pipeline",
        features: &["rookery-e2e/torch"],
        needs_binaries: true,
    },
    Bench {
        name: "relay",
        package: "rookery-e2e",
        example: "bench_relay",
        features: &[],
        needs_binaries: false,
    },
];

pub fn main(args: &[String]) -> Result<()> {
    let names: Vec<&str> = BENCHES.iter().map(|b| b.name).collect();
    let [name] = args else {
        bail!("usage: cargo xtask bench <{}>", names.join(" | "));
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
    cargo.env("ROOKERY_BIN_DIR", target_dir().join("release"));
    run(&mut cargo)
}
