//! The kernel checks every harness runs, natively on lavapipe
//! (`shared/kernels/tests/gpu_kernels.rs`) and in headless Chromium
//! (`web-provider/tests/browser.rs`): each [`Check`] names its buffers'
//! initial contents, the kernels to dispatch in order, and which buffers must
//! then equal the CPU reference within the tolerance stated for that op.
//! Building a check runs the reference; [`run`] runs the GPU side.
//!
//! The case builders take shapes and a seed, so property tests call them
//! with random shapes and [`standard_checks`] is a fixed spread of odd and
//! even sizes.

use super::conv::Conv2d;
use super::elementwise::{BINARY_OPS, BinaryOp, Broadcast, Dropout, Operand, UNARIES, Unary};
use super::gemm::{Linear, MatMul, gemm_tol};
use super::loss::{CrossEntropy, Mse};
use super::norm::{BatchNorm, LayerNorm};
use super::optim::optimizer_cases;
use super::optimizer::OptimizerConfig;
use super::pool::{GlobalAvgPool, Pool2d};
use super::reduce::Softmax;
use super::sample_matrix;
use super::shape::{Concat, Gather, Transpose};
use super::spec::{KernelSpec, Tol, numel};

/// A buffer's initial contents.
#[derive(Debug, Clone, PartialEq)]
pub enum Init {
    F32(Vec<f32>),
    U32(Vec<u32>),
    Zeros(usize),
}

/// One kernel check: buffers, the dispatches over them (indices into
/// `buffers`), and the expected contents of some buffers afterwards.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: String,
    pub buffers: Vec<Init>,
    pub steps: Vec<(KernelSpec, Vec<usize>)>,
    pub expect: Vec<Expect>,
}

/// Buffer `buffer` must equal `want` within `tol` after the steps.
#[derive(Debug, Clone)]
pub struct Expect {
    pub what: &'static str,
    pub buffer: usize,
    pub want: Vec<f32>,
    pub tol: Tol,
}

impl Expect {
    /// Buffer `buffer` must hold `want` within `tol`; `what` names it in failures.
    pub fn new(what: &'static str, buffer: usize, want: Vec<f32>, tol: Tol) -> Self {
        Self {
            what,
            buffer,
            want,
            tol,
        }
    }
}

/// Why a check failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CheckError {
    #[error("{check}: {what}[{index}] is {got} but the reference says {want} (tolerance {tol:?})")]
    Mismatch {
        check: String,
        what: &'static str,
        index: usize,
        got: f32,
        want: f32,
        tol: Tol,
    },
    #[error("{check}: {what} has {got} elements, the reference {want}")]
    Length {
        check: String,
        what: &'static str,
        got: usize,
        want: usize,
    },
    #[cfg(feature = "gpu")]
    #[error("{check}: {error}")]
    Gpu {
        check: String,
        error: super::GpuError,
    },
}

impl Check {
    /// Compares read-back buffers with the expectations.
    pub fn compare(&self, read: &[Vec<f32>]) -> Result<(), CheckError> {
        for (e, got) in self.expect.iter().zip(read) {
            if got.len() != e.want.len() {
                return Err(CheckError::Length {
                    check: self.name.clone(),
                    what: e.what,
                    got: got.len(),
                    want: e.want.len(),
                });
            }
            if let Some((index, got, want)) = e.tol.first_violation(got, &e.want) {
                return Err(CheckError::Mismatch {
                    check: self.name.clone(),
                    what: e.what,
                    index,
                    got,
                    want,
                    tol: e.tol,
                });
            }
        }
        Ok(())
    }
}

/// Uploads the buffers, runs the steps in one submission, reads back the
/// expected buffers and compares them.
#[cfg(feature = "gpu")]
pub async fn run(gpu: &super::GpuContext, check: &Check) -> Result<(), CheckError> {
    let gpu_err = |error| CheckError::Gpu {
        check: check.name.clone(),
        error,
    };
    let mut buffers = Vec::with_capacity(check.buffers.len());
    for init in &check.buffers {
        buffers.push(
            match init {
                Init::F32(v) => gpu.upload_f32(v),
                Init::U32(v) => gpu.upload_u32(v),
                Init::Zeros(n) => gpu.create_buffer(*n),
            }
            .map_err(gpu_err)?,
        );
    }
    let bound: Vec<Vec<&super::GpuBuffer>> = check
        .steps
        .iter()
        .map(|(_, idx)| idx.iter().map(|&i| &buffers[i]).collect())
        .collect();
    let steps: Vec<(&KernelSpec, &[&super::GpuBuffer])> = check
        .steps
        .iter()
        .zip(&bound)
        .map(|((spec, _), b)| (spec, b.as_slice()))
        .collect();
    gpu.dispatch_all(&steps).await.map_err(gpu_err)?;
    let mut read = Vec::with_capacity(check.expect.len());
    for e in &check.expect {
        read.push(gpu.read_f32(&buffers[e.buffer]).await.map_err(gpu_err)?);
    }
    check.compare(&read)
}

