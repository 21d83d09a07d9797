//! `cargo xtask setup`: installs what the build and the tests need, idempotently.
//!
//! Everything heavy lands in the cache folder (`$ROOKERY_CACHE`, default
//! `~/.cache/rookery`), outside the repository so fresh clones and CI runners
//! reuse it. Each part is checked before anything is installed, so a second run
//! only looks (well under 2 s):
//!
//! - the rustup targets: `wasm32-unknown-unknown` for the browser's provider,
//!   and the Windows and macOS desktops that `cargo xtask test` checks the
//!   native provider's wgpu build for ([`DESKTOP_TARGETS`]);
//! - Debian packages: chromium, chromium-driver, lavapipe (mesa-vulkan-drivers),
//!   and g++/python3/pip where the steps below need them;
//! - `wasm-bindgen-cli` at exactly the `wasm-bindgen` version in Cargo.lock (the
//!   CLI refuses to process output of another version), in `wasm-bindgen-<ver>/`;
//! - a CPU libtorch in `libtorch-<ver>/`, assembled from the PyPI wheels because
//!   the wheels (kept in `wheels/`) are the one official build pip can fetch.
//!
//! [`env`] gives the variables every later cargo call needs.

use crate::util::{cargo_bin, probe, repo_root, run, step};
use anyhow::{Context, Result, bail};
use std::ffi::{OsStr, OsString};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const WASM_TARGET: &str = "wasm32-unknown-unknown";
/// The desktops besides Linux that donors run `rookery-provider --backend
/// wgpu` on; checked (not linked: that needs their SDKs) without libtorch.
pub const DESKTOP_TARGETS: [&str; 2] = ["x86_64-pc-windows-gnu", "aarch64-apple-darwin"];
/// The libtorch that tch 0.26 (torch-sys) is written against; its build script
/// checks `build-version` against this.
const TORCH_VERSION: &str = "2.13.0";
/// `pip download` specs, as (distribution, version). The two nvidia wheels carry
/// the CUDA runtime libraries that the CUDA-enabled wheel's libtorch_cpu.so links
/// to even when it only ever runs on the CPU.
const WHEELS: [(&str, &str); 3] = [
    ("torch", TORCH_VERSION),
    ("nvidia-cuda-runtime", "13.0.96"),
    ("nvidia-cuda-cupti", "13.0.85"),
];
/// What an assembled libtorch must contain (checked before it is moved into place).
const LIBTORCH_FILES: [&str; 6] = [
    "lib/libtorch_cpu.so",
    "lib/libc10.so",
    "lib/libgomp.so.1",
    "lib/libcudart.so.13",
    "lib/libcupti.so.13",
    "include/torch/csrc/api/include/torch/torch.h",
];
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// Extracts from the wheels only what linking against libtorch on the CPU needs:
/// the headers, libtorch_cpu, c10, the vendored OpenMP runtime, and the two CUDA
/// libraries libtorch_cpu.so names (it finds them through its `$ORIGIN` rpath).
/// Python, because its zipfile is always there and `unzip` often is not.
const EXTRACT_PY: &str = r#"
import fnmatch, os, shutil, sys, zipfile
out, torch_wheel, *nvidia_wheels = sys.argv[1:]
TORCH_LIBS = ["libtorch_cpu.so", "libc10.so", "libgomp*.so*"]
NVIDIA_LIBS = ["libcudart.so.13", "libcupti.so.13"]

def dest(name, is_torch):
    base = name.rsplit("/", 1)[-1]
    if is_torch and name.startswith("torch/include/"):
        return "include/" + name[len("torch/include/"):]
    if is_torch and name == "torch/lib/" + base and any(fnmatch.fnmatch(base, p) for p in TORCH_LIBS):
        return "lib/" + base
    if not is_torch and base in NVIDIA_LIBS:
        return "lib/" + base
    return None

for wheel in [torch_wheel, *nvidia_wheels]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            target = None if info.is_dir() else dest(info.filename, wheel == torch_wheel)
            if target is None:
                continue
            path = os.path.join(out, target)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with z.open(info) as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            if target.startswith("lib/"):
                os.chmod(path, 0o755)
