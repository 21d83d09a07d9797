//! Pipeline schedules over real processes: `rookery train` with local
//! `rookery-provider`s (libtorch) and the same job under each
//! `training.schedule`.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::path::Path;

use rookery_e2e::reference::two_bw_losses;
use rookery_e2e::rookery_train;
use rookery_proto::api::JobMetrics;
use rookery_test_support::{Classes, dense_mlp, write_job};

const STAGES: usize = 4;
const MICRO_BATCHES: usize = 8;

/// Syncs (barriers) every 5 of the 20 steps, so `async` has steps to
/// overlap between them.
const SYNC_EVERY: u64 = 5;

fn run(dir: &Path, schedule: &str) -> (JobMetrics, Vec<u8>) {
    run_in(&dir.join(schedule), schedule)
}

fn run_in(job_dir: &Path, schedule: &str) -> (JobMetrics, Vec<u8>) {
    let model = dense_mlp(
        12,
        &[
            (24, Some("relu")),
            (16, Some("tanh")),
            (16, Some("relu")),
            (4, None),
        ],
    );
    let data = Classes::learnable(20 * 16, &[12], 0x2545_f491_4f6c_dd1d);
    let training = format!(
        "epochs = 1\nbatch_size = 16\nmicro_batches = {MICRO_BATCHES}\n\
         optimizer = {{ name = \"adam\", lr = 0.01 }}\nclusters = 1\nstages = {STAGES}\n\
         seed = 3\nsync_every = {SYNC_EVERY}\nschedule = \"{schedule}\""
    );
    std::fs::create_dir_all(job_dir).unwrap();
    let job = write_job(job_dir, &model, &data, &training).unwrap();
    let out = job_dir.join("out");
    let metrics = rookery_train(&job, STAGES, &out).unwrap();
    let weights = std::fs::read(out.join("weights.safetensors")).unwrap();
    (metrics, weights)
}

fn losses(m: &JobMetrics) -> Vec<f64> {
    m.steps.iter().map(|s| s.loss).collect()
}

/// The most micro-batches each stage held in any step.
fn peak_held(metrics: &JobMetrics) -> Vec<u32> {
    let mut peak = vec![0; STAGES];
    for step in &metrics.steps {
        for s in &step.stages {
            peak[s.stage as usize] = peak[s.stage as usize].max(s.peak_held);
        }
    }
    peak
}

/// 1F1B runs every stage's forwards and backwards in the order GPipe does,
/// only later, so its losses and weights are GPipe's to the bit; and stage
/// `s` of `S` never holds more than `S - s` micro-batches where GPipe's
/// Root holds all of a step's.
#[test]
fn one_forward_one_backward_trains_exactly_as_gpipe_holding_at_most_the_stages_from_each() {
    let dir = tempfile::tempdir().unwrap();
    let (gpipe, gpipe_weights) = run(dir.path(), "gpipe");
    let (one_f_one_b, one_f_one_b_weights) = run(dir.path(), "1f1b");
    assert_eq!(losses(&gpipe).len(), 20);
    assert_eq!(losses(&gpipe), losses(&one_f_one_b));
    assert!(gpipe_weights == one_f_one_b_weights, "the weights differ");

    // GPipe's Root is sent a step's every forward before any backward can
    // come back, so it holds them all.
    let gpipe_peak = peak_held(&gpipe);
    assert_eq!(gpipe_peak[0], MICRO_BATCHES as u32, "{gpipe_peak:?}");
    let peak = peak_held(&one_f_one_b);
    let bound: Vec<u32> = (0..STAGES).map(|s| (STAGES - s) as u32).collect();
    assert!(
        peak.iter().zip(&bound).all(|(p, b)| p <= b),
        "1f1b held {peak:?}, bound {bound:?}"
    );
    // The Root fills its allowance before the first backward returns, and
    // the Leaf holds one micro-batch, backpropagated at once.
    assert_eq!((peak[0], peak[STAGES - 1]), (STAGES as u32, 1), "{peak:?}");
}

/// `async` (PipeDream-2BW) trains to the single-process 2BW reference's
/// losses, which are not GPipe's; a second run replays the first to the
/// bit (the versions a step uses do not depend on timing); a stage holds
/// at most the two steps it may have open.
#[test]
fn async_trains_as_the_two_version_reference_and_replays_to_the_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (first, first_weights) = run_in(&dir.path().join("a"), "async");
    let (second, second_weights) = run_in(&dir.path().join("b"), "async");
    assert_eq!(losses(&first), losses(&second));
    assert!(first_weights == second_weights, "two async runs differ");

    let job = dir.path().join("a").join("job.toml");
    let want = two_bw_losses(&job);
    let got = losses(&first);
    assert_eq!(got.len(), want.len());
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        let rel = (g - w).abs() / w.abs();
        assert!(rel < 1e-5, "step {step}: {g}, 2BW reference {w} ({rel:e})");
    }
    // The delay is real: after the first steps GPipe's losses differ.
    let (gpipe, _) = run(dir.path(), "gpipe");
    let apart = losses(&gpipe)
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs() / a.abs())
        .fold(0.0, f64::max);
    assert!(apart > 1e-3, "async equals gpipe within {apart:e}");

    let peak = peak_held(&first);
    assert!(
        peak.iter().all(|&p| p as usize <= 2 * MICRO_BATCHES) && peak[STAGES - 1] == 1,
        "async held {peak:?}"
    );
}
