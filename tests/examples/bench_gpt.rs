//! `cargo xtask bench gpt [--size example|124m] [--steps N]`: a GPT trained
//! by `rookery train` across 4 local providers (one cluster of 4 stages, 4
//! micro-batches), measured in one run:
//! - tokens/s of `rookery train` against the single-process libtorch
//!   reference on the same batches (`--size example` only: the example GPT of
//!   examples/gpt, about 14M parameters, on its Shakespeare tokens);
//! - peak resident memory of the server (`rookery train`'s embedded one) and
//!   of every provider process;
//! - bytes relayed per step and seconds per step.
//!
//! `--size 124m` builds a GPT-2-small-shaped model (12 layers, d = 768, 12
//! heads, vocabulary 50,257, context 128) and trains it for 3 steps with Adam
//! on random tokens: it proves nothing breaks at that size and reports what
//! each process needs.
//!
//! Needs release binaries (`ROOKERY_BIN_DIR`, set by xtask) and Python with
//! torch to export the model (`ROOKERY_PYTHON`, set by xtask to the cache's
//! torch venv).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rookery_e2e::binary;
use rookery_proto::api::JobMetrics;
use rookery_test_support::workspace_root;

/// Steps left out of the timings: process start, first allocations.
const WARMUP: usize = 2;
const PROVIDERS: usize = 4;

struct Size {
    name: &'static str,
    layers: u32,
    d_model: u32,
    heads: u32,
    vocab: u32,
    context: u32,
    batch: u32,
    steps: u32,
}

const EXAMPLE: Size = Size {
    name: "example",
    layers: 6,
    d_model: 384,
    heads: 6,
    vocab: 4096,
    context: 128,
    batch: 16,
    steps: 12,
};

const GPT2_SMALL: Size = Size {
    name: "124m",
    layers: 12,
    d_model: 768,
    heads: 12,
    vocab: 50_257,
    context: 128,
    batch: 8,
    steps: 3,
};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut size = match flag(&args, "--size")?.as_deref() {
        None | Some("example") => EXAMPLE,
        Some("124m") => GPT2_SMALL,
        Some(other) => bail!("--size is `example` or `124m`, not `{other}`"),
    };
    if let Some(steps) = flag(&args, "--steps")? {
        size.steps = steps.parse().context("--steps")?;
    }
    let dir = tempfile::tempdir()?;
    let onnx = export(dir.path(), &size)?;
    let tokens = tokens_file(dir.path(), &size)?;
    let job = write_job(dir.path(), &onnx, &tokens, &size)?;
    println!(
        "model: GPT {} ({} layers, d {}, {} heads, vocab {}, context {}), batch {} x {} tokens, \
         {} steps, Adam, 1 cluster x {PROVIDERS} stages, 4 micro-batches",
        size.name,
        size.layers,
        size.d_model,
        size.heads,
        size.vocab,
        size.context,
        size.batch,
        size.context,
        size.steps
    );

    let (metrics, peaks, wall) = train_watching_memory(&job, &dir.path().join("out"))?;
    let steps = &metrics.steps;
    anyhow::ensure!(
        steps.len() == size.steps as usize,
        "{} steps recorded",
        steps.len()
    );
    let timed = if steps.len() > WARMUP {
        &steps[WARMUP..]
    } else {
        &steps[..]
    };
    let ms: f64 = timed.iter().map(|s| s.elapsed_ms).sum();
    let tokens_per_step = f64::from(size.batch * size.context);
    let per_s = timed.len() as f64 * tokens_per_step / (ms / 1e3);
    println!(
        "rookery train: {per_s:>9.1} tokens/s, {:.2} s/step (median), {:.1} s wall in all",
        median(steps.iter().map(|s| s.elapsed_ms / 1e3).collect()),
        wall.as_secs_f64()
    );
    println!(
        "losses: {}",
        steps
            .iter()
            .map(|s| format!("{:.4}", s.loss))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let relayed = steps.iter().map(|s| s.bytes_relayed).sum::<u64>() / steps.len() as u64;
    println!(
        "bytes relayed per step: {relayed} ({:.1} MiB)",
        relayed as f64 / 1048576.0
    );
    println!("peak resident memory per process:");
    for (what, kib) in &peaks {
        println!("  {what:<24} {:>8.1} MiB", *kib as f64 / 1024.0);
    }
    if size.name == EXAMPLE.name {
        let reference = reference::tokens_per_s(&job, WARMUP)?;
        println!("single-process reference: {reference:>9.1} tokens/s");
        println!("ratio rookery train / reference: {:.3}", per_s / reference);
    }
    Ok(())
}