/// Tolerances, stated per op. The GPU computes in f32 with its own `exp`
/// and `erf` (A&S 7.1.26, error 1.5e-7); the references compute in f64.
pub mod tol {
    use super::Tol;

    /// Relu, Identity, Add/Sub forward, Dropout: exact operations in f32.
    pub const EXACT: Tol = Tol::EXACT;
    /// Sigmoid/Tanh/Gelu: a few ulps of `exp` plus the erf approximation.
    pub const ACTIVATION: Tol = Tol::new(2e-6, 2e-5);
    /// Mul/Div forward: one rounding; Div by values near zero is avoided by
    /// the case builders.
    pub const ARITH: Tol = Tol::new(1e-6, 1e-6);
    /// Broadcast backward sums up to a few hundred terms in f32.
    pub const BROADCAST_SUM: Tol = Tol::new(1e-5, 1e-5);
    /// Losses: `exp`/`log` per element plus a sum over rows in f32.
    pub const LOSS: Tol = Tol::new(2e-6, 2e-5);
    /// Optimizers: the same f32 operations in the same order as the
    /// reference, except that WGSL's division and `sqrt` may be off by
    /// 2.5 ulp (Vulkan's precision rules), over three steps.
    /// Layer/batch norm: two-pass statistics and `inverseSqrt` in f32,
    /// sums over up to a few thousand elements.
    pub const NORM: Tol = Tol::new(2e-5, 1e-4);
    pub const OPTIM: Tol = Tol::new(1e-7, 2e-5);
}

fn shape_name(shape: &[usize]) -> String {
    shape
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join("x")
}

/// Forward and backward of an activation over `len` elements in `[-4, 4)`.
pub fn unary(op: Unary, len: usize, seed: u64) -> Check {
    let x: Vec<f32> = sample_matrix(len, seed).iter().map(|v| v * 4.0).collect();
    let dy = sample_matrix(len, seed ^ 0x55);
    let tol = match op {
        Unary::Relu | Unary::Identity => tol::EXACT,
        _ => tol::ACTIVATION,
    };
    Check {
        name: format!("{}[{len}]", op.name()),
        expect: vec![
            Expect::new("y", 2, op.reference(&x), tol),
            Expect::new("dx", 3, op.reference_backward(&x, &dy), tol),
        ],
        buffers: vec![
            Init::F32(x),
            Init::F32(dy),
            Init::Zeros(len),
            Init::Zeros(len),
        ],
        steps: vec![
            (op.forward(len), vec![0, 2]),
            (op.backward(len), vec![0, 1, 3]),
        ],
    }
}

/// Forward and both backwards of a broadcast binary op.
pub fn binary(op: BinaryOp, a_shape: &[usize], b_shape: &[usize], seed: u64) -> Option<Check> {
    let s = Broadcast::new(a_shape, b_shape)?;
    let a = sample_matrix(numel(a_shape), seed);
    let mut b = sample_matrix(numel(b_shape), seed ^ 1);
    if op == BinaryOp::Div {
        // Keeps divisors away from zero, where any rounding is amplified.
        for v in &mut b {
            *v = v.signum() * (0.5 + v.abs());
        }
    }
    let dy = sample_matrix(numel(&s.out), seed ^ 2);
    let (fwd_tol, bwd_tol) = match op {
        BinaryOp::Add | BinaryOp::Sub => (tol::EXACT, tol::BROADCAST_SUM),
        _ => (tol::ARITH, tol::BROADCAST_SUM),
    };
    let out_len = numel(&s.out);
    Some(Check {
        name: format!(
            "{}({},{})",
            op.name(),
            shape_name(a_shape),
            shape_name(b_shape)
        ),
        expect: vec![
            Expect::new("y", 3, op.reference(&s, &a, &b), fwd_tol),
            Expect::new(
                "da",
                4,
                op.reference_backward(&s, &a, &b, &dy, Operand::A),
                bwd_tol,
            ),
            Expect::new(
                "db",
                5,
                op.reference_backward(&s, &a, &b, &dy, Operand::B),
                bwd_tol,
            ),
        ],
        steps: vec![
            (op.forward(&s), vec![0, 1, 3]),
            (op.backward(&s, Operand::A), vec![0, 1, 2, 4]),
            (op.backward(&s, Operand::B), vec![0, 1, 2, 5]),
        ],
        buffers: vec![
            Init::F32(a.clone()),
            Init::F32(b.clone()),
            Init::F32(dy),
            Init::Zeros(out_len),
            Init::Zeros(a.len()),
            Init::Zeros(b.len()),
        ],
    })
}

/// Dropout forward and backward with drop probability `p`.
pub fn dropout(p: f32, len: usize, seed: u64) -> Check {
    let d = Dropout { p, len };
    let x = sample_matrix(len, seed);
    let dy = sample_matrix(len, seed ^ 3);
    let uniform = Dropout::seed_uniform(seed);
    Check {
        name: format!("dropout(p={p})[{len}]"),
        expect: vec![
            Expect::new("y", 3, d.reference(seed, &x), tol::EXACT),
            Expect::new("dx", 4, d.reference(seed, &dy), tol::EXACT),
        ],
        buffers: vec![
            Init::U32(uniform),
            Init::F32(x),
            Init::F32(dy),
            Init::Zeros(len),
            Init::Zeros(len),
        ],
        steps: vec![(d.forward(), vec![0, 1, 3]), (d.backward(), vec![0, 2, 4])],
    }
}

