//! `cargo xtask bench gpt [--size example|124m] [--steps N] [--wire-dtype
//! f32|f16|bf16|int8] [--schedule gpipe|1f1b|async] [--precision f32|mixed]
//! [--compare | --no-compare]`:
//! a GPT trained by `rookery train` across 4 local providers (one cluster of
//! 4 stages, 4 micro-batches; f32 on the wire and the `gpipe` schedule
//! unless told), measured in one run:
//! - tokens/s of `rookery train` against the single-process libtorch
//!   reference on the same batches (`--size example` only: the example GPT of
//!   examples/gpt, about 14M parameters, on its Shakespeare tokens);
//! - peak resident memory of the server (`rookery train`'s embedded one) and
//!   of every provider process;
//! - bytes relayed per step and seconds per step.
//!
//! Then (`--compare`, the default at `--size example`; `--no-compare` skips
//! it) it trains the same steps four more times, once with int8 on the
//! wire, once with the `1f1b` schedule, once with `async` and once in mixed
//! precision (each other setting the first run's), and prints their final
//! and mean losses against the first run's (the goal for int8 and async:
//! within 2%; 1f1b computes the same numbers), their bytes relayed per
//! step, and each stage's provider's peak resident memory and most
//! micro-batches held at once under each schedule. The planner splits the
//! model by the speeds providers measure at the start, so on a loaded
//! machine a run may split it elsewhere: each is retried (up to 3 tries)
//! until its bytes relayed are the first run's at its wire dtype's size, the
//! same split.
//! At `--size example` the two runs add about a minute here.
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
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rookery_e2e::binary;
use rookery_e2e::gpt::{self, GptSize};
use rookery_proto::WireDType;
use rookery_proto::api::JobMetrics;

/// Steps left out of the timings: process start, first allocations.
const WARMUP: usize = 2;
const PROVIDERS: usize = 4;
/// Checkpoints (a single cluster's syncs) this far apart, so `async` has
/// steps to overlap; they change no other schedule's numbers.
const SYNC_EVERY: u64 = 1000;
/// Runs of a `--compare` variant until its stages are split as the first
/// run's were.
const SPLIT_TRIES: u32 = 3;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut size = match flag(&args, "--size")?.as_deref() {
        None | Some("example") => gpt::EXAMPLE,
        Some("124m") => gpt::GPT2_SMALL,
        Some(other) => bail!("--size is `example` or `124m`, not `{other}`"),
    };
    if let Some(steps) = flag(&args, "--steps")? {
        size.steps = steps.parse().context("--steps")?;
    }
    let base = Variant {
        wire: flag(&args, "--wire-dtype")?.unwrap_or_else(|| "f32".into()),
        schedule: flag(&args, "--schedule")?.unwrap_or_else(|| "gpipe".into()),
        precision: flag(&args, "--precision")?.unwrap_or_else(|| "f32".into()),
    };
    let compare = if args.iter().any(|a| a == "--no-compare") {
        false
    } else {
        size.name == gpt::EXAMPLE.name || args.iter().any(|a| a == "--compare")
    };
    let dir = tempfile::tempdir()?;
    let onnx = gpt::export(dir.path(), &size)?;
    let tokens = gpt::tokens_file(dir.path(), &size)?;
    let job = write_job(dir.path(), &onnx, &tokens, &size, &base)?;
    println!(
        "model: {}, batch {} x {} tokens, {} steps, Adam, 1 cluster x {PROVIDERS} stages, \
         4 micro-batches, {} on the wire, schedule {}, precision {}",
        size.describe(),
        size.batch,
        size.context,
        size.steps,
        base.wire,
        base.schedule,
        base.precision
    );

    let run = train_watching_memory(&job, &dir.path().join("out"))?;
    let (metrics, wall) = (&run.metrics, run.wall);
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
    for process in &run.peaks {
        println!(
            "  {:<32} {:>8.1} MiB",
            run.label(process),
            process.kib as f64 / 1024.0
        );
    }
    if size.name == gpt::EXAMPLE.name {
        let reference =
            rookery_e2e::reference::steps_per_s(&job, WARMUP as u64)? * size.tokens_per_step();
        println!("single-process reference: {reference:>9.1} tokens/s");
        println!("ratio rookery train / reference: {:.3}", per_s / reference);
    }
    if compare {
        compare_variants(dir.path(), &onnx, &tokens, &size, &base, &run)?;
    }
    Ok(())
}

/// What a run puts on the wire, how its stages schedule micro-batches and
/// how they multiply matrices.
#[derive(Clone)]
struct Variant {
    wire: String,
    schedule: String,
    precision: String,
}

impl Variant {
    /// For people: `int8 wire, 1f1b, mixed precision`.
    fn describe(&self) -> String {
        format!(
            "{} wire, {}, {} precision",
            self.wire, self.schedule, self.precision
        )
    }
}

