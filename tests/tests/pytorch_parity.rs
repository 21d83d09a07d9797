//! A model exported from PyTorch trains in Rookery exactly as PyTorch trains
//! it: `rookery train` on the ONNX export (3 stages, 4 micro-batches) against
//! the losses and final weights PyTorch recorded in the fixture
//! (tests/scripts/pytorch_parity.py made it).
#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::collections::BTreeMap;

use rookery_e2e::rookery_train;
use rookery_test_support::workspace_root;

fn fixture_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = workspace_root().join("tests/fixtures/pytorch-mlp");
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

#[test]
fn an_onnx_export_trains_to_pytorchs_own_losses_and_weights() {
    let dir = fixture_copy();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("expected.json")).unwrap())
            .unwrap();
    for run in ["sgd", "adam"] {
        let out = dir.path().join(format!("out-{run}"));
        let metrics = rookery_train(&dir.path().join(format!("job-{run}.toml")), 3, &out).unwrap();
        let want: Vec<f64> =
            serde_json::from_value(expected["runs"][run]["losses"].clone()).unwrap();
        let got: Vec<f64> = metrics.steps.iter().map(|s| s.loss).collect();
        assert_eq!(got.len(), want.len(), "{run}");
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            let rel = (g - w).abs() / w.abs();
            assert!(
                rel < 1e-5,
                "{run} step {step}: Rookery {g}, PyTorch {w} (relative {rel:e})"
            );
        }

        // The weights file is PyTorch's state_dict: same names, same values.
        let want: BTreeMap<String, Vec<f32>> =
            serde_json::from_value(expected["runs"][run]["final_weights"].clone()).unwrap();
        let got = rookery_job::read_safetensors(&out.join("weights.safetensors")).unwrap();
        let names: Vec<&String> = got.iter().map(|t| &t.name).collect();
        assert_eq!(names, want.keys().collect::<Vec<_>>(), "{run}");
        for tensor in &got {
            let w = &want[&tensor.name];
            let worst = tensor
                .values
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst < 1e-5,
                "{run} {}: differs from PyTorch by {worst}",
                tensor.name
            );
        }
    }
}