/// Matmul forward and both backwards, with the reductions over broadcast
/// batch dimensions where there are any; `tile` is the GEMM tile side.
pub fn matmul(
    a_shape: &[usize],
    b_shape: &[usize],
    tile: u32,
    per_thread: u32,
    seed: u64,
) -> Option<Check> {
    let mut mm = MatMul::new(a_shape, b_shape)?;
    mm.tile = tile;
    mm.per_thread = per_thread;
    let a = sample_matrix(numel(a_shape), seed);
    let b = sample_matrix(numel(b_shape), seed ^ 1);
    let out = mm.out_shape();
    let dc = sample_matrix(numel(&out), seed ^ 2);
    let (c, da, db) = mm.reference(&a, &b, &dc);
    let (m, k, n) = (
        a_shape[a_shape.len() - 2],
        a_shape[a_shape.len() - 1],
        b_shape[b_shape.len() - 1],
    );
    let (ua, ub) = mm.unreduced_lens();
    let z_a = ua / (m * k).max(1) / (a.len() / (m * k).max(1)).max(1);
    let z_b = ub / (k * n).max(1) / (b.len() / (k * n).max(1)).max(1);
    // Buffers: 0 a, 1 b, 2 dc, 3 c, 4 da, 5 db, 6 da unreduced, 7 db unreduced.
    let mut steps = vec![(mm.forward(), vec![0, 1, 3])];
    match mm.reduce_a() {
        Some(reduce) => {
            steps.push((mm.backward_a(), vec![2, 1, 6]));
            steps.push((reduce, vec![6, 4]));
        }
        None => steps.push((mm.backward_a(), vec![2, 1, 4])),
    }
    match mm.reduce_b() {
        Some(reduce) => {
            steps.push((mm.backward_b(), vec![0, 2, 7]));
            steps.push((reduce, vec![7, 5]));
        }
        None => steps.push((mm.backward_b(), vec![0, 2, 5])),
    }
    Some(Check {
        name: format!(
            "matmul({},{}) tile {tile}",
            shape_name(a_shape),
            shape_name(b_shape)
        ),
        expect: vec![
            Expect::new("c", 3, c, gemm_tol(k)),
            Expect::new("da", 4, da, gemm_tol(n * z_a)),
            Expect::new("db", 5, db, gemm_tol(m * z_b)),
        ],
        buffers: vec![
            Init::F32(a.clone()),
            Init::F32(b.clone()),
            Init::F32(dc),
            Init::Zeros(numel(&out)),
            Init::Zeros(a.len()),
            Init::Zeros(b.len()),
            Init::Zeros(ua),
            Init::Zeros(ub),
        ],
        steps,
    })
}

/// Linear forward (bias fused) and backward for x, weight and bias.
pub fn linear(rows: usize, inputs: usize, outputs: usize, bias: bool, seed: u64) -> Check {
    let l = Linear::new(rows, inputs, outputs, bias);
    let x = sample_matrix(rows * inputs, seed);
    let w = sample_matrix(outputs * inputs, seed ^ 1);
    let b = sample_matrix(outputs, seed ^ 2);
    let dy = sample_matrix(rows * outputs, seed ^ 3);
    let (y, dx, dw, db) = l.reference(&x, &w, bias.then_some(&b[..]), &dy);
    // Buffers: 0 x, 1 w, 2 b, 3 dy, 4 y, 5 dx, 6 dw, 7 db.
    let fwd = if bias {
        vec![0, 1, 2, 4]
    } else {
        vec![0, 1, 4]
    };
    let mut expect = vec![
        Expect::new("y", 4, y, gemm_tol(inputs)),
        Expect::new("dx", 5, dx, gemm_tol(outputs)),
        Expect::new("dw", 6, dw, gemm_tol(rows)),
    ];
    let mut steps = vec![
        (l.forward(), fwd),
        (l.backward_x(), vec![3, 1, 5]),
        (l.backward_w(), vec![3, 0, 6]),
    ];
    if bias {
        steps.push((l.backward_bias(), vec![3, 7]));
        expect.push(Expect::new("db", 7, db, tol::BROADCAST_SUM));
    }
    Check {
        name: format!("linear({rows}x{inputs}->{outputs}, bias {bias})"),
        buffers: vec![
            Init::F32(x),
            Init::F32(w),
            Init::F32(b),
            Init::F32(dy),
            Init::Zeros(rows * outputs),
            Init::Zeros(rows * inputs),
            Init::Zeros(outputs * inputs),
            Init::Zeros(outputs),
        ],
        steps,
        expect,
    }
}