"#;

/// The environment later cargo calls run in, and the paths it was made from.
pub struct Env {
    /// Folder holding `wasm-bindgen` and `wasm-bindgen-test-runner`.
    pub wasm_bindgen_bin: PathBuf,
    vars: Vec<(&'static str, OsString)>,
}

impl Env {
    /// A command run from the repository root with this environment.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new(program);
        cmd.current_dir(repo_root())
            .envs(self.vars.iter().map(|(k, v)| (k, v)));
        cmd
    }

    pub fn cargo(&self) -> Command {
        self.command(cargo_bin())
    }

    pub fn wasm_bindgen(&self) -> PathBuf {
        self.wasm_bindgen_bin.join("wasm-bindgen")
    }
}

/// The cache folder: `$ROOKERY_CACHE`, else `$HOME/.cache/rookery`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("ROOKERY_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").context("neither ROOKERY_CACHE nor HOME is set")?;
    Ok(Path::new(&home).join(".cache/rookery"))
}

fn libtorch_dir(cache: &Path) -> PathBuf {
    cache.join(format!("libtorch-{TORCH_VERSION}"))
}

/// The environment every later cargo call needs. No LIBTORCH_BYPASS_VERSION_CHECK:
/// the assembled libtorch's `build-version` matches what torch-sys expects.
pub fn env() -> Result<Env> {
    let cache = cache_dir()?;
    let wasm_bindgen_bin = cache.join(format!("wasm-bindgen-{}/bin", wasm_bindgen_version()?));
    let mut path = vec![wasm_bindgen_bin.clone()];
    path.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    let vars = vec![
        ("LIBTORCH", libtorch_dir(&cache).into_os_string()),
        (
            "PATH",
            std::env::join_paths(path).context("PATH cannot hold the cache folder")?,
        ),
        (
            "ROOKERY_WASM_BINDGEN",
            wasm_bindgen_bin.join("wasm-bindgen").into_os_string(),
        ),
        ("CHROMEDRIVER", CHROMEDRIVER.into()),
        ("ROOKERY_CHROMIUM", CHROMIUM.into()),
    ];
    Ok(Env {
        wasm_bindgen_bin,
        vars,
    })
}

/// `cargo xtask setup`: installs what is missing, then shows the environment.
pub fn main(args: &[String]) -> Result<()> {
    if let Some(arg) = args.first() {
        bail!("`setup` takes no arguments, got `{arg}`");
    }
    let env = step("setup", ensure)?;
    println!("\nEnvironment the other subcommands give cargo:");
    for (key, value) in &env.vars {
        // PATH only gains a prefix; `$PATH` keeps the line short and reusable.
        let value = match *key {
            "PATH" => format!("{}:$PATH", env.wasm_bindgen_bin.display()),
            _ => value.to_string_lossy().into_owned(),
        };
        println!("export {key}={value}");
    }
    Ok(())
}

/// Installs whatever is missing and returns [`env`]. Cheap when nothing is.
pub fn ensure() -> Result<Env> {
    let cache = cache_dir()?;
    let env = env()?;
    step("rustup targets", ensure_targets)?;
    // Python (and pip) are only needed while libtorch is not assembled yet.
    let need_libtorch = !is_complete(&libtorch_dir(&cache));
    let need_wheels = need_libtorch && find_wheels(&cache).is_none();
    step("debian packages", || {
        ensure_packages(need_libtorch, need_wheels)
    })?;
    step("wasm-bindgen-cli", || ensure_wasm_bindgen(&env))?;
    step("libtorch", || ensure_libtorch(&cache))?;
    Ok(env)
}

