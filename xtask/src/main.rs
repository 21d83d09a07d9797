//! Project automation for Rookery, run as `cargo xtask <command>` from anywhere in
//! the repository (the alias lives in `.cargo/config.toml`).
//!
//! ```text
//! cargo xtask setup                  install what the build needs (idempotent; fast once done)
//! cargo xtask web [--release]        build the dashboard into target/web/
//! cargo xtask test [--skip-lint]     everything CI runs (.ci/run), in CI's order
//! cargo xtask demo [--addr HOST:PORT] [--providers N]
//!                                    server + N native providers + dashboard on
//!                                    http://127.0.0.1:8080/ until Ctrl-C
//! cargo xtask demo gpt [--steps N] [--prompt TEXT]
//!                                    the example GPT trained on Shakespeare across
//!                                    4 local providers, then sampled
//! cargo xtask conformance [--backend cpu,torch,wgpu] [--filter TEXT]
//!                                    ONNX's backend node test cases on each backend:
//!                                    a per-op table, N passed, M failed, K skipped
//! cargo xtask gpu-kit [--debug]      target/gpu-kit/: kernel checks, kernel speed and
//!                                    run.sh, to run on any machine with a GPU driver
//! cargo xtask bench plan             planner benchmark (release build)
//! cargo xtask bench fuzz [--inputs N] fuzz every parser of untrusted bytes
//!                                    (default 1,000,000 inputs each; zero panics)
//! cargo xtask bench gpt [--size example|124m] [--steps N]
//!                                    a GPT across 4 providers: tokens/s against one
//!                                    process, peak memory, bytes per step
//! ```
//!
//! Setup fills a cache outside the repository, `$ROOKERY_CACHE` (default
//! `~/.cache/rookery`): the wasm32 rustup target, chromium, chromedriver and
//! lavapipe from apt when missing, `wasm-bindgen-cli` at the version pinned in
//! Cargo.lock, and a CPU libtorch for the provider's `torch` feature assembled
//! from the PyPI wheels. Every other command runs setup first and hands cargo:
//!
//! ```text
//! LIBTORCH=$ROOKERY_CACHE/libtorch-2.13.0       where torch-sys finds libtorch
//! PATH=$ROOKERY_CACHE/wasm-bindgen-<ver>/bin:$PATH
//! ROOKERY_WASM_BINDGEN=<that bin>/wasm-bindgen
//! CHROMEDRIVER=/usr/bin/chromedriver
//! ROOKERY_CHROMIUM=/usr/bin/chromium
//! ```
//!
//! `cargo xtask setup` prints these as `export` lines, to use plain cargo (e.g.
//! `cargo check -p rookery-provider --features torch`) in the same environment.
//! Each step prints its duration; a failure names its step.

mod bench;
mod conformance;
mod demo;
mod demo_gpt;
mod gpu_kit;
mod setup;
mod test;
mod util;
mod web;

use anyhow::{Result, bail};
use std::process::ExitCode;

const USAGE: &str = "usage: cargo xtask <setup | web [--release] | test [--skip-lint] | \
                     demo [--addr HOST:PORT] [--providers N] | demo gpt [--steps N] | \
                     conformance [--backend LIST] | gpu-kit [--debug] | bench plan|pipeline|relay|fuzz|kernels|load|gpt>";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // The chain on one line; anyhow's Debug form would add a backtrace
            // whenever RUST_BACKTRACE is set, burying the message in CI logs.
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((command, rest)) = args.split_first() else {
        bail!("{USAGE}");
    };
    match command.as_str() {
        "setup" => setup::main(rest),
        "web" => web::main(rest),
        "test" => test::main(rest),
        "conformance" => conformance::main(rest),
        "demo" => match rest.split_first() {
            Some((gpt, rest)) if gpt == "gpt" => demo_gpt::main(rest),
            _ => demo::main(rest),
        },
        "bench" => bench::main(rest),
        "gpu-kit" => gpu_kit::main(rest).map(drop),
        "help" | "--help" | "-h" => {
            println!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown command `{other}`\n{USAGE}"),
    }
}