/// The same steps with int8 on the wire and with the 1f1b schedule, against
/// the first run: losses at equal steps, bytes relayed, and each stage's
/// peak resident memory under each schedule.
fn compare_variants(
    dir: &Path,
    onnx: &Path,
    tokens: &Path,
    size: &GptSize,
    base: &Variant,
    first: &Run,
) -> anyhow::Result<()> {
    let variants = [
        Variant {
            wire: "int8".into(),
            ..base.clone()
        },
        Variant {
            schedule: "1f1b".into(),
            ..base.clone()
        },
        Variant {
            schedule: "async".into(),
            ..base.clone()
        },
        Variant {
            precision: "mixed".into(),
            ..base.clone()
        },
    ];
    let base_bytes = relayed_per_step(&first.metrics);
    let mut runs = Vec::new();
    for (i, variant) in variants.iter().enumerate() {
        let job_dir = dir.join(format!("variant-{i}"));
        std::fs::create_dir_all(&job_dir)?;
        let job = write_job(&job_dir, onnx, tokens, size, variant)?;
        let mut tries = 0;
        let run = loop {
            tries += 1;
            let run = train_watching_memory(&job, &job_dir.join(format!("out-{tries}")))?;
            anyhow::ensure!(
                run.metrics.steps.len() == first.metrics.steps.len(),
                "{} steps recorded",
                run.metrics.steps.len()
            );
            // The planner splits the model by the speeds the providers
            // measure at the start, so a loaded machine can move a stage
            // boundary, and with it the bytes and each stage's memory. The
            // bytes relayed tell: a run on the first run's split relays its
            // bytes at the wire dtype's size. Run again otherwise.
            let bytes = relayed_per_step(&run.metrics);
            let expected = base_bytes as f64 * wire_size(&variant.wire)? / wire_size(&base.wire)?;
            let same_split = (bytes as f64 / expected - 1.0).abs() < 0.01;
            if same_split || tries == SPLIT_TRIES {
                if !same_split {
                    println!(
                        "  ({}: the stages were split elsewhere than in the first run \
                         in all {tries} tries: not comparable)",
                        variant.describe()
                    );
                }
                break run;
            }
            println!(
                "  ({}: the planner split the stages elsewhere than in the first run \
                 ({bytes} bytes relayed/step, {expected:.0} on its split): running it again)",
                variant.describe()
            );
        };
        runs.push(run);
    }
    let losses = |run: &Run| {
        let steps = &run.metrics.steps;
        let last = steps.last().map_or(f64::NAN, |s| s.loss);
        let mean = steps.iter().map(|s| s.loss).sum::<f64>() / steps.len() as f64;
        (last, mean)
    };
    let (base_last, base_mean) = losses(first);
    println!(
        "at equal steps ({}), against the first run ({}): final loss {base_last:.5}, \
         mean loss {base_mean:.5}, {base_bytes} bytes relayed/step",
        first.metrics.steps.len(),
        base.describe()
    );
    for (variant, run) in variants.iter().zip(&runs) {
        let (last, mean) = losses(run);
        let bytes = relayed_per_step(&run.metrics);
        println!(
            "  {}: final loss {last:.5} ({:+.3}%), mean loss {mean:.5} ({:+.3}%), \
             {bytes} bytes relayed/step ({:.3} of the first run's), {:.2} s/step (median)",
            variant.describe(),
            100.0 * (last - base_last) / base_last,
            100.0 * (mean - base_mean) / base_mean,
            bytes as f64 / base_bytes as f64,
            median(
                run.metrics
                    .steps
                    .iter()
                    .map(|s| s.elapsed_ms / 1e3)
                    .collect()
            ),
        );
    }
    let schedule_run = &runs[1];
    println!(
        "peak resident memory of each stage's provider, {} against 1f1b (most micro-batches held at once):",
        base.schedule
    );
    let stages = first.metrics.steps.first().map_or(0, |s| s.stages.len());
    let mut totals = (0u64, 0u64);
    for k in 0..stages {
        let a = first.stage_peak(k);
        let b = schedule_run.stage_peak(k);
        totals.0 += a.0;
        totals.1 += b.0;
        println!(
            "  stage {k}: {:>8.1} MiB (held {}) against {:>8.1} MiB (held {}): {:+.1} MiB",
            a.0 as f64 / 1024.0,
            a.1,
            b.0 as f64 / 1024.0,
            b.1,
            (b.0 as f64 - a.0 as f64) / 1024.0
        );
    }
    println!(
        "  all stages: {:>8.1} MiB against {:>8.1} MiB",
        totals.0 as f64 / 1024.0,
        totals.1 as f64 / 1024.0
    );
    Ok(())
}

/// Bytes a value takes on the wire in `dtype` (its job-file spelling), on
/// average over an int8 block: int8 carries a scale a block.
fn wire_size(dtype: &str) -> anyhow::Result<f64> {
    let dtype: WireDType = serde_json::from_value(serde_json::Value::String(dtype.into()))
        .with_context(|| format!("wire dtype `{dtype}`"))?;
    let n = rookery_proto::INT8_BLOCK;
    Ok(dtype.bytes_for(n).context("a block's bytes")? as f64 / n as f64)
}