fn ensure_targets() -> Result<()> {
    let installed = probe(Command::new("rustup").args(["target", "list", "--installed"]))
        .context("`rustup target list` failed: install Rust with rustup (https://rustup.rs)")?;
    let missing: Vec<&str> = std::iter::once(WASM_TARGET)
        .chain(DESKTOP_TARGETS)
        .filter(|target| !installed.lines().any(|line| line.trim() == *target))
        .collect();
    if missing.is_empty() {
        println!(
            "{WASM_TARGET} and {} are installed",
            DESKTOP_TARGETS.join(", ")
        );
        return Ok(());
    }
    run(Command::new("rustup")
        .args(["target", "add"])
        .args(&missing))
}

/// Exact checks for files the packages provide, so a present system installs nothing.
fn ensure_packages(need_python: bool, need_pip: bool) -> Result<()> {
    let mut missing = Vec::new();
    if !Path::new(CHROMIUM).exists() {
        missing.push("chromium");
    }
    if !Path::new(CHROMEDRIVER).exists() {
        missing.push("chromium-driver");
    }
    if !has_lavapipe() {
        missing.push("mesa-vulkan-drivers");
    }
    // torch-sys compiles its C++ glue with the system compiler.
    if !Path::new("/usr/bin/c++").exists() {
        missing.push("g++");
    }
    if need_python && probe(Command::new("python3").arg("--version")).is_none() {
        missing.push("python3");
    }
    if need_pip && probe(Command::new("python3").args(["-m", "pip", "--version"])).is_none() {
        missing.push("python3-pip");
    }
    if missing.is_empty() {
        println!("chromium, chromedriver and lavapipe are installed");
        return Ok(());
    }
    println!("missing Debian packages: {}", missing.join(" "));
    apt(&["update"])?;
    apt(&[
        &["install", "-y", "--no-install-recommends"],
        missing.as_slice(),
    ]
    .concat())
}

/// Lavapipe is Mesa's software Vulkan driver: WebGPU in headless Chromium and
/// wgpu on GPU-less machines run on it.
fn has_lavapipe() -> bool {
    let Ok(entries) = fs::read_dir("/usr/share/vulkan/icd.d") else {
        return false;
    };
    entries.flatten().any(|entry| {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        name.starts_with("lvp_icd") && name.ends_with(".json")
    })
}

fn apt(args: &[&str]) -> Result<()> {
    let root = probe(Command::new("id").arg("-u")).is_some_and(|uid| uid.trim() == "0");
    let mut cmd = if root {
        let mut cmd = Command::new("apt-get");
        cmd.env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    } else {
        // sudo resets the environment, so the variable goes on its command line.
        let mut cmd = Command::new("sudo");
        cmd.args(["DEBIAN_FRONTEND=noninteractive", "apt-get"]);
        cmd
    };
    run(cmd.args(args))
}

/// The version of the `wasm-bindgen` package in the workspace's Cargo.lock.
fn wasm_bindgen_version() -> Result<String> {
    let lock_path = repo_root().join("Cargo.lock");
    let lock = fs::read_to_string(&lock_path)
        .with_context(|| format!("cannot read {}", lock_path.display()))?;
    locked_version(&lock, "wasm-bindgen").context("no `wasm-bindgen` package in Cargo.lock")
}

/// In Cargo.lock a package's `version` line follows its `name` line.
fn locked_version(lock: &str, package: &str) -> Option<String> {
    let name_line = format!("name = \"{package}\"");
    let mut lines = lock.lines();
    lines.by_ref().find(|line| *line == name_line)?;
    let version = lines
        .next()?
        .strip_prefix("version = \"")?
        .strip_suffix('"')?;
    Some(version.to_owned())
}

fn ensure_wasm_bindgen(env: &Env) -> Result<()> {
    let version = wasm_bindgen_version()?;
    let want = format!("wasm-bindgen {version}");
    let have = probe(Command::new(env.wasm_bindgen()).arg("--version"));
    let runner = env.wasm_bindgen_bin.join("wasm-bindgen-test-runner");
    if have.as_deref().map(str::trim) == Some(want.as_str()) && runner.exists() {
        println!("{want} is installed in {}", env.wasm_bindgen_bin.display());
        return Ok(());
    }
    let root = env
        .wasm_bindgen_bin
        .parent()
        .context("wasm-bindgen folder has no parent")?;
    // No --locked: the CLI's own lock file pins a since-yanked crate, which fails.
    // --force: a broken or partial install in that root would otherwise be kept.
    let mut cmd = Command::new(cargo_bin());
    cmd.args([
        "install",
        "wasm-bindgen-cli",
        "--force",
        "--version",
        &version,
        "--root",
    ]);
    run(cmd.arg(root))
}

