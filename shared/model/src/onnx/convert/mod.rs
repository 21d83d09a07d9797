//! The node-by-node translation from an ONNX graph to a [`Graph`].
//!
//! ONNX graphs are topologically sorted, so one pass suffices: each node either
//! folds to a constant (all inputs known at import time), maps onto Rookery ops
//! (its output shape inferred immediately, so later `Shape` nodes can fold), or
//! is rejected with an error naming it. A second pass fuses PyTorch's
//! `Transpose(W) -> MatMul -> Add(b)` spelling of `nn.Linear` back into
//! [`Op::Linear`] and drops nodes nothing reads.
//!
//! Here: the importer's state, the per-node loop and the value lookups every
//! translation uses; `read` reads initializers, graph inputs and outputs,
//! `dispatch` maps each ONNX op onto Rookery ops, `layers` holds the ops
//! with weights or windows (Gemm, Conv, pooling, BatchNorm, Dropout) and
//! `activations` the activations beyond ReLU, GELU, sigmoid and tanh,
//! including the spellings PyTorch's exporters write for them.

mod activations;
mod dispatch;
mod layers;
mod read;
mod slicing;

use std::collections::HashMap;

use super::attrs::Attrs;
use super::fold;
use super::fuse::{fuse_linear, prune};
use super::pb::{ModelProto, NodeProto};
use super::tensor::{Data, Elem, Tensor};
use super::{External, Imported, TRAINING_EXPORT_HINT};
use crate::error::OnnxError;
use crate::graph::{Graph, Node, Param, ParamKind};
use crate::init::Init;
use crate::ops::{Op, OpError};
use crate::tensor::{DType, TensorInfo};

/// ONNX ops the importer maps onto Rookery ops (besides the ones it folds).
const SUPPORTED: &str = "Gemm, MatMul, Add, Sub, Mul, Div, Relu, Gelu, Sigmoid, Tanh, Neg, Abs, \
    Sqrt, Reciprocal, Exp, Log, LeakyRelu, Elu, Selu (its default constants), Softplus, Softsign, \
    Shrink (bias 0 or lambd), Clip (constant bounds), ThresholdedRelu, Softmax, \
    LogSoftmax, Conv, MaxPool, AveragePool, GlobalAveragePool, ReduceMean (global pooling), \
    BatchNormalization, LayerNormalization, Flatten, Reshape, Squeeze, Unsqueeze, Transpose, \
    Concat, Dropout, Gather, Identity, Cast, Split, SplitToSequence with SequenceAt, Slice (step 1); \
    and, when their inputs are known at import time, Constant, Shape, Size, Range, ConstantOfShape, Expand, Where, Mod, Sqrt and other \
    shape arithmetic; comparisons, Sign and Where of run-time tensors only as PyTorch's exporters \
    spell softplus, threshold, hardshrink and softshrink";

/// ONNX ops [`Importer::convert`] maps onto Rookery ops (where their inputs
/// are computed at run time).
pub(crate) const LOWERED: &[&str] = &[
    "Gemm",
    "MatMul",
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Relu",
    "Sigmoid",
    "Tanh",
    "Gelu",
    "Neg",
    "Abs",
    "Sqrt",
    "Reciprocal",
    "Exp",
    "Log",
    "LeakyRelu",
    "Elu",
    "Selu",
    "Softplus",
    "Softsign",
    "Shrink",
    "Clip",
    "ThresholdedRelu",
    "Softmax",
    "LogSoftmax",
    "Conv",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "ReduceMean",
    "BatchNormalization",
    "LayerNormalization",
    "Flatten",
    "Reshape",
    "Squeeze",
    "Unsqueeze",
    "Transpose",
    "Concat",
    "Dropout",
    "Split",
    "SplitToSequence",
    "SequenceAt",
    "Slice",
    "Gather",
    "Identity",
    "Cast",
    "CastLike",
];

/// What the importer knows about one ONNX value.
#[derive(Debug, Clone)]
enum Val {
    /// Known at import time: a `Constant`, folded arithmetic, or an integer
    /// initializer (`Some(index)` into the initializers).
    Const(Tensor, Option<usize>),
    /// A weight initializer: a parameter or buffer once a node reads it.
    Var(usize),
    /// A graph input or node output, with its inferred shape.
    Graph(TensorInfo),
    /// An output Rookery's op does not compute (BatchNorm's updated statistics,
    /// Dropout's mask, MaxPool's indices).
    Missing {
        node: String,
        op: String,
        index: usize,
    },
    /// A `SplitToSequence` of a run-time tensor, its parts emitted as read.
    Sequence(Parts),
    /// Computed from run-time tensors by ops Rookery has no kernels for
    /// (comparisons, `Where`), kept as an expression until it completes an
    /// activation's spelling (`activations`); `node` and `op` first made it.
    Pending {
        sym: activations::Sym,
        node: String,
        op: String,
    },
}

