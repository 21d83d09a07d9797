//! `cargo xtask bench pipeline`: samples/s of `rookery train` with one
//! cluster of 3 local providers against the single-process reference
//! trainer on the same model (the MNIST CNN of the demo) and the same
//! batches, measured in one run and printed as a ratio (target >= 0.8); the
//! same for each schedule (`gpipe`, `1f1b`, `async`) with every frame to a provider
//! held 0, 20 and 100 ms (`--relay-delay-ms`), with each stage's busy share
//! and the most micro-batches it held at once; the bytes on the wire per
//! step for f32, f16, bf16 and int8 activations; and the test accuracy of
//! int8 against f32, and `async` against `gpipe`, on the demo's MNIST
//! digits (train and test sets, `ACCURACY_EPOCHS` epochs, same seed). Jobs
//! sync once per epoch, so `async` has steps to overlap.
//!
//! Then the same latency table on the example GPT (exported with PyTorch,
//! `ROOKERY_PYTHON`), one stage per core: a model whose step computes for
//! longer than a round trip of 100 ms hops, where `async` can keep every
//! stage busy (goal: at least 85%).
//!
//! `--gpt-latency-only` runs only that table. `--micro-batches-only` measures only the cost per micro-batch (the same
//! samples in 4 and in 16 micro-batches), `--repeat N` times alternately
//! (default 3), printing each pair's ratio and their median: a quick
//! check of a change to what a micro-batch costs.
//!
//! Needs release binaries (`ROOKERY_BIN_DIR`, set by xtask).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rookery_e2e::reference::steps_per_s;
use rookery_e2e::{gpt, rookery_train, rookery_train_with};
use rookery_proto::api::{JobMetrics, StageMetric, StepMetric};
use rookery_test_support::job::{job_text, mnist_10k_job_text, write_mnist_digits};
use rookery_test_support::workspace_root;

const BATCH: usize = 64;
const STEPS: usize = 40;
/// Steps left out of both timings: process start, first allocations.
const WARMUP: usize = 5;
const SCHEDULES: [&str; 3] = ["gpipe", "1f1b", "async"];
/// Each frame to a provider held this long, one latency run each.
const DELAYS_MS: [u64; 3] = [0, 20, 100];
/// Steps of each GPT latency run: 15 timed.
const GPT_STEPS: u32 = 20;
/// Epochs of the accuracy runs over the 8,000 digits of datasets/mnist-10k.
const ACCURACY_EPOCHS: u64 = 3;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let repeat = match args.iter().position(|a| a == "--repeat") {
        Some(i) => args
            .get(i + 1)
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .ok_or_else(|| anyhow::anyhow!("--repeat takes a count of at least 1"))?,
        // One pair moves by about 10% with the machine's load: the median
        // of three alternating pairs is steadier.
        None => 3,
    };
    if args.iter().any(|a| a == "--micro-batches-only") {
        let dir = tempfile::tempdir()?;
        return micro_batch_cost(dir.path(), repeat);
    }
    if args.iter().any(|a| a == "--gpt-latency-only") {
        let dir = tempfile::tempdir()?;
        return gpt_latency(dir.path());
    }
    let dir = tempfile::tempdir()?;
    let job = write_job(dir.path(), "f32", "gpipe")?;
    println!(
        "model: examples/mnist-cnn.toml on MNIST, batch {BATCH}, 4 micro-batches, {STEPS} steps ({WARMUP} warm-up)"
    );

    let out = dir.path().join("out-f32");
    let metrics = rookery_train(&job, 3, &out)?;
    let timed = &metrics.steps[WARMUP..];
    let pipeline_ms: f64 = timed.iter().map(|s| s.elapsed_ms).sum();
    let pipeline = (timed.len() * BATCH) as f64 / (pipeline_ms / 1e3);

    let reference = steps_per_s(&job, WARMUP as u64)? * BATCH as f64;
    println!("rookery train, 1 cluster x 3 stages: {pipeline:>8.1} samples/s");
    println!("single-process reference:          {reference:>8.1} samples/s");
    println!(
        "ratio pipeline / reference: {:.3} (target >= 0.8)",
        pipeline / reference
    );
    // Where a pipeline step goes: the slowest stage bounds the ratio.
    println!(
        "per step: reference {:.1} ms; pipeline {:.1} ms, of which each stage computes (and idles), median:",
        BATCH as f64 / reference * 1e3,
        median(timed.iter().map(|s| s.elapsed_ms).collect())
    );
    let stages = timed.first().map_or(0, |s| s.stages.len());
    for k in 0..stages {
        let of = |f: fn(&StageMetric) -> f64| {
            median(timed.iter().filter_map(|s| stage(s, k)).map(f).collect())
        };
        println!(
            "  stage {k}: {:>6.1} ms, planned {:.1} ms ({:.1} ms idle)",
            of(|t| t.compute_ms),
            of(|t| t.planned_ms),
            of(|t| t.idle_ms)
        );
    }

    // A link between homes: every frame to a provider held this long
    // (one hop: stage to server to stage is two of them, the server's own
    // being loopback), under each schedule.
    println!(
        "latency per hop (samples/s, ratio to the single-process reference, each stage's busy share, \
         each stage's most micro-batches held at once):"
    );
    for schedule in SCHEDULES {
        let job = write_job(dir.path(), "f32", schedule)?;
        latency_rows(
            &job,
            3,
            dir.path(),
            schedule,
            (BATCH as f64, "samples/s"),
            reference,
        )?;
    }
    gpt_latency(dir.path())?;

    micro_batch_cost(dir.path(), repeat)?;

    println!("bytes on the wire per step (activations and gradients relayed):");
    let f32_per_step = relayed_per_step(&metrics);
    for dtype in ["f32", "f16", "bf16", "int8"] {
        let per_step = if dtype == "f32" {
            f32_per_step
        } else {
            let job = write_job(dir.path(), dtype, "gpipe")?;
            relayed_per_step(&rookery_train(
                &job,
                3,
                &dir.path().join(format!("out-{dtype}")),
            )?)
        };
        println!(
            "  {dtype:>4}: {per_step:>10} bytes/step ({:.3} of f32)",
            per_step as f64 / f32_per_step as f64
        );
    }

    accuracy(dir.path())
}