fn relayed_per_step(metrics: &JobMetrics) -> u64 {
    metrics.steps.iter().map(|s| s.bytes_relayed).sum::<u64>() / metrics.steps.len().max(1) as u64
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

fn write_job(
    dir: &Path,
    onnx: &Path,
    tokens: &Path,
    size: &GptSize,
    variant: &Variant,
) -> anyhow::Result<PathBuf> {
    let path = dir.join("job.toml");
    let settings = format!(
        "sync_every = {SYNC_EVERY}\nwire_dtype = \"{}\"\nschedule = \"{}\"\nprecision = \"{}\"",
        variant.wire, variant.schedule, variant.precision
    );
    gpt::write_job(&path, onnx, tokens, size, PROVIDERS, &settings)?;
    Ok(path)
}

/// One `rookery train` run: its metrics, the peak resident memory of it and
/// of each provider process, its wall time, and which provider id the
/// server gave each local provider (its log's "provider joined" lines).
struct Run {
    metrics: JobMetrics,
    peaks: Vec<Process>,
    wall: Duration,
    ids: BTreeMap<String, u64>,
}

struct Process {
    pid: u32,
    /// A provider's `--name` (`local-N`); none for the server.
    name: Option<String>,
    kib: u64,
}

impl Run {
    /// The stage (of cluster 0) the provider named `name` ran.
    fn stage_of(&self, name: &str) -> Option<u32> {
        let id = self.ids.get(name)?;
        let step = self.metrics.steps.first()?;
        step.stages
            .iter()
            .find(|t| t.provider == *id)
            .map(|t| t.stage)
    }

    fn label(&self, process: &Process) -> String {
        match &process.name {
            None => "server (rookery train)".to_string(),
            Some(name) => match self.stage_of(name) {
                Some(stage) => format!("provider {name} (stage {stage})"),
                None => format!("provider {name} (pid {})", process.pid),
            },
        }
    }

    /// Stage `k`'s provider's peak resident memory (KiB) and the most
    /// micro-batches the stage held at once in any step.
    fn stage_peak(&self, k: usize) -> (u64, u32) {
        let kib = self
            .peaks
            .iter()
            .find(|p| {
                p.name
                    .as_deref()
                    .and_then(|n| self.stage_of(n))
                    .is_some_and(|s| s as usize == k)
            })
            .map_or(0, |p| p.kib);
        let held = self
            .metrics
            .steps
            .iter()
            .flat_map(|s| s.stages.iter().filter(|t| t.stage as usize == k))
            .map(|t| t.peak_held)
            .max()
            .unwrap_or(0);
        (kib, held)
    }
}

/// Runs `rookery train` to the end while sampling the peak resident memory
/// (VmHWM) of it and of every process it starts.
fn train_watching_memory(job: &Path, out: &Path) -> anyhow::Result<Run> {
    std::fs::create_dir_all(out)?;
    let log_path = out.join("train.log");
    let log = std::fs::File::create(&log_path)?;
    let started = Instant::now();
    let mut child = Command::new(binary("rookery")?)
        .args(["train", &job.display().to_string()])
        .args(["--local-providers", &PROVIDERS.to_string()])
        .args(["--out", &out.display().to_string()])
        .env("ROOKERY_PROVIDER_BIN", binary("rookery-provider")?)
        // The server's "provider joined" lines name each provider's id.
        .env("RUST_LOG", "warn,rookery_server::http::ws=info")
        .env("NO_COLOR", "1")
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting rookery train")?;
    let root = child.id();
    let mut peaks: BTreeMap<u32, Process> = BTreeMap::new();
    let status = loop {
        for pid in std::iter::once(root).chain(children_of(root)) {
            if let Some(kib) = peak_kib(pid) {
                let entry = peaks.entry(pid).or_insert_with(|| Process {
                    pid,
                    name: (pid != root).then(|| provider_name(pid)).flatten(),
                    kib: 0,
                });
                entry.kib = entry.kib.max(kib);
            }
        }
        if let Some(status) = child.try_wait()? {
            break status;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    if !status.success() {
        bail!("rookery train failed: {status}\n{log}");
    }
    let text = std::fs::read_to_string(out.join("metrics.json")).context("metrics.json")?;
    Ok(Run {
        metrics: serde_json::from_str(&text)?,
        peaks: peaks.into_values().collect(),
        wall: started.elapsed(),
        ids: provider_ids(&log),
    })
}

/// A provider process's `--name`.
fn provider_name(pid: u32) -> Option<String> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let mut args = cmdline
        .split(|&b| b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned());
    args.find(|a| a == "--name")?;
    args.next()
}

/// Each provider's name and id, from the server's "provider joined" log
/// lines (`... id=3 ... name=local-0`).
fn provider_ids(log: &str) -> BTreeMap<String, u64> {
    log.lines()
        .filter(|l| l.contains("provider joined"))
        .filter_map(|l| {
            let field = |key: &str| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(key))
                    .map(|v| v.trim_matches('"').to_string())
            };
            Some((field("name=")?, field("id=")?.parse().ok()?))
        })
        .collect()
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
