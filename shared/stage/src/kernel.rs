//! One kernel invocation as data ([`Kernel`]), with its two lowerings: the
//! generated WGSL a GPU runs ([`Kernel::spec`]) and the CPU reference a
//! machine without a GPU runs ([`Kernel::cpu`]). Both see the same buffers in
//! the same binding order, so the executor never knows which device it has.
//!
//! The few kernels the executor needs for its own bookkeeping (copy, add into,
//! fill) are generated here with the kernel crate's 1-D helper.

use rookery_kernels::KernelSpec;
use rookery_kernels::OptimizerConfig;
use rookery_kernels::conv::Conv2d;
use rookery_kernels::dropout::DropoutMask;
use rookery_kernels::elementwise::{BinaryOp, Broadcast, Operand, Unary};
use rookery_kernels::gemm::{Linear, MatMul, sum_to_shape};
use rookery_kernels::int8::{Int8Block, from_words, to_words};
use rookery_kernels::norm::{BatchNorm, LayerNorm};
use rookery_kernels::pool::{GlobalAvgPool, Pool2d};
use rookery_kernels::reduce::Softmax;
use rookery_kernels::shape::{Concat, Gather, Transpose};
use rookery_kernels::spec::{Binding, DEFAULT_WORKGROUP, f32_lit, numel, one_d};
use rookery_kernels::winograd::{Step, Winograd};