/// What a micro-batch costs beyond its arithmetic: the same samples in four
/// times as many micro-batches, `repeat` times alternately.
fn micro_batch_cost(dir: &Path, repeat: usize) -> anyhow::Result<()> {
    let (mut ratios, mut fours, mut sixteens) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..repeat {
        let mut step_ms = Vec::new();
        for micro_batches in [4, 16] {
            let job = write_job_split(dir, "f32", "gpipe", micro_batches)?;
            let out = dir.join(format!("out-split-{micro_batches}-{round}"));
            let metrics = rookery_train(&job, 3, &out)?;
            let timed = &metrics.steps[WARMUP..];
            step_ms.push(median(timed.iter().map(|s| s.elapsed_ms).collect()));
            let stages = timed.first().map_or(0, |s| s.stages.len());
            let computes: Vec<String> = (0..stages)
                .map(|k| {
                    let ms = median(
                        timed
                            .iter()
                            .filter_map(|s| stage(s, k))
                            .map(|t| t.compute_ms)
                            .collect(),
                    );
                    format!("{ms:.1}")
                })
                .collect();
            println!(
                "  {micro_batches:>2} micro-batches: stages compute {} ms a step (median)",
                computes.join(" / ")
            );
        }
        println!(
            "per micro-batch: a step of {BATCH} samples takes {:.1} ms in 4 micro-batches and {:.1} ms in 16 (median): \
             {:.2} times (goal: at most 1.3)",
            step_ms[0],
            step_ms[1],
            step_ms[1] / step_ms[0]
        );
        ratios.push(step_ms[1] / step_ms[0]);
        fours.push(step_ms[0]);
        sixteens.push(step_ms[1]);
    }
    if repeat > 1 {
        println!(
            "per micro-batch, median of {repeat} pairs: {:.2} times ({:.1} ms in 4, {:.1} ms in 16)",
            median(ratios),
            median(fours),
            median(sixteens)
        );
    }
    Ok(())
}