/// Cross-entropy forward and backward on logits `[n, classes, inner]` in
/// `[-3, 3)`; tolerance: `exp`/`log` in f32 summed over rows.
pub fn cross_entropy(n: usize, classes: usize, inner: usize, seed: u64) -> Check {
    let ce = CrossEntropy { n, classes, inner };
    let x: Vec<f32> = sample_matrix(n * classes * inner, seed)
        .iter()
        .map(|v| v * 3.0)
        .collect();
    let labels: Vec<u32> = sample_matrix(n * inner, seed ^ 1)
        .iter()
        .map(|v| (((v + 1.0) / 2.0 * classes as f32) as u32).min(classes as u32 - 1))
        .collect();
    let dloss = 0.75;
    let (loss, dx) = ce.reference(&x, &labels, dloss);
    Check {
        name: format!("cross_entropy({n}x{classes}x{inner})"),
        expect: vec![
            Expect::new("loss", 3, vec![loss], tol::LOSS),
            Expect::new("dx", 4, dx, tol::LOSS),
        ],
        buffers: vec![
            Init::F32(x),
            Init::U32(labels),
            Init::F32(vec![dloss]),
            Init::Zeros(1),
            Init::Zeros(n * classes * inner),
        ],
        steps: vec![
            (ce.forward(), vec![0, 1, 3]),
            (ce.backward(), vec![0, 1, 2, 4]),
        ],
    }
}

/// MSE forward and backward over `len` elements.
pub fn mse(len: usize, seed: u64) -> Check {
    let m = Mse { len };
    let x = sample_matrix(len, seed);
    let t = sample_matrix(len, seed ^ 1);
    let (loss, dx) = m.reference(&x, &t, 1.5);
    Check {
        name: format!("mse[{len}]"),
        expect: vec![
            Expect::new("loss", 3, vec![loss], tol::LOSS),
            Expect::new("dx", 4, dx, tol::ARITH),
        ],
        buffers: vec![
            Init::F32(x),
            Init::F32(t),
            Init::F32(vec![1.5]),
            Init::Zeros(1),
            Init::Zeros(len),
        ],
        steps: vec![
            (m.forward(), vec![0, 1, 3]),
            (m.backward(), vec![0, 1, 2, 4]),
        ],
    }
}

/// Three steps of an optimizer over `len` parameters, each with its own
/// gradient and uniform, against the reference's parameters and state.
pub fn optimizer(o: OptimizerConfig, len: usize, seed: u64) -> Check {
    const STEPS: u64 = 3;
    let mut param = sample_matrix(len, seed);
    let states = o.state_names();
    let mut state = vec![vec![0.0f32; len]; states.len()];
    let grads: Vec<Vec<f32>> = (0..STEPS)
        .map(|s| sample_matrix(len, seed ^ (10 + s)))
        .collect();
    // Buffers: 0 param, 1.. state, then per step a uniform and a gradient.
    let mut buffers = vec![Init::F32(param.clone())];
    buffers.extend(states.iter().map(|_| Init::Zeros(len)));
    let spec = o.step(len);
    let mut steps = Vec::new();
    for (s, g) in grads.iter().enumerate() {
        let step = s as u64 + 1;
        o.reference_step(step, &mut param, g, &mut state);
        let u = buffers.len();
        buffers.push(Init::U32(o.uniform(step)));
        buffers.push(Init::F32(g.clone()));
        let mut bound = vec![u, 0, u + 1];
        bound.extend(1..=states.len());
        steps.push((spec.clone(), bound));
    }
    let mut expect = vec![Expect::new("param", 0, param, tol::OPTIM)];
    for (i, (name, want)) in states.iter().zip(state).enumerate() {
        expect.push(Expect {
            what: name,
            buffer: 1 + i,
            want,
            tol: tol::OPTIM,
        });
    }
    Check {
        name: format!("{}[{len}] {o:?}", spec.label),
        buffers,
        steps,
        expect,
    }
}

/// Softmax or LogSoftmax forward and backward on `[outer, axis, inner]`.
pub fn softmax(outer: usize, axis: usize, inner: usize, log: bool, seed: u64) -> Check {
    let s = Softmax {
        outer,
        axis,
        inner,
        log,
    };
    let len = outer * axis * inner;
    let x: Vec<f32> = sample_matrix(len, seed).iter().map(|v| v * 5.0).collect();
    let dy = sample_matrix(len, seed ^ 1);
    let (y, dx) = s.reference(&x, &dy);
    Check {
        name: format!(
            "{}({outer}x{axis}x{inner})",
            if log { "log_softmax" } else { "softmax" }
        ),
        expect: vec![
            Expect::new("y", 2, y, tol::LOSS),
            Expect::new("dx", 3, dx, tol::LOSS),
        ],
        buffers: vec![
            Init::F32(x),
            Init::F32(dy),
            Init::Zeros(len),
            Init::Zeros(len),
        ],
        steps: vec![(s.forward(), vec![0, 2]), (s.backward(), vec![2, 1, 3])],
    }
}