/// A kernel with every shape fixed. Binding orders are those of the kernel
/// crate's generators, documented there.
#[derive(Debug, Clone, PartialEq)]
pub enum Kernel {
    /// `x`, `y`.
    Unary { op: Unary, len: usize },
    /// `x`, `dy`, `dx`.
    UnaryBackward { op: Unary, len: usize },
    /// `a`, `b`, `y`.
    Binary { op: BinaryOp, shapes: Broadcast },
    /// `a`, `b`, `dy`, `d` (shaped like the operand).
    BinaryBackward {
        op: BinaryOp,
        shapes: Broadcast,
        wrt: Operand,
    },
    /// `x`, `w`, `bias`?, `y`.
    Linear(Linear),
    /// `dy`, `w`, `dx`.
    LinearBackwardX(Linear),
    /// `dy`, `x`, `dw`.
    LinearBackwardW(Linear),
    /// `dy`, `d`: sums `from` down to `to`, which broadcasts to it.
    SumToShape { from: Vec<usize>, to: Vec<usize> },
    /// `a`, `b`, `c`.
    MatMul(MatMul),
    /// `dc`, `b`, `da` (unreduced over broadcast batch dimensions).
    MatMulBackwardA(MatMul),
    /// `a`, `dc`, `db` (unreduced).
    MatMulBackwardB(MatMul),
    /// `x`, `y`: `y = x`.
    Copy { len: usize },
    /// `x`, `y`: `y += x`.
    AddInto { len: usize },
    /// `x`, `y`: `y = x + (x - y)`, the weights `x` one more update like
    /// the last one (`y` held the weights before it) further on: the
    /// `async` schedule's weight prediction. Exact IEEE f32 arithmetic, so
    /// every device and libtorch give the same bits.
    Extrapolate { len: usize },
    /// `y`: every element set to `value`.
    Fill { len: usize, value: f32 },
    /// `x`, `w`, `b`, `y`, `mean`, `rstd`.
    LayerNorm(LayerNorm),
    /// `x`, `w`, `mean`, `rstd`, `dy`, `dx`.
    LayerNormBackwardX(LayerNorm),
    /// `x`, `mean`, `rstd`, `dy`, `dw`, `db`.
    LayerNormBackwardParams(LayerNorm),
    /// `x`, `y`.
    Softmax(Softmax),
    /// `y`, `dy`, `dx`.
    SoftmaxBackward(Softmax),
    /// `x`, `y`.
    Transpose(Transpose),
    /// `x`, `y`: input `part` into its slice of `y`.
    Concat { concat: Concat, part: usize },
    /// `dy`, `dx`: input `part`'s slice of `dy`.
    ConcatBackward { concat: Concat, part: usize },
    /// `x`, `weight`, `bias`?, `y`.
    Conv2d(Conv2d),
    /// `dy`, `weight`, `dx`.
    Conv2dBackwardInput(Conv2d),
    /// `dy`, `x`, `dweight`.
    Conv2dBackwardWeight(Conv2d),
    /// `dy`, `x`, `dweight_parts` (`[parts, ..weight]`, partial sums that
    /// add up to the weight gradient).
    Conv2dBackwardWeightParts { conv: Conv2d, parts: u32 },
    /// One kernel of a Winograd convolution product, bindings as `step`
    /// says.
    Winograd { w: Winograd, step: Step },
    /// `x`, `y`, `argmax` (u32).
    MaxPool(Pool2d),
    /// `argmax`, `dy`, `dx`.
    MaxPoolBackward(Pool2d),
    /// `x`, `y`.
    AvgPool(Pool2d),
    /// `dy`, `dx`.
    AvgPoolBackward(Pool2d),
    /// `x`, `y`.
    GlobalAvgPool(GlobalAvgPool),
    /// `dy`, `dx`.
    GlobalAvgPoolBackward(GlobalAvgPool),
    /// `x`, `w`, `b`, `running_mean`, `running_var`, `y`, `save_mean`,
    /// `save_rstd`: batch statistics, running ones updated in place.
    BatchNormTrain(BatchNorm),
    /// `x`, `w`, `b`, `running_mean`, `running_var`, `y`.
    BatchNormEval(BatchNorm),
    /// `x`, `w`, `save_mean`, `save_rstd`, `dy`, `dx`, `dw`, `db`.
    BatchNormBackward(BatchNorm),
    /// `args` (u32 key and first index), `x`, `y`, `noise`.
    Dropout(DropoutMask),
    /// `data`, `indices` (i32), `y`.
    Gather(Gather),
    /// `indices`, `dy`, `ddata`.
    GatherBackward(Gather),
    /// `x` (f32), `packed` (the wire's int8 payload as `u32` words).
    Quantize(Int8Block),
    /// `packed`, `y` (f32).
    Dequantize(Int8Block),
    /// `u` (the uniform of `step`), `param`, `grad`, then the optimizer's
    /// state buffers. `step` is 1 for a parameter's first update.
    OptimizerStep {
        optimizer: OptimizerConfig,
        len: usize,
        step: u64,
    },
}

