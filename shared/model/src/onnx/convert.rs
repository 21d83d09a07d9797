//! The node-by-node translation from an ONNX graph to a [`Graph`].
//!
//! ONNX graphs are topologically sorted, so one pass suffices: each node either
//! folds to a constant (all inputs known at import time), maps onto Rookery ops
//! (its output shape inferred immediately, so later `Shape` nodes can fold), or
//! is rejected with an error naming it. A second pass fuses PyTorch's
//! `Transpose(W) -> MatMul -> Add(b)` spelling of `nn.Linear` back into
//! [`Op::Linear`] and drops nodes nothing reads.

use std::collections::{BTreeSet, HashMap, HashSet};

use super::fold::{self, Attrs, norm_axis};
use super::pb::{GraphProto, ModelProto, NodeProto, TensorProto};
use super::tensor::{self, Elem, Tensor};
use super::{ExternalData, Imported, TRAINING_EXPORT_HINT};
use crate::error::OnnxError;
use crate::graph::{DType, Graph, Input, Node, Param, ParamKind, TensorInfo};
use crate::init::Init;
use crate::ops::{Op, OpError};

/// ONNX ops the importer maps onto Rookery ops (besides the ones it folds).
const SUPPORTED: &str = "Gemm, MatMul, Add, Sub, Mul, Div, Relu, Gelu, Sigmoid, Tanh, Softmax, \
    LogSoftmax, Conv, MaxPool, AveragePool, GlobalAveragePool, ReduceMean (global pooling), \
    BatchNormalization, LayerNormalization, Flatten, Reshape, Squeeze, Unsqueeze, Transpose, \
    Concat, Dropout, Gather, Identity, Cast; and, when their inputs are known at import time, \
    Constant, Shape, Size, Slice, Range, ConstantOfShape, Expand, Where, Mod, Sqrt and other \
    shape arithmetic";

/// dynamo exporter metadata on initializers: what `torch.export` says each one is.
const SPEC_KIND: &str = "pkg.torch.export.graph_signature.InputSpec.kind";
const SPEC_TARGET: &str = "pkg.torch.export.graph_signature.InputSpec.target";

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
}

/// One initializer.
struct InitInfo {
    /// Name in the graph: the `state_dict` name.
    name: String,
    tensor: Tensor,
    kind: Option<ParamKind>,
    /// Marked for the final parameter list once a node reads it.
    used: bool,
}

/// The node being translated, for error messages.
struct Here<'n> {
    node: String,
    op: &'n str,
}

pub(crate) struct Importer<'a> {
    file: &'a str,
    external: ExternalData<'a>,
    external_cache: HashMap<String, Vec<u8>>,
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
    warnings: Vec<String>,
    /// Evidence that the file was exported for inference, for one warning.
    inference_signs: Vec<String>,
}