/// LayerNorm forward and backward (x, weight, bias) on `rows x cols`.
pub fn layer_norm(rows: usize, cols: usize, seed: u64) -> Check {
    let l = LayerNorm {
        rows,
        cols,
        eps: 1e-5,
    };
    let x: Vec<f32> = sample_matrix(rows * cols, seed)
        .iter()
        .map(|v| v * 3.0 + 0.5)
        .collect();
    let w = sample_matrix(cols, seed ^ 1);
    let b = sample_matrix(cols, seed ^ 2);
    let dy = sample_matrix(rows * cols, seed ^ 3);
    let (y, dx, dw, db) = l.reference(&x, &w, &b, &dy);
    // Buffers: 0 x, 1 w, 2 b, 3 dy, 4 y, 5 mean, 6 rstd, 7 dx, 8 dw, 9 db.
    Check {
        name: format!("layer_norm({rows}x{cols})"),
        expect: vec![
            Expect::new("y", 4, y, tol::NORM),
            Expect::new("dx", 7, dx, tol::NORM),
            Expect::new("dw", 8, dw, tol::NORM),
            Expect::new("db", 9, db, tol::BROADCAST_SUM),
        ],
        buffers: vec![
            Init::F32(x),
            Init::F32(w),
            Init::F32(b),
            Init::F32(dy),
            Init::Zeros(rows * cols),
            Init::Zeros(rows),
            Init::Zeros(rows),
            Init::Zeros(rows * cols),
            Init::Zeros(cols),
            Init::Zeros(cols),
        ],
        steps: vec![
            (l.forward(), vec![0, 1, 2, 4, 5, 6]),
            (l.backward_x(), vec![0, 1, 5, 6, 3, 7]),
            (l.backward_params(), vec![0, 5, 6, 3, 8, 9]),
        ],
    }
}

/// BatchNorm training forward (with the running statistics update),
/// training backward, and eval forward, on `[n, channels, spatial]`.
pub fn batch_norm(n: usize, channels: usize, spatial: usize, seed: u64) -> Check {
    let bn = BatchNorm {
        n,
        channels,
        spatial,
        eps: 1e-5,
        momentum: 0.1,
    };
    let len = n * channels * spatial;
    let x: Vec<f32> = sample_matrix(len, seed)
        .iter()
        .map(|v| v * 2.0 + 1.0)
        .collect();
    let w = sample_matrix(channels, seed ^ 1);
    let b = sample_matrix(channels, seed ^ 2);
    let rm = sample_matrix(channels, seed ^ 3);
    let rv: Vec<f32> = sample_matrix(channels, seed ^ 4)
        .iter()
        .map(|v| v.abs() + 0.5)
        .collect();
    let dy = sample_matrix(len, seed ^ 5);
    let eval = bn.reference_eval(&x, &w, &b, (&rm, &rv));
    let (y, rm2, rv2, dx, dw, db) = bn.reference_train(&x, &w, &b, (&rm, &rv), &dy);
    // Buffers: 0 x, 1 w, 2 b, 3 rm, 4 rv, 5 y, 6 save_mean, 7 save_rstd,
    // 8 dy, 9 dx, 10 dw, 11 db, 12 eval y (run first, on the old stats).
    Check {
        name: format!("batch_norm({n}x{channels}x{spatial})"),
        expect: vec![
            Expect::new("eval y", 12, eval, tol::NORM),
            Expect::new("y", 5, y, tol::NORM),
            Expect::new("running_mean", 3, rm2, tol::NORM),
            Expect::new("running_var", 4, rv2, tol::NORM),
            Expect::new("dx", 9, dx, tol::NORM),
            Expect::new("dw", 10, dw, tol::NORM),
            Expect::new("db", 11, db, tol::BROADCAST_SUM),
        ],
        buffers: vec![
            Init::F32(x),
            Init::F32(w),
            Init::F32(b),
            Init::F32(rm),
            Init::F32(rv),
            Init::Zeros(len),
            Init::Zeros(channels),
            Init::Zeros(channels),
            Init::F32(dy),
            Init::Zeros(len),
            Init::Zeros(channels),
            Init::Zeros(channels),
            Init::Zeros(len),
        ],
        steps: vec![
            (bn.forward_eval(), vec![0, 1, 2, 3, 4, 12]),
            (bn.forward_train(), vec![0, 1, 2, 3, 4, 5, 6, 7]),
            (bn.backward_train(), vec![0, 1, 6, 7, 8, 9, 10, 11]),
        ],
    }
}

/// A transpose and its backward (the inverse permutation).
pub fn transpose(shape: &[usize], perm: &[usize], seed: u64) -> Option<Check> {
    let t = Transpose::new(shape, perm)?;
    let len = numel(shape);
    let x = sample_matrix(len, seed);
    let dy = sample_matrix(len, seed ^ 1);
    let y = t.reference(&x);
    let dx = t.inverse().reference(&dy);
    Some(Check {
        name: format!("transpose({} by {perm:?})", shape_name(shape)),
        expect: vec![
            Expect::new("y", 2, y, tol::EXACT),
            Expect::new("dx", 3, dx, tol::EXACT),
        ],
        buffers: vec![
            Init::F32(x),
            Init::F32(dy),
            Init::Zeros(len),
            Init::Zeros(len),
        ],
        steps: vec![
            (t.forward(), vec![0, 2]),
            (t.inverse().forward(), vec![1, 3]),
        ],
    })
}

