//! Any size travels: a model whose stages are many times the frame limit
//! trains end to end with `rookery train` (an embedded server and local
//! `rookery-provider`s on loopback), every tensor streamed in frames within
//! a 4 MiB limit the server announces: `Assign`, `Forward` data, `Params`,
//! `OptimizerState` and `SetParams`. A frame over the limit from either side
//! would drop the provider, and with no spare provider the job would stall.
#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::time::{Duration, Instant};

use rookery_e2e::rookery_train_with;
use rookery_test_support::{Classes, dense_mlp, write_job};

const FRAME_LIMIT: usize = 4 << 20;
const SEED: u64 = 3;

#[test]
fn a_21m_parameter_model_with_adam_trains_in_three_stages_under_a_4_mib_frame_limit() {
    let dir = tempfile::tempdir().unwrap();
    let mut layers = vec![(2048, Some("relu")); 5];
    layers.push((4, None));
    let model = dense_mlp(2048, &layers);
    let graph = rookery_model::from_toml(&model).unwrap();
    let initial = graph.initial_values(SEED);
    let params: usize = initial.values().map(Vec::len).sum();
    assert!(params > 20_000_000, "{params} parameters");
    // Each weight (16 MiB) is four times the limit, a stage's parameters
    // with Adam's state many times more; a micro-batch of inputs (8 x 2048
    // f32, 64 KiB) streams too.
    let data = Classes::learnable(64, &[2048], 0x5eed);
    // Two clusters so that the sync (one, at the end: each costs a resume
    // point of every cluster's Adam state) sends SetParams.
    let training = format!(
        "epochs = 1\nbatch_size = 16\nmicro_batches = 2\n\
         optimizer = {{ name = \"adam\", lr = 0.001 }}\n\
         clusters = 2\nstages = 3\nsync_every = 2\nseed = {SEED}"
    );
    let job = write_job(dir.path(), &model, &data, &training).unwrap();
    let out = dir.path().join("out");
    let started = Instant::now();
    let metrics = rookery_train_with(
        &job,
        6,
        &out,
        &["--max-frame-bytes", &FRAME_LIMIT.to_string()],
        Duration::from_secs(300),
    )
    .unwrap();
    let took = started.elapsed();

    // 64 samples, 2 clusters of 16 per step: 2 steps, each with a loss.
    let losses: Vec<f64> = metrics.steps.iter().map(|s| s.loss).collect();
    assert_eq!(losses.len(), 2, "{losses:?}");
    assert!(
        losses.iter().all(|l| l.is_finite() && *l > 0.0),
        "{losses:?}"
    );

    // The weights came back whole, and training moved every one of them.
    let weights = rookery_job::read_safetensors(&out.join("weights.safetensors")).unwrap();
    assert_eq!(weights.len(), initial.len());
    for tensor in &weights {
        let start = &initial[&tensor.name];
        assert_eq!(tensor.values.len(), start.len(), "{}", tensor.name);
        assert!(
            tensor.values.iter().all(|v| v.is_finite()),
            "{}",
            tensor.name
        );
        let moved = tensor
            .values
            .iter()
            .zip(start)
            .filter(|(a, b)| a != b)
            .count();
        assert!(
            moved > start.len() / 4,
            "{}: only {moved} of {} values changed",
            tensor.name,
            start.len()
        );
    }
    eprintln!(
        "{params} parameters ({} MB), 2 clusters x 3 stages, trained in {:.1} s",
        params * 4 / 1_000_000,
        took.as_secs_f64()
    );
}