/// int8 against f32 on what the model learns: the demo's digits with its
/// test set, the same seed and steps, one cluster of 3 stages.
fn accuracy(dir: &Path) -> anyhow::Result<()> {
    println!(
        "test accuracy, int8 against f32 and async against gpipe: datasets/mnist-10k (8,000 digits, 2,000 test), \
         {ACCURACY_EPOCHS} epochs, batch {BATCH}, 4 micro-batches, seed 1:"
    );
    let mut runs = Vec::new();
    for (dtype, schedule) in [("f32", "gpipe"), ("int8", "gpipe"), ("f32", "async")] {
        let job = write_accuracy_job(dir, dtype, schedule)?;
        let started = Instant::now();
        let metrics = rookery_train(
            &job,
            3,
            &dir.join(format!("out-accuracy-{dtype}-{schedule}")),
        )?;
        let accuracy = metrics
            .epochs
            .last()
            .map_or(f64::NAN, |e| e.test_accuracy * 100.0);
        let per_step = relayed_per_step(&metrics);
        println!(
            "  {dtype:>4} {schedule:>5}: test accuracy {accuracy:.2}% after {} steps, final loss {:.4}, \
             {per_step} bytes/step, {:.1} s",
            metrics.steps.len(),
            metrics.steps.last().map_or(f64::NAN, |s| s.loss),
            started.elapsed().as_secs_f64()
        );
        runs.push((accuracy, per_step));
    }
    let [
        (f32_accuracy, f32_bytes),
        (int8_accuracy, int8_bytes),
        (async_accuracy, _),
    ] = runs[..]
    else {
        unreachable!("three runs")
    };
    println!(
        "  int8 - f32: {:+.2} points (goal: within 0.5); bytes/step int8 / f32: {:.3} (goal: at most 0.27)",
        int8_accuracy - f32_accuracy,
        int8_bytes as f64 / f32_bytes as f64
    );
    println!(
        "  async - gpipe: {:+.2} points (goal: within 0.5)",
        async_accuracy - f32_accuracy
    );
    Ok(())
}

/// Stage `k`'s record in a step (the job has one cluster).
fn stage(step: &StepMetric, k: usize) -> Option<&StageMetric> {
    step.stages.iter().find(|t| t.stage as usize == k)
}

