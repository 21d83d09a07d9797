//! A GPT exported from PyTorch trains in Rookery exactly as PyTorch trains it:
//! `rookery train` on each export of tests/fixtures/gpt-parity (3 stages, 4
//! micro-batches, next-token windows cut by the server from one token file)
//! against the per-step losses PyTorch recorded for the same windows
//! (tests/scripts/gpt_parity.py made them). The runs cover both exporters,
//! both logit layouts, hand-written and `nn.MultiheadAttention` attention,
//! and a cosine schedule with gradient clipping.
#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::path::Path;

use rookery_e2e::rookery_train;
use rookery_test_support::workspace_root;

/// The bar: every step's loss within 1e-4 of PyTorch's, relatively.
const TOLERANCE: f64 = 1e-4;

fn fixture_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = workspace_root().join("tests/fixtures/gpt-parity");
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

fn expected_losses(dir: &Path, run: &str) -> Vec<f64> {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    serde_json::from_value(expected["runs"][run]["losses"].clone()).unwrap()
}

fn assert_matches_pytorch(run: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{run}: steps");
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        let rel = (g - w).abs() / w.abs();
        assert!(
            rel < TOLERANCE,
            "{run} step {step}: Rookery {g}, PyTorch {w} (relative {rel:e})"
        );
    }
}

fn train_and_compare(run: &str) {
    let dir = fixture_copy();
    let out = dir.path().join(format!("out-{run}"));
    let metrics = rookery_train(&dir.path().join(format!("{run}.toml")), 3, &out).unwrap();
    let got: Vec<f64> = metrics.steps.iter().map(|s| s.loss).collect();
    assert_matches_pytorch(run, &got, &expected_losses(dir.path(), run));
    assert!(out.join("weights.safetensors").is_file(), "{run}: weights");
}

#[test]
fn a_gpt_by_the_dynamo_exporter_with_nt_v_logits_trains_to_pytorchs_losses() {
    train_and_compare("dynamo-ntv");
}

#[test]
fn a_gpt_by_the_legacy_exporter_with_nv_t_logits_trains_to_pytorchs_losses() {
    train_and_compare("legacy-nvt");
}

#[test]
fn a_gpt_with_multihead_attention_trains_to_pytorchs_losses_by_either_exporter() {
    train_and_compare("dynamo-nvt-mha");
    train_and_compare("legacy-ntv-mha");
}

#[test]
fn a_gpt_with_a_cosine_schedule_and_clipping_trains_to_pytorchs_losses() {
    train_and_compare("dynamo-ntv-cosine-clip");
}

/// A browser tab on the Donate page holds one of the three stages (our own
/// kernels on WebGPU, SwiftShader in headless Chromium) beside two libtorch
/// providers, and the GPT still trains to PyTorch's losses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_tab_holding_a_gpt_stage_trains_to_pytorchs_losses() -> anyhow::Result<()> {
    use std::time::Duration;

    use rookery_e2e::Browser;
    use rookery_proto::ProviderKind;
    use rookery_server::cli::client::Client;

    let run = "dynamo-ntv";
    let dir = fixture_copy();
    let browser = Browser::start().await?;
    let (server, _natives) = browser.beside_two_natives().await?;
    let client = Client::new(&server.http_url(""), &server.api_token()?);
    let id = client
        .submit(&dir.path().join(format!("{run}.toml")))
        .await?
        .id;
    let job = tokio::time::timeout(Duration::from_secs(300), client.watch(id)).await??;
    assert_eq!(job.status, "completed", "{job:?}");
    let plan = job.plan.as_ref().expect("a running job has a plan");
    let tabs = plan.clusters[0]
        .stages
        .iter()
        .filter(|s| s.provider_kind == ProviderKind::Browser)
        .count();
    assert_eq!(tabs, 1, "{plan:?}");
    let metrics = client.metrics(id).await?;
    let got: Vec<f64> = metrics.steps.iter().map(|s| s.loss).collect();
    assert_matches_pytorch(
        &format!("{run} with a browser stage"),
        &got,
        &expected_losses(dir.path(), run),
    );
    Ok(())
}
