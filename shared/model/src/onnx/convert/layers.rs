//! Ops with weights or windows: Gemm, Conv, the pools (and `ReduceMean` as
//! global pooling), BatchNormalization and Dropout, which also record the
//! signs that a file was exported for inference.

use super::{Here, Importer, Val, keep_batch};
use crate::error::OnnxError;
use crate::graph::{Param, ParamKind};
use crate::init::Init;
use crate::onnx::shapes::norm_axis;
use crate::ops::Op;
use crate::tensor::DType;

/// Strides, padding (per side, symmetric) and dilations of a 2-D window.
type Window = ([usize; 2], [usize; 2], [usize; 2]);

impl Importer<'_> {
    pub(super) fn gemm(&mut self, here: &Here) -> Result<(), OnnxError> {
        let alpha = here.attrs.float("alpha").unwrap_or(1.0);
        let beta = here.attrs.float("beta").unwrap_or(1.0);
        let trans_a = here.attrs.int("transA").unwrap_or(0) != 0;
        let trans_b = here.attrs.int("transB").unwrap_or(0) != 0;
        self.note_folded_weight(here, 1);
        let (a, b) = (self.input_info(here, 0)?, self.input_info(here, 1)?);
        if a.shape.len() != 2 || b.shape.len() != 2 {
            return Err(self.node_err(
                here,
                format!("A and B must be 2-D, are {:?} and {:?}", a.shape, b.shape),
            ));
        }
        let c = match here.ins.get(2) {
            None | Some(None) => None,
            // The dynamo exporter spells `bias=False` as zeros.
            Some(Some(Val::Const(t, None))) if t.all_zero() => None,
            Some(Some(_)) => Some(self.input_info(here, 2)?),
        };
        let plain_bias = c.as_ref().is_none_or(|c| beta == 1.0 && c.shape.len() == 1);
        if !trans_a && alpha == 1.0 && plain_bias {
            return self.gemm_as_linear(here, trans_b);
        }
        // alpha * A' B' + beta * C, in ONNX's order of operations.
        let out = here.out.clone();
        let mut x = self.tensor_input(here, 0)?;
        if trans_a {
            let t = format!("{out}/a_t");
            self.emit(here, &t, Op::Transpose { perm: vec![1, 0] }, vec![x])?;
            x = t;
        }
        let mut w = self.tensor_input(here, 1)?;
        if trans_b {
            let t = format!("{out}/b_t");
            self.emit(here, &t, Op::Transpose { perm: vec![1, 0] }, vec![w])?;
            w = t;
        }
        let product = if c.is_none() && alpha == 1.0 {
            out.clone()
        } else {
            format!("{out}/matmul")
        };
        self.emit(here, &product, Op::MatMul, vec![x, w])?;
        let scaled = if alpha == 1.0 {
            product
        } else {
            let factor = self.scalar(&format!("{out}/alpha"), alpha);
            let name = if c.is_none() {
                out.clone()
            } else {
                format!("{out}/scaled")
            };
            self.emit(here, &name, Op::Mul, vec![product, factor])?;
            name
        };
        if c.is_none() {
            return Ok(());
        }
        let mut bias = self.tensor_input(here, 2)?;
        if beta != 1.0 {
            let factor = self.scalar(&format!("{out}/beta"), beta);
            let name = format!("{out}/bias");
            self.emit(here, &name, Op::Mul, vec![bias, factor])?;
            bias = name;
        }
        self.emit(here, &out, Op::Add, vec![scaled, bias])
    }

    /// `Gemm` as PyTorch's `nn.Linear` writes it (`transB = 1`, a 1-D bias),
    /// or a matrix product plus a broadcast bias.
    fn gemm_as_linear(&mut self, here: &Here, trans_b: bool) -> Result<(), OnnxError> {
        let x = self.tensor_input(here, 0)?;
        let w = self.tensor_input(here, 1)?;
        let bias = self.bias_input(here, 2)?;
        if trans_b {
            let mut inputs = vec![x, w];
            inputs.extend(bias);
            return self.emit(here, &here.out, Op::Linear, inputs);
        }
        match bias {
            None => self.emit(here, &here.out, Op::MatMul, vec![x, w]),
            Some(c) => {
                let mm = format!("{}/matmul", here.out);
                self.emit(here, &mm, Op::MatMul, vec![x, w])?;
                self.emit(here, &here.out, Op::Add, vec![mm, c])
            }
        }
    }

    /// A scalar constant of the graph, for a factor such as Gemm's `alpha`.
    fn scalar(&mut self, name: &str, value: f32) -> String {
        self.add_constant(name, Vec::new(), DType::F32, vec![value])
    }

    /// A bias input, or `None` when absent or a constant of zeros (the dynamo
    /// exporter spells `bias=False` as an expanded zero tensor).
    fn bias_input(&mut self, here: &Here, i: usize) -> Result<Option<String>, OnnxError> {
        match here.ins.get(i) {
            None | Some(None) => Ok(None),
            Some(Some(Val::Const(t, None))) if t.all_zero() => Ok(None),
            Some(Some(_)) => {
                let info = self.input_info(here, i)?;
                if info.shape.len() != 1 {
                    return Err(self.unsupported(
                        here,
                        format!("a bias of shape {:?} (only 1-D)", info.shape),
                    ));
                }
                self.tensor_input(here, i).map(Some)
            }
        }
    }

    /// The legacy exporter's constant folding renames the weights it rewrites
    /// (BatchNorm folded into Conv) to `onnx::Conv_N`; the dynamo optimizer's
    /// fused convolutions are named `node_Conv_N` instead of after the aten op.
    fn note_folded_weight(&mut self, here: &Here, i: usize) {
        if let Some(w) = here.proto.input.get(i)
            && w.starts_with("onnx::")
            && matches!(self.vals.get(w), Some(Val::Var(_)))
        {
            self.inference_signs.push(format!(
                "the weight of node `{}` ({}) is named `{w}`, not after a state_dict entry, so \
                 the exporter rewrote it (constant folding)",
                here.node, here.op
            ));
        } else if let Some(rest) = here.proto.name().strip_prefix("node_Conv_")
            && rest.chars().all(|c| c.is_ascii_digit())
        {
            self.inference_signs.push(format!(
                "node `{}` is a convolution the dynamo exporter's optimizer rewrote \
                 (optimize=True fuses BatchNorm into it)",
                here.node
            ));
        }
    }

    pub(super) fn conv(&mut self, here: &Here) -> Result<(), OnnxError> {
        self.note_folded_weight(here, 1);
        let w = self.input_info(here, 1)?;
        if w.shape.len() != 4 {
            return Err(self.unsupported(
                here,
                format!("weight {:?}: only 2-D convolutions (4-D weights)", w.shape),
            ));
        }
        if let Some(k) = here.attrs.ints("kernel_shape")
            && k.iter()
                .map(|&d| d as usize)
                .ne(w.shape[2..].iter().copied())
        {
            return Err(self.node_err(
                here,
                format!("kernel_shape {k:?} disagrees with weight {:?}", w.shape),
            ));
        }
        let (stride, padding, dilation) = self.window_attrs(here, [w.shape[2], w.shape[3]])?;
        let groups = here.attrs.int("group").unwrap_or(1);
        let groups =
            usize::try_from(groups).map_err(|_| self.node_err(here, format!("group {groups}")))?;
        let x = self.tensor_input(here, 0)?;
        let wn = self.tensor_input(here, 1)?;
        let mut inputs = vec![x, wn];
        inputs.extend(self.bias_input(here, 2)?);
        self.emit(
            here,
            &here.out,
            Op::Conv2d {
                stride,
                padding,
                dilation,
                groups,
            },
            inputs,
        )
    }

    /// `auto_pad = SAME_*`: the padding that keeps `ceil(size / stride)`
    /// outputs, where it splits evenly between the two sides (an odd total
    /// is asymmetric, which Rookery's windows are not).
    fn same_padding(
        &self,
        here: &Here,
        kernel: [usize; 2],
        stride: [usize; 2],
        dilation: [usize; 2],
    ) -> Result<[usize; 2], OnnxError> {
        let x = self.input_info(here, 0)?;
        if x.shape.len() != 4 {
            return Err(self.unsupported(here, format!("input {:?} (only 2-D windows)", x.shape)));
        }
        let mut padding = [0; 2];
        for i in 0..2 {
            let size = x.shape[2 + i];
            let out = size.div_ceil(stride[i].max(1));
            let span = dilation[i] * (kernel[i].max(1) - 1) + 1;
            let total = ((out.max(1) - 1) * stride[i] + span).saturating_sub(size);
            if total % 2 != 0 {
                return Err(self.unsupported(
                    here,
                    format!("auto_pad SAME with an odd total padding {total} (asymmetric)"),
                ));
            }
            padding[i] = total / 2;
        }
        Ok(padding)
    }

    /// Strides, symmetric pads and dilations of a 2-D window op.
    fn window_attrs(&self, here: &Here, kernel: [usize; 2]) -> Result<Window, OnnxError> {
        let auto_pad = here.attrs.string("auto_pad").unwrap_or_default();
        if !matches!(
            auto_pad.as_str(),
            "" | "NOTSET" | "VALID" | "SAME_UPPER" | "SAME_LOWER"
        ) {
            return Err(self.unsupported(here, format!("auto_pad = {auto_pad}")));
        }
        let pair = |name: &str, default: usize| -> Result<[usize; 2], OnnxError> {
            match here.attrs.ints(name) {
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
        let padding = match here.attrs.ints("pads") {
            _ if auto_pad == "VALID" => [0, 0],
            _ if auto_pad.starts_with("SAME") => {
                self.same_padding(here, kernel, stride, dilation)?
            }
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

    pub(super) fn pool(&mut self, here: &Here) -> Result<(), OnnxError> {
        let kernel = match here.attrs.ints("kernel_shape") {
            Some(k) if k.len() == 2 && k.iter().all(|&d| d > 0) => [k[0] as usize, k[1] as usize],
            k => {
                return Err(
                    self.unsupported(here, format!("kernel_shape {k:?} (only 2-D windows)"))
                );
            }
        };
        let (stride, padding, dilation) = self.window_attrs(here, kernel)?;
        // ONNX pooling strides default to 1 (PyTorch's to the kernel), but both
        // exporters always write them, so the ONNX default is right here.
        let ceil_mode = here.attrs.int("ceil_mode").unwrap_or(0) != 0;
        let op = if here.op == "MaxPool" {
            Op::MaxPool2d {
                kernel,
                stride,
                padding,
                dilation,
                ceil_mode,
            }
        } else {
            if dilation != [1, 1] {
                return Err(self.unsupported(
                    here,
                    format!("dilations {dilation:?} (PyTorch's average pooling has none)"),
                ));
            }
            Op::AvgPool2d {
                kernel,
                stride,
                padding,
                ceil_mode,
                count_include_pad: here.attrs.int("count_include_pad").unwrap_or(0) != 0,
            }
        };
        let x = self.input_info(here, 0)?;
        if let [n, c, h, w] = x.shape[..]
            && op.pool_geometry(n * c, h, w).is_none()
        {
            return Err(self.unsupported(
                here,
                format!(
                    "pads {padding:?} over half the window (kernel {kernel:?}, dilations \
                     {dilation:?}), or a window with no tap inside the input"
                ),
            ));
        }
        let x = self.tensor_input(here, 0)?;
        self.emit(here, &here.out, op, vec![x])
    }

    /// `ReduceMean` over the spatial axes is global average pooling (how the
    /// dynamo exporter writes `AdaptiveAvgPool2d(1)`); other reductions have no
    /// Rookery op.
    pub(super) fn reduce_mean(&mut self, here: &Here) -> Result<(), OnnxError> {
        let x = self.input_info(here, 0)?;
        let rank = x.shape.len();
        let axes = match self.known(here, 1) {
            Some(t) => t.as_i64(),
            None if here.present(1) => {
                return Err(self.dynamic(here, "the axes are computed at run time"));
            }
            None => here.attrs.ints("axes").unwrap_or_default(),
        };
        let mut norm = axes
            .iter()
            .map(|&a| norm_axis(a, rank))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.node_err(here, e))?;
        norm.sort_unstable();
        norm.dedup();
        let keepdims = here.attrs.int("keepdims").unwrap_or(1) != 0;
        if norm.is_empty() {
            if here.attrs.int("noop_with_empty_axes").unwrap_or(0) != 0 {
                let xin = self.tensor_input(here, 0)?;
                return self.emit(here, &here.out, Op::Identity, vec![xin]);
            }
            norm = (0..rank).collect();
        }
        if rank < 3 || norm != (2..rank).collect::<Vec<_>>() {
            let source = self.tensor_input(here, 0)?;
            let out = here.out.clone();
            return self.mean_by_pooling(here, source, &x.shape, &norm, keepdims, &out);
        }
        let xin = self.tensor_input(here, 0)?;
        if keepdims {
            return self.emit(here, &here.out, Op::GlobalAveragePool, vec![xin]);
        }
        let pooled = format!("{}/pool", here.out);
        self.emit(here, &pooled, Op::GlobalAveragePool, vec![xin])?;
        let shape = keep_batch(
            vec![x.shape[0] as i64, x.shape[1] as i64],
            &x.shape,
            self.batch,
            self.exported_batch,
        );
        self.emit(here, &here.out, Op::Reshape { shape }, vec![pooled])
    }

    /// A mean over any axes, as global average pooling: the kept axes
    /// first, the reduced ones last (a `Transpose` where they are not
    /// already), shaped `[N, kept, reduced, 1]`, pooled, and shaped back.
    fn mean_by_pooling(
        &mut self,
        here: &Here,
        mut source: String,
        shape: &[usize],
        reduced: &[usize],
        keepdims: bool,
        out: &str,
    ) -> Result<(), OnnxError> {
        let kept: Vec<usize> = (0..shape.len()).filter(|a| !reduced.contains(a)).collect();
        let perm: Vec<usize> = kept.iter().chain(reduced).copied().collect();
        if perm.iter().enumerate().any(|(i, &p)| i != p) {
            let t = format!("{out}/moved");
            self.emit(here, &t, Op::Transpose { perm }, vec![source])?;
            source = t;
        }
        let count = |axes: &[usize]| axes.iter().map(|&a| shape[a]).product::<usize>();
        // The batch stays the leading dimension where it is kept.
        let lead = match kept.first() {
            Some(0) => shape[0],
            _ => 1,
        };
        let grid = vec![
            lead as i64,
            (count(&kept) / lead.max(1)) as i64,
            count(reduced) as i64,
            1,
        ];
        let grid = match kept.first() {
            Some(0) => keep_batch(grid, shape, self.batch, self.exported_batch),
            _ => grid,
        };
        let flat = format!("{out}/grid");
        self.emit(here, &flat, Op::Reshape { shape: grid }, vec![source])?;
        let pooled = format!("{out}/pool");
        self.emit(here, &pooled, Op::GlobalAveragePool, vec![flat])?;
        let target: Vec<i64> = (0..shape.len())
            .filter_map(|a| match reduced.contains(&a) {
                true if keepdims => Some(1),
                true => None,
                false => Some(shape[a] as i64),
            })
            .collect();
        let target = match target.first() {
            Some(_) if kept.first() == Some(&0) => {
                keep_batch(target, shape, self.batch, self.exported_batch)
            }
            _ => target,
        };
        self.emit(here, out, Op::Reshape { shape: target }, vec![pooled])
    }

    /// `LayerNormalization`'s `Mean` and `InvStdDev` outputs, where a graph
    /// names them: the mean over the normalised axes, and `1 / sqrt(var +
    /// epsilon)`, in f32 as `stash_type = 1` asks (Rookery's LayerNorm
    /// keeps its own statistics, so these are computed beside it).
    pub(super) fn layer_norm_stats(
        &mut self,
        here: &Here,
        x: &str,
        axis: i64,
        eps: f32,
    ) -> Result<(), OnnxError> {
        let named = |i: usize| here.proto.output.get(i).filter(|n| !n.is_empty()).cloned();
        let (mean_out, inv_out) = (named(1), named(2));
        if mean_out.is_none() && inv_out.is_none() {
            return Ok(());
        }
        if here.attrs.int("stash_type").unwrap_or(1) != 1 {
            return Err(self.unsupported(here, "stash_type other than 1 (float32 statistics)"));
        }
        let shape = self.input_info(here, 0)?.shape;
        let a = norm_axis(axis, shape.len()).map_err(|e| self.node_err(here, e))?;
        let reduced: Vec<usize> = (a..shape.len()).collect();
        let out = here.out.clone();
        let mean = mean_out.unwrap_or_else(|| format!("{out}/mean"));
        self.mean_by_pooling(here, x.to_string(), &shape, &reduced, true, &mean)?;
        let Some(inv) = inv_out else {
            return Ok(());
        };
        let centered = format!("{out}/centered");
        self.emit(here, &centered, Op::Sub, vec![x.to_string(), mean])?;
        let squared = format!("{out}/squared");
        self.emit(here, &squared, Op::Mul, vec![centered.clone(), centered])?;
        let variance = format!("{out}/variance");
        self.mean_by_pooling(here, squared, &shape, &reduced, true, &variance)?;
        let epsilon = self.scalar(&format!("{out}/epsilon"), eps);
        let shifted = format!("{out}/shifted");
        self.emit(here, &shifted, Op::Add, vec![variance, epsilon])?;
        let deviation = format!("{out}/deviation");
        self.emit(here, &deviation, Op::Sqrt, vec![shifted])?;
        self.emit(here, &inv, Op::Reciprocal, vec![deviation])
    }

    pub(super) fn batch_norm(&mut self, here: &Here) -> Result<(), OnnxError> {
        let eps = here.attrs.float("epsilon").unwrap_or(1e-5);
        // ONNX keeps `momentum` of the running statistic, PyTorch of the new
        // batch statistic; ONNX stores it in f32, so round away the f32 noise
        // (0.9f32 -> 0.100000024) to get PyTorch's value back.
        let onnx_momentum = f64::from(here.attrs.float("momentum").unwrap_or(0.9));
        let momentum = (((1.0 - onnx_momentum) * 1e6).round() / 1e6) as f32;
        // The legacy exporter writes training_mode=1; the dynamo exporter writes
        // none, but names training-mode nodes after aten's functional batch norm.
        let training = here.attrs.int("training_mode").unwrap_or(0) != 0
            || here.proto.name().contains("legit_functional");
        if training && self.run_once && here.attrs.int("training_mode").unwrap_or(0) != 0 {
            return Err(self.unsupported(
                here,
                "training_mode = 1 in a forward-only run (batch statistics and updated \
                 running statistics are training's)",
            ));
        }
        if !training {
            self.inference_signs.push(format!(
                "BatchNormalization node `{}` is in inference mode",
                here.node
            ));
        }
        let mut inputs = Vec::with_capacity(6);
        for i in 0..5 {
            if i >= 3
                && let Some(Some(Val::Var(idx))) = here.ins.get(i)
                && self.inits[*idx].kind.is_none()
            {
                self.inits[*idx].kind = Some(ParamKind::Buffer);
            }
            inputs.push(self.tensor_input(here, i)?);
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
        self.emit(here, &here.out, Op::BatchNorm { eps, momentum }, inputs)
    }

    pub(super) fn dropout(&mut self, here: &Here) -> Result<(), OnnxError> {
        // Opset 12 moved ratio from an attribute to an input and added training_mode,
        // which defaults to false (inference: Dropout does nothing).
        let (p, training) = if self.opset >= 12 {
            let p = match self.known(here, 1) {
                Some(t) if t.len() == 1 => t.as_f64()[0] as f32,
                None if !here.present(1) => 0.5,
                _ => return Err(self.node_err(here, "the ratio must be a constant scalar")),
            };
            // A missing training_mode is no sign of an inference export: the
            // dynamo exporter spells scaled_dot_product_attention's dropout
            // (nn.MultiheadAttention's) `Dropout(x, p)` in training exports too.
            let training = match self.known(here, 2) {
                Some(t) if t.len() == 1 => t.as_i64()[0] != 0,
                None if !here.present(2) => true,
                _ => return Err(self.node_err(here, "training_mode must be a constant scalar")),
            };
            (p, training)
        } else {
            (
                here.attrs.float("ratio").unwrap_or(0.5),
                here.attrs.int("is_test").unwrap_or(0) == 0,
            )
        };
        if !training {
            self.inference_signs
                .push(format!("Dropout node `{}` is in inference mode", here.node));
        }
        let x = self.tensor_input(here, 0)?;
        self.emit(here, &here.out, Op::Dropout { p }, vec![x])
    }
}