fn relayed_per_step(metrics: &JobMetrics) -> u64 {
    metrics.steps.iter().map(|s| s.bytes_relayed).sum::<u64>() / metrics.steps.len().max(1) as u64
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The demo's model on the first `STEPS * BATCH` MNIST digits, as npy files
/// beside a job file with the given wire dtype and schedule.
fn write_job(dir: &Path, wire: &str, schedule: &str) -> anyhow::Result<PathBuf> {
    write_job_split(dir, wire, schedule, 4)
}

/// [`write_job`] with the step's batch in `micro_batches` micro-batches.
fn write_job_split(
    dir: &Path,
    wire: &str,
    schedule: &str,
    micro_batches: usize,
) -> anyhow::Result<PathBuf> {
    if !dir.join("x.npy").exists() {
        write_mnist_digits(dir, STEPS * BATCH)?;
    }
    let path = dir.join(format!("job-{wire}-{schedule}-{micro_batches}.toml"));
    let spec = workspace_root().join("examples/mnist-cnn.toml");
    let training = format!(
        "epochs = 1\nbatch_size = {BATCH}\nmicro_batches = {micro_batches}\n\
         optimizer = {{ name = \"adam\", lr = 0.001 }}\nclusters = 1\nstages = 3\n\
         seed = 1\nsync_every = {STEPS}\nwire_dtype = \"{wire}\"\nschedule = \"{schedule}\""
    );
    std::fs::write(&path, job_text(&spec, &[1, 28, 28], "", None, &training))?;
    Ok(path)
}

/// The demo's model and data (datasets/mnist-10k, with its test set and
/// normalisation) at the benchmark's batch, with the given wire dtype.
fn write_accuracy_job(dir: &Path, wire: &str, schedule: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join(format!("job-accuracy-{wire}-{schedule}.toml"));
    // A sync per epoch (125 steps at batch 64).
    let text = mnist_10k_job_text(&format!(
        "epochs = {ACCURACY_EPOCHS}\nbatch_size = {BATCH}\nmicro_batches = 4\n\
         optimizer = {{ name = \"adam\", lr = 0.001 }}\nclusters = 1\nstages = 3\n\
         shuffle = true\nseed = 1\nsync_every = 125\nwire_dtype = \"{wire}\"\nschedule = \"{schedule}\""
    ));
    std::fs::write(&path, text)?;
    Ok(path)
}

/// One line per relay delay ([`DELAYS_MS`], 100 ms last) of `job` under
/// `schedule` on `stages` local providers: its rate in `unit`s (`per_step`
/// of them a step), the ratio to the single-process `reference` rate, each
/// stage's busy share and the most micro-batches it held at once.
fn latency_rows(
    job: &Path,
    stages: usize,
    dir: &Path,
    schedule: &str,
    (per_step, unit): (f64, &str),
    reference: f64,
) -> anyhow::Result<Vec<Vec<f64>>> {
    let mut busy_by_delay = Vec::new();
    for delay_ms in DELAYS_MS {
        let out = dir.join(format!("out-{schedule}-{stages}-delay-{delay_ms}"));
        let delay = delay_ms.to_string();
        let metrics = rookery_train_with(
            job,
            stages,
            &out,
            &["--relay-delay-ms", &delay],
            Duration::from_secs(3600),
        )?;
        let timed = &metrics.steps[WARMUP..];
        let elapsed: f64 = timed.iter().map(|s| s.elapsed_ms).sum();
        let rate = timed.len() as f64 * per_step / (elapsed / 1e3);
        let busy: Vec<f64> = (0..stages)
            .map(|k| {
                let computed: f64 = timed
                    .iter()
                    .filter_map(|s| stage(s, k))
                    .map(|t| t.compute_ms)
                    .sum();
                100.0 * computed / elapsed
            })
            .collect();
        let held: Vec<String> = (0..stages)
            .map(|k| {
                let most = metrics
                    .steps
                    .iter()
                    .filter_map(|s| stage(s, k))
                    .map(|t| t.peak_held)
                    .max()
                    .unwrap_or(0);
                most.to_string()
            })
            .collect();
        let shares: Vec<String> = busy.iter().map(|b| format!("{b:.0}%")).collect();
        println!(
            "  {schedule:>5} {delay_ms:>3} ms: {rate:>8.1} {unit}, ratio {:.3}, busy {}, held {}",
            rate / reference,
            shares.join(" / "),
            held.join(" / ")
        );
        busy_by_delay.push(busy);
    }
    Ok(busy_by_delay)
}

/// Latency hidden by compute: the example GPT, whose step computes for
/// longer than a micro-batch's round trip at 100 ms a hop, where the MNIST
/// CNN's 1.6 ms micro-batches would need some 260 of them in flight. One
/// stage per core (at most 4): stages sharing a core would measure the
/// operating system's scheduler, not the pipeline's, and each donor brings
/// its own machine.
fn gpt_latency(dir: &Path) -> anyhow::Result<()> {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let stages = cores.clamp(2, 4);
    let size = gpt::GptSize {
        steps: GPT_STEPS,
        ..gpt::EXAMPLE
    };
    let onnx = gpt::export(dir, &size)?;
    let tokens = gpt::tokens_file(dir, &size)?;
    println!(
        "latency per hop on the {}, batch {} x {} tokens, {GPT_STEPS} steps ({WARMUP} warm-up), \
         1 cluster x {stages} stages (one a core of {cores}), 4 micro-batches \
         (tokens/s, ratio to the single-process reference, busy share, held):",
        size.describe(),
        size.batch,
        size.context,
    );
    let job_for = |schedule: &str| -> anyhow::Result<PathBuf> {
        let job = dir.join(format!("gpt-{schedule}.toml"));
        let settings = format!("sync_every = {GPT_STEPS}\nschedule = \"{schedule}\"");
        gpt::write_job(&job, &onnx, &tokens, &size, stages, &settings)?;
        Ok(job)
    };
    // The same batches whatever the schedule.
    let reference = steps_per_s(&job_for(SCHEDULES[0])?, WARMUP as u64)? * size.tokens_per_step();
    for schedule in SCHEDULES {
        let job = job_for(schedule)?;
        let busy = latency_rows(
            &job,
            stages,
            dir,
            schedule,
            (size.tokens_per_step(), "tokens/s"),
            reference,
        )?;
        if schedule == "async" {
            let at_100_ms = busy.last().map_or(&[][..], Vec::as_slice);
            let least = at_100_ms.iter().copied().fold(f64::INFINITY, f64::min);
            println!(
                "  async at 100 ms a hop: every stage at least {least:.0}% busy (goal: at least 85%)"
            );
        }
    }
    Ok(())
}