impl<'a> Importer<'a> {
    pub(crate) fn new(file: &'a str, external: ExternalData<'a>) -> Self {
        Importer {
            file,
            external,
            external_cache: HashMap::new(),
            opset: 0,
            batch: 1,
            exported_batch: None,
            vals: HashMap::new(),
            inits: Vec::new(),
            synthesized: Vec::new(),
            constants: Vec::new(),
            nodes: Vec::new(),
            warnings: Vec::new(),
            inference_signs: Vec::new(),
        }
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

    /// Decodes every initializer (loading external data) and decides which are
    /// weights and which are constants for folding.
    fn read_initializers(&mut self, graph: &GraphProto) -> Result<(), OnnxError> {
        // The dynamo exporter describes each initializer in value_info metadata.
        let mut meta: HashMap<&str, HashMap<&str, &str>> = HashMap::new();
        for vi in graph.value_info.iter().chain(&graph.input) {
            let m = meta.entry(vi.name()).or_default();
            for kv in &vi.metadata_props {
                m.insert(kv.key(), kv.value());
            }
        }
        for t in &graph.initializer {
            let tensor = self.decode_initializer(t)?;
            let m = meta.get(t.name());
            let spec_kind = m.and_then(|m| m.get(SPEC_KIND).copied());
            // torch.export knows each tensor's state_dict name; older exporters
            // already name initializers after it.
            let name = m
                .and_then(|m| m.get(SPEC_TARGET).copied())
                .filter(|n| !n.is_empty())
                .unwrap_or(t.name())
                .to_string();
            let kind = match spec_kind {
                Some("PARAMETER") => Some(ParamKind::Trainable),
                Some("BUFFER") => Some(ParamKind::Buffer),
                Some("CONSTANT_TENSOR") => Some(ParamKind::Constant),
                _ if generated_name(t.name(), &tensor) => Some(ParamKind::Constant),
                _ if !tensor.elem.is_float() => Some(ParamKind::Buffer),
                _ if is_statistic(&name) => Some(ParamKind::Buffer),
                _ => None,
            };
            let index = self.inits.len();
            // Weights stay variables even where a node could fold them (a
            // Transpose of a weight must be trained through, not baked in).
            let val = if tensor.elem.is_float() && kind != Some(ParamKind::Constant) {
                Val::Var(index)
            } else {
                Val::Const(tensor.clone(), Some(index))
            };
            self.vals.insert(t.name().to_string(), val);
            self.inits.push(InitInfo {
                name,
                tensor,
                kind,
                used: false,
            });
        }
        Ok(())
    }

    fn decode_initializer(&mut self, t: &TensorProto) -> Result<Tensor, OnnxError> {
        let tensor_err = |reason: String| OnnxError::Tensor {
            file: self.file.to_string(),
            tensor: t.name().to_string(),
            reason,
        };
        let external = tensor::external_ref(t).map_err(tensor_err)?;
        let bytes = match &external {
            None => None,
            Some(r) => Some(self.external_bytes(t.name(), r)?),
        };
        tensor::decode(t, bytes.as_deref()).map_err(|reason| OnnxError::Tensor {
            file: self.file.to_string(),
            tensor: t.name().to_string(),
            reason,
        })
    }

    /// The slice of an external-data file one tensor occupies.
    fn external_bytes(
        &mut self,
        tensor: &str,
        r: &tensor::ExternalRef,
    ) -> Result<Vec<u8>, OnnxError> {
        let err = |reason: String| OnnxError::ExternalData {
            file: self.file.to_string(),
            tensor: tensor.to_string(),
            location: r.location.clone(),
            reason,
        };
        // ONNX locations are relative to the model file; anything else could read
        // arbitrary files on the machine importing a stranger's model.
        let escapes = r.location.starts_with('/')
            || r.location.starts_with('\\')
            || r.location.contains(':')
            || r.location.split(['/', '\\']).any(|c| c == "..");
        if escapes {
            return Err(err(
                "the location must be a path relative to the model's folder".into(),
            ));
        }
        if !self.external_cache.contains_key(&r.location) {
            let data = (self.external)(&r.location).map_err(|e| err(e.to_string()))?;
            self.external_cache.insert(r.location.clone(), data);
        }
        let data = self
            .external_cache
            .get(&r.location)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let end = match r.length {
            Some(len) => r.offset.checked_add(len),
            None => Some(data.len()),
        };
        match end {
            Some(end) if r.offset <= end && end <= data.len() => Ok(data[r.offset..end].to_vec()),
            _ => Err(err(format!(
                "bytes {}..{} are past the end of the {}-byte file (truncated?)",
                r.offset,
                end.map_or_else(|| "?".to_string(), |e| e.to_string()),
                data.len()
            ))),
        }
    }

    /// Records the graph inputs (those that are not initializers) and their shapes.
    fn read_inputs(&mut self, graph: &GraphProto, input_shape: &[usize]) -> Result<(), OnnxError> {
        let mut first = true;
        for vi in &graph.input {
            if self.vals.contains_key(vi.name()) {
                continue;
            }
            let err = |reason: String| OnnxError::Input {
                file: self.file.to_string(),
                name: vi.name().to_string(),
                reason,
            };
            let tt = match vi.r#type.as_ref().and_then(|t| t.value.as_ref()) {
                Some(super::pb::type_proto::Value::TensorType(tt)) => tt,
                _ => return Err(err("is not a tensor".into())),
            };
            let dtype = match Elem::from_onnx(tt.elem_type()) {
                Some(Elem::F32) => DType::F32,
                Some(Elem::I64) => DType::I64,
                _ => {
                    return Err(err(format!(
                        "element type {} is not supported (float32 or int64 only)",
                        tt.elem_type()
                    )));
                }
            };
            use super::pb::tensor_shape_proto::dimension::Value as Dim;
            let declared: Option<Vec<Option<i64>>> = tt.shape.as_ref().map(|s| {
                s.dim
                    .iter()
                    .map(|d| match d.value {
                        Some(Dim::DimValue(v)) if v > 0 => Some(v),
                        _ => None,
                    })
                    .collect()
            });
            let shape = if first {
                if let Some(decl) = &declared {
                    if decl.len() != input_shape.len() {
                        return Err(err(format!(
                            "the model declares rank {} ({}), the given input shape {input_shape:?} has rank {}",
                            decl.len(),
                            show_dims(decl),
                            input_shape.len()
                        )));
                    }
                    let differs = decl
                        .iter()
                        .zip(input_shape)
                        .any(|(d, &s)| d.is_some_and(|d| d as usize != s));
                    if differs {
                        self.warnings.push(format!(
                            "{}: graph input `{}`: the model was exported for shape {}, importing it \
                             for {input_shape:?}; shapes the exporter computed from its example \
                             input may not fit",
                            self.file,
                            vi.name(),
                            show_dims(decl)
                        ));
                    }
                }
                input_shape.to_vec()
            } else {
                match &declared {
                    Some(d) if d.iter().all(Option::is_some) => {
                        d.iter().map(|v| v.unwrap_or(1) as usize).collect()
                    }
                    _ => {
                        return Err(err(format!(
                            "has dynamic dimensions ({}) and only the first input's shape is given",
                            declared
                                .as_deref()
                                .map_or_else(|| "unknown".into(), show_dims)
                        )));
                    }
                }
            };
            if first {
                self.batch = shape.first().copied().unwrap_or(1);
                self.exported_batch = declared
                    .as_ref()
                    .and_then(|d| d.first().copied().flatten())
                    .map(|d| d as usize);
            }
            first = false;
            self.vals.insert(
                vi.name().to_string(),
                Val::Graph(TensorInfo { shape, dtype }),
            );
        }
        if first {
            return Err(self.model_err("the graph has no inputs besides its weights"));
        }
        Ok(())
    }

    fn graph_inputs(&self, graph: &GraphProto) -> Vec<Input> {
        graph
            .input
            .iter()
            .filter_map(|vi| match self.vals.get(vi.name()) {
                Some(Val::Graph(info)) => Some(Input {
                    name: vi.name().to_string(),
                    shape: info.shape.clone(),
                    dtype: info.dtype,
                }),
                _ => None,
            })
            .collect()
    }

    /// Shapes of every weight, by graph name, for the Linear fusion.
    fn param_shapes(&self) -> HashMap<String, Vec<usize>> {
        self.inits
            .iter()
            .filter(|i| i.used)
            .map(|i| (i.name.clone(), i.tensor.shape.clone()))
            .collect()
    }

    /// The parameter list: weights in file order (each BatchNorm's synthesized
    /// `num_batches_tracked` after its statistics), then folded constants.
    fn params(&mut self) -> Vec<Param> {
        let mut params = Vec::new();
        let mut synthesized = std::mem::take(&mut self.synthesized);
        for (i, init) in self.inits.iter().enumerate() {
            if init.used {
                params.push(Param {
                    name: init.name.clone(),
                    shape: init.tensor.shape.clone(),
                    dtype: dtype_of(init.tensor.elem),
                    kind: init.kind.unwrap_or(ParamKind::Trainable),
                    init: Init::Values {
                        data: init.tensor.to_f32(),
                    },
                });
            }
            synthesized.retain(|(after, p)| {
                if *after == i {
                    params.push(p.clone());
                }
                *after != i
            });
        }
        params.extend(synthesized.into_iter().map(|(_, p)| p));
        params.append(&mut self.constants);
        params
    }

