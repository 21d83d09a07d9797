//! The demo's job end to end on real data: the MNIST CNN, two clusters of
//! Root -> Stem -> Leaf over six local providers, reaches at least 97% on the
//! 2,000 held-out digits, and its weights carry the model's parameter names.
#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use rookery_e2e::rookery_train;
use rookery_test_support::workspace_root;

#[test]
fn the_demo_cnn_reaches_97_percent_on_held_out_digits() {
    let out = tempfile::tempdir().unwrap();
    let job = workspace_root().join("examples/mnist-job.toml");
    let metrics = rookery_train(&job, 6, out.path()).unwrap();
    let last = metrics.epochs.last().unwrap();
    assert_eq!(last.samples, 2000);
    assert!(
        last.test_accuracy >= 0.97,
        "test accuracy {} after {} epochs",
        last.test_accuracy,
        metrics.epochs.len()
    );
    // Two clusters of three stages each, every step.
    assert!(metrics.steps.iter().all(|s| s.stages.len() == 6));
    assert!(metrics.steps.iter().all(|s| s.bytes_relayed > 0));

    let spec = rookery_job::JobSpec::from_file(&job).unwrap();
    let graph = spec.load_model().unwrap().graph;
    let weights = rookery_job::read_safetensors(&out.path().join("weights.safetensors")).unwrap();
    let mut names: Vec<&str> = weights.iter().map(|t| t.name.as_str()).collect();
    let mut want: Vec<&str> = graph
        .params
        .iter()
        .filter(|p| p.kind != rookery_model::ParamKind::Constant)
        .map(|p| p.name.as_str())
        .collect();
    names.sort_unstable();
    want.sort_unstable();
    assert_eq!(names, want);
    assert!(names.contains(&"1.running_mean") && names.contains(&"0.weight"));
}