/// A libtorch folder is complete once it has `build-version`: it is written last,
/// before the folder is renamed into place.
fn is_complete(dir: &Path) -> bool {
    fs::read_to_string(dir.join("build-version")).is_ok_and(|v| v.trim() == TORCH_VERSION)
}

fn ensure_libtorch(cache: &Path) -> Result<()> {
    let dest = libtorch_dir(cache);
    if is_complete(&dest) {
        println!(
            "libtorch {TORCH_VERSION} is assembled in {}",
            dest.display()
        );
        return Ok(());
    }
    let wheels = step("download wheels", || download_wheels(cache))?;
    step("assemble libtorch", || assemble(&wheels, &dest))
}

/// The cached wheels, torch first, when all of them are there.
fn find_wheels(cache: &Path) -> Option<Vec<PathBuf>> {
    let entries: Vec<PathBuf> = fs::read_dir(cache.join("wheels"))
        .ok()?
        .flatten()
        .map(|e| e.path())
        .collect();
    WHEELS
        .iter()
        .map(|(name, version)| {
            // pip names files with the normalized distribution name.
            let prefix = format!("{}-{version}-", name.replace('-', "_"));
            entries
                .iter()
                .find(|path| {
                    let file = path.file_name().unwrap_or_default().to_string_lossy();
                    file.starts_with(&prefix) && file.ends_with(".whl")
                })
                .cloned()
        })
        .collect()
}

fn download_wheels(cache: &Path) -> Result<Vec<PathBuf>> {
    if let Some(wheels) = find_wheels(cache) {
        println!("wheels are cached in {}", cache.join("wheels").display());
        return Ok(wheels);
    }
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pip", "download", "--no-deps", "-d"])
        .arg(cache.join("wheels"));
    run(cmd.args(WHEELS.map(|(name, version)| format!("{name}=={version}"))))?;
    find_wheels(cache).context("pip finished but some wheels are still missing")
}

/// Builds the folder next to its final place and renames it at the end, so an
/// interrupted setup never leaves a half libtorch behind.
fn assemble(wheels: &[PathBuf], dest: &Path) -> Result<()> {
    let mut tmp = dest.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    if tmp.exists() {
        fs::remove_dir_all(&tmp).context("cannot remove a leftover partial libtorch")?;
    }
    run(Command::new("python3")
        .arg("-c")
        .arg(EXTRACT_PY)
        .arg(&tmp)
        .args(wheels))?;
    for file in LIBTORCH_FILES {
        if !tmp.join(file).exists() {
            bail!("the wheels did not provide {file}");
        }
    }
    let lib = tmp.join("lib");
    // torch-sys links -ltorch (an alias of libtorch_cpu for a CPU build) and -lgomp;
    // the unversioned libgomp.so keeps the binary on libtorch's own OpenMP runtime
    // and works where the system has no libgomp development symlink.
    std::os::unix::fs::symlink("libtorch_cpu.so", lib.join("libtorch.so"))?;
    std::os::unix::fs::symlink("libgomp.so.1", lib.join("libgomp.so"))?;
    for so in ["libtorch_cpu.so", "libc10.so"] {
        check_ldd(&lib.join(so))?;
    }
    fs::write(tmp.join("build-version"), TORCH_VERSION)?;
    if dest.exists() {
        // An incomplete folder from some other tool or an older layout.
        fs::remove_dir_all(dest)?;
    }
    fs::rename(&tmp, dest)?;
    println!("libtorch {TORCH_VERSION} assembled in {}", dest.display());
    Ok(())
}

