//! `rookery predict` on the toy GPTs of tests/fixtures/gpt-tiny: the logits
//! it writes are PyTorch's for the same tokens, on every backend this build
//! has (the CPU references always; libtorch with feature `torch`; wgpu with
//! feature `gpu`, lavapipe in CI), with the weights from a safetensors file
//! or the file's own; and what a user can get wrong is refused in words.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use rookery_job::data::{NpyData, read_npy, write_npy};
use rookery_server::cli::predict::{PredictArgs, PredictBackend, run};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/gpt-tiny")
        .join(name)
}

fn expected() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap()
}

fn backends() -> Vec<PredictBackend> {
    let mut all = vec![PredictBackend::Cpu];
    if cfg!(feature = "torch") {
        all.push(PredictBackend::Torch);
    }
    if cfg!(feature = "gpu") {
        all.push(PredictBackend::Wgpu);
    }
    all
}

/// The fixture's tokens as `tokens.npy` in `dir`: `[batch, context]` i64.
fn write_tokens(dir: &Path) -> (PathBuf, usize, usize) {
    let e = expected();
    let context = e["context"].as_u64().unwrap() as usize;
    let tokens: Vec<i64> = e["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap().iter().map(|t| t.as_i64().unwrap()))
        .collect();
    let path = dir.join("tokens.npy");
    write_npy(
        &path,
        &[tokens.len() / context, context],
        NpyData::I64(&tokens),
    )
    .unwrap();
    (path, tokens.len() / context, context)
}

fn args(model: &str, weights: Option<&str>, inputs: Vec<String>, out: &Path) -> PredictArgs {
    PredictArgs {
        model: fixture(model),
        weights: weights.map(fixture),
        inputs,
        out: out.to_path_buf(),
        backend: PredictBackend::Cpu,
    }
}

#[tokio::test]
async fn predicted_logits_are_pytorchs_on_every_backend_with_either_weights() {
    let dir = tempfile::tempdir().unwrap();
    let (tokens, batch, context) = write_tokens(dir.path());
    let e = expected();
    let vocab = e["vocab"].as_u64().unwrap() as usize;
    for attn in ["hand", "mha"] {
        let want: Vec<f32> = e["logits"][attn]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let weights = format!("{attn}.safetensors");
        for backend in backends() {
            for weights in [Some(weights.as_str()), None] {
                let out = dir
                    .path()
                    .join(format!("{attn}-{backend:?}-{}", weights.is_some()));
                let mut a = args(
                    &format!("dynamo-{attn}-ntv.onnx"),
                    weights,
                    vec![format!("tokens={}", tokens.display())],
                    &out,
                );
                a.backend = backend;
                run(a).await.unwrap();
                let written: Vec<_> = std::fs::read_dir(&out).unwrap().collect();
                assert_eq!(written.len(), 1, "one output, one file");
                let logits = read_npy(&written[0].as_ref().unwrap().path()).unwrap();
                assert_eq!(logits.shape(), [batch, context, vocab]);
                let got = logits.to_f32();
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (g - w).abs())
                    .fold(0f32, f32::max);
                assert!(
                    worst <= 1e-4 * scale,
                    "{attn} on {backend:?}: off by {worst} (logits up to {scale})"
                );
            }
        }
    }
}

#[tokio::test]
async fn inputs_the_model_lacks_or_cannot_read_are_refused_in_words() {
    let dir = tempfile::tempdir().unwrap();
    let (tokens, _, context) = write_tokens(dir.path());
    let floats = dir.path().join("floats.npy");
    write_npy(&floats, &[1, context], NpyData::F32(&vec![0.5; context])).unwrap();
    let cases = [
        (
            vec![format!("nope={}", tokens.display())],
            "graph input `nope`: is not an input of the graph",
        ),
        (vec![tokens.display().to_string()], "expected NAME=FILE.npy"),
        (
            vec![format!(
                "tokens={}",
                dir.path().join("absent.npy").display()
            )],
            "absent.npy",
        ),
        (
            vec![format!("tokens={}", floats.display())],
            "holds integers (int64) in the model",
        ),
    ];
    for (inputs, says) in cases {
        let err = run(args(
            "dynamo-hand-ntv.onnx",
            Some("hand.safetensors"),
            inputs.clone(),
            &dir.path().join("out"),
        ))
        .await
        .unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains(says), "{inputs:?}: {text}");
    }
    // Weights of another model: named, not silently ignored.
    let err = run(args(
        "dynamo-hand-ntv.onnx",
        Some("mha.safetensors"),
        vec![format!("tokens={}", tokens.display())],
        &dir.path().join("out"),
    ))
    .await
    .unwrap_err();
    assert!(
        format!("{err:#}").contains("are they this model's?"),
        "{err:#}"
    );
}