    fn outputs(&mut self, graph: &GraphProto) -> Result<Vec<String>, OnnxError> {
        let mut outputs = Vec::new();
        for o in &graph.output {
            match self.vals.get(o.name()) {
                Some(Val::Graph(_)) => outputs.push(o.name().to_string()),
                Some(Val::Var(i)) => {
                    let i = *i;
                    self.inits[i].used = true;
                    outputs.push(self.inits[i].name.clone());
                }
                Some(Val::Missing { node, op, .. }) => self.warnings.push(format!(
                    "{}: graph output `{}` (from node `{node}`, {op}) is state Rookery's op keeps \
                     itself (e.g. updated BatchNorm statistics); it is not a graph output",
                    self.file,
                    o.name()
                )),
                Some(Val::Const(..)) => self.warnings.push(format!(
                    "{}: graph output `{}` does not depend on the input (it folds to a \
                     constant); dropped",
                    self.file,
                    o.name()
                )),
                None => {
                    return Err(self.model_err(format!(
                        "graph output `{}` is not produced by any node",
                        o.name()
                    )));
                }
            }
        }
        if outputs.is_empty() {
            return Err(self.model_err("no graph output depends on the model's input"));
        }
        Ok(outputs)
    }

    /// Translates one node.
    fn node(&mut self, node: &NodeProto) -> Result<(), OnnxError> {
        let op = node.op_type();
        let here = Here {
            node: node_label(node),
            op,
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
        if node.output.first().is_none_or(String::is_empty) {
            return Err(self.node_err(&here, "has no output"));
        }
        let mut ins: Vec<Option<Val>> = Vec::with_capacity(node.input.len());
        for name in &node.input {
            if name.is_empty() {
                ins.push(None);
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
                Some(v) => ins.push(Some(v.clone())),
                None => {
                    return Err(self.node_err(
                        &here,
                        format!("input `{name}` is not produced by any earlier node"),
                    ));
                }
            }
        }
        let attrs = Attrs(&node.attribute);
        if let Some(t) = self.fold(&here, &attrs, &ins)? {
            self.vals
                .insert(node.output[0].clone(), Val::Const(t, None));
            return self.mark_extra_outputs(node, &here);
        }
        self.convert(node, &here, &attrs, &ins)?;
        self.mark_extra_outputs(node, &here)
    }

    /// Outputs past the first: Rookery ops have one output.
    fn mark_extra_outputs(&mut self, node: &NodeProto, here: &Here) -> Result<(), OnnxError> {
        for (index, name) in node.output.iter().enumerate().skip(1) {
            if !name.is_empty() {
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
        Ok(())
    }

    /// Folds the node if everything it needs is known now.
    fn fold(
        &self,
        here: &Here,
        attrs: &Attrs,
        ins: &[Option<Val>],
    ) -> Result<Option<Tensor>, OnnxError> {
        let op = here.op;
        if op == "Shape" || op == "Size" {
            let x = ins.first().and_then(Option::as_ref);
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
            let start = clamp(attrs.int("start").unwrap_or(0));
            let end = clamp(attrs.int("end").unwrap_or(rank));
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
            && let (Some(Some(Val::Const(t, _))), Some(Some(like))) = (ins.first(), ins.get(1))
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
        let mut consts = Vec::with_capacity(ins.len());
        for v in ins {
            match v {
                None => consts.push(None),
                Some(Val::Const(t, _)) => consts.push(Some(t)),
                Some(_) => return Ok(None),
            }
        }
        fold::eval(op, attrs, &consts, self.opset)
            .map(Some)
            .map_err(|reason| self.node_err(here, reason))
    }

    fn shape_of<'v>(&'v self, v: &'v Val) -> Option<&'v [usize]> {
        match v {
            Val::Const(t, _) => Some(&t.shape),
            Val::Var(i) => Some(&self.inits[*i].tensor.shape),
            Val::Graph(info) => Some(&info.shape),
            Val::Missing { .. } => None,
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
            Val::Missing { .. } => None,
        }
    }

    /// An input's value if known at import time (constants and weights alike:
    /// attribute-like inputs such as a Dropout ratio may be stored as either).
    fn known(&self, v: Option<&Option<Val>>) -> Option<Tensor> {
        match v?.as_ref()? {
            Val::Const(t, _) => Some(t.clone()),
            Val::Var(i) => Some(self.inits[*i].tensor.clone()),
            _ => None,
        }
    }

    /// Makes input `i` of the node a tensor in the graph and returns its graph name.
    fn tensor_input(
        &mut self,
        node: &NodeProto,
        here: &Here,
        ins: &[Option<Val>],
        i: usize,
    ) -> Result<String, OnnxError> {
        let (Some(name), Some(Some(v))) = (node.input.get(i), ins.get(i)) else {
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
                    self.constants.push(Param {
                        name: name.clone(),
                        shape: t.shape.clone(),
                        dtype: dtype_of(t.elem),
                        kind: ParamKind::Constant,
                        init: Init::Values { data: t.to_f32() },
                    });
                }
                name.clone()
            }
            Val::Missing { .. } => {
                return Err(self.node_err(here, format!("input `{name}` is unavailable")));
            }
        })
    }

    fn input_info(
        &self,
        here: &Here,
        ins: &[Option<Val>],
        i: usize,
    ) -> Result<TensorInfo, OnnxError> {
        ins.get(i)
            .and_then(Option::as_ref)
            .and_then(|v| self.info_of(v))
            .ok_or_else(|| self.node_err(here, format!("missing input {i}")))
    }

    fn present(ins: &[Option<Val>], i: usize) -> bool {
        matches!(ins.get(i), Some(Some(_)))
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

    /// Maps a node that computes on run-time tensors onto Rookery ops.
    fn convert(
        &mut self,
        node: &NodeProto,
        here: &Here,
        attrs: &Attrs,
        ins: &[Option<Val>],
    ) -> Result<(), OnnxError> {
        let out = node.output[0].clone();
        let op = here.op;
        match op {
            "Gemm" => self.gemm(node, here, attrs, ins, &out),
            "MatMul" => {
                let (a, b) = (
                    self.input_info(here, ins, 0)?,
                    self.input_info(here, ins, 1)?,
                );
                if a.shape.len() < 2 || b.shape.len() < 2 {
                    return Err(self.unsupported(
                        here,
                        format!("1-D operands ({:?} x {:?})", a.shape, b.shape),
                    ));
                }
                let inputs = vec![
                    self.tensor_input(node, here, ins, 0)?,
                    self.tensor_input(node, here, ins, 1)?,
                ];
                self.emit(here, &out, Op::MatMul, inputs)
            }
            "Add" | "Sub" | "Mul" | "Div" => {
                let rop = match op {
                    "Add" => Op::Add,
                    "Sub" => Op::Sub,
                    "Mul" => Op::Mul,
                    _ => Op::Div,
                };
                for i in 0..2 {
                    if self.input_info(here, ins, i)?.dtype != DType::F32 {
                        return Err(self.unsupported(
                            here,
                            "integer arithmetic on run-time tensors (only float32 is computed in the graph)",
                        ));
                    }
                }
                let inputs = vec![
                    self.tensor_input(node, here, ins, 0)?,
                    self.tensor_input(node, here, ins, 1)?,
                ];
                self.emit(here, &out, rop, inputs)
            }
            "Relu" | "Sigmoid" | "Tanh" | "Gelu" => {
                let rop = match op {
                    "Relu" => Op::Relu,
                    "Sigmoid" => Op::Sigmoid,
                    "Tanh" => Op::Tanh,
                    _ => {
                        let approx = attrs.string("approximate").unwrap_or_default();
                        if !(approx.is_empty() || approx == "none") {
                            return Err(self.unsupported(
                                here,
                                format!("approximate = \"{approx}\" (only the exact erf GELU)"),
                            ));
                        }
                        Op::Gelu
                    }
                };
                let x = self.tensor_input(node, here, ins, 0)?;
                self.emit(here, &out, rop, vec![x])
            }
            "Softmax" | "LogSoftmax" => {
                let rank = self.input_info(here, ins, 0)?.shape.len();
                // Before opset 13 these flattened the input at `axis` (default 1),
                // which matches a per-axis softmax only over the last axis.
                let axis = attrs
                    .int("axis")
                    .unwrap_or(if self.opset >= 13 { -1 } else { 1 });
                let a = norm_axis(axis, rank).map_err(|e| self.node_err(here, e))?;
                if self.opset < 13 && a + 1 != rank {
                    return Err(self.unsupported(
                        here,
                        format!("opset {} {op} over axis {axis} of a rank-{rank} input (coerced to 2-D)", self.opset),
                    ));
                }
                let x = self.tensor_input(node, here, ins, 0)?;
                let rop = if op == "Softmax" {
                    Op::Softmax { axis }
                } else {
                    Op::LogSoftmax { axis }
                };
                self.emit(here, &out, rop, vec![x])
            }
            "Conv" => self.conv(node, here, attrs, ins, &out),
            "MaxPool" | "AveragePool" => self.pool(node, here, attrs, ins, &out),
            "GlobalAveragePool" => {
                let x = self.tensor_input(node, here, ins, 0)?;
                self.emit(here, &out, Op::GlobalAveragePool, vec![x])
            }
            "ReduceMean" => self.reduce_mean(node, here, attrs, ins, &out),
            "BatchNormalization" => self.batch_norm(node, here, attrs, ins, &out),
            "LayerNormalization" => {
                let axis = attrs.int("axis").unwrap_or(-1);
                let eps = attrs.float("epsilon").unwrap_or(1e-5);
                let mut inputs = vec![self.tensor_input(node, here, ins, 0)?];
                for i in 1..3 {
                    if Self::present(ins, i) {
                        inputs.push(self.tensor_input(node, here, ins, i)?);
                    }
                }
                if inputs.len() == 2 && !Self::present(ins, 1) {
                    return Err(self.unsupported(here, "a bias without a scale"));
                }
                self.emit(here, &out, Op::LayerNorm { axis, eps }, inputs)
            }
            "Flatten" => {
                let axis = attrs.int("axis").unwrap_or(1);
                let x = self.tensor_input(node, here, ins, 0)?;
                self.emit(here, &out, Op::Flatten { axis }, vec![x])
            }
            "Reshape" => {
                let x = self.input_info(here, ins, 0)?;
                let target = self
                    .known(ins.get(1))
                    .ok_or_else(|| {
                        self.dynamic(
                            here,
                            format!(
                                "the target shape `{}` is computed from tensor values at run time",
                                node.input.get(1).map_or("", String::as_str)
                            ),
                        )
                    })?
                    .as_i64();
                let allowzero = attrs.int("allowzero").unwrap_or(0) != 0;
                if allowzero && target.contains(&0) {
                    return Err(self.unsupported(
                        here,
                        "zero-sized dimensions (allowzero with a 0 in the shape)",
                    ));
                }
                let shape = keep_batch(target, &x.shape, self.batch, self.exported_batch);
                // Check it against the example shape now, for an error naming
                // this node (with the kept batch spelled out).
                let mut example = shape.clone();
                if let (Some(0), Some(&b)) = (example.first(), x.shape.first()) {
                    example[0] = b as i64;
                }
                fold::reshape_shape(&x.shape, &example, allowzero)
                    .map_err(|e| self.node_err(here, e))?;
                let xin = self.tensor_input(node, here, ins, 0)?;
                self.emit(here, &out, Op::Reshape { shape }, vec![xin])
            }
            "Squeeze" | "Unsqueeze" => {
                let x = self.input_info(here, ins, 0)?;
                let axes = match self.known(ins.get(1)) {
                    Some(t) => Some(t.as_i64()),
                    None if Self::present(ins, 1) => {
                        return Err(self.dynamic(here, "the axes are computed at run time"));
                    }
                    None => attrs.ints("axes"),
                };
                let shape = if op == "Squeeze" {
                    fold::squeeze_shape(&x.shape, axes.as_deref())
                } else {
                    let axes = axes.ok_or_else(|| self.node_err(here, "missing axes"))?;
                    fold::unsqueeze_shape(&x.shape, &axes)
                }
                .map_err(|e| self.node_err(here, e))?;
                let target = shape.iter().map(|&d| d as i64).collect();
                let shape = keep_batch(target, &x.shape, self.batch, self.exported_batch);
                let xin = self.tensor_input(node, here, ins, 0)?;
                self.emit(here, &out, Op::Reshape { shape }, vec![xin])
            }
            "Transpose" => {
                let rank = self.input_info(here, ins, 0)?.shape.len();
                let perm = match attrs.ints("perm") {
                    Some(p) => p
                        .iter()
                        .map(|&a| norm_axis(a, rank))
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| self.node_err(here, e))?,
                    None => (0..rank).rev().collect(),
                };
                let x = self.tensor_input(node, here, ins, 0)?;
                self.emit(here, &out, Op::Transpose { perm }, vec![x])
            }
            "Concat" => {
                let axis = attrs
                    .int("axis")
                    .ok_or_else(|| self.node_err(here, "missing attribute `axis`"))?;
                let mut inputs = Vec::new();
                for i in 0..ins.len() {
                    if Self::present(ins, i) {
                        inputs.push(self.tensor_input(node, here, ins, i)?);
                    }
                }
                self.emit(here, &out, Op::Concat { axis }, inputs)
            }
            "Dropout" => self.dropout(node, here, attrs, ins, &out),
            "Gather" => {
                let axis = attrs.int("axis").unwrap_or(0);
                let data = self.input_info(here, ins, 0)?;
                let a = norm_axis(axis, data.shape.len()).map_err(|e| self.node_err(here, e))?;
                // Constant indices: check them and make negative ones positive,
                // since the graph's Gather takes indices as they are.
                let mut ins = ins.to_vec();
                if let Some(Some(Val::Const(t, None))) = ins.get(1) {
                    if t.elem.is_float() {
                        return Err(self.node_err(here, "float indices"));
                    }
                    let dim = data.shape[a] as i64;
                    let mut idx = t.as_i64();
                    for v in &mut idx {
                        if *v < 0 {
                            *v += dim;
                        }
                        if !(0..dim).contains(v) {
                            return Err(self.node_err(
                                here,
                                format!("index {v} out of range for dimension {dim}"),
                            ));
                        }
                    }
                    ins[1] = Some(Val::Const(Tensor::ints(t.shape.clone(), idx), None));
                }
                let inputs = vec![
                    self.tensor_input(node, here, &ins, 0)?,
                    self.tensor_input(node, here, &ins, 1)?,
                ];
                self.emit(here, &out, Op::Gather { axis }, inputs)
            }
            "Identity" => {
                let x = self.tensor_input(node, here, ins, 0)?;
                self.emit(here, &out, Op::Identity, vec![x])
            }
            "Cast" | "CastLike" => {
                let x = self.input_info(here, ins, 0)?;
                let to = if op == "Cast" {
                    attrs.int("to").and_then(|t| Elem::from_onnx(t as i32))
                } else {
                    ins.get(1)
                        .and_then(Option::as_ref)
                        .and_then(|v| self.info_of(v))
                        .map(|i| {
                            if i.dtype == DType::F32 {
                                Elem::F32
                            } else {
                                Elem::I64
                            }
                        })
                };
                match to {
                    Some(e) if dtype_of(e) == x.dtype && matches!(e, Elem::F32 | Elem::I64) => {
                        let xin = self.tensor_input(node, here, ins, 0)?;
                        self.emit(here, &out, Op::Identity, vec![xin])
                    }
                    _ => Err(self.unsupported(
                        here,
                        format!("converting a run-time {:?} tensor to another type", x.dtype),
                    )),
                }
            }
            _ if fold::is_foldable(op) => {
                let runtime_at =
                    |i: usize| matches!(ins.get(i), Some(Some(Val::Graph(_) | Val::Var(_))));
                let runtime = (0..ins.len())
                    .find(|&i| runtime_at(i))
                    .and_then(|i| node.input.get(i))
                    .map_or("", String::as_str);
                // Inputs that are shapes or sizes: computed at run time, they make
                // the output's shape unknowable here.
                let shape_like = match op {
                    "ConstantOfShape" | "Range" => true,
                    "Expand" => runtime_at(1),
                    "Slice" => (1..ins.len()).any(runtime_at),
                    _ => false,
                };
                let reason = format!(
                    "it needs input `{runtime}` at import time, but that is computed from the \
                     model's input (or weights) at run time, and Rookery's op set has no \
                     run-time {op}"
                );
                Err(if shape_like {
                    self.dynamic(here, reason)
                } else {
                    self.unsupported(here, reason)
                })
            }
            _ => Err(OnnxError::UnsupportedOp {
                file: self.file.to_string(),
                node: here.node.clone(),
                op: op.to_string(),
                domain: String::new(),
                supported: SUPPORTED.to_string(),
            }),
        }
    }

    fn gemm(
        &mut self,
        node: &NodeProto,
        here: &Here,
        attrs: &Attrs,
        ins: &[Option<Val>],
        out: &str,
    ) -> Result<(), OnnxError> {
        let alpha = attrs.float("alpha").unwrap_or(1.0);
        let beta = attrs.float("beta").unwrap_or(1.0);
        if alpha != 1.0 || (beta != 1.0 && Self::present(ins, 2)) {
            return Err(self.unsupported(here, format!("alpha = {alpha}, beta = {beta} (only 1)")));
        }
        if attrs.int("transA").unwrap_or(0) != 0 {
            return Err(self.unsupported(here, "transA = 1"));
        }
        self.note_folded_weight(node, here, 1);
        let b = self.input_info(here, ins, 1)?;
        if b.shape.len() != 2 {
            return Err(self.node_err(here, format!("B must be 2-D, is {:?}", b.shape)));
        }
        let x = self.tensor_input(node, here, ins, 0)?;
        let w = self.tensor_input(node, here, ins, 1)?;
        let bias = self.bias_input(node, here, ins, 2)?;
        if attrs.int("transB").unwrap_or(0) != 0 {
            let mut inputs = vec![x, w];
            inputs.extend(bias);
            return self.emit(here, out, Op::Linear, inputs);
        }
        // B is [in, out]: a plain matrix product plus a broadcast bias.
        match bias {
            None => self.emit(here, out, Op::MatMul, vec![x, w]),
            Some(c) => {
                let mm = format!("{out}/matmul");
                self.emit(here, &mm, Op::MatMul, vec![x, w])?;
                self.emit(here, out, Op::Add, vec![mm, c])
            }
        }
    }

    /// A bias input, or `None` when absent or a constant of zeros (the dynamo
    /// exporter spells `bias=False` as an expanded zero tensor).
    fn bias_input(
        &mut self,
        node: &NodeProto,
        here: &Here,
        ins: &[Option<Val>],
        i: usize,
    ) -> Result<Option<String>, OnnxError> {
        match ins.get(i) {
            None | Some(None) => Ok(None),
            Some(Some(Val::Const(t, None))) if t.all_zero() => Ok(None),
            Some(Some(_)) => {
                let info = self.input_info(here, ins, i)?;
                if info.shape.len() != 1 {
                    return Err(self.unsupported(
                        here,
                        format!("a bias of shape {:?} (only 1-D)", info.shape),
                    ));
                }
                self.tensor_input(node, here, ins, i).map(Some)
            }
        }
    }

    /// The legacy exporter's constant folding renames the weights it rewrites
    /// (BatchNorm folded into Conv) to `onnx::Conv_N`; the dynamo optimizer's
    /// fused convolutions are named `node_Conv_N` instead of after the aten op.
    fn note_folded_weight(&mut self, node: &NodeProto, here: &Here, i: usize) {
        if let Some(w) = node.input.get(i)
            && w.starts_with("onnx::")
            && matches!(self.vals.get(w), Some(Val::Var(_)))
        {
            self.inference_signs.push(format!(
                "the weight of node `{}` ({}) is named `{w}`, not after a state_dict entry, so \
                 the exporter rewrote it (constant folding)",
                here.node, here.op
            ));
        } else if let Some(rest) = node.name().strip_prefix("node_Conv_")
            && rest.chars().all(|c| c.is_ascii_digit())
        {
            self.inference_signs.push(format!(
                "node `{}` is a convolution the dynamo exporter's optimizer rewrote \
                 (optimize=True fuses BatchNorm into it)",
                here.node
            ));
        }
    }

    fn conv(
        &mut self,
        node: &NodeProto,
        here: &Here,
        attrs: &Attrs,
        ins: &[Option<Val>],
        out: &str,
    ) -> Result<(), OnnxError> {
        self.note_folded_weight(node, here, 1);
        let w = self.input_info(here, ins, 1)?;
        if w.shape.len() != 4 {
            return Err(self.unsupported(
                here,
                format!("weight {:?}: only 2-D convolutions (4-D weights)", w.shape),
            ));
        }
        if let Some(k) = attrs.ints("kernel_shape")
            && k.iter()
                .map(|&d| d as usize)
                .ne(w.shape[2..].iter().copied())
        {
            return Err(self.node_err(
                here,
                format!("kernel_shape {k:?} disagrees with weight {:?}", w.shape),
            ));
        }
        let (stride, padding, dilation) = self.window_attrs(here, attrs)?;
        let groups = attrs.int("group").unwrap_or(1);
        let groups =
            usize::try_from(groups).map_err(|_| self.node_err(here, format!("group {groups}")))?;
        let x = self.tensor_input(node, here, ins, 0)?;
        let wn = self.tensor_input(node, here, ins, 1)?;
        let mut inputs = vec![x, wn];
        inputs.extend(self.bias_input(node, here, ins, 2)?);
        self.emit(
            here,
            out,
            Op::Conv2d {
                stride,
                padding,
                dilation,
                groups,
            },
            inputs,
        )
    }

    /// Strides, symmetric pads and dilations of a 2-D window op.
    fn window_attrs(&self, here: &Here, attrs: &Attrs) -> Result<Window, OnnxError> {
        let auto_pad = attrs.string("auto_pad").unwrap_or_default();
        if !matches!(auto_pad.as_str(), "" | "NOTSET" | "VALID") {
            return Err(self.unsupported(
                here,
                format!("auto_pad = {auto_pad} (export with explicit padding)"),
            ));
        }
        let pair = |name: &str, default: usize| -> Result<[usize; 2], OnnxError> {
            match attrs.ints(name) {
                None => Ok([default; 2]),
                Some(v) if v.len() == 2 && v.iter().all(|&d| d >= 0) => {
                    Ok([v[0] as usize, v[1] as usize])
                }
                Some(v) => {
                    Err(self.unsupported(here, format!("{name} = {v:?} (only 2-D windows)")))
                }
            }
        };
        let stride = pair("strides", 1)?;
        let dilation = pair("dilations", 1)?;
        let padding = match attrs.ints("pads") {
            _ if auto_pad == "VALID" => [0, 0],
            None => [0, 0],
            Some(p) if p.len() == 4 && p.iter().all(|&d| d >= 0) => {
                if p[0] != p[2] || p[1] != p[3] {
                    return Err(self.unsupported(here, format!("asymmetric padding {p:?}")));
                }
                [p[0] as usize, p[1] as usize]
            }
            Some(p) => {
                return Err(self.unsupported(here, format!("pads = {p:?} (only 2-D windows)")));
            }
        };
        Ok((stride, padding, dilation))
    }

    fn pool(
        &mut self,
        node: &NodeProto,
        here: &Here,
        attrs: &Attrs,
        ins: &[Option<Val>],
        out: &str,
    ) -> Result<(), OnnxError> {
        let kernel = match attrs.ints("kernel_shape") {
            Some(k) if k.len() == 2 && k.iter().all(|&d| d > 0) => [k[0] as usize, k[1] as usize],
            k => {
                return Err(
                    self.unsupported(here, format!("kernel_shape {k:?} (only 2-D windows)"))
                );
            }
        };
        let (stride, padding, dilation) = self.window_attrs(here, attrs)?;
        // ONNX pooling strides default to 1 (PyTorch's to the kernel), but both
        // exporters always write them, so the ONNX default is right here.
        if dilation != [1, 1] {
            return Err(self.unsupported(here, format!("dilations {dilation:?}")));
        }
        if attrs.int("ceil_mode").unwrap_or(0) != 0 {
            return Err(self.unsupported(here, "ceil_mode = 1"));
        }
        if here.op == "AveragePool"
            && padding != [0, 0]
            && attrs.int("count_include_pad").unwrap_or(0) == 0
        {
            return Err(self.unsupported(
                here,
                "count_include_pad = 0 with padding (PyTorch's default includes the padding)",
            ));
        }
        let x = self.tensor_input(node, here, ins, 0)?;
        let op = if here.op == "MaxPool" {
            Op::MaxPool2d {
                kernel,
                stride,
                padding,
            }
        } else {
            Op::AvgPool2d {
                kernel,
                stride,
                padding,
            }
        };
        self.emit(here, out, op, vec![x])
    }

    /// `ReduceMean` over the spatial axes is global average pooling (how the
    /// dynamo exporter writes `AdaptiveAvgPool2d(1)`); other reductions have no
    /// Rookery op.
    fn reduce_mean(
        &mut self,
        node: &NodeProto,
        here: &Here,
        attrs: &Attrs,
        ins: &[Option<Val>],
        out: &str,
    ) -> Result<(), OnnxError> {
        let x = self.input_info(here, ins, 0)?;
        let rank = x.shape.len();
        let axes = match self.known(ins.get(1)) {
            Some(t) => t.as_i64(),
            None if Self::present(ins, 1) => {
                return Err(self.dynamic(here, "the axes are computed at run time"));
            }
            None => attrs.ints("axes").unwrap_or_default(),
        };
        let mut norm = axes
            .iter()
            .map(|&a| norm_axis(a, rank))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.node_err(here, e))?;
        norm.sort_unstable();
        if rank < 3 || norm != (2..rank).collect::<Vec<_>>() {
            return Err(self.unsupported(
                here,
                format!(
                    "mean over axes {axes:?} of a rank-{rank} input (only over all spatial axes, \
                     i.e. global average pooling)"
                ),
            ));
        }
        let xin = self.tensor_input(node, here, ins, 0)?;
        if attrs.int("keepdims").unwrap_or(1) != 0 {
            return self.emit(here, out, Op::GlobalAveragePool, vec![xin]);
        }
        let pooled = format!("{out}/pool");
        self.emit(here, &pooled, Op::GlobalAveragePool, vec![xin])?;
        let shape = keep_batch(
            vec![x.shape[0] as i64, x.shape[1] as i64],
            &x.shape,
            self.batch,
            self.exported_batch,
        );
        self.emit(here, out, Op::Reshape { shape }, vec![pooled])
    }