/// Concat of `sizes.len()` inputs along the middle axis, and the backward
/// copying each input's slice of the gradient out.
pub fn concat(outer: usize, sizes: &[usize], inner: usize, seed: u64) -> Check {
    let c = Concat {
        outer,
        sizes: sizes.to_vec(),
        inner,
    };
    let parts: Vec<Vec<f32>> = sizes
        .iter()
        .enumerate()
        .map(|(i, s)| sample_matrix(outer * s * inner, seed ^ i as u64))
        .collect();
    let refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
    let y = c.reference(&refs);
    let total = y.len();
    // The backward of concatenation is the split: check it returns the parts.
    let mut buffers: Vec<Init> = parts.iter().cloned().map(Init::F32).collect();
    let out = buffers.len();
    buffers.push(Init::Zeros(total));
    let mut steps = Vec::new();
    let mut expect = vec![Expect::new("y", out, y, tol::EXACT)];
    for i in 0..parts.len() {
        steps.push((c.forward(i), vec![i, out]));
    }
    for (i, p) in parts.into_iter().enumerate() {
        let slot = buffers.len();
        buffers.push(Init::Zeros(p.len()));
        steps.push((c.backward(i), vec![out, slot]));
        expect.push(Expect::new("dx part", slot, p, tol::EXACT));
    }
    Check {
        name: format!("concat({outer}x{sizes:?}x{inner})"),
        buffers,
        steps,
        expect,
    }
}

/// Gather / Embedding forward and backward with indices in `[-axis, axis)`.
pub fn gather(outer: usize, axis: usize, inner: usize, count: usize, seed: u64) -> Check {
    let g = Gather {
        outer,
        axis,
        inner,
        count,
    };
    let data = sample_matrix(outer * axis * inner, seed);
    let indices: Vec<i32> = sample_matrix(count, seed ^ 1)
        .iter()
        .map(|v| ((v * axis as f32).floor() as i32).clamp(-(axis as i32), axis as i32 - 1))
        .collect();
    let dy = sample_matrix(outer * count * inner, seed ^ 2);
    let (y, dd) = g.reference(&data, &indices, &dy);
    Check {
        name: format!("gather({outer}x{axis}x{inner}, {count} indices)"),
        expect: vec![
            Expect::new("y", 3, y, tol::EXACT),
            Expect::new("ddata", 4, dd, tol::BROADCAST_SUM),
        ],
        buffers: vec![
            Init::F32(data.clone()),
            Init::U32(indices.iter().map(|&v| v as u32).collect()),
            Init::F32(dy),
            Init::Zeros(outer * count * inner),
            Init::Zeros(data.len()),
        ],
        steps: vec![(g.forward(), vec![0, 1, 3]), (g.backward(), vec![1, 2, 4])],
    }
}

/// Conv2d forward and backward (input, weight, bias) against the direct
/// reference.
pub fn conv2d(conv: Conv2d, seed: u64) -> Check {
    let x = sample_matrix(conv.n * conv.c * conv.h * conv.w, seed);
    let weight = sample_matrix(
        conv.o * (conv.c / conv.groups) * conv.kh * conv.kw,
        seed ^ 1,
    );
    let bias = sample_matrix(conv.o, seed ^ 2);
    let dy = sample_matrix(conv.out_len(), seed ^ 3);
    let (y, dx, dw, db) = conv.reference(&x, &weight, conv.bias.then_some(&bias[..]), &dy);
    let (oh, ow) = conv.out_hw();
    let k_fwd = conv.c / conv.groups * conv.kh * conv.kw;
    let k_in = conv.o / conv.groups * conv.kh * conv.kw;
    let k_w = conv.n * oh * ow;
    // Buffers: 0 x, 1 weight, 2 bias, 3 dy, 4 y, 5 dx, 6 dweight, 7 dbias.
    let fwd = if conv.bias {
        vec![0, 1, 2, 4]
    } else {
        vec![0, 1, 4]
    };
    let mut steps = vec![
        (conv.forward(), fwd),
        (conv.backward_input(), vec![3, 1, 5]),
        (conv.backward_weight(), vec![3, 0, 6]),
    ];
    let mut expect = vec![
        Expect::new("y", 4, y, gemm_tol(k_fwd)),
        Expect::new("dx", 5, dx, gemm_tol(k_in)),
        Expect::new("dweight", 6, dw, gemm_tol(k_w)),
    ];
    if conv.bias {
        steps.push((conv.backward_bias(), vec![3, 7]));
        expect.push(Expect::new("dbias", 7, db, gemm_tol(k_w)));
    }
    Check {
        name: format!("{conv:?}"),
        buffers: vec![
            Init::F32(x.clone()),
            Init::F32(weight.clone()),
            Init::F32(bias),
            Init::F32(dy),
            Init::Zeros(conv.out_len()),
            Init::Zeros(x.len()),
            Init::Zeros(weight.len()),
            Init::Zeros(conv.o),
        ],
        steps,
        expect,
    }
}

