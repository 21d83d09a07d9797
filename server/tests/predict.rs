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

/// A Dense layer with ReLU on `[2, 3]` inputs: what `rookery predict` gives
/// for a layer spec, with its seeded initial values and with weights from a
/// file, against the arithmetic done here.
#[tokio::test]
async fn a_layer_spec_predicts_with_its_initial_or_given_weights() {
    use rookery_job::weights::{WeightTensor, write_safetensors};
    use rookery_model::DType;

    let dir = tempfile::tempdir().unwrap();
    let spec =
        "input_shape = [3]\n[[layers]]\ntype = \"Dense\"\nunits = 2\nactivation = \"relu\"\n";
    let spec_path = dir.path().join("dense.toml");
    std::fs::write(&spec_path, spec).unwrap();
    let x = [1.0f32, -2.0, 0.5, 3.0, 0.25, -1.0];
    let x_path = dir.path().join("x.npy");
    write_npy(&x_path, &[2, 3], NpyData::F32(&x)).unwrap();
    let graph = rookery_model::from_toml(spec).unwrap();
    let [w, b] = graph.params.as_slice() else {
        panic!("a Dense layer has a weight and a bias: {:?}", graph.params);
    };
    let expected = |w: &[f32], b: &[f32]| -> Vec<f32> {
        (0..2)
            .flat_map(|n| {
                (0..2).map(move |o| {
                    let dot: f32 = (0..3).map(|i| x[n * 3 + i] * w[o * 3 + i]).sum();
                    (dot + b[o]).max(0.0)
                })
            })
            .collect()
    };
    let given_w = [0.5f32, -1.0, 2.0, 1.0, 1.0, 1.0];
    let given_b = [0.25f32, -3.0];
    write_safetensors(
        &dir.path().join("w.safetensors"),
        &[
            WeightTensor {
                name: w.name.clone(),
                shape: w.shape.clone(),
                dtype: DType::F32,
                values: given_w.to_vec(),
            },
            WeightTensor {
                name: b.name.clone(),
                shape: b.shape.clone(),
                dtype: DType::F32,
                values: given_b.to_vec(),
            },
        ],
    )
    .unwrap();
    let cases = [
        (None, expected(&w.initial_values(0), &b.initial_values(0))),
        (
            Some(dir.path().join("w.safetensors")),
            expected(&given_w, &given_b),
        ),
    ];
    for (i, (weights, want)) in cases.into_iter().enumerate() {
        let out = dir.path().join(format!("out{i}"));
        run(PredictArgs {
            model: spec_path.clone(),
            weights,
            inputs: vec![format!("input={}", x_path.display())],
            out: out.clone(),
            backend: PredictBackend::Cpu,
        })
        .await
        .unwrap();
        let file = std::fs::read_dir(&out)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let got = read_npy(&file).unwrap();
        assert_eq!(got.shape(), [2, 2]);
        for (g, w) in got.to_f32().iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "case {i}: {g} vs {w}"
            );
        }
    }
}