    fn batch_norm(
        &mut self,
        node: &NodeProto,
        here: &Here,
        attrs: &Attrs,
        ins: &[Option<Val>],
        out: &str,
    ) -> Result<(), OnnxError> {
        let eps = attrs.float("epsilon").unwrap_or(1e-5);
        // ONNX keeps `momentum` of the running statistic, PyTorch of the new
        // batch statistic; ONNX stores it in f32, so round away the f32 noise
        // (0.9f32 -> 0.100000024) to get PyTorch's value back.
        let onnx_momentum = f64::from(attrs.float("momentum").unwrap_or(0.9));
        let momentum = (((1.0 - onnx_momentum) * 1e6).round() / 1e6) as f32;
        // The legacy exporter writes training_mode=1; the dynamo exporter writes
        // none, but names training-mode nodes after aten's functional batch norm.
        let training = attrs.int("training_mode").unwrap_or(0) != 0
            || node.name().contains("legit_functional");
        if !training {
            self.inference_signs.push(format!(
                "BatchNormalization node `{}` is in inference mode",
                here.node
            ));
        }
        let mut inputs = Vec::with_capacity(6);
        for i in 0..5 {
            if i >= 3
                && let Some(Some(Val::Var(idx))) = ins.get(i)
                && self.inits[*idx].kind.is_none()
            {
                self.inits[*idx].kind = Some(ParamKind::Buffer);
            }
            inputs.push(self.tensor_input(node, here, ins, i)?);
        }
        // PyTorch's state_dict has `num_batches_tracked` beside the statistics;
        // exporters drop it (ONNX has no use for it), so it is restored as a fresh
        // counter, keeping the graph's parameters those of the state_dict.
        if let Some(prefix) = inputs[3].strip_suffix(".running_mean") {
            let name = format!("{prefix}.num_batches_tracked");
            if let Some(i) = self.inits.iter().position(|i| i.name == name) {
                self.inits[i].used = true;
                self.inits[i].kind.get_or_insert(ParamKind::Buffer);
                inputs.push(name);
            } else if self.synthesized.iter().any(|(_, p)| p.name == name) {
                inputs.push(name);
            } else if let Some(after) = self.inits.iter().position(|i| i.name == inputs[4]) {
                self.synthesized.push((
                    after,
                    Param {
                        name: name.clone(),
                        shape: vec![],
                        dtype: DType::I64,
                        kind: ParamKind::Buffer,
                        init: Init::Zeros,
                    },
                ));
                inputs.push(name);
            }
        }
        self.emit(here, out, Op::BatchNorm { eps, momentum }, inputs)
    }

