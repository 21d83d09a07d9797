//! `cargo xtask gpu-kit [--debug]`: writes `target/gpu-kit/`, a folder to
//! copy to any machine with a Vulkan, Metal or DX12 driver, which needs no
//! libtorch, Rust or network there: the kernel check binaries
//! (`gpu_kernels`, `gpu_matmul`), the kernel benchmark `kernel_speed` (one
//! line per kernel and shape with its GFLOP/s), `stage_speed` (what a
//! micro-batch costs beyond its kernels) and `run.sh`, which runs
//! every check, then the benchmark (beside PyTorch's cuBLAS and cuDNN,
//! `vendor_speed.py`, where PyTorch sees a CUDA GPU), and exits 0 only when
//! every check passed. `./run.sh --quick` times small shapes only (lavapipe).
//!
//! Release builds by default (the figures are what donors' GPUs get);
//! `--debug` reuses a debug build, as `cargo xtask test` does.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, Result, bail};

use crate::setup;
use crate::util::{run, step, target_dir};

/// The benchmarks the kit carries: (package, example).
const SPEED: [(&str, &str); 2] = [
    ("rookery-kernels", "kernel_speed"),
    ("rookery-stage", "stage_speed"),
];

/// The kernel checks the kit carries (integration tests of rookery-kernels).
const CHECKS: [&str; 2] = ["gpu_kernels", "gpu_matmul"];

/// Times the same workloads with PyTorch's cuBLAS and cuDNN, where there.
const VENDOR_SPEED_PY: &str = include_str!("../python/vendor_speed.py");

const RUN_SH: &str = r#"#!/bin/sh
# Rookery's GPU kit: every kernel check on this machine's GPU, then the
# kernels' speed. Exits 0 only when every check passed.
# Usage: ./run.sh [--quick] [--sweep] [--seconds S]   (arguments go to kernel_speed)
cd "$(dirname "$0")" || exit 2
quick=""
for arg in "$@"; do [ "$arg" = "--quick" ] && quick="--quick"; done
failed=0
for check in gpu_kernels gpu_matmul; do
    echo "==> $check"
    if "./$check" --test-threads=1; then
        echo "<== $check: pass"
    else
        echo "<== $check: FAIL"
        failed=1
    fi
done
echo "==> kernel_speed"
if "./kernel_speed" "$@" >speed.txt 2>&1; then
    cat speed.txt
    # Beside the vendor's libraries where PyTorch sees a CUDA GPU.
    if python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        echo "==> vendor_speed"
        python3 vendor_speed.py speed.txt || echo "<== vendor_speed could not run"
    fi
else
    cat speed.txt
    echo "<== kernel_speed could not run"
fi
echo "==> stage_speed"
./stage_speed $quick || echo "<== stage_speed could not run"
if [ "$failed" -eq 0 ]; then
    echo "every kernel check passed"
else
    echo "some kernel checks FAILED"
fi
exit "$failed"
"#;