fn flag(args: &[String], name: &str) -> anyhow::Result<Option<String>> {
    match args.iter().position(|a| a == name) {
        None => Ok(None),
        Some(i) => Ok(Some(
            args.get(i + 1)
                .with_context(|| format!("{name} needs a value"))?
                .clone(),
        )),
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

fn python() -> PathBuf {
    std::env::var_os("ROOKERY_PYTHON").map_or_else(|| PathBuf::from("python3"), PathBuf::from)
}

/// The model, exported as README tells users to (dynamo, dynamic batch).
fn export(dir: &Path, size: &Size) -> anyhow::Result<PathBuf> {
    let out = dir.join("gpt.onnx");
    let started = Instant::now();
    let status = Command::new(python())
        .arg(workspace_root().join("examples/gpt/export.py"))
        .args(["--out", &out.display().to_string()])
        .args(["--vocab", &size.vocab.to_string()])
        .args(["--context", &size.context.to_string()])
        .args(["--layers", &size.layers.to_string()])
        .args(["--d-model", &size.d_model.to_string()])
        .args(["--heads", &size.heads.to_string()])
        .args(["--dropout", "0"])
        .stdout(Stdio::inherit())
        .stderr(Stdio::null())
        .status()
        .context("running examples/gpt/export.py (set ROOKERY_PYTHON to a Python with torch)")?;
    anyhow::ensure!(status.success(), "export.py failed: {status}");
    println!("exported in {:.1} s", started.elapsed().as_secs_f64());
    Ok(out)
}

/// Exactly the tokens `steps` steps read: the start of the example's own
/// corpus, or (for the 124M model, whose vocabulary it does not use) seeded
/// random ids.
fn tokens_file(dir: &Path, size: &Size) -> anyhow::Result<PathBuf> {
    let needed = (size.steps * size.batch * size.context + 1) as usize;
    let path = dir.join("train.u16");
    if size.name == EXAMPLE.name {
        let corpus = workspace_root().join("examples/gpt/data/train.u16.gz");
        let out = Command::new("gzip")
            .arg("-dc")
            .arg(&corpus)
            .output()
            .with_context(|| format!("gzip -dc {}", corpus.display()))?;
        anyhow::ensure!(
            out.status.success() && out.stdout.len() >= needed * 2,
            "{} holds fewer than {needed} tokens",
            corpus.display()
        );
        std::fs::write(&path, &out.stdout[..needed * 2])?;
        return Ok(path);
    }
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut bytes = Vec::with_capacity(needed * 2);
    for _ in 0..needed {
        // xorshift64*: any fixed sequence of ids below the vocabulary will do.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let id = (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) % u64::from(size.vocab);
        bytes.extend_from_slice(&(id as u16).to_le_bytes());
    }
    std::fs::write(&path, bytes)?;
    Ok(path)
}

fn write_job(dir: &Path, onnx: &Path, tokens: &Path, size: &Size) -> anyhow::Result<PathBuf> {
    let path = dir.join("job.toml");
    let text = format!(
        "[model]\nonnx = \"{}\"\ninput_shape = [{ctx}]\n\
         [data]\nformat = \"tokens\"\ntrain_inputs = \"{}\"\nseq_len = {ctx}\n\
         [training]\nepochs = 1\nbatch_size = {}\nmicro_batches = 4\n\
         optimizer = {{ name = \"adam\", lr = 0.0003 }}\n\
         loss = {{ name = \"cross_entropy\", class_axis = -1 }}\n\
         clusters = 1\nstages = {PROVIDERS}\nshuffle = false\nseed = 0\n",
        onnx.display(),
        tokens.display(),
        size.batch,
        ctx = size.context,
    );
    std::fs::write(&path, text)?;
    Ok(path)
}

/// Runs `rookery train` to the end while sampling the peak resident memory
/// (VmHWM) of it and of every process it starts.
fn train_watching_memory(
    job: &Path,
    out: &Path,
) -> anyhow::Result<(JobMetrics, BTreeMap<String, u64>, Duration)> {
    let started = Instant::now();
    let mut child = Command::new(binary("rookery")?)
        .args(["train", &job.display().to_string()])
        .args(["--local-providers", &PROVIDERS.to_string()])
        .args(["--out", &out.display().to_string()])
        .env("ROOKERY_PROVIDER_BIN", binary("rookery-provider")?)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .context("starting rookery train")?;
    let root = child.id();
    let mut peaks: BTreeMap<u32, (String, u64)> = BTreeMap::new();
    let status = loop {
        for pid in std::iter::once(root).chain(children_of(root)) {
            if let Some(kib) = peak_kib(pid) {
                let name = if pid == root {
                    "server (rookery train)".to_string()
                } else {
                    format!("provider pid {pid}")
                };
                let entry = peaks.entry(pid).or_insert((name, 0));
                entry.1 = entry.1.max(kib);
            }
        }
        if let Some(status) = child.try_wait()? {
            break status;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if !status.success() {
        bail!("rookery train failed: {status}");
    }
    let text = std::fs::read_to_string(out.join("metrics.json")).context("metrics.json")?;
    let peaks = peaks.into_values().collect();
    Ok((serde_json::from_str(&text)?, peaks, started.elapsed()))
}

fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    // The command name in parentheses may hold spaces.
                    let after = s.rsplit_once(')')?.1;
                    after.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .collect()
}

fn peak_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

mod reference {
    use std::path::Path;
    use std::time::Instant;

    use rookery_test_support::JobBatches;
    use rookery_torch::exec::reference::whole_batch_step;
    use rookery_torch::step_seed;
    use rookery_torch::{TorchExecutor, TorchOptimizer, tensors_from_values};
    use tch::{Device, Kind, Tensor};

    /// The same batches in one process: one libtorch executor over the whole
    /// graph, timed after `warmup` steps.
    pub fn tokens_per_s(job: &Path, warmup: usize) -> anyhow::Result<f64> {
        let batches = JobBatches::open(job)?;
        let t = batches.spec.training.clone();
        let graph = batches.graph.clone();
        let params = tensors_from_values(&graph, &graph.initial_values(t.seed))?;
        let n = graph.analyze()?.nodes.len();
        let mut exec =
            TorchExecutor::new(&graph, 0..n, graph.outputs.clone(), params, Device::Cpu)?;
        let mut optimizer = TorchOptimizer::new(t.optimizer)?;
        let mut started = Instant::now();
        let mut tokens = 0;
        for batch in batches {
            if batch.step == warmup as u64 {
                started = Instant::now();
                tokens = 0;
            }
            let shape: Vec<i64> = batch.shape.iter().map(|&d| d as i64).collect();
            let x = Tensor::from_slice(&batch.x)
                .to_kind(Kind::Int64)
                .reshape(shape.as_slice());
            let y = Tensor::from_slice(&batch.y).reshape(shape.as_slice());
            let inputs = [(graph.inputs[0].name.clone(), x)];
            whole_batch_step(
                &mut exec,
                &inputs,
                &y,
                t.loss,
                &mut optimizer,
                step_seed(t.seed, batch.step),
            )?;
            tokens += batch.y.len();
        }
        Ok(tokens as f64 / started.elapsed().as_secs_f64())
    }
}