    fn dropout(
        &mut self,
        node: &NodeProto,
        here: &Here,
        attrs: &Attrs,
        ins: &[Option<Val>],
        out: &str,
    ) -> Result<(), OnnxError> {
        // Opset 12 moved ratio from an attribute to an input and added training_mode,
        // which defaults to false (inference: Dropout does nothing).
        let (p, training) = if self.opset >= 12 {
            let p = match self.known(ins.get(1)) {
                Some(t) if t.len() == 1 => t.as_f64()[0] as f32,
                None if !Self::present(ins, 1) => 0.5,
                _ => return Err(self.node_err(here, "the ratio must be a constant scalar")),
            };
            let training = match self.known(ins.get(2)) {
                Some(t) if t.len() == 1 => t.as_i64()[0] != 0,
                None if !Self::present(ins, 2) => false,
                _ => return Err(self.node_err(here, "training_mode must be a constant scalar")),
            };
            (p, training)
        } else {
            (
                attrs.float("ratio").unwrap_or(0.5),
                attrs.int("is_test").unwrap_or(0) == 0,
            )
        };
        if !training {
            self.inference_signs
                .push(format!("Dropout node `{}` is in inference mode", here.node));
        }
        let x = self.tensor_input(node, here, ins, 0)?;
        self.emit(here, out, Op::Dropout { p }, vec![x])
    }
}

