//! `cargo xtask bench fuzz [--inputs N] [--seed S] [--target NAME-PART]`: N structured random
//! inputs (default 1,000,000) through each parser of untrusted bytes, in a
//! release build with overflow checks; prints inputs/s, how many parsed, and
//! the panic count, which must be zero. Panicking inputs are written to
//! `target/fuzz-panics/` to become regression tests.

use std::process::ExitCode;

use anyhow::{Context, bail};
use rookery_fuzz::{fuzz, targets};

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<bool> {
    let mut inputs = 1_000_000u64;
    let mut seed = 0x5eed_u64;
    let mut only: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> anyhow::Result<u64> {
            let text = args
                .next()
                .with_context(|| format!("{name} needs a value"))?;
            text.replace('_', "")
                .parse()
                .with_context(|| format!("{name} {text}"))
        };
        match arg.as_str() {
            "--inputs" => inputs = value("--inputs")?,
            "--seed" => seed = value("--seed")?,
            "--target" => {
                only = Some(args.next().context("--target needs a value")?);
            }
            other => bail!(
                "unknown argument {other}; usage: bench_fuzz [--inputs N] [--seed S] [--target NAME-PART]"
            ),
        }
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let targets = targets::all().context("reading the seed files")?;
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fuzz-panics");
    rookery_fuzz::quiet_panics();
    // Arithmetic overflow is a panic only with overflow checks, which
    // `cargo xtask bench fuzz` turns on for release builds as cargo-fuzz does.
    let overflow_checks = std::panic::catch_unwind(|| {
        let byte: u8 = std::hint::black_box(255);
        byte + std::hint::black_box(1)
    })
    .is_err();
    println!(
        "fuzz: {inputs} inputs per target, seed {seed:#x}, {threads} threads, overflow checks {}",
        if overflow_checks { "on" } else { "off" }
    );
    println!(
        "{:<22} {:>10} {:>12} {:>9} {:>8}",
        "target", "inputs", "inputs/s", "parsed", "panics"
    );
    let mut total_panics = 0;
    let chosen = targets.list.iter().filter(|t| {
        only.as_ref()
            .is_none_or(|part| t.name.contains(part.as_str()))
    });
    for target in chosen {
        let report = fuzz(target, inputs, seed, threads);
        let rate = report.inputs as f64 / report.elapsed.as_secs_f64().max(1e-9);
        println!(
            "{:<22} {:>10} {:>12.0} {:>8.2}% {:>8}",
            target.name,
            report.inputs,
            rate,
            100.0 * report.accepted as f64 / report.inputs.max(1) as f64,
            report.panics
        );
        for (i, panic) in report.examples.iter().enumerate() {
            std::fs::create_dir_all(&out)?;
            let file = out.join(format!("{}-{i}.bin", rookery_fuzz::slug(target.name)));
            std::fs::write(&file, &panic.input)?;
            println!(
                "  panic (seed {}): {}\n  input: {}",
                panic.seed,
                panic.message,
                file.display()
            );
        }
        total_panics += report.panics;
    }
    println!("total panics: {total_panics}");
    Ok(total_panics == 0)
}