/// The parts a `SplitToSequence` cut, for `SequenceAt` to name one.
#[derive(Debug, Clone)]
struct Parts {
    /// The graph name of the tensor split.
    source: String,
    axis: usize,
    ranges: Vec<(usize, usize)>,
    /// The axis is dropped from each part (`keepdims = 0` without `split`).
    squeeze: bool,
}

/// One initializer.
struct InitInfo {
    /// Name in the graph: the `state_dict` name.
    name: String,
    /// A weight's element type and shape, with no values (they are in
    /// `weights`); any other initializer's values, for folding.
    tensor: Tensor,
    /// A weight's values, as f32; `None` where a shapes-only import skipped
    /// them.
    weights: Option<Vec<f32>>,
    kind: Option<ParamKind>,
    /// Marked for the final parameter list once a node reads it.
    used: bool,
}

/// The node being translated: what its errors name and what its translation
/// reads.
struct Here<'n> {
    proto: &'n NodeProto,
    /// The node's name for messages: its ONNX name, else its first output.
    node: String,
    op: &'n str,
    attrs: Attrs<'n>,
    /// What is known of each input; `None` for an omitted optional one.
    ins: Vec<Option<Val>>,
    /// The first output, which the node's Rookery op computes.
    out: String,
}

impl Here<'_> {
    /// Whether optional input `i` is given.
    fn present(&self, i: usize) -> bool {
        matches!(self.ins.get(i), Some(Some(_)))
    }
}

pub(crate) struct Importer<'a> {
    file: &'a str,
    external: External<'a>,
    external_cache: HashMap<String, Vec<u8>>,
    /// Reads large weights' shapes, not their values (their parameters
    /// come out zero): enough to compare graphs at two batch sizes.
    shapes_only: bool,
    opset: i64,
    batch: usize,
    /// The batch size the exporter traced with (the first input's declared
    /// leading dimension), which it bakes into reshape targets.
    exported_batch: Option<usize>,
    vals: HashMap<String, Val>,
    inits: Vec<InitInfo>,
    /// BatchNorm `num_batches_tracked` buffers the file lacks, keyed by the
    /// initializer they follow in the parameter list.
    synthesized: Vec<(usize, Param)>,
    /// Folded constants that real ops read, in first-use order.
    constants: Vec<Param>,
    nodes: Vec<Node>,
    /// Index in `nodes` of the node computing each tensor.
    produced: HashMap<String, usize>,
    warnings: Vec<String>,
    /// Evidence that the file was exported for inference, for one warning.
    inference_signs: Vec<String>,
    /// Graph inputs given values at import, read as initializers.
    bound: Vec<super::BoundInput>,
    /// The graph runs once at the import's shapes (`rookery predict`):
    /// outputs that fold to constants are kept.
    run_once: bool,
}

impl<'a> Importer<'a> {
    pub(crate) fn new(file: &'a str, external: External<'a>) -> Self {
        Importer {
            file,
            external,
            external_cache: HashMap::new(),
            shapes_only: false,
            opset: 0,
            batch: 1,
            exported_batch: None,
            vals: HashMap::new(),
            inits: Vec::new(),
            synthesized: Vec::new(),
            constants: Vec::new(),
            nodes: Vec::new(),
            produced: HashMap::new(),
            warnings: Vec::new(),
            inference_signs: Vec::new(),
            bound: Vec::new(),
            run_once: false,
        }
    }

    /// An import to run once, with `bound` inputs fixed to their values;
    /// see [`Importer::run_once`](Self#structfield.run_once).
    pub(crate) fn run_once(mut self, bound: Vec<super::BoundInput>) -> Self {
        self.bound = bound;
        self.run_once = true;
        self
    }

    /// See [`Importer::shapes_only`](Self#structfield.shapes_only).
    pub(crate) fn shapes_only(mut self) -> Self {
        self.shapes_only = true;
        self
    }

    fn model_err(&self, reason: impl Into<String>) -> OnnxError {
        OnnxError::Model {
            file: self.file.to_string(),
            reason: reason.into(),
        }
    }

    fn node_err(&self, here: &Here, reason: impl Into<String>) -> OnnxError {
        OnnxError::Node {
            file: self.file.to_string(),
            node: here.node.clone(),
            op: here.op.to_string(),
            reason: reason.into(),
        }
    }