impl Kernel {
    /// The generated WGSL.
    pub fn spec(&self) -> KernelSpec {
        match self {
            Kernel::Unary { op, len } => op.forward(*len),
            Kernel::UnaryBackward { op, len } => op.backward(*len),
            Kernel::Binary { op, shapes } => op.forward(shapes),
            Kernel::BinaryBackward { op, shapes, wrt } => op.backward(shapes, *wrt),
            Kernel::Linear(l) => l.forward(),
            Kernel::LinearBackwardX(l) => l.backward_x(),
            Kernel::LinearBackwardW(l) => l.backward_w(),
            Kernel::SumToShape { from, to } => sum_to_shape(from, to),
            Kernel::MatMul(m) => m.forward(),
            Kernel::MatMulBackwardA(m) => m.backward_a(),
            Kernel::MatMulBackwardB(m) => m.backward_b(),
            Kernel::Copy { len } => one_d(
                "copy",
                &[
                    ("x", Binding::Read, "f32"),
                    ("y", Binding::ReadWrite, "f32"),
                ],
                "",
                *len,
                DEFAULT_WORKGROUP,
                "    y[i] = x[i];",
            ),
            Kernel::AddInto { len } => one_d(
                "add_into",
                &[
                    ("x", Binding::Read, "f32"),
                    ("y", Binding::ReadWrite, "f32"),
                ],
                "",
                *len,
                DEFAULT_WORKGROUP,
                "    y[i] = y[i] + x[i];",
            ),
            Kernel::Extrapolate { len } => one_d(
                "extrapolate",
                &[
                    ("x", Binding::Read, "f32"),
                    ("y", Binding::ReadWrite, "f32"),
                ],
                "",
                *len,
                DEFAULT_WORKGROUP,
                "    y[i] = x[i] + (x[i] - y[i]);",
            ),
            Kernel::Fill { len, value } => one_d(
                "fill",
                &[("y", Binding::ReadWrite, "f32")],
                "",
                *len,
                DEFAULT_WORKGROUP,
                &format!("    y[i] = {};", f32_lit(*value)),
            ),
            Kernel::OptimizerStep { optimizer, len, .. } => optimizer.step(*len),
            Kernel::LayerNorm(n) => n.forward(),
            Kernel::LayerNormBackwardX(n) => n.backward_x(),
            Kernel::LayerNormBackwardParams(n) => n.backward_params(),
            Kernel::Softmax(s) => s.forward(),
            Kernel::SoftmaxBackward(s) => s.backward(),
            Kernel::Transpose(t) => t.forward(),
            Kernel::Concat { concat, part } => concat.forward(*part),
            Kernel::ConcatBackward { concat, part } => concat.backward(*part),
            Kernel::Conv2d(c) => c.forward(),
            Kernel::Conv2dBackwardInput(c) => c.backward_input(),
            Kernel::Conv2dBackwardWeight(c) => c.backward_weight(),
            Kernel::Conv2dBackwardWeightParts { conv, parts } => conv.backward_weight_parts(*parts),
            Kernel::Winograd { w, step } => w.spec(*step),
            Kernel::MaxPool(p) => p.max_forward(),
            Kernel::MaxPoolBackward(p) => p.max_backward(),
            Kernel::AvgPool(p) => p.avg_forward(),
            Kernel::AvgPoolBackward(p) => p.avg_backward(),
            Kernel::GlobalAvgPool(g) => g.forward(),
            Kernel::GlobalAvgPoolBackward(g) => g.backward(),
            Kernel::BatchNormTrain(b) => b.forward_train(),
            Kernel::BatchNormEval(b) => b.forward_eval(),
            Kernel::BatchNormBackward(b) => b.backward_train(),
            Kernel::Dropout(d) => d.forward(),
            Kernel::Gather(g) => g.forward(),
            Kernel::GatherBackward(g) => g.backward(),
            Kernel::Quantize(q) => q.quantize(),
            Kernel::Dequantize(q) => q.dequantize(),
        }
    }

