//! ONNX import of a real GPT (examples/gpt/model.py at toy size,
//! tests/fixtures/gpt-tiny): both exporters, hand-written attention and
//! `nn.MultiheadAttention`, logits `[N, T, V]` and `[N, V, T]`, and exports
//! with a fixed batch. What runs (numbers against PyTorch) is checked in
//! `rookery-stage` and `rookery-torch`; here, what the import makes of them.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use rookery_model::onnx::{self, Imported};
use rookery_model::{DType, Graph, Op, ParamKind};

const VOCAB: usize = 48;
const CONTEXT: usize = 16;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gpt-tiny")
        .join(name)
}

/// Every dynamic-batch export: (file, MultiheadAttention, logits `[N, V, T]`).
fn exports() -> Vec<(String, bool, bool)> {
    let mut out = Vec::new();
    for exporter in ["dynamo", "legacy"] {
        for attn in ["hand", "mha"] {
            for layout in ["ntv", "nvt"] {
                out.push((
                    format!("{exporter}-{attn}-{layout}.onnx"),
                    attn == "mha",
                    layout == "nvt",
                ));
            }
        }
    }
    out
}

fn import(name: &str, batch: usize) -> Result<Imported, rookery_model::OnnxError> {
    onnx::import_file(fixture(name), &[batch, CONTEXT])
}

/// The output shape `graph` infers when its input has `batch` samples.
fn output_at(graph: &Graph, batch: usize) -> Vec<usize> {
    let mut g = graph.clone();
    g.inputs[0].shape[0] = batch;
    let analysis = g.analyze().unwrap();
    analysis.tensors[&g.outputs[0]].shape.clone()
}

#[test]
fn every_gpt_export_imports_without_warnings_and_with_the_state_dict_names() {
    for (name, mha, _) in exports() {
        let imported = import(&name, 2).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            imported.warnings.is_empty(),
            "{name}: {:?}",
            imported.warnings
        );
        let g = &imported.graph;
        let trainable: Vec<&str> = g
            .params
            .iter()
            .filter(|p| p.kind == ParamKind::Trainable)
            .map(|p| p.name.as_str())
            .collect();
        let attn = if mha {
            "blocks.1.attn.mha.in_proj_weight"
        } else {
            "blocks.1.attn.qkv.weight"
        };
        for want in ["tok.weight", "pos.weight", attn, "ln_f.bias", "head.weight"] {
            assert!(trainable.contains(&want), "{name}: {want} in {trainable:?}");
        }
        // The causal mask is a constant of the module, never trained, and no
        // integer constant (our kernels take none) is left for a Gather.
        assert!(
            !trainable.iter().any(|n| n.contains("mask")),
            "{name}: {trainable:?}"
        );
        assert!(
            !g.params
                .iter()
                .any(|p| p.kind == ParamKind::Constant && p.dtype == DType::I64),
            "{name}: integer constants {:?}",
            g.params
                .iter()
                .filter(|p| p.dtype == DType::I64)
                .collect::<Vec<_>>()
        );
        // q, k and v (or the position rows) are slices.
        assert!(
            g.nodes.iter().any(|n| matches!(n.op, Op::Slice { .. })),
            "{name}: no Slice"
        );
    }
}

#[test]
fn imported_gpts_run_at_any_batch_size_in_either_logit_layout() {
    for (name, _, nvt) in exports() {
        let g = import(&name, 2).unwrap().graph;
        for batch in [1, 2, 5, 32] {
            let want = if nvt {
                vec![batch, VOCAB, CONTEXT]
            } else {
                vec![batch, CONTEXT, VOCAB]
            };
            assert_eq!(output_at(&g, batch), want, "{name} at batch {batch}");
        }
    }
}

#[test]
fn a_batch_dependent_reshape_becomes_inferred() {
    // nn.MultiheadAttention views q as [T, N * heads, head_dim]: a dimension
    // that is the batch times a constant, not the batch itself.
    let g = import("dynamo-mha-ntv.onnx", 2).unwrap().graph;
    let inferred = g
        .nodes
        .iter()
        .filter(|n| matches!(&n.op, Op::Reshape { shape } if shape.len() == 3 && shape[1] == -1))
        .count();
    assert!(inferred >= 3, "{inferred} reshapes to [T, -1, D]");
}

#[test]
fn a_fixed_batch_export_with_the_batch_leading_every_reshape_trains_at_any_batch() {
    // fixed-hand.onnx was traced at batch 3 without a dynamic batch: its
    // reshapes read [3, 16, 2, 8], which keep the batch in front.
    for batch in [3, 5] {
        let imported = import("fixed-hand.onnx", batch).unwrap();
        for other in [1, 4, 9] {
            assert_eq!(
                output_at(&imported.graph, other),
                [other, CONTEXT, VOCAB],
                "imported at {batch}"
            );
        }
    }
}

#[test]
fn a_fixed_batch_export_that_cannot_follow_the_batch_is_refused_in_words() {
    // fixed-mha.onnx bakes 3 * heads into MultiheadAttention's reshapes.
    for batch in [3, 5] {
        let err = import("fixed-mha.onnx", batch).unwrap_err().to_string();
        for words in [
            "fixed-mha.onnx",
            "fixed batch size of 3",
            "graph input `tokens`",
            "runs only at micro-batch 3",
            "dynamic_shapes={\"tokens\": {0: torch.export.Dim(\"batch\")}}",
            "dynamic_axes={\"tokens\": {0: \"batch\"}}",
        ] {
            assert!(
                err.contains(words),
                "at batch {batch}: {words:?} not in: {err}"
            );
        }
    }
}
