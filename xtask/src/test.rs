//! `cargo xtask test [--skip-lint]`: everything CI checks, in CI's order.
//!
//! Setup, fmt, clippy (default and all features), a build of every binary, the
//! dashboard, the workspace tests (the e2e tests need the binaries and the
//! dashboard built first), ONNX's node conformance cases on every backend,
//! the GPU kit on lavapipe, then the browser-side wasm tests in headless
//! Chromium (the dashboard's component tests, then the web provider's).
//! Stops at the first failure and closes with a table of steps and durations.
//! `--skip-lint` leaves out fmt and clippy for quicker local runs.

use crate::setup::{self, WASM_TARGET};
use crate::util::{Summary, repo_root, run, target_dir};
use crate::web;
use anyhow::{Result, bail};

pub fn main(args: &[String]) -> Result<()> {
    let skip_lint = match args {
        [] => false,
        [flag] if flag == "--skip-lint" => true,
        _ => bail!("`test` takes only `--skip-lint`, got `{}`", args.join(" ")),
    };
    let mut summary = Summary::default();
    let result = steps(&mut summary, skip_lint);
    summary.print();
    result
}

fn steps(summary: &mut Summary, skip_lint: bool) -> Result<()> {
    let env = summary.step("setup", setup::ensure)?;
    let cargo = |args: &[&str]| {
        let mut cmd = env.cargo();
        cmd.args(args);
        cmd
    };
    let lints: [(&str, &[&str]); 3] = [
        ("fmt", &["fmt", "--all", "--check"]),
        (
            "clippy",
            &[
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ],
        ),
        (
            "clippy --all-features",
            &[
                "clippy",
                "--workspace",
                "--all-targets",
                "--all-features",
                "--",
                "-D",
                "warnings",
            ],
        ),
    ];
    for (name, args) in lints {
        if skip_lint {
            summary.skipped(name);
        } else {
            summary.step(name, || run(&mut cargo(args)))?;
        }
    }
    // Donors on Windows and macOS run the wgpu provider; its build is
    // checked for both (no libtorch), so a Unix-only call fails here.
    for target in setup::DESKTOP_TARGETS {
        summary.step(&format!("check provider for {target}"), || {
            run(&mut cargo(&[
                "check",
                "-p",
                "rookery-provider",
                "--features",
                "wgpu",
                "--target",
                target,
            ]))
        })?;
    }
    summary.step("build binaries", || {
        run(&mut cargo(&[
            "build",
            "--workspace",
            "--all-features",
            "--bins",
        ]))
    })?;
    summary.step("web", || web::build(&env, false))?;
    summary.step("cargo test", || {
        let mut cmd = cargo(&["test", "--workspace", "--all-features"]);
        cmd.env("ROOKERY_WEB_DIR", target_dir().join("web"))
            .env("ROOKERY_BIN_DIR", target_dir().join("debug"));
        run(&mut cmd)
    })?;
    // ONNX's node cases on the CPU reference, libtorch and lavapipe; `cargo
    // test` built the runner.
    summary.step("onnx conformance", || {
        crate::conformance::run_cases(&env, "cpu,torch,wgpu", None)
    })?;
    // The kit's own script on CI's adapter, so what donors' machines run is
    // what CI checked.
    summary.step("gpu kit", || {
        let kit = crate::gpu_kit::main(&["--debug".to_string()])?;
        run(std::process::Command::new(kit.join("run.sh")).arg("--quick"))
    })?;
    summary.step("dashboard component tests", || {
        let mut cmd = cargo(&[
            "test",
            "-p",
            "rookery-frontend",
            "--target",
            WASM_TARGET,
            "--test",
            "components",
        ]);
        // From frontend/ so the runner picks up that crate's webdriver.json.
        cmd.current_dir(repo_root().join("frontend"))
            .env(
                "CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER",
                env.wasm_bindgen_bin.join("wasm-bindgen-test-runner"),
            )
            .env("WASM_BINDGEN_TEST_TIMEOUT", "180");
        run(&mut cmd)
    })?;
    summary.step("browser tests", || {
        let mut cmd = cargo(&[
            "test",
            "-p",
            "rookery-web-provider",
            "--target",
            WASM_TARGET,
        ]);
        // From web-provider/ so the runner picks up that crate's webdriver.json.
        cmd.current_dir(repo_root().join("web-provider"))
            .env(
                "CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER",
                env.wasm_bindgen_bin.join("wasm-bindgen-test-runner"),
            )
            .env("WASM_BINDGEN_TEST_TIMEOUT", "180");
        run(&mut cmd)
    })
}