    /// Runs the CPU reference on `buffers` (32-bit words, in binding order),
    /// writing the kernel's outputs in place.
    pub fn cpu(&self, buffers: &mut [Vec<u32>]) {
        let f = |b: &[u32]| -> Vec<f32> { b.iter().map(|&w| f32::from_bits(w)).collect() };
        let store = |b: &mut Vec<u32>, v: &[f32]| {
            for (w, x) in b.iter_mut().zip(v) {
                *w = x.to_bits();
            }
        };
        let zeros = |n: usize| vec![0.0f32; n];
        match self {
            Kernel::Unary { op, .. } => {
                let y = op.reference(&f(&buffers[0]));
                store(&mut buffers[1], &y);
            }
            Kernel::UnaryBackward { op, .. } => {
                let dx = op.reference_backward(&f(&buffers[0]), &f(&buffers[1]));
                store(&mut buffers[2], &dx);
            }
            Kernel::Binary { op, shapes } => {
                let y = op.reference(shapes, &f(&buffers[0]), &f(&buffers[1]));
                store(&mut buffers[2], &y);
            }
            Kernel::BinaryBackward { op, shapes, wrt } => {
                let d = op.reference_backward(
                    shapes,
                    &f(&buffers[0]),
                    &f(&buffers[1]),
                    &f(&buffers[2]),
                    *wrt,
                );
                store(&mut buffers[3], &d);
            }
            Kernel::Linear(l) => {
                let bias = l.bias.then(|| f(&buffers[2]));
                let (y, ..) = l.reference(
                    &f(&buffers[0]),
                    &f(&buffers[1]),
                    bias.as_deref(),
                    &zeros(l.rows * l.outputs),
                );
                let out = if l.bias { 3 } else { 2 };
                store(&mut buffers[out], &y);
            }
            Kernel::LinearBackwardX(l) => {
                let (_, dx, ..) = l.reference(
                    &zeros(l.rows * l.inputs),
                    &f(&buffers[1]),
                    None,
                    &f(&buffers[0]),
                );
                store(&mut buffers[2], &dx);
            }
            Kernel::LinearBackwardW(l) => {
                let (_, _, dw, _) = l.reference(
                    &f(&buffers[1]),
                    &zeros(l.outputs * l.inputs),
                    None,
                    &f(&buffers[0]),
                );
                store(&mut buffers[2], &dw);
            }
            Kernel::SumToShape { from, to } => {
                let shapes = Broadcast {
                    a: to.clone(),
                    b: from.clone(),
                    out: from.clone(),
                };
                let d = BinaryOp::Add.reference_backward(
                    &shapes,
                    &zeros(numel(to)),
                    &zeros(numel(from)),
                    &f(&buffers[0]),
                    Operand::A,
                );
                store(&mut buffers[1], &d);
            }
            Kernel::MatMul(m) => {
                let c_len = numel(&m.out_shape());
                let (c, ..) = m.reference(&f(&buffers[0]), &f(&buffers[1]), &zeros(c_len));
                store(&mut buffers[2], &c);
            }
            // The references reduce over broadcast batch dimensions; the GPU
            // kernels leave that to a separate sum. Widening the other
            // operand to the output's batch makes the reference's gradient
            // the unreduced one.
            Kernel::MatMulBackwardA(m) => {
                let wide = widened(m, &m.a);
                let (_, da, _) =
                    wide.reference(&zeros(numel(&wide.a)), &f(&buffers[1]), &f(&buffers[0]));
                store(&mut buffers[2], &da);
            }
            Kernel::MatMulBackwardB(m) => {
                let wide = widened(m, &m.b);
                let (_, _, db) =
                    wide.reference(&f(&buffers[0]), &zeros(numel(&wide.b)), &f(&buffers[1]));
                store(&mut buffers[2], &db);
            }
            Kernel::Copy { len } => {
                let x = buffers[0][..*len].to_vec();
                buffers[1][..*len].copy_from_slice(&x);
            }
            Kernel::Extrapolate { len } => {
                let x = f(&buffers[0][..*len]);
                let mut y = f(&buffers[1][..*len]);
                for (y, x) in y.iter_mut().zip(&x) {
                    *y = extrapolate(*x, *y);
                }
                store(&mut buffers[1], &y);
            }
            Kernel::AddInto { len } => {
                let x = f(&buffers[0][..*len]);
                let mut y = f(&buffers[1][..*len]);
                for (y, x) in y.iter_mut().zip(&x) {
                    *y += x;
                }
                store(&mut buffers[1], &y);
            }
            Kernel::Fill { len, value } => {
                buffers[0][..*len].fill(value.to_bits());
            }
            Kernel::OptimizerStep {
                optimizer,
                len,
                step,
            } => {
                let mut param = f(&buffers[1][..*len]);
                let grad = f(&buffers[2][..*len]);
                let mut state: Vec<Vec<f32>> = buffers[3..].iter().map(|b| f(&b[..*len])).collect();
                optimizer.reference_step(*step, &mut param, &grad, &mut state);
                store(&mut buffers[1], &param);
                for (b, s) in buffers[3..].iter_mut().zip(&state) {
                    store(b, s);
                }
            }
            Kernel::LayerNorm(n) => {
                let x = f(&buffers[0]);
                let (y, ..) = n.reference(&x, &f(&buffers[1]), &f(&buffers[2]), &zeros(x.len()));
                let (mean, rstd) = row_stats(&x, n.cols, n.eps);
                store(&mut buffers[3], &y);
                store(&mut buffers[4], &mean);
                store(&mut buffers[5], &rstd);
            }
            // The references recompute the statistics from `x` rather than
            // reading the saved ones.
            Kernel::LayerNormBackwardX(n) => {
                let (_, dx, ..) = n.reference(
                    &f(&buffers[0]),
                    &f(&buffers[1]),
                    &zeros(n.cols),
                    &f(&buffers[4]),
                );
                store(&mut buffers[5], &dx);
            }
            Kernel::LayerNormBackwardParams(n) => {
                let (_, _, dw, db) = n.reference(
                    &f(&buffers[0]),
                    &vec![1.0; n.cols],
                    &zeros(n.cols),
                    &f(&buffers[3]),
                );
                store(&mut buffers[4], &dw);
                store(&mut buffers[5], &db);
            }
            Kernel::Softmax(s) => {
                let x = f(&buffers[0]);
                let (y, _) = s.reference(&x, &zeros(x.len()));
                store(&mut buffers[1], &y);
            }
            Kernel::SoftmaxBackward(s) => {
                let dx = softmax_backward(s, &f(&buffers[0]), &f(&buffers[1]));
                store(&mut buffers[2], &dx);
            }
            Kernel::Transpose(t) => {
                let y = t.reference(&f(&buffers[0]));
                store(&mut buffers[1], &y);
            }
            Kernel::Concat { concat, part } => {
                let (range, stride, offset) = concat_slice(concat, *part);
                let x = buffers[0][..concat.outer * range].to_vec();
                for o in 0..concat.outer {
                    let at = o * stride + offset;
                    buffers[1][at..at + range].copy_from_slice(&x[o * range..(o + 1) * range]);
                }
            }
            Kernel::ConcatBackward { concat, part } => {
                let (range, stride, offset) = concat_slice(concat, *part);
                let dy = buffers[0].clone();
                for o in 0..concat.outer {
                    let at = o * stride + offset;
                    buffers[1][o * range..(o + 1) * range].copy_from_slice(&dy[at..at + range]);
                }
            }
            Kernel::Conv2d(c) => {
                let bias = c.bias.then(|| f(&buffers[2]));
                let (y, ..) = c.reference(
                    &f(&buffers[0]),
                    &f(&buffers[1]),
                    bias.as_deref(),
                    &zeros(c.out_len()),
                );
                let out = if c.bias { 3 } else { 2 };
                store(&mut buffers[out], &y);
            }
            Kernel::Conv2dBackwardInput(c) => {
                let (_, dx, ..) = c.reference(
                    &zeros(c.n * c.c * c.h * c.w),
                    &f(&buffers[1]),
                    None,
                    &f(&buffers[0]),
                );
                store(&mut buffers[2], &dx);
            }
            Kernel::Conv2dBackwardWeight(c) | Kernel::Conv2dBackwardWeightParts { conv: c, .. } => {
                let (_, _, dw, _) = c.reference(
                    &f(&buffers[1]),
                    &zeros(c.weight_len()),
                    None,
                    &f(&buffers[0]),
                );
                // In parts, the whole sum is the first part and the others
                // are zero: they still add up to the gradient.
                buffers[2].fill(0);
                store(&mut buffers[2], &dw);
            }
            Kernel::Winograd { w, step } => winograd_cpu(w, *step, buffers),
            Kernel::MaxPool(p) => {
                let (y, argmax, _) = p.max_reference(&f(&buffers[0]), &zeros(p.out_len()));
                store(&mut buffers[1], &y);
                buffers[2][..argmax.len()].copy_from_slice(&argmax);
            }
            Kernel::MaxPoolBackward(p) => {
                let dx = max_pool_backward(p, &buffers[0], &f(&buffers[1]));
                store(&mut buffers[2], &dx);
            }
            Kernel::AvgPool(p) => {
                let x = f(&buffers[0]);
                let (y, _) = p.avg_reference(&x, &zeros(p.out_len()));
                store(&mut buffers[1], &y);
            }
            Kernel::AvgPoolBackward(p) => {
                let (_, dx) = p.avg_reference(&zeros(p.planes * p.h * p.w), &f(&buffers[0]));
                store(&mut buffers[1], &dx);
            }
            Kernel::GlobalAvgPool(g) => {
                let (y, _) = g.reference(&f(&buffers[0]), &zeros(g.planes));
                store(&mut buffers[1], &y);
            }
            Kernel::GlobalAvgPoolBackward(g) => {
                let (_, dx) = g.reference(&zeros(g.planes * g.spatial), &f(&buffers[0]));
                store(&mut buffers[1], &dx);
            }
            Kernel::BatchNormTrain(b) => {
                let x = f(&buffers[0]);
                let (rm, rv) = (f(&buffers[3]), f(&buffers[4]));
                let (y, rm, rv, ..) = b.reference_train(
                    &x,
                    &f(&buffers[1]),
                    &f(&buffers[2]),
                    (&rm, &rv),
                    &zeros(x.len()),
                );
                let (mean, rstd) = channel_stats(b, &x);
                store(&mut buffers[3], &rm);
                store(&mut buffers[4], &rv);
                store(&mut buffers[5], &y);
                store(&mut buffers[6], &mean);
                store(&mut buffers[7], &rstd);
            }
            Kernel::BatchNormEval(b) => {
                let (rm, rv) = (f(&buffers[3]), f(&buffers[4]));
                let y = b.reference_eval(
                    &f(&buffers[0]),
                    &f(&buffers[1]),
                    &f(&buffers[2]),
                    (&rm, &rv),
                );
                store(&mut buffers[5], &y);
            }
            // Recomputes the batch statistics from `x`, as the reference does.
            Kernel::BatchNormBackward(b) => {
                let ch = zeros(b.channels);
                let (.., dx, dw, db) = b.reference_train(
                    &f(&buffers[0]),
                    &f(&buffers[1]),
                    &ch,
                    (&ch, &ch),
                    &f(&buffers[4]),
                );
                store(&mut buffers[5], &dx);
                store(&mut buffers[6], &dw);
                store(&mut buffers[7], &db);
            }
            Kernel::Dropout(d) => {
                let args = [buffers[0][0], buffers[0][1], buffers[0][2], buffers[0][3]];
                let (y, noise) = d.reference(args, &f(&buffers[1]));
                store(&mut buffers[2], &y);
                store(&mut buffers[3], &noise);
            }
            Kernel::Gather(g) => {
                let indices = ints(&buffers[1][..g.count]);
                let (y, _) = g.reference(
                    &f(&buffers[0]),
                    &indices,
                    &zeros(g.outer * g.count * g.inner),
                );
                store(&mut buffers[2], &y);
            }
            Kernel::GatherBackward(g) => {
                let indices = ints(&buffers[0][..g.count]);
                let (_, dd) = g.reference(
                    &zeros(g.outer * g.axis * g.inner),
                    &indices,
                    &f(&buffers[1]),
                );
                store(&mut buffers[2], &dd);
            }
            Kernel::Quantize(q) => {
                let payload = q.quantize_reference(&f(&buffers[0][..q.len]));
                let words = to_words(&payload);
                buffers[1][..words.len()].copy_from_slice(&words);
            }
            Kernel::Dequantize(q) => {
                let payload = from_words(&buffers[0], q.payload_bytes());
                store(&mut buffers[1], &q.dequantize_reference(&payload));
            }
        }
    }
}

