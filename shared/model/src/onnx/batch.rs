//! Making an imported graph run at any batch size, as the planner's
//! micro-batches need, or saying why it cannot.
//!
//! Exporters write reshape targets as shape arithmetic on the batch
//! dimension (`[N, T, H, D]`, and `nn.MultiheadAttention`'s `[T, N * H, D]`),
//! which the importer folds at the batch it imports for. Importing twice, at
//! two batch sizes, shows which target dimensions follow the batch: where
//! exactly one does, `-1` (inferred) is exact at every batch size, since the
//! element count is the batch times a constant. An export with a fixed batch
//! (no `dynamic_shapes` / `dynamic_axes`) has the traced batch baked in as
//! constants instead, so the second import fails; then the error names the
//! batch size and the export option that frees it.

use super::pb::ModelProto;
use crate::error::OnnxError;
use crate::graph::ParamKind;
use crate::graph::{Graph, Node};
use crate::ops::Op;

/// The first graph input that is not an initializer, and its declared
/// leading dimension when that is a fixed number (the traced batch).
pub(super) fn declared_batch(model: &ModelProto) -> Option<(String, Option<usize>)> {
    let input = super::fed_inputs(model.graph.as_ref()?).next()?;
    let fixed = super::tensor_type(input)
        .and_then(super::declared_dims)
        .and_then(|dims| dims.first().copied().flatten())
        .map(|v| v as usize);
    Some((input.name().to_string(), fixed))
}

/// The words that tell a user how to free the batch dimension.
pub(super) fn fixed_batch_error(
    file: &str,
    input: &str,
    batch: usize,
    detail: impl std::fmt::Display,
) -> OnnxError {
    OnnxError::Model {
        file: file.to_string(),
        reason: format!(
            "the model was exported with a fixed batch size of {batch} (graph input `{input}` \
             declares it), and its reshapes hold that number, so it runs only at micro-batch \
             {batch} ({detail}). Export it with a dynamic batch: \
             `dynamic_shapes={{\"{input}\": {{0: torch.export.Dim(\"batch\")}}}}` with \
             `dynamo=True`, or `input_names=[\"{input}\"], dynamic_axes={{\"{input}\": {{0: \
             \"batch\"}}}}` with the legacy exporter"
        ),
    }
}

/// Folds what differs between `graph` (imported at one batch size) and
/// `other` (the same file at another) into batch-independent reshape
/// targets: each dimension the same at both sizes is written out, the one
/// that follows the batch is copied (`0`, leading and equal to the input's)
/// or inferred (`-1`): the nodes `graph` should have. `Err` names the first
/// difference that is not one.
pub(super) fn generalize(graph: &Graph, other: &Graph) -> Result<Vec<Node>, String> {
    if graph.nodes.len() != other.nodes.len() {
        return Err(format!(
            "the graph has {} nodes at one batch size and {} at another",
            graph.nodes.len(),
            other.nodes.len()
        ));
    }
    let (mine, theirs) = match (graph.analyze(), other.analyze()) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return Err(e.to_string()),
    };
    let shape =
        |a: &crate::graph::Analysis, name: &str| a.tensors.get(name).map(|t| t.shape.clone());
    let mut nodes = graph.nodes.clone();
    for (node, their) in nodes.iter_mut().zip(&other.nodes) {
        if node.name != their.name || node.inputs != their.inputs {
            return Err(format!(
                "node `{}` reads other tensors at another batch size",
                node.name
            ));
        }
        match (&mut node.op, &their.op) {
            (Op::Reshape { shape: target }, Op::Reshape { .. }) => {
                let (Some(out1), Some(out2), Some(in1), Some(in2)) = (
                    shape(&mine, &node.name),
                    shape(&theirs, &node.name),
                    shape(&mine, &node.inputs[0]),
                    shape(&theirs, &node.inputs[0]),
                ) else {
                    return Err(format!("node `{}` (Reshape) has no shape", node.name));
                };
                let differ: Vec<usize> = (0..out1.len())
                    .filter(|&i| out2.get(i) != Some(&out1[i]))
                    .collect();
                if out1.len() != out2.len() || differ.len() > 1 {
                    return Err(format!(
                        "node `{}` (Reshape) reshapes to {out1:?} at one batch size and to \
                         {out2:?} at another",
                        node.name
                    ));
                }
                *target = out1.iter().map(|&d| d as i64).collect();
                if let Some(&p) = differ.first() {
                    let copies =
                        p == 0 && in1.first() == Some(&out1[0]) && in2.first() == Some(&out2[0]);
                    target[p] = if copies { 0 } else { -1 };
                }
            }
            (mine, theirs) if mine != theirs => {
                return Err(format!(
                    "node `{}` ({}) has other attributes at another batch size",
                    node.name,
                    mine.name()
                ));
            }
            _ => {}
        }
    }
    for (p, theirs) in graph.params.iter().zip(&other.params) {
        // Weights' values are not read at the other size, only their shapes.
        if p.shape != theirs.shape || (p.kind == ParamKind::Constant && p.init != theirs.init) {
            return Err(format!(
                "constant `{}` is {:?} at one batch size and {:?} at another",
                p.name, p.shape, theirs.shape
            ));
        }
    }
    Ok(nodes)
}
