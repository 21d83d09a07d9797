//! Reading what the graph declares besides its nodes: initializers (with
//! external data), graph inputs and their shapes, graph outputs, and the
//! final parameter list.

use std::collections::HashMap;

use super::{External, Importer, InitInfo, Val, dtype_of};
use crate::error::OnnxError;
use crate::graph::{Input, Param, ParamKind};
use crate::init::Init;
use crate::onnx::pb::{GraphProto, TensorProto};
use crate::onnx::tensor::{self, Elem, Tensor};
use crate::tensor::{DType, TensorInfo};

/// dynamo exporter metadata on initializers: what `torch.export` says each one is.
const SPEC_KIND: &str = "pkg.torch.export.graph_signature.InputSpec.kind";
const SPEC_TARGET: &str = "pkg.torch.export.graph_signature.InputSpec.target";
const SPEC_PERSISTENT: &str = "pkg.torch.export.graph_signature.InputSpec.persistent";

impl Importer<'_> {
    /// Decodes every initializer (loading external data) and decides which are
    /// weights and which are constants for folding.
    pub(super) fn read_initializers(&mut self, graph: &GraphProto) -> Result<(), OnnxError> {
        // The dynamo exporter describes each initializer in value_info metadata.
        let mut meta: HashMap<&str, HashMap<&str, &str>> = HashMap::new();
        for vi in graph.value_info.iter().chain(&graph.input) {
            let m = meta.entry(vi.name()).or_default();
            for kv in &vi.metadata_props {
                m.insert(kv.key(), kv.value());
            }
        }
        let bound = self.bound_protos(graph)?;
        let is_bound = |t: &TensorProto| bound.iter().any(|b| b.name() == t.name());
        for t in graph.initializer.iter().chain(&bound) {
            let (elem, shape, numel) =
                tensor::header(t).map_err(|reason| self.tensor_err(t, reason))?;
            let m = meta.get(t.name());
            let spec_kind = m.and_then(|m| m.get(SPEC_KIND).copied());
            // torch.export knows each tensor's state_dict name; older exporters
            // already name initializers after it.
            let name = m
                .and_then(|m| m.get(SPEC_TARGET).copied())
                .filter(|n| !n.is_empty())
                .unwrap_or(t.name())
                .to_string();
            // A buffer registered with `persistent=False` (a causal mask, say)
            // is not in the state_dict: a constant of the module, which
            // folds like one (a mask sliced to the sequence length).
            let persistent = m.and_then(|m| m.get(SPEC_PERSISTENT).copied()) != Some("False");
            let kind = match spec_kind {
                Some("PARAMETER") => Some(ParamKind::Trainable),
                Some("BUFFER") if !persistent => Some(ParamKind::Constant),
                Some("BUFFER") => Some(ParamKind::Buffer),
                Some("CONSTANT_TENSOR") => Some(ParamKind::Constant),
                _ if generated_name(t.name(), numel) => Some(ParamKind::Constant),
                // A fed integer input is data, not state: a constant.
                _ if !elem.is_float() && is_bound(t) => Some(ParamKind::Constant),
                _ if !elem.is_float() => Some(ParamKind::Buffer),
                _ if is_statistic(&name) => Some(ParamKind::Buffer),
                _ => None,
            };
            let index = self.inits.len();
            // Weights stay variables even where a node could fold them (a
            // Transpose of a weight must be trained through, not baked in).
            let (tensor, weights) = if elem.is_float() && kind != Some(ParamKind::Constant) {
                let weights = if self.shapes_only && numel >= SHAPES_ONLY_ABOVE {
                    None
                } else {
                    Some(self.decode_weights(t)?)
                };
                self.vals.insert(t.name().to_string(), Val::Var(index));
                let data = tensor::Data::Float(Vec::new());
                (Tensor { elem, shape, data }, weights)
            } else {
                let tensor = self.decode_initializer(t)?;
                let val = Val::Const(tensor.clone(), Some(index));
                self.vals.insert(t.name().to_string(), val);
                (tensor, None)
            };
            self.inits.push(InitInfo {
                name,
                tensor,
                weights,
                kind,
                used: false,
            });
        }
        Ok(())
    }

    /// The bound inputs as initializers of the element type each input
    /// declares (f32 or i64; values cast where the two differ).
    fn bound_protos(&self, graph: &GraphProto) -> Result<Vec<TensorProto>, OnnxError> {
        use crate::onnx::BoundValues;
        use crate::onnx::pb::tensor_proto::DataType;
        let mut out = Vec::with_capacity(self.bound.len());
        for b in &self.bound {
            let err = |reason: String| OnnxError::Input {
                file: self.file.to_string(),
                name: b.name.clone(),
                reason,
            };
            let Some(vi) = graph.input.iter().find(|vi| vi.name() == b.name) else {
                return Err(err("is not an input of the graph".into()));
            };
            let Some(declared) = crate::onnx::tensor_type(vi).map(|tt| tt.elem_type()) else {
                return Err(err("is not a tensor".into()));
            };
            let numel: usize = b.shape.iter().product();
            let len = match &b.values {
                BoundValues::F32(v) => v.len(),
                BoundValues::I64(v) => v.len(),
            };
            if len != numel {
                return Err(err(format!(
                    "{len} values given for shape {:?} ({numel} elements)",
                    b.shape
                )));
            }
            let (data_type, raw_data) = match (Elem::from_onnx(declared), &b.values) {
                (Some(Elem::F32), BoundValues::F32(v)) => {
                    (DataType::Float, f32_bytes(v.iter().copied()))
                }
                (Some(Elem::F32), BoundValues::I64(v)) => {
                    (DataType::Float, f32_bytes(v.iter().map(|&x| x as f32)))
                }
                (Some(Elem::I64), BoundValues::I64(v)) => {
                    (DataType::Int64, i64_bytes(v.iter().copied()))
                }
                (Some(Elem::I64), BoundValues::F32(v)) => {
                    (DataType::Int64, i64_bytes(v.iter().map(|&x| x as i64)))
                }
                _ => return Err(err(unsupported_elem(declared))),
            };
            out.push(TensorProto {
                name: Some(b.name.clone()),
                dims: b.shape.iter().map(|&d| d as i64).collect(),
                data_type: Some(data_type as i32),
                raw_data: Some(raw_data),
                ..TensorProto::default()
            });
        }
        Ok(out)
    }

    fn tensor_err(&self, t: &TensorProto, reason: String) -> OnnxError {
        OnnxError::Tensor {
            file: self.file.to_string(),
            tensor: t.name().to_string(),
            reason,
        }
    }

    fn decode_weights(&mut self, t: &TensorProto) -> Result<Vec<f32>, OnnxError> {
        let external = tensor::external_ref(t).map_err(|reason| self.tensor_err(t, reason))?;
        let bytes = match &external {
            None => None,
            Some(r) => Some(self.external_bytes(t.name(), r)?),
        };
        tensor::decode_f32(t, bytes.as_deref()).map_err(|reason| self.tensor_err(t, reason))
    }

    fn decode_initializer(&mut self, t: &TensorProto) -> Result<Tensor, OnnxError> {
        let external = tensor::external_ref(t).map_err(|reason| self.tensor_err(t, reason))?;
        let bytes = match &external {
            None => None,
            Some(r) => Some(self.external_bytes(t.name(), r)?),
        };
        tensor::decode(t, bytes.as_deref()).map_err(|reason| self.tensor_err(t, reason))
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
        let past_end = |end: Option<usize>, len: usize| {
            format!(
                "bytes {}..{} are past the end of the {len}-byte file (truncated?)",
                r.offset,
                end.map_or_else(|| "?".to_string(), |e| e.to_string()),
            )
        };
        let whole = match self.external {
            External::Beside(dir) => {
                return read_range(&dir.join(&r.location), r.offset, r.length, past_end)
                    .map_err(err);
            }
            External::Whole(read) => read,
        };
        if !self.external_cache.contains_key(&r.location) {
            let data = whole(&r.location).map_err(|e| err(e.to_string()))?;
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
            _ => Err(err(past_end(end, data.len()))),
        }
    }

    /// Records the graph inputs (those that are not initializers) and their shapes.
    pub(super) fn read_inputs(
        &mut self,
        graph: &GraphProto,
        input_shape: &[usize],
    ) -> Result<(), OnnxError> {
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
            let Some(tt) = crate::onnx::tensor_type(vi) else {
                return Err(err("is not a tensor".into()));
            };
            let dtype = match Elem::from_onnx(tt.elem_type()) {
                Some(Elem::F32) => DType::F32,
                Some(Elem::I64) => DType::I64,
                _ => return Err(err(unsupported_elem(tt.elem_type()))),
            };
            let declared = crate::onnx::declared_dims(tt);
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

    pub(super) fn graph_inputs(&self, graph: &GraphProto) -> Vec<Input> {
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
    pub(super) fn param_shapes(&self) -> HashMap<String, Vec<usize>> {
        self.inits
            .iter()
            .filter(|i| i.used)
            .map(|i| (i.name.clone(), i.tensor.shape.clone()))
            .collect()
    }

    /// The parameter list: weights in file order (each BatchNorm's synthesized
    /// `num_batches_tracked` after its statistics), then folded constants.
    pub(super) fn params(&mut self) -> Vec<Param> {
        let mut params = Vec::new();
        let mut synthesized = std::mem::take(&mut self.synthesized);
        let shapes_only = self.shapes_only;
        for (i, init) in self.inits.iter_mut().enumerate() {
            if init.used {
                let values = match init.weights.take() {
                    Some(data) => Init::Values { data },
                    None if init.tensor.len() == 0 && init.tensor.numel() > 0 && shapes_only => {
                        Init::Zeros
                    }
                    None => Init::Values {
                        data: init.tensor.to_f32(),
                    },
                };
                params.push(Param {
                    name: init.name.clone(),
                    shape: init.tensor.shape.clone(),
                    dtype: dtype_of(init.tensor.elem),
                    kind: init.kind.unwrap_or(ParamKind::Trainable),
                    init: values,
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

    pub(super) fn outputs(&mut self, graph: &GraphProto) -> Result<Vec<String>, OnnxError> {
        let mut outputs = Vec::new();
        for o in &graph.output {
            match self.vals.get(o.name()) {
                Some(Val::Graph(_)) => outputs.push(o.name().to_string()),
                Some(Val::Var(i)) => {
                    let i = *i;
                    self.inits[i].used = true;
                    outputs.push(self.inits[i].name.clone());
                }
                Some(Val::Missing { node, op, index }) if self.run_once => {
                    return Err(OnnxError::Unsupported {
                        file: self.file.to_string(),
                        node: node.clone(),
                        op: op.clone(),
                        reason: format!(
                            "output {index} (`{}`): Rookery's {op} computes only its first",
                            o.name()
                        ),
                    });
                }
                Some(Val::Missing { node, op, .. }) => self.warnings.push(format!(
                    "{}: graph output `{}` (from node `{node}`, {op}) is state Rookery's op keeps \
                     itself (e.g. updated BatchNorm statistics); it is not a graph output",
                    self.file,
                    o.name()
                )),
                Some(Val::Const(t, _)) if self.run_once => {
                    // Kept as a constant of the graph, read by an Identity
                    // named as the output.
                    let t = t.clone();
                    let name = self.add_constant(
                        &format!("{}/constant", o.name()),
                        t.shape.clone(),
                        dtype_of(t.elem),
                        t.to_f32(),
                    );
                    self.nodes.push(crate::graph::Node {
                        name: o.name().to_string(),
                        op: crate::ops::Op::Identity,
                        inputs: vec![name],
                    });
                    outputs.push(o.name().to_string());
                }
                Some(Val::Const(..)) => self.warnings.push(format!(
                    "{}: graph output `{}` does not depend on the input (it folds to a \
                     constant); dropped",
                    self.file,
                    o.name()
                )),
                Some(Val::Pending { node, op, .. }) => {
                    return Err(OnnxError::Unsupported {
                        file: self.file.to_string(),
                        node: node.clone(),
                        op: op.clone(),
                        reason: format!(
                            "graph output `{}` is computed by {op} of run-time tensors, which \
                             Rookery runs only within the activations PyTorch's exporters spell \
                             with it (softplus, threshold, hardshrink, softshrink)",
                            o.name()
                        ),
                    });
                }
                Some(Val::Sequence(_)) => {
                    return Err(self.model_err(format!(
                        "graph output `{}` is a sequence of tensors; Rookery's outputs are tensors",
                        o.name()
                    )));
                }
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
}

/// Why a graph input of ONNX element type `code` cannot be fed, naming the type.
fn unsupported_elem(code: i32) -> String {
    use crate::onnx::pb::tensor_proto::DataType;
    let name = DataType::try_from(code).map_or_else(
        |_| format!("code {code}"),
        |t| t.as_str_name().to_lowercase(),
    );
    format!("element type {name} is not supported (float32 or int64 only)")
}

fn f32_bytes(values: impl Iterator<Item = f32>) -> Vec<u8> {
    values.flat_map(f32::to_le_bytes).collect()
}

fn i64_bytes(values: impl Iterator<Item = i64>) -> Vec<u8> {
    values.flat_map(i64::to_le_bytes).collect()
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
fn generated_name(name: &str, numel: usize) -> bool {
    let val_n = name
        .strip_prefix("val_")
        .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
    val_n || (name.starts_with("onnx::") && numel <= 1)
}

/// Weights of at least this many elements keep only their shape in a
/// shapes-only import; smaller ones (scalars a node reads as attributes)
/// are read.
const SHAPES_ONLY_ABOVE: usize = 1024;

/// BatchNorm statistics, which are buffers in PyTorch.
fn is_statistic(name: &str) -> bool {
    name.ends_with("running_mean") || name.ends_with("running_var")
}

/// Bytes `offset..offset + length` (or to the end) of the file at `path`.
fn read_range(
    path: &std::path::Path,
    offset: usize,
    length: Option<usize>,
    past_end: impl Fn(Option<usize>, usize) -> String,
) -> Result<Vec<u8>, String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    let end = match length {
        Some(n) => offset.checked_add(n),
        None => Some(len),
    };
    let Some(end) = end.filter(|&end| offset <= end && end <= len) else {
        return Err(past_end(end, len));
    };
    file.seek(SeekFrom::Start(offset as u64))
        .map_err(|e| e.to_string())?;
    let mut bytes = vec![0; end - offset];
    file.read_exact(&mut bytes).map_err(|e| e.to_string())?;
    Ok(bytes)
}