    fn unsupported(&self, here: &Here, reason: impl Into<String>) -> OnnxError {
        OnnxError::Unsupported {
            file: self.file.to_string(),
            node: here.node.clone(),
            op: here.op.to_string(),
            reason: reason.into(),
        }
    }

    fn dynamic(&self, here: &Here, reason: impl Into<String>) -> OnnxError {
        OnnxError::DynamicShape {
            file: self.file.to_string(),
            node: here.node.clone(),
            op: here.op.to_string(),
            reason: reason.into(),
        }
    }

    pub(crate) fn run(
        mut self,
        model: &ModelProto,
        input_shape: &[usize],
    ) -> Result<Imported, OnnxError> {
        let graph = model
            .graph
            .as_ref()
            .ok_or_else(|| self.model_err("the model has no graph"))?;
        self.opset = model
            .opset_import
            .iter()
            .find(|o| o.domain().is_empty() || o.domain() == "ai.onnx")
            .map(|o| o.version())
            .ok_or_else(|| self.model_err("the model imports no version of the ONNX op set"))?;
        self.read_initializers(graph)?;
        self.read_inputs(graph, input_shape)?;
        for node in &graph.node {
            self.node(node)?;
        }
        let outputs = self.outputs(graph)?;
        if !self.inference_signs.is_empty() {
            let shown: Vec<&str> = self
                .inference_signs
                .iter()
                .take(3)
                .map(String::as_str)
                .collect();
            let more = self.inference_signs.len().saturating_sub(shown.len());
            let more = if more > 0 {
                format!(" (and {more} more)")
            } else {
                String::new()
            };
            self.warnings.push(format!(
                "{}: this file looks exported for inference, not training: {}{more}. \
                 BatchNorm may have been folded into Conv and Dropout removed, so training \
                 this graph would not train the model as written; {TRAINING_EXPORT_HINT}",
                self.file,
                shown.join("; ")
            ));
        }
        let nodes = fuse_linear(
            std::mem::take(&mut self.nodes),
            &self.param_shapes(),
            &outputs,
        );
        let nodes = prune(nodes, &outputs);
        // Constants only pruned nodes read (an activation's spelled-out
        // arithmetic, fused into one op) go with them.
        let read: std::collections::HashSet<&str> = nodes
            .iter()
            .flat_map(|n| n.inputs.iter().map(String::as_str))
            .chain(outputs.iter().map(String::as_str))
            .collect();
        let constants = std::mem::take(&mut self.constants);
        self.constants = constants
            .into_iter()
            .filter(|p| read.contains(p.name.as_str()))
            .collect();
        let graph = Graph {
            inputs: self.graph_inputs(graph),
            params: self.params(),
            nodes,
            outputs,
        };
        graph.analyze().map_err(|source| OnnxError::Graph {
            file: self.file.to_string(),
            source,
        })?;
        Ok(Imported {
            graph,
            warnings: self.warnings,
        })
    }

    /// Translates one node.
    fn node(&mut self, node: &NodeProto) -> Result<(), OnnxError> {
        let op = node.op_type();
        let mut here = Here {
            proto: node,
            node: node_label(node),
            op,
            attrs: Attrs(&node.attribute),
            ins: Vec::with_capacity(node.input.len()),
            out: node.output.first().cloned().unwrap_or_default(),
        };
        let domain = node.domain();
        if !(domain.is_empty() || domain == "ai.onnx") {
            return Err(OnnxError::UnsupportedOp {
                file: self.file.to_string(),
                node: here.node,
                op: op.to_string(),
                domain: format!("{domain}::"),
                supported: SUPPORTED.to_string(),
            });
        }
        if here.out.is_empty() {
            return Err(self.node_err(&here, "has no output"));
        }
        for name in &node.input {
            if name.is_empty() {
                here.ins.push(None);
                continue;
            }
            match self.vals.get(name) {
                Some(Val::Missing {
                    node: src,
                    op: src_op,
                    index,
                }) => {
                    return Err(self.unsupported(
                        &here,
                        format!(
                            "reads `{name}`, output {index} of node `{src}` ({src_op}), which \
                             Rookery's {src_op} does not produce"
                        ),
                    ));
                }
                Some(v) => here.ins.push(Some(v.clone())),
                None => {
                    return Err(self.node_err(
                        &here,
                        format!("input `{name}` is not produced by any earlier node"),
                    ));
                }
            }
        }
        if let Some(t) = self.fold(&here)? {
            self.vals.insert(here.out.clone(), Val::Const(t, None));
        } else {
            self.convert(&mut here)?;
        }
        self.mark_extra_outputs(&here);
        Ok(())
    }

