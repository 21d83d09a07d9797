//! The per-op translation: which Rookery op (or ops) each ONNX op becomes,
//! with the checks that reject what Rookery cannot run.

use super::{Here, Importer, SUPPORTED, Val, dtype_of, keep_batch};
use crate::error::OnnxError;
use crate::onnx::fold;
use crate::onnx::shapes::{self, norm_axis};
use crate::onnx::tensor::{Elem, Tensor};
use crate::ops::Op;
use crate::tensor::DType;

impl Importer<'_> {
    /// Maps a node that computes on run-time tensors onto Rookery ops.
    pub(super) fn convert(&mut self, here: &mut Here) -> Result<(), OnnxError> {
        let op = here.op;
        if self.symbolic_node(here)? {
            return Ok(());
        }
        match op {
            "Gemm" => self.gemm(here),
            "Add" | "Sub" | "Mul" | "Div" => {
                let rop = match op {
                    "Add" => Op::Add,
                    "Sub" => Op::Sub,
                    "Mul" => Op::Mul,
                    _ => Op::Div,
                };
                for i in 0..2 {
                    if self.input_info(here, i)?.dtype != DType::F32 {
                        return Err(self.unsupported(
                            here,
                            "integer arithmetic on run-time tensors (only float32 is computed in the graph)",
                        ));
                    }
                }
                let inputs = vec![self.tensor_input(here, 0)?, self.tensor_input(here, 1)?];
                self.emit(here, &here.out, rop, inputs)
            }
            "Relu" | "Sigmoid" | "Tanh" | "Gelu" | "Neg" | "Abs" | "Sqrt" | "Reciprocal"
            | "Exp" | "Log" => {
                let rop = match op {
                    "Relu" => Op::Relu,
                    "Sigmoid" => Op::Sigmoid,
                    "Tanh" => Op::Tanh,
                    "Neg" => Op::Neg,
                    "Abs" => Op::Abs,
                    "Sqrt" => Op::Sqrt,
                    "Reciprocal" => Op::Reciprocal,
                    "Exp" => Op::Exp,
                    "Log" => Op::Log,
                    _ => {
                        let approx = here.attrs.string("approximate").unwrap_or_default();
                        if approx == "tanh" {
                            let x = self.tensor_input(here, 0)?;
                            return self.emit(here, &here.out, Op::GeluTanh, vec![x]);
                        }
                        if !(approx.is_empty() || approx == "none") {
                            return Err(self.unsupported(
                                here,
                                format!("approximate = \"{approx}\" (only the exact erf GELU)"),
                            ));
                        }
                        Op::Gelu
                    }
                };
                let x = self.tensor_input(here, 0)?;
                self.emit(here, &here.out, rop, vec![x])
            }
            "LeakyRelu" | "Elu" | "Selu" | "Softplus" | "Softsign" | "Shrink" | "Clip"
            | "ThresholdedRelu" => self.activation(here),
            "Softmax" | "LogSoftmax" => {
                let rank = self.input_info(here, 0)?.shape.len();
                // Before opset 13 these flattened the input at `axis` (default 1),
                // which matches a per-axis softmax only over the last axis.
                let axis = here
                    .attrs
                    .int("axis")
                    .unwrap_or(if self.opset >= 13 { -1 } else { 1 });
                let a = norm_axis(axis, rank).map_err(|e| self.node_err(here, e))?;
                if self.opset < 13 && a + 1 != rank {
                    return Err(self.unsupported(
                        here,
                        format!("opset {} {op} over axis {axis} of a rank-{rank} input (coerced to 2-D)", self.opset),
                    ));
                }
                let x = self.tensor_input(here, 0)?;
                let rop = if op == "Softmax" {
                    Op::Softmax { axis }
                } else {
                    Op::LogSoftmax { axis }
                };
                self.emit(here, &here.out, rop, vec![x])
            }
            "Conv" => self.conv(here),
            "MaxPool" | "AveragePool" => self.pool(here),
            "GlobalAveragePool" => {
                let x = self.tensor_input(here, 0)?;
                self.emit(here, &here.out, Op::GlobalAveragePool, vec![x])
            }
            "ReduceMean" => self.reduce_mean(here),
            "BatchNormalization" => self.batch_norm(here),
            "LayerNormalization" => {
                let axis = here.attrs.int("axis").unwrap_or(-1);
                let eps = here.attrs.float("epsilon").unwrap_or(1e-5);
                let mut inputs = vec![self.tensor_input(here, 0)?];
                for i in 1..3 {
                    if here.present(i) {
                        inputs.push(self.tensor_input(here, i)?);
                    }
                }
                if inputs.len() == 2 && !here.present(1) {
                    return Err(self.unsupported(here, "a bias without a scale"));
                }
                let x = inputs[0].clone();
                self.emit(here, &here.out, Op::LayerNorm { axis, eps }, inputs)?;
                self.layer_norm_stats(here, &x, axis, eps)
            }
            "Flatten" => {
                let axis = here.attrs.int("axis").unwrap_or(1);
                let x = self.tensor_input(here, 0)?;
                self.emit(here, &here.out, Op::Flatten { axis }, vec![x])
            }
            "Reshape" => {
                let x = self.input_info(here, 0)?;
                let target = self
                    .known(here, 1)
                    .ok_or_else(|| {
                        self.dynamic(
                            here,
                            format!(
                                "the target shape `{}` is computed from tensor values at run time",
                                here.proto.input.get(1).map_or("", String::as_str)
                            ),
                        )
                    })?
                    .as_i64();
                let allowzero = here.attrs.int("allowzero").unwrap_or(0) != 0;
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
                shapes::reshape_shape(&x.shape, &example, allowzero)
                    .map_err(|e| self.node_err(here, e))?;
                let xin = self.tensor_input(here, 0)?;
                self.emit(here, &here.out, Op::Reshape { shape }, vec![xin])
            }
            "Squeeze" | "Unsqueeze" => {
                let x = self.input_info(here, 0)?;
                let axes = match self.known(here, 1) {
                    Some(t) => Some(t.as_i64()),
                    None if here.present(1) => {
                        return Err(self.dynamic(here, "the axes are computed at run time"));
                    }
                    None => here.attrs.ints("axes"),
                };
                let shape = if op == "Squeeze" {
                    shapes::squeeze_shape(&x.shape, axes.as_deref())
                } else {
                    let axes = axes.ok_or_else(|| self.node_err(here, "missing axes"))?;
                    shapes::unsqueeze_shape(&x.shape, &axes)
                }
                .map_err(|e| self.node_err(here, e))?;
                let target = shape.iter().map(|&d| d as i64).collect();
                let shape = keep_batch(target, &x.shape, self.batch, self.exported_batch);
                let xin = self.tensor_input(here, 0)?;
                self.emit(here, &here.out, Op::Reshape { shape }, vec![xin])
            }
            "Transpose" => {
                let rank = self.input_info(here, 0)?.shape.len();
                let perm = match here.attrs.ints("perm") {
                    Some(p) => p
                        .iter()
                        .map(|&a| norm_axis(a, rank))
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| self.node_err(here, e))?,
                    None => (0..rank).rev().collect(),
                };
                let x = self.tensor_input(here, 0)?;
                self.emit(here, &here.out, Op::Transpose { perm }, vec![x])
            }
            "Concat" => {
                let axis = here
                    .attrs
                    .int("axis")
                    .ok_or_else(|| self.node_err(here, "missing attribute `axis`"))?;
                let mut inputs = Vec::new();
                for i in 0..here.ins.len() {
                    if here.present(i) {
                        inputs.push(self.tensor_input(here, i)?);
                    }
                }
                self.emit(here, &here.out, Op::Concat { axis }, inputs)
            }
            "Dropout" => self.dropout(here),
            "Split" => self.split(here),
            "SplitToSequence" => self.split_to_sequence(here),
            "SequenceAt" => self.sequence_at(here),
            "Slice" => self.slice(here),
            "Gather" if self.gather_as_slice(here)? => Ok(()),
            "Gather" => {
                let axis = here.attrs.int("axis").unwrap_or(0);
                let data = self.input_info(here, 0)?;
                let a = norm_axis(axis, data.shape.len()).map_err(|e| self.node_err(here, e))?;
                // Constant indices: check them and make negative ones positive,
                // since the graph's Gather takes indices as they are.
                if let Some(Some(Val::Const(t, None))) = here.ins.get(1) {
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
                    here.ins[1] = Some(Val::Const(Tensor::ints(t.shape.clone(), idx), None));
                }
                let inputs = vec![self.tensor_input(here, 0)?, self.tensor_input(here, 1)?];
                self.emit(here, &here.out, Op::Gather { axis }, inputs)
            }
            "Identity" => {
                let x = self.tensor_input(here, 0)?;
                self.emit(here, &here.out, Op::Identity, vec![x])
            }
            "Cast" | "CastLike" => {
                let x = self.input_info(here, 0)?;
                let to = if op == "Cast" {
                    here.attrs.int("to").and_then(|t| Elem::from_onnx(t as i32))
                } else {
                    here.ins
                        .get(1)
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
                        let xin = self.tensor_input(here, 0)?;
                        self.emit(here, &here.out, Op::Identity, vec![xin])
                    }
                    _ => Err(self.unsupported(
                        here,
                        format!("converting a run-time {:?} tensor to another type", x.dtype),
                    )),
                }
            }
            "Expand" if matches!(here.ins.get(1), Some(Some(Val::Const(..)))) => self.expand(here),
            "MatMul" => self.matmul(here),
            _ if fold::is_foldable(op) => {
                let runtime_at =
                    |i: usize| matches!(here.ins.get(i), Some(Some(Val::Graph(_) | Val::Var(_))));
                let runtime = (0..here.ins.len())
                    .find(|&i| runtime_at(i))
                    .and_then(|i| here.proto.input.get(i))
                    .map_or("", String::as_str);
                // Inputs that are shapes or sizes: computed at run time, they make
                // the output's shape unknowable here.
                let shape_like = match op {
                    "ConstantOfShape" | "Range" => true,
                    "Expand" => runtime_at(1),
                    "Slice" => (1..here.ins.len()).any(runtime_at),
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

    /// `Expand` of a run-time tensor to a known shape: adding zeros of the
    /// broadcast shape (`x + 0` is `x`), as Rookery's op set has no
    /// broadcast of its own.
    fn expand(&mut self, here: &Here) -> Result<(), OnnxError> {
        let x = self.input_info(here, 0)?;
        let Some(Some(Val::Const(target, _))) = here.ins.get(1) else {
            return Err(self.node_err(here, "the shape is not known at import time"));
        };
        let target: Vec<usize> = target
            .as_i64()
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| self.node_err(here, format!("dimension {d}"))))
            .collect::<Result<_, _>>()?;
        let shape =
            shapes::broadcast_shapes(&x.shape, &target).map_err(|e| self.node_err(here, e))?;
        if shape == x.shape {
            let xin = self.tensor_input(here, 0)?;
            return self.emit(here, &here.out, Op::Identity, vec![xin]);
        }
        let numel = shape.iter().product();
        let zeros = self.add_constant(
            &format!("{}/zeros", here.out),
            shape,
            x.dtype,
            vec![0.0; numel],
        );
        let xin = self.tensor_input(here, 0)?;
        self.emit(here, &here.out, Op::Add, vec![xin, zeros])
    }

    /// `MatMul`, where a 1-D operand is a matrix of one row (left) or one
    /// column (right) whose added dimension the result drops, as NumPy does.
    fn matmul(&mut self, here: &Here) -> Result<(), OnnxError> {
        let (a, b) = (self.input_info(here, 0)?, self.input_info(here, 1)?);
        if a.shape.is_empty() || b.shape.is_empty() {
            return Err(self.unsupported(here, "scalar operands"));
        }
        let mut x = self.tensor_input(here, 0)?;
        let mut w = self.tensor_input(here, 1)?;
        if a.shape.len() >= 2 && b.shape.len() >= 2 {
            return self.emit(here, &here.out, Op::MatMul, vec![x, w]);
        }
        let out = here.out.clone();
        if a.shape.len() == 1 {
            let row = format!("{out}/row");
            self.emit(
                here,
                &row,
                Op::Reshape {
                    shape: vec![1, a.shape[0] as i64],
                },
                vec![x],
            )?;
            x = row;
        }
        if b.shape.len() == 1 {
            let column = format!("{out}/column");
            self.emit(
                here,
                &column,
                Op::Reshape {
                    shape: vec![b.shape[0] as i64, 1],
                },
                vec![w],
            )?;
            w = column;
        }
        let product = format!("{out}/matrix");
        self.emit(here, &product, Op::MatMul, vec![x, w])?;
        let mut shape = self
            .graph_info(&product)
            .ok_or_else(|| self.node_err(here, "the product's shape is unknown"))?
            .shape;
        if b.shape.len() == 1 {
            shape.pop();
        }
        if a.shape.len() == 1 {
            shape.remove(shape.len() - 1 - usize::from(b.shape.len() != 1));
        }
        let target = shape.iter().map(|&d| d as i64).collect();
        self.emit(here, &out, Op::Reshape { shape: target }, vec![product])
    }
}