/// i32 words as the kernels bind indices.
/// The `async` schedule's predicted weight from `latest` and the value
/// `before` the update that made it ([`Kernel::Extrapolate`]'s arithmetic).
pub fn extrapolate(latest: f32, before: f32) -> f32 {
    latest + (latest - before)
}

fn ints(words: &[u32]) -> Vec<i32> {
    words.iter().map(|&w| w as i32).collect()
}

/// Per-channel batch mean and `1 / sqrt(var + eps)` (biased variance), as
/// the BatchNorm training forward saves them.
fn channel_stats(b: &BatchNorm, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (ch, sp) = (b.channels, b.spatial);
    let m = (b.n * sp) as f64;
    (0..ch)
        .map(|c| {
            let vals: Vec<f64> = (0..b.n * sp)
                .map(|j| f64::from(x[(j / sp) * ch * sp + c * sp + j % sp]))
                .collect();
            let mu = vals.iter().sum::<f64>() / m;
            let var = vals.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / m;
            (mu as f32, (1.0 / (var + f64::from(b.eps)).sqrt()) as f32)
        })
        .unzip()
}

/// `m` with `operand` (its `a` or `b`) given the output's batch dimensions.
fn widened(m: &MatMul, operand: &[usize]) -> MatMul {
    let mut full = m.out_shape();
    let r = full.len();
    full[r - 2] = operand[operand.len() - 2];
    full[r - 1] = operand[operand.len() - 1];
    let (a, b) = if std::ptr::eq(operand, m.a.as_slice()) {
        (full, m.b.clone())
    } else {
        (m.a.clone(), full)
    };
    MatMul {
        a,
        b,
        tiling: m.tiling,
        precision: m.precision,
    }
}

