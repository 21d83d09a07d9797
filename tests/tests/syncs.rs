//! Syncs between clusters over real processes: `rookery train` with local
//! `rookery-provider`s (libtorch), two clusters of two stages.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::path::Path;

use rookery_e2e::rookery_train;
use rookery_job::read_safetensors;
use rookery_model::DType;
use rookery_proto::WireDType;
use rookery_proto::api::JobMetrics;
use rookery_test_support::{Classes, dense_mlp, write_job};

const STEPS: usize = 20;

fn run(dir: &Path, compress: &str) -> JobMetrics {
    let model = dense_mlp(12, &[(24, Some("relu")), (16, Some("tanh")), (4, None)]);
    let data = Classes::learnable(STEPS * 16, &[12], 0x2545_f491_4f6c_dd1d);
    // Plain SGD keeps no optimizer state, so a sync moves parameters only.
    let training = format!(
        "epochs = 1\nbatch_size = 8\nmicro_batches = 2\n\
         optimizer = {{ name = \"sgd\", lr = 0.1 }}\nclusters = 2\nstages = 2\nseed = 11\n\
         [training.sync]\nevery = 4\ncompress = \"{compress}\""
    );
    let job_dir = dir.join(compress);
    std::fs::create_dir_all(&job_dir).unwrap();
    let job = write_job(&job_dir, &model, &data, &training).unwrap();
    rookery_train(&job, 4, &job_dir.join("out")).unwrap()
}

/// With `compress = "int8"` each stage uploads its change since the last
/// sync in blockwise int8 (the server's parameters come back in f32), so a
/// sync moves `int8 bytes + f32 bytes` where it moved twice the f32 bytes,
/// exactly; and training follows the uncompressed run to within the
/// quantization's error while not being it.
#[test]
fn int8_syncs_upload_changes_in_a_quarter_of_the_bytes_and_train_as_f32_syncs_do() {
    let dir = tempfile::tempdir().unwrap();
    let f32_run = run(dir.path(), "none");
    let int8_run = run(dir.path(), "int8");

    let weights = read_safetensors(&dir.path().join("none/out/weights.safetensors")).unwrap();
    let (mut f32_bytes, mut int8_bytes) = (0u64, 0u64);
    for t in weights.iter().filter(|t| t.dtype == DType::F32) {
        let n = t.values.len();
        f32_bytes += WireDType::F32.bytes_for(n).unwrap() as u64;
        int8_bytes += WireDType::I8Block.bytes_for(n).unwrap() as u64;
    }
    let synced = |m: &JobMetrics| m.steps.iter().map(|s| s.bytes_synced).sum::<u64>();
    let (f32_synced, int8_synced) = (synced(&f32_run), synced(&int8_run));
    assert!(f32_synced > 0);
    // Per sync and cluster: up f32 + down f32, against up int8 + down f32.
    assert_eq!(
        int8_synced * (2 * f32_bytes),
        f32_synced * (int8_bytes + f32_bytes),
        "synced {int8_synced} int8 against {f32_synced} f32 bytes"
    );

    let losses = |m: &JobMetrics| m.steps.iter().map(|s| s.loss).collect::<Vec<_>>();
    let (want, got) = (losses(&f32_run), losses(&int8_run));
    assert_eq!(got.len(), STEPS);
    // Identical up to the first sync, which is after step 4.
    assert_eq!(got[..4], want[..4]);
    assert_ne!(got, want, "the int8 syncs changed nothing");
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-2 * w.abs(),
            "step {step}: {g} with int8 syncs, {w} without"
        );
    }
}