    /// Outputs past the first: Rookery ops have one output (a `Split`'s
    /// several are each a node of their own, already known).
    fn mark_extra_outputs(&mut self, here: &Here) {
        for (index, name) in here.proto.output.iter().enumerate().skip(1) {
            if !name.is_empty() && !self.vals.contains_key(name) {
                self.vals.insert(
                    name.clone(),
                    Val::Missing {
                        node: here.node.clone(),
                        op: here.op.to_string(),
                        index,
                    },
                );
            }
        }
    }

    /// Folds the node if everything it needs is known now.
    fn fold(&self, here: &Here) -> Result<Option<Tensor>, OnnxError> {
        let op = here.op;
        if op == "Shape" || op == "Size" {
            let x = here.ins.first().and_then(Option::as_ref);
            let shape = x
                .and_then(|v| self.shape_of(v))
                .ok_or_else(|| self.node_err(here, "missing input"))?;
            if op == "Size" {
                let n: usize = shape.iter().product();
                return Ok(Some(Tensor::ints(vec![], vec![n as i64])));
            }
            // Opset 15 added start/end to take part of the shape.
            let rank = shape.len() as i64;
            let clamp = |v: i64| (if v < 0 { v + rank } else { v }).clamp(0, rank) as usize;
            let start = clamp(here.attrs.int("start").unwrap_or(0));
            let end = clamp(here.attrs.int("end").unwrap_or(rank));
            let dims: Vec<i64> = shape
                .get(start..end.max(start))
                .unwrap_or_default()
                .iter()
                .map(|&d| d as i64)
                .collect();
            return Ok(Some(Tensor::ints(vec![dims.len()], dims)));
        }
        // CastLike reads only the element type of its second input.
        if op == "CastLike"
            && let (Some(Some(Val::Const(t, _))), Some(Some(like))) =
                (here.ins.first(), here.ins.get(1))
            && let Some(info) = self.info_of(like)
        {
            let elem = match like {
                Val::Const(l, _) => l.elem,
                Val::Var(i) => self.inits[*i].tensor.elem,
                _ if info.dtype == DType::F32 => Elem::F32,
                _ => Elem::I64,
            };
            return Ok(Some(t.cast(elem)));
        }
        if !fold::is_foldable(op) {
            return Ok(None);
        }
        let mut consts = Vec::with_capacity(here.ins.len());
        for v in &here.ins {
            match v {
                None => consts.push(None),
                Some(Val::Const(t, _)) => consts.push(Some(t)),
                Some(_) => return Ok(None),
            }
        }
        fold::eval(op, &here.attrs, &consts, self.opset)
            .map(Some)
            .map_err(|reason| self.node_err(here, reason))
    }

    fn shape_of<'v>(&'v self, v: &'v Val) -> Option<&'v [usize]> {
        match v {
            Val::Const(t, _) => Some(&t.shape),
            Val::Var(i) => Some(&self.inits[*i].tensor.shape),
            Val::Graph(info) => Some(&info.shape),
            Val::Missing { .. } | Val::Sequence(_) | Val::Pending { .. } => None,
        }
    }

    fn info_of(&self, v: &Val) -> Option<TensorInfo> {
        match v {
            Val::Const(t, _) => Some(TensorInfo {
                shape: t.shape.clone(),
                dtype: dtype_of(t.elem),
            }),
            Val::Var(i) => Some(TensorInfo {
                shape: self.inits[*i].tensor.shape.clone(),
                dtype: dtype_of(self.inits[*i].tensor.elem),
            }),
            Val::Graph(info) => Some(info.clone()),
            Val::Missing { .. } | Val::Sequence(_) | Val::Pending { .. } => None,
        }
    }

    /// Input `i`'s value if known at import time (constants and weights alike:
    /// attribute-like inputs such as a Dropout ratio may be stored as either).
    fn known(&self, here: &Here, i: usize) -> Option<Tensor> {
        match here.ins.get(i)?.as_ref()? {
            Val::Const(t, _) => Some(t.clone()),
            Val::Var(i) => {
                let init = &self.inits[*i];
                let values = init.weights.as_ref()?;
                Some(Tensor {
                    data: Data::Float(values.iter().map(|&v| f64::from(v)).collect()),
                    ..init.tensor.clone()
                })
            }
            _ => None,
        }
    }