/// Per-row mean and `1 / sqrt(var + eps)` of rows of `cols`, as the
/// LayerNorm forward saves them.
fn row_stats(x: &[f32], cols: usize, eps: f32) -> (Vec<f32>, Vec<f32>) {
    x.chunks(cols.max(1))
        .map(|row| {
            let n = row.len() as f64;
            let mu = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
            let var = row
                .iter()
                .map(|&v| (f64::from(v) - mu).powi(2))
                .sum::<f64>()
                / n;
            (mu as f32, (1.0 / (var + f64::from(eps)).sqrt()) as f32)
        })
        .unzip()
}

/// Softmax's backward from its output, in f64 (the kernel crate's reference
/// starts from the input, which the kernel does not bind): `dx = y (dy -
/// sum(dy y))`, or for log-softmax `dx = dy - exp(y) sum(dy)`.
fn softmax_backward(s: &Softmax, y: &[f32], dy: &[f32]) -> Vec<f32> {
    let (a, inner) = (s.axis, s.inner);
    let mut dx = vec![0.0f32; y.len()];
    for row in 0..s.outer * inner {
        let base = (row / inner) * a * inner + row % inner;
        let idx = |c: usize| base + c * inner;
        let (yv, g): (Vec<f64>, Vec<f64>) = (0..a)
            .map(|c| (f64::from(y[idx(c)]), f64::from(dy[idx(c)])))
            .unzip();
        if s.log {
            let sum: f64 = g.iter().sum();
            for c in 0..a {
                dx[idx(c)] = (g[c] - yv[c].exp() * sum) as f32;
            }
        } else {
            let dot: f64 = yv.iter().zip(&g).map(|(y, g)| y * g).sum();
            for c in 0..a {
                dx[idx(c)] = (yv[c] * (g[c] - dot)) as f32;
            }
        }
    }
    dx
}

