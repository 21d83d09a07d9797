//! `cargo xtask bench <name>`: benchmarks that print ratios measured in one run.
//!
//! Each benchmark is a release-mode example of the crate it measures, so it
//! times optimised code without a benchmarking framework.

use anyhow::{Result, bail};

use crate::setup;
use crate::util::run;

/// (name, package, example) of every benchmark built so far.
const BENCHES: &[(&str, &str, &str)] = &[("plan", "rookery-model", "bench_plan")];

pub fn main(args: &[String]) -> Result<()> {
    let names: Vec<&str> = BENCHES.iter().map(|(name, ..)| *name).collect();
    let [name] = args else {
        bail!("usage: cargo xtask bench <{}>", names.join(" | "));
    };
    let Some((_, package, example)) = BENCHES.iter().find(|(n, ..)| n == name) else {
        bail!("no benchmark `{name}` yet; available: {}", names.join(", "));
    };
    let env = setup::ensure()?;
    let mut cargo = env.cargo();
    cargo.args([
        "run",
        "--release",
        "--quiet",
        "-p",
        package,
        "--example",
        example,
    ]);
    run(&mut cargo)
}
