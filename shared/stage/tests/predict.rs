//! [`Predictor`] on our kernels' CPU references runs the imported GPTs of
//! tests/fixtures/gpt-tiny (both exporters, both attention spellings, both
//! logit layouts) to the logits PyTorch computed for the same tokens in
//! evaluation mode.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use rookery_model::onnx;
use rookery_proto::tensor::{WireDType, WireTensor};
use rookery_stage::{CpuDevice, OwnFactory, Predictor};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gpt-tiny")
        .join(name)
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn imported_gpts_predict_pytorchs_logits_on_the_cpu_references() {
    let e = expected();
    let (vocab, context) = (
        e["vocab"].as_u64().unwrap() as usize,
        e["context"].as_u64().unwrap() as usize,
    );
    let tokens: Vec<i64> = e["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap().iter().map(|t| t.as_i64().unwrap()))
        .collect();
    let batch = tokens.len() / context;
    for exporter in ["dynamo", "legacy"] {
        for attn in ["hand", "mha"] {
            let want = floats(&e["logits"][attn]);
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for layout in ["ntv", "nvt"] {
                let name = format!("{exporter}-{attn}-{layout}.onnx");
                // Imported at another batch than it runs at.
                let graph = onnx::import_file(fixture(&name), &[5, context])
                    .unwrap()
                    .graph;
                let params: Vec<WireTensor> = graph
                    .params
                    .iter()
                    .map(|p| {
                        WireTensor::from_f32(
                            &p.name,
                            &p.shape,
                            &p.initial_values(0),
                            WireDType::F32,
                        )
                    })
                    .collect();
                let mut predictor =
                    Predictor::new(&mut OwnFactory::new(CpuDevice), &graph, &params).unwrap();
                let input = WireTensor::from_i64("tokens", &[batch, context], &tokens);
                let got = pollster::block_on(predictor.predict(&input)).unwrap();
                let got_shape = got.shape_usize();
                let got = got.to_f32().unwrap();
                if layout == "nvt" {
                    assert_eq!(got_shape, [batch, vocab, context], "{name}");
                } else {
                    assert_eq!(got_shape, [batch, context, vocab], "{name}");
                }
                let at = |n: usize, t: usize, v: usize| {
                    if layout == "nvt" {
                        got[(n * vocab + v) * context + t]
                    } else {
                        got[(n * context + t) * vocab + v]
                    }
                };
                // f32 through two blocks (sums of at most 64 terms) against
                // PyTorch's f32, written to 6 decimals.
                let tol = 1e-4 * scale.max(1.0);
                for n in 0..batch {
                    for t in 0..context {
                        for v in 0..vocab {
                            let (g, w) = (at(n, t, v), want[(n * context + t) * vocab + v]);
                            assert!(
                                (g - w).abs() <= tol,
                                "{name}: logits[{n}, {t}, {v}] = {g}, PyTorch {w} (tolerance {tol})"
                            );
                        }
                    }
                }
            }
        }
    }
}