pub fn main(args: &[String]) -> Result<PathBuf> {
    let release = match args {
        [] => true,
        [flag] if flag == "--debug" => false,
        _ => bail!("`gpu-kit` takes only `--debug`, got `{}`", args.join(" ")),
    };
    let env = step("setup", setup::ensure)?;
    let profile: &[&str] = if release { &["--release"] } else { &[] };
    let checks = step("build the kernel checks", || {
        let mut cmd = env.cargo();
        cmd.args([
            "test",
            "-p",
            "rookery-kernels",
            "--features",
            "gpu",
            "--no-run",
        ])
        .args(profile)
        .args(["--message-format", "json-render-diagnostics"])
        .stdout(Stdio::piped());
        println!(
            "$ cargo test -p rookery-kernels --features gpu --no-run {}",
            profile.join(" ")
        );
        let out = cmd.output().context("running cargo test --no-run")?;
        if !out.status.success() {
            bail!("building the kernel checks failed ({})", out.status);
        }
        executables(&String::from_utf8_lossy(&out.stdout))
    })?;
    step("build kernel_speed and stage_speed", || {
        for (package, example) in SPEED {
            let mut cmd = env.cargo();
            cmd.args(["build", "-p", package, "--features", "gpu"])
                .args(["--example", example])
                .args(profile);
            run(&mut cmd)?;
        }
        Ok(())
    })?;
    let kit = target_dir().join("gpu-kit");
    step("assemble target/gpu-kit", || {
        if kit.exists() {
            std::fs::remove_dir_all(&kit).with_context(|| format!("emptying {}", kit.display()))?;
        }
        std::fs::create_dir_all(&kit)?;
        for (name, path) in &checks {
            copy(path, &kit.join(name))?;
        }
        let dir = target_dir().join(if release { "release" } else { "debug" });
        for (_, example) in SPEED {
            copy(&dir.join("examples").join(exe(example)), &kit.join(example))?;
        }
        std::fs::write(kit.join("vendor_speed.py"), VENDOR_SPEED_PY)?;
        let script = kit.join("run.sh");
        std::fs::write(&script, RUN_SH)?;
        executable(&script)?;
        println!(
            "{}: copy it to a machine with a GPU driver and run ./run.sh",
            kit.display()
        );
        Ok(())
    })?;
    Ok(kit)
}

/// The check binaries cargo built, by check name, from its JSON messages.
fn executables(messages: &str) -> Result<Vec<(String, PathBuf)>> {
    let mut found = Vec::new();
    for line in messages.lines() {
        let Some(path) = json_string(line, "\"executable\":\"") else {
            continue;
        };
        let path = PathBuf::from(path);
        let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
        if let Some(check) = CHECKS.iter().find(|c| {
            stem.as_deref()
                .is_some_and(|s| s.starts_with(&format!("{c}-")))
        }) {
            found.push(((*check).to_string(), path));
        }
    }
    for check in CHECKS {
        if !found.iter().any(|(name, _)| name == check) {
            bail!("cargo built no `{check}` test binary");
        }
    }
    Ok(found)
}

/// The string value after `key` on a JSON line (cargo escapes nothing in
/// paths but backslashes, which only Windows paths have).
fn json_string(line: &str, key: &str) -> Option<String> {
    let start = line.find(key)? + key.len();
    let end = line[start..].find('"')?;
    Some(line[start..start + end].replace("\\\\", "\\"))
}

fn exe(name: &str) -> String {
    format!("{name}{}", std::env::consts::EXE_SUFFIX)
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .map(|_| ())
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))
}

#[cfg(unix)]
fn executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

#[cfg(not(unix))]
fn executable(_: &Path) -> Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_binaries_are_found_by_name_in_cargos_messages() {
        let messages = concat!(
            r#"{"reason":"compiler-artifact","target":{"name":"rookery_kernels"},"executable":null}"#,
            "\n",
            r#"{"reason":"compiler-artifact","executable":"/t/debug/deps/gpu_kernels-1a2b"}"#,
            "\n",
            r#"{"reason":"compiler-artifact","executable":"/t/debug/deps/rookery_kernels-9f"}"#,
            "\n",
            r#"{"reason":"compiler-artifact","executable":"/t/debug/deps/gpu_matmul-77"}"#,
        );
        let found = executables(messages).unwrap();
        assert_eq!(
            found,
            vec![
                (
                    "gpu_kernels".to_string(),
                    PathBuf::from("/t/debug/deps/gpu_kernels-1a2b")
                ),
                (
                    "gpu_matmul".to_string(),
                    PathBuf::from("/t/debug/deps/gpu_matmul-77")
                ),
            ]
        );
        let missing = executables(&messages.replace("gpu_matmul", "other")).unwrap_err();
        assert!(missing.to_string().contains("gpu_matmul"), "{missing}");
    }
}