/// Max and average pooling, forward and backward, on the same geometry.
pub fn pool2d(pool: Pool2d, seed: u64) -> Check {
    let x = sample_matrix(pool.planes * pool.h * pool.w, seed);
    let dy = sample_matrix(pool.out_len(), seed ^ 1);
    let (my, arg, mdx) = pool.max_reference(&x, &dy);
    let (ay, adx) = pool.avg_reference(&x, &dy);
    let window = (pool.kernel[0] * pool.kernel[1]) as f32;
    let avg_tol = Tol::new(1e-6 * window, 1e-5);
    // Buffers: 0 x, 1 dy, 2 max y, 3 argmax, 4 max dx, 5 avg y, 6 avg dx.
    Check {
        name: format!("{pool:?}"),
        expect: vec![
            Expect::new("max y", 2, my, tol::EXACT),
            Expect::new(
                "argmax",
                3,
                arg.iter().map(|&v| f32::from_bits(v)).collect(),
                tol::EXACT,
            ),
            Expect::new("max dx", 4, mdx, tol::BROADCAST_SUM),
            Expect::new("avg y", 5, ay, avg_tol),
            Expect::new("avg dx", 6, adx, avg_tol),
        ],
        buffers: vec![
            Init::F32(x.clone()),
            Init::F32(dy),
            Init::Zeros(pool.out_len()),
            Init::Zeros(pool.out_len()),
            Init::Zeros(x.len()),
            Init::Zeros(pool.out_len()),
            Init::Zeros(x.len()),
        ],
        steps: vec![
            (pool.max_forward(), vec![0, 2, 3]),
            (pool.max_backward(), vec![3, 1, 4]),
            (pool.avg_forward(), vec![0, 5]),
            (pool.avg_backward(), vec![1, 6]),
        ],
    }
}

/// GlobalAveragePool forward and backward.
pub fn global_avg_pool(planes: usize, spatial: usize, seed: u64) -> Check {
    let g = GlobalAvgPool { planes, spatial };
    let x = sample_matrix(planes * spatial, seed);
    let dy = sample_matrix(planes, seed ^ 1);
    let (y, dx) = g.reference(&x, &dy);
    Check {
        name: format!("global_avg_pool({planes}x{spatial})"),
        expect: vec![
            Expect::new("y", 2, y, tol::BROADCAST_SUM),
            Expect::new("dx", 3, dx, tol::ARITH),
        ],
        buffers: vec![
            Init::F32(x),
            Init::F32(dy),
            Init::Zeros(planes),
            Init::Zeros(planes * spatial),
        ],
        steps: vec![(g.forward(), vec![0, 2]), (g.backward(), vec![1, 3])],
    }
}

/// The convolutions of the standard checks: the demo CNN's
/// (`examples/mnist-cnn.toml`) and odd geometries with stride, padding,
/// dilation and groups.
pub fn conv_cases() -> Vec<Conv2d> {
    [
        ([2, 1, 28, 28], 8, [3, 3], [1, 1], [1, 1], [1, 1], 1, true),
        ([2, 8, 14, 14], 16, [3, 3], [1, 1], [1, 1], [1, 1], 1, true),
        ([1, 1, 5, 5], 1, [3, 3], [1, 1], [0, 0], [1, 1], 1, false),
        ([3, 4, 9, 7], 6, [3, 2], [2, 1], [1, 0], [1, 2], 2, true),
        ([2, 3, 8, 8], 3, [3, 3], [2, 2], [1, 1], [2, 2], 3, true),
        ([1, 2, 6, 5], 5, [1, 1], [3, 2], [0, 0], [1, 1], 1, true),
    ]
    .into_iter()
    .filter_map(|(x, o, k, s, p, d, g, b)| Conv2d::new(x, o, k, s, p, d, g, b))
    .collect()
}

/// Broadcast shape pairs every harness runs: equal shapes, scalars, leading
/// and inner broadcasts on both sides, odd sizes.
pub const BROADCAST_CASES: [(&[usize], &[usize]); 6] = [
    (&[5, 7], &[5, 7]),
    (&[3, 1, 5], &[4, 1]),
    (&[1], &[9, 2]),
    (&[13], &[3, 13]),
    (&[2, 3, 1], &[1, 3, 4]),
    (&[33, 17], &[17]),
];