/// Strides, padding (per side, symmetric) and dilations of a 2-D window.
type Window = ([usize; 2], [usize; 2], [usize; 2]);

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

fn show_dims(d: &[Option<i64>]) -> String {
    let parts: Vec<String> = d
        .iter()
        .map(|v| v.map_or_else(|| "?".to_string(), |v| v.to_string()))
        .collect();
    format!("[{}]", parts.join(", "))
}

/// Names exporters give to constants they created (the dynamo optimizer's
/// `val_N`; the legacy exporter's `onnx::Op_N` scalars), as opposed to weights.
fn generated_name(name: &str, t: &Tensor) -> bool {
    let val_n = name
        .strip_prefix("val_")
        .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
    val_n || (name.starts_with("onnx::") && t.numel() <= 1)
}

/// BatchNorm statistics, which are buffers in PyTorch.
fn is_statistic(name: &str) -> bool {
    name.ends_with("running_mean") || name.ends_with("running_var")
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

/// Rewrites `Transpose(W, [1, 0]) -> MatMul(x, ·) [-> Add(·, b)]`, PyTorch's
/// `nn.Linear` on inputs of rank > 2, into one [`Op::Linear`] named after the
/// last node it replaces.
fn fuse_linear(
    nodes: Vec<Node>,
    params: &HashMap<String, Vec<usize>>,
    outputs: &[String],
) -> Vec<Node> {
    let mut users: HashMap<&str, usize> = HashMap::new();
    for n in &nodes {
        for i in &n.inputs {
            *users.entry(i.as_str()).or_default() += 1;
        }
    }
    let private = |t: &str| users.get(t) == Some(&1) && !outputs.iter().any(|o| o == t);
    let index: HashMap<&str, usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.as_str(), i))
        .collect();
    let consumer: HashMap<&str, usize> = nodes
        .iter()
        .enumerate()
        .flat_map(|(i, n)| n.inputs.iter().map(move |t| (t.as_str(), i)))
        .collect();
    let mut remove = BTreeSet::new();
    let mut replace: HashMap<usize, Node> = HashMap::new();
    for (mi, m) in nodes.iter().enumerate() {
        if m.op != Op::MatMul || remove.contains(&mi) {
            continue;
        }
        let Some(&ti) = index.get(m.inputs[1].as_str()) else {
            continue;
        };
        let t = &nodes[ti];
        let weight = &t.inputs[0];
        let is_transposed_weight = t.op == (Op::Transpose { perm: vec![1, 0] })
            && params.get(weight).is_some_and(|s| s.len() == 2)
            && private(&t.name);
        if !is_transposed_weight {
            continue;
        }
        let out_features = params.get(weight).map_or(0, |s| s[0]);
        let x = m.inputs[0].clone();
        // The bias Add, if it is the MatMul's only reader.
        let add = consumer
            .get(m.name.as_str())
            .copied()
            .filter(|_| private(&m.name))
            .and_then(|ai| {
                let a = &nodes[ai];
                let bias = a.inputs.iter().find(|i| **i != m.name)?;
                let ok = a.op == Op::Add
                    && a.inputs.len() == 2
                    && params.get(bias).is_some_and(|s| s == &[out_features]);
                ok.then(|| (ai, bias.clone()))
            });
        remove.insert(ti);
        match add {
            Some((ai, bias)) => {
                remove.insert(mi);
                replace.insert(
                    ai,
                    Node {
                        name: nodes[ai].name.clone(),
                        op: Op::Linear,
                        inputs: vec![x, weight.clone(), bias],
                    },
                );
            }
            None => {
                replace.insert(
                    mi,
                    Node {
                        name: m.name.clone(),
                        op: Op::Linear,
                        inputs: vec![x, weight.clone()],
                    },
                );
            }
        }
    }
    nodes
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !remove.contains(i))
        .map(|(i, n)| replace.remove(&i).unwrap_or(n))
        .collect()
}

/// Drops nodes whose outputs nothing reads (e.g. shape computations left over
/// from fusions), repeating until none are left.
fn prune(mut nodes: Vec<Node>, outputs: &[String]) -> Vec<Node> {
    loop {
        let read: HashSet<&str> = nodes
            .iter()
            .flat_map(|n| n.inputs.iter().map(String::as_str))
            .chain(outputs.iter().map(String::as_str))
            .collect();
        let keep: Vec<bool> = nodes
            .iter()
            .map(|n| read.contains(n.name.as_str()))
            .collect();
        if keep.iter().all(|&k| k) {
            return nodes;
        }
        let mut k = keep.into_iter();
        nodes.retain(|_| k.next().unwrap_or(true));
    }
}