/// Input `part` of `concat` as `(elements per outer index, output elements
/// per outer index, offset of the part within those)`.
fn concat_slice(concat: &Concat, part: usize) -> (usize, usize, usize) {
    let total: usize = concat.sizes.iter().sum();
    let offset: usize = concat.sizes[..part].iter().sum();
    (
        concat.sizes[part] * concat.inner,
        total * concat.inner,
        offset * concat.inner,
    )
}

/// Max pooling's backward from the saved argmax (index within the plane):
/// each output's gradient goes to the element that won its window.
fn max_pool_backward(p: &Pool2d, argmax: &[u32], dy: &[f32]) -> Vec<f32> {
    let plane_in = p.h * p.w;
    let (oh, ow) = p.out_hw();
    let plane_out = oh * ow;
    let mut dx = vec![0.0f64; p.planes * plane_in];
    for (oi, &g) in dy.iter().enumerate().take(p.planes * plane_out) {
        let plane = oi / plane_out;
        dx[plane * plane_in + argmax[oi] as usize] += f64::from(g);
    }
    dx.into_iter().map(|v| v as f32).collect()
}

/// A Winograd step on the CPU: in f64 from the f32 buffers, rounded once
/// when stored.
fn winograd_cpu(w: &Winograd, step: Step, buffers: &mut [Vec<u32>]) {
    let wide =
        |b: &[u32]| -> Vec<f64> { b.iter().map(|&x| f64::from(f32::from_bits(x))).collect() };
    let narrow = |b: &[u32]| -> Vec<f32> { b.iter().map(|&x| f32::from_bits(x)).collect() };
    let store_f32 = |b: &mut Vec<u32>, v: &[f32]| {
        for (word, x) in b.iter_mut().zip(v) {
            *word = x.to_bits();
        }
    };
    let store = |b: &mut Vec<u32>, v: &[f64]| {
        store_f32(b, &v.iter().map(|&x| x as f32).collect::<Vec<_>>());
    };
    match step {
        Step::Weight => {
            let u = w.weight_values(&narrow(&buffers[0]), false);
            store(&mut buffers[1], &u);
        }
        Step::Input(chunk) => {
            let v = w.input_values(chunk, &narrow(&buffers[0]), false);
            store(&mut buffers[1], &v);
        }
        Step::Gemm(chunk) => {
            let m = w.products(chunk, &wide(&buffers[0]), &wide(&buffers[1]));
            store(&mut buffers[2], &m);
        }
        Step::Output(chunk) => {
            let out = buffers.len() - 1;
            let mut y = wide(&buffers[out]);
            w.output_values(chunk, &wide(&buffers[0]), false, &mut y);
            let mut y: Vec<f32> = y.into_iter().map(|v| v as f32).collect();
            if w.bias {
                let bias = narrow(&buffers[1]);
                let plane = w.oh * w.ow;
                let (from, to) = (
                    chunk.start * w.cout * plane,
                    (chunk.start + chunk.count) * w.cout * plane,
                );
                for (i, v) in y.iter_mut().enumerate().take(to).skip(from) {
                    *v += bias[(i / plane) % w.cout];
                }
            }
            store_f32(&mut buffers[out], &y);
        }
        Step::GradOutput(chunk) => {
            let dm = w.grad_output_values(chunk, &narrow(&buffers[0]), false);
            store(&mut buffers[1], &dm);
        }
        // The parts' sum in one: the CPU has no parallelism to split for.
        Step::WeightGemm(chunk) => {
            let du = w.weight_grad_products(chunk, &wide(&buffers[0]), &wide(&buffers[1]));
            buffers[2].fill(0);
            store(&mut buffers[2], &du);
        }
        Step::WeightFinish { first, .. } => {
            let mut dweight = vec![0.0; w.cout * w.cin * 9];
            w.weight_grad_values(&wide(&buffers[0]), false, &mut dweight);
            let mut out: Vec<f32> = dweight.into_iter().map(|v| v as f32).collect();
            if !first {
                for (o, old) in out.iter_mut().zip(narrow(&buffers[1])) {
                    *o += old;
                }
            }
            store_f32(&mut buffers[1], &out);
        }
    }
}