/// The fixed spread of checks both harnesses run.
pub fn standard_checks() -> Vec<Check> {
    let mut checks = Vec::new();
    for (i, op) in UNARIES.into_iter().enumerate() {
        for len in [1, 63, 1000, 4097] {
            checks.push(unary(op, len, i as u64 * 10 + len as u64));
        }
    }
    for (i, op) in BINARY_OPS.into_iter().enumerate() {
        for (j, (a, b)) in BROADCAST_CASES.iter().enumerate() {
            checks.extend(binary(op, a, b, (i * 10 + j) as u64));
        }
    }
    for (p, len) in [(0.0, 10), (0.5, 1001), (0.1, 77), (1.0, 5)] {
        checks.push(dropout(p, len, len as u64));
    }
    let matmuls: [(&[usize], &[usize]); 6] = [
        (&[1, 1], &[1, 1]),
        (&[17, 31], &[31, 5]),
        (&[64, 64], &[64, 64]),
        (&[3, 7, 9], &[9, 4]),
        (&[2, 1, 5, 3], &[4, 3, 6]),
        (&[33, 1], &[1, 47]),
    ];
    for (i, (a, b)) in matmuls.iter().enumerate() {
        for (tile, per_thread) in [(16, 4), (5, 3), (16, 1)] {
            checks.extend(matmul(a, b, tile, per_thread, i as u64));
        }
    }
    for (i, (rows, inputs, outputs)) in [(1, 1, 1), (32, 784, 10), (7, 13, 29)]
        .into_iter()
        .enumerate()
    {
        checks.push(linear(rows, inputs, outputs, true, i as u64));
        checks.push(linear(rows, inputs, outputs, false, i as u64));
    }
    for (n, c, inner) in [(1, 1, 1), (32, 10, 1), (5, 3, 7), (300, 17, 1)] {
        checks.push(cross_entropy(n, c, inner, n as u64));
    }
    for len in [1, 255, 1000] {
        checks.push(mse(len, len as u64));
    }
    for (i, o) in optimizer_cases().into_iter().enumerate() {
        checks.push(optimizer(o, 1 + 97 * i, i as u64));
    }
    for log in [false, true] {
        for (outer, axis, inner) in [(1, 1, 1), (32, 10, 1), (3, 17, 5), (1, 1000, 1)] {
            checks.push(softmax(outer, axis, inner, log, axis as u64));
        }
    }
    for (rows, cols) in [(1, 1), (7, 33), (64, 128)] {
        checks.push(layer_norm(rows, cols, cols as u64));
    }
    for (n, c, sp) in [(2, 1, 1), (4, 3, 25), (32, 8, 49), (1, 5, 2)] {
        checks.push(batch_norm(n, c, sp, sp as u64));
    }
    let transposes: [(&[usize], &[usize]); 4] = [
        (&[5, 7], &[1, 0]),
        (&[2, 3, 4], &[2, 0, 1]),
        (&[3, 1, 4, 2], &[0, 3, 1, 2]),
        (&[9], &[0]),
    ];
    for (i, (shape, perm)) in transposes.iter().enumerate() {
        checks.extend(transpose(shape, perm, i as u64));
    }
    checks.push(concat(3, &[1, 4, 2], 5, 1));
    checks.push(concat(1, &[7], 1, 2));
    checks.push(gather(1, 10, 16, 33, 1));
    checks.push(gather(3, 5, 2, 4, 2));
    for (i, conv) in conv_cases().into_iter().enumerate() {
        checks.push(conv2d(conv, i as u64));
    }
    for (i, (planes, h, w, k, s, p)) in [
        (1, 1, 1, [1, 1], [1, 1], [0, 0]),
        (16, 28, 28, [2, 2], [2, 2], [0, 0]),
        (3, 7, 5, [3, 2], [2, 1], [1, 1]),
        (2, 9, 9, [3, 3], [1, 1], [1, 0]),
    ]
    .into_iter()
    .enumerate()
    {
        checks.extend(Pool2d::new(planes, h, w, k, s, p).map(|pool| pool2d(pool, i as u64)));
    }
    for (planes, spatial) in [(1, 1), (64, 49), (3, 1000)] {
        checks.push(global_avg_pool(planes, spatial, spatial as u64));
    }
    checks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_accept_their_own_reference_and_catch_a_wrong_result() {
        let check = unary(Unary::Gelu, 10, 1);
        let want: Vec<Vec<f32>> = check.expect.iter().map(|e| e.want.clone()).collect();
        check.compare(&want).unwrap();
        let mut wrong = want.clone();
        wrong[1][3] += 1e-3;
        assert!(matches!(
            check.compare(&wrong),
            Err(CheckError::Mismatch {
                index: 3,
                what: "dx",
                ..
            })
        ));
        wrong[1].pop();
        assert!(matches!(
            check.compare(&wrong),
            Err(CheckError::Length { .. })
        ));
    }

    #[test]
    fn every_standard_check_is_well_formed_and_its_shaders_validate() {
        let checks = standard_checks();
        assert!(checks.len() > 40);
        for c in &checks {
            for (spec, idx) in &c.steps {
                assert_eq!(spec.bindings.len(), idx.len(), "{}", c.name);
                assert!(idx.iter().all(|&i| i < c.buffers.len()));
                super::super::spec::validate::spec(spec);
                // Chromium's WGSL compiler refuses const infinities (naga accepts them).
                assert!(!spec.wgsl.contains("bitcast<f32>(0x"), "{}", c.name);
            }
            for e in &c.expect {
                assert!(e.buffer < c.buffers.len());
            }
        }
    }
}