    /// Makes input `i` of the node a tensor in the graph and returns its graph name.
    fn tensor_input(&mut self, here: &Here, i: usize) -> Result<String, OnnxError> {
        let (Some(name), Some(Some(v))) = (here.proto.input.get(i), here.ins.get(i)) else {
            return Err(self.node_err(here, format!("missing input {i}")));
        };
        Ok(match v {
            Val::Graph(_) => name.clone(),
            Val::Var(idx) => {
                self.inits[*idx].used = true;
                self.inits[*idx].name.clone()
            }
            Val::Const(_, Some(idx)) => {
                let init = &mut self.inits[*idx];
                init.used = true;
                if init.kind.is_none() {
                    init.kind = Some(ParamKind::Buffer);
                }
                init.name.clone()
            }
            Val::Const(t, None) => {
                if !self.constants.iter().any(|p| &p.name == name) {
                    self.add_constant(name, t.shape.clone(), dtype_of(t.elem), t.to_f32());
                }
                name.clone()
            }
            Val::Missing { .. } | Val::Sequence(_) | Val::Pending { .. } => {
                return Err(self.node_err(here, format!("input `{name}` is unavailable")));
            }
        })
    }

    /// A constant tensor of the graph (a folded value a real op reads, a
    /// scale factor, zeros to broadcast against), named `name`.
    fn add_constant(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        dtype: DType,
        data: Vec<f32>,
    ) -> String {
        self.constants.push(Param {
            name: name.to_string(),
            shape,
            dtype,
            kind: ParamKind::Constant,
            init: Init::Values { data },
        });
        name.to_string()
    }

    /// Shape and dtype of input `i`.
    fn input_info(&self, here: &Here, i: usize) -> Result<TensorInfo, OnnxError> {
        here.ins
            .get(i)
            .and_then(Option::as_ref)
            .and_then(|v| self.info_of(v))
            .ok_or_else(|| self.node_err(here, format!("missing input {i}")))
    }

    /// Adds a graph node, inferring its output shape now.
    fn emit(
        &mut self,
        here: &Here,
        name: &str,
        op: Op,
        inputs: Vec<String>,
    ) -> Result<(), OnnxError> {
        let infos = inputs
            .iter()
            .map(|n| self.graph_info(n))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| self.node_err(here, "an input's shape is unknown"))?;
        let out = op.infer(&infos).map_err(|e| match e {
            OpError::Shape(reason) => self.node_err(here, format!("shape mismatch: {reason}")),
            OpError::Invalid(reason) => self.node_err(here, reason),
        })?;
        self.produced.insert(name.to_string(), self.nodes.len());
        self.nodes.push(Node {
            name: name.to_string(),
            op,
            inputs,
        });
        self.vals.insert(name.to_string(), Val::Graph(out));
        Ok(())
    }

    /// Shape and dtype of a tensor by graph name.
    fn graph_info(&self, name: &str) -> Option<TensorInfo> {
        if let Some(v) = self.vals.get(name)
            && !matches!(v, Val::Var(_) | Val::Const(_, Some(_)))
        {
            return self.info_of(v);
        }
        if let Some(p) = self.constants.iter().find(|p| p.name == name) {
            return Some(TensorInfo {
                shape: p.shape.clone(),
                dtype: p.dtype,
            });
        }
        if let Some(p) = self.synthesized.iter().find(|(_, p)| p.name == name) {
            return Some(TensorInfo {
                shape: p.1.shape.clone(),
                dtype: p.1.dtype,
            });
        }
        self.inits
            .iter()
            .find(|i| i.name == name)
            .map(|i| TensorInfo {
                shape: i.tensor.shape.clone(),
                dtype: dtype_of(i.tensor.elem),
            })
    }
}

/// The node's name for messages: its ONNX name, else its first output.
fn node_label(node: &NodeProto) -> String {
    if node.name().is_empty() {
        node.output.first().cloned().unwrap_or_default()
    } else {
        node.name().to_string()
    }
}

fn dtype_of(e: Elem) -> DType {
    if e.is_float() { DType::F32 } else { DType::I64 }
}

/// The exporter bakes the example batch size into reshape targets; where the
/// leading dimension is the batch on both sides (the target's being the
/// import's batch or the one the exporter traced with), 0 ("copy the
/// input's") keeps the graph valid for other batch sizes, as the planner's
/// micro-batches need.
fn keep_batch(
    mut target: Vec<i64>,
    input: &[usize],
    batch: usize,
    exported_batch: Option<usize>,
) -> Vec<i64> {
    if let (Some(t), Some(&i)) = (target.first_mut(), input.first())
        && (*t == batch as i64 || exported_batch.is_some_and(|b| *t == b as i64))
        && i == batch
    {
        *t = 0;
    }
    target
}
