//! `cargo xtask demo gpt [--steps N] [--prompt TEXT]`: the example GPT
//! (examples/gpt) trained on Shakespeare across 4 local providers, then
//! sampled.
//!
//! Gets the cache's torch venv, exports the model as README tells users to
//! (kept in `target/demo-gpt/gpt.onnx`), writes a copy of
//! `examples/gpt/job.toml` there (its data paths made absolute, and the
//! training data cut to N steps when `--steps` is given), runs `rookery train
//! --local-providers 4` with release binaries, and samples from the trained
//! weights with `rookery generate`.

use crate::setup;
use crate::util::{repo_root, run, step, target_dir};
use anyhow::{Context, Result, bail};
use std::path::Path;

const TOKENS_PER_STEP: usize = 16 * 128;

pub fn main(args: &[String]) -> Result<()> {
    let mut steps: Option<usize> = None;
    let mut prompt = "ROMEO:".to_owned();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--steps" => {
                let n = args.next().context("`--steps` needs a number")?;
                steps = Some(n.parse().with_context(|| format!("`--steps {n}`"))?);
            }
            "--prompt" => prompt = args.next().context("`--prompt` needs text")?.clone(),
            other => bail!("`demo gpt` takes `--steps N` and `--prompt TEXT`, got `{other}`"),
        }
    }
    let env = step("setup", setup::ensure)?;
    let python = setup::ensure_torch_python()?;
    step("build server and provider (release)", || {
        let mut cmd = env.cargo();
        cmd.args([
            "build",
            "--release",
            "-p",
            "rookery-server",
            "-p",
            "rookery-provider",
        ]);
        // `rookery` with libtorch too, so `generate` samples at libtorch's speed.
        run(cmd.args(["--features", "rookery-provider/torch,rookery-server/torch"]))
    })?;
    let dir = target_dir().join("demo-gpt");
    std::fs::create_dir_all(&dir)?;
    let examples = repo_root().join("examples/gpt");
    let onnx = dir.join("gpt.onnx");
    if !onnx.exists() {
        step("export the GPT", || {
            let mut cmd = env.command(&python);
            cmd.arg(examples.join("export.py")).arg("--out").arg(&onnx);
            run(&mut cmd)
        })?;
    }
    let job = write_job(&dir, &examples, steps)?;
    let bin = target_dir().join("release");
    let out = dir.join("out");
    step("train", || {
        let mut cmd = env.command(bin.join("rookery"));
        cmd.arg("train")
            .arg(&job)
            .args(["--local-providers", "4", "--out"])
            .arg(&out)
            .env("ROOKERY_PROVIDER_BIN", bin.join("rookery-provider"));
        run(&mut cmd)
    })?;
    step("generate", || {
        let mut cmd = env.command(bin.join("rookery"));
        cmd.arg("generate")
            .arg("--model")
            .arg(&onnx)
            .arg("--weights")
            .arg(out.join("weights.safetensors"))
            .arg("--tokenizer")
            .arg(examples.join("data/tokenizer.json"))
            .args([
                "--prompt",
                &prompt,
                "--tokens",
                "200",
                "--temperature",
                "0.8",
            ])
            .args(["--seed", "1"]);
        run(&mut cmd)
    })
}

/// The example's job beside the export, reading the example's data (or its
/// first `steps` steps' worth).
fn write_job(dir: &Path, examples: &Path, steps: Option<usize>) -> Result<std::path::PathBuf> {
    let data = examples.join("data");
    let mut train = data.join("train.u16.gz");
    if let Some(steps) = steps {
        let ids = gunzip(&train)?;
        let bytes = (steps * TOKENS_PER_STEP + 1) * 2;
        if ids.len() < bytes {
            bail!("`--steps {steps}` needs more tokens than the corpus holds");
        }
        train = dir.join(format!("train-{steps}-steps.u16"));
        std::fs::write(&train, &ids[..bytes])?;
    }
    let text = std::fs::read_to_string(examples.join("job.toml"))?
        .replace(
            "\"data/train.u16.gz\"",
            &format!("{:?}", train.display().to_string()),
        )
        .replace(
            "\"data/test.u16.gz\"",
            &format!("{:?}", data.join("test.u16.gz").display().to_string()),
        );
    let job = dir.join("job.toml");
    std::fs::write(&job, text)?;
    Ok(job)
}

fn gunzip(path: &Path) -> Result<Vec<u8>> {
    let out = std::process::Command::new("gzip")
        .arg("-dc")
        .arg(path)
        .output()
        .with_context(|| format!("gzip -dc {}", path.display()))?;
    if !out.status.success() {
        bail!("gzip -dc {} failed", path.display());
    }
    Ok(out.stdout)
}
