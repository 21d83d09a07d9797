//! `cargo xtask bench sync`: what DiLoCo-style syncs save between clusters.
//! The demo's MNIST CNN on its 10,000 digits, 2 clusters of one provider
//! each, trained three times in one run: syncing every step by plain
//! averaging (H = 1); every 50 steps with the outer Nesterov optimizer of
//! DiLoCo (lr 0.7, momentum 0.9); and that again with `compress = "int8"`
//! (each upload the stage's change since the last sync). Prints the bytes
//! syncs move per step (parameters and optimizer state, up and back; the
//! goal is H = 50 moving at least 50 times fewer) and each run's final
//! test accuracy.
//!
//! Needs release binaries (`ROOKERY_BIN_DIR`, set by xtask).

use std::path::{Path, PathBuf};
use std::time::Instant;

use rookery_e2e::rookery_train;
use rookery_proto::api::JobMetrics;
use rookery_test_support::job::mnist_10k_job_text;

const EPOCHS: u64 = 2;

fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    println!(
        "model: examples/mnist-cnn.toml on datasets/mnist-10k, {EPOCHS} epochs, 2 clusters x 1 stage, batch 16 per cluster (250 steps an epoch, so every 50th step ends one), Adam"
    );
    let runs = [
        ("H = 1, plain averaging", "sync_every = 1"),
        (
            "H = 50, outer Nesterov",
            "[training.sync]\nevery = 50\nouter_optimizer = { name = \"nesterov\", lr = 0.7, momentum = 0.9 }",
        ),
        (
            "H = 50, Nesterov, int8",
            "[training.sync]\nevery = 50\nouter_optimizer = { name = \"nesterov\", lr = 0.7, momentum = 0.9 }\ncompress = \"int8\"",
        ),
    ];
    let mut rates = Vec::new();
    for (i, (what, sync)) in runs.iter().enumerate() {
        let job = write_job(dir.path(), i, sync)?;
        let started = Instant::now();
        let metrics = rookery_train(&job, 2, &dir.path().join(format!("out-{i}")))?;
        let seconds = started.elapsed().as_secs_f64();
        let per_step = synced_per_step(&metrics);
        let accuracy = metrics.epochs.last().map_or(f64::NAN, |e| e.test_accuracy);
        println!(
            "{what:<24} {per_step:>12.0} bytes synced/step, test accuracy {:.2}%, {} steps in {seconds:.1} s",
            accuracy * 100.0,
            metrics.steps.len()
        );
        rates.push(per_step);
    }
    println!(
        "H = 1 moves {:.1} times the bytes of H = 50 per step (goal: at least 50)",
        rates[0] / rates[1]
    );
    // Adam's two moments still travel in f32 for the checkpoint, and the
    // synced parameters come back in f32: only the upload is int8.
    println!(
        "int8 uploads move {:.3} of the f32 sync's bytes (parameters up in int8; Adam's state up and parameters down in f32)",
        rates[2] / rates[1]
    );
    Ok(())
}

/// Sync bytes per step over the steps whose syncs are recorded: each
/// sync's bytes are in the record of the step after it, so the window ends
/// at the last record that has any.
fn synced_per_step(metrics: &JobMetrics) -> f64 {
    let last = metrics
        .steps
        .iter()
        .rposition(|s| s.bytes_synced > 0)
        .map_or(0, |i| i + 1);
    let total: u64 = metrics.steps[..last].iter().map(|s| s.bytes_synced).sum();
    total as f64 / last.max(1) as f64
}

/// The demo's job with 2 clusters of one stage and the given sync table.
fn write_job(dir: &Path, i: usize, sync: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join(format!("job-{i}.toml"));
    let text = mnist_10k_job_text(&format!(
        "epochs = {EPOCHS}\nbatch_size = 16\nmicro_batches = 1\n\
         optimizer = {{ name = \"adam\", lr = 0.002 }}\nclusters = 2\nstages = 1\nseed = 42\n{sync}"
    ));
    std::fs::write(&path, text)?;
    Ok(path)
}