/// Fails when the dynamic loader cannot resolve one of the library's dependencies.
fn check_ldd(so: &Path) -> Result<()> {
    let out = Command::new("ldd")
        .arg(so)
        .output()
        .context("cannot run ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let missing: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("not found"))
        .map(str::trim)
        .collect();
    if !out.status.success() || !missing.is_empty() {
        bail!(
            "ldd {}: unresolved dependencies: {}",
            so.display(),
            missing.join(", ")
        );
    }
    Ok(())
}

/// What the GPT example's Python needs, pinned: PyTorch to export the model,
/// the exporter's `onnx`/`onnxscript`, `safetensors` for the initial weights
/// and `tokenizers` for the corpus.
const TORCH_PYTHON_PACKAGES: [&str; 6] = [
    "torch==2.13.0",
    "onnx==1.23.2",
    "onnxscript==0.7.2",
    "numpy==2.4.6",
    "safetensors==0.8.0",
    "tokenizers==0.23.3",
];

/// A Python with PyTorch in the cache (`torch-venv/`), for what exports
/// models: `cargo xtask bench gpt` and `cargo xtask demo gpt`. Not part of
/// [`ensure`]: the tests use committed exports, and this is a large download.
pub fn ensure_torch_python() -> Result<PathBuf> {
    let venv = cache_dir()?.join("torch-venv");
    let python = venv.join("bin/python");
    let mut check = Command::new(&python);
    check.args([
        "-c",
        "import torch, onnx, onnxscript, safetensors, tokenizers",
    ]);
    if probe(&mut check).is_some() {
        println!("{} has torch", python.display());
        return Ok(python);
    }
    step("torch venv", || {
        ensure_packages(true, true)?;
        // Debian keeps venv's pip bootstrap in its own package.
        if probe(Command::new("python3").args(["-c", "import venv, ensurepip"])).is_none() {
            apt(&["install", "-y", "--no-install-recommends", "python3-venv"])?;
        }
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        run(Command::new(&python)
            .args(["-m", "pip", "install", "--quiet"])
            .args(TORCH_PYTHON_PACKAGES))
    })?;
    Ok(python)
}

/// The `onnx` whose backend node test cases `cargo xtask conformance` runs:
/// pinned, so a case's inputs and expected outputs change only with it.
pub const ONNX_VERSION: &str = "1.23.2";
const ONNX_PYTHON_PACKAGES: &[&str] = &["onnx==1.23.2", "numpy==2.4.6"];

/// A Python with the pinned `onnx` in the cache (`onnx-venv/`), for the
/// conformance cases; small beside the torch venv, so `cargo xtask test`
/// makes it on a fresh machine.
pub fn ensure_onnx_python() -> Result<PathBuf> {
    let venv = cache_dir()?.join("onnx-venv");
    let python = venv.join("bin/python");
    let mut check = Command::new(&python);
    check.args(["-c", "import onnx; print(onnx.__version__)"]);
    if probe(&mut check).is_some_and(|v| v.trim() == ONNX_VERSION) {
        return Ok(python);
    }
    step("onnx venv", || {
        ensure_packages(true, true)?;
        if probe(Command::new("python3").args(["-c", "import venv, ensurepip"])).is_none() {
            apt(&["install", "-y", "--no-install-recommends", "python3-venv"])?;
        }
        run(Command::new("python3")
            .args(["-m", "venv", "--clear"])
            .arg(&venv))?;
        run(Command::new(&python)
            .args(["-m", "pip", "install", "--quiet"])
            .args(ONNX_PYTHON_PACKAGES))
    })?;
    Ok(python)
}

#[cfg(test)]
mod tests {
    use super::locked_version;

    #[test]
    fn reads_the_locked_version() {
        let lock = "[[package]]\nname = \"wasm-bindgen-futures\"\nversion = \"0.4.1\"\n\n\
                    [[package]]\nname = \"wasm-bindgen\"\nversion = \"0.2.130\"\n";
        assert_eq!(
            locked_version(lock, "wasm-bindgen").as_deref(),
            Some("0.2.130")
        );
        assert_eq!(locked_version(lock, "leptos"), None);
    }
}
