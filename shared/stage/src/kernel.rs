//! One kernel invocation as data ([`Kernel`]), with its two lowerings: the
//! generated WGSL a GPU runs ([`Kernel::spec`]) and the CPU reference a
//! machine without a GPU runs ([`Kernel::cpu`]). Both see the same buffers in
//! the same binding order, so the executor never knows which device it has.
//!
//! The few kernels the executor needs for its own bookkeeping (copy, add into,
//! fill) are generated here with the kernel crate's 1-D helper.

use rookery_shared::kernels::KernelSpec;
use rookery_shared::kernels::elementwise::{BinaryOp, Broadcast, Operand, Unary};
use rookery_shared::kernels::gemm::{Linear, MatMul, sum_to_shape};
use rookery_shared::kernels::optim::Optimizer;
use rookery_shared::kernels::spec::{Binding, DEFAULT_WORKGROUP, f32_lit, numel, one_d};

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
    /// `y`: every element set to `value`.
    Fill { len: usize, value: f32 },
    /// `u` (the uniform of `step`), `param`, `grad`, then the optimizer's
    /// state buffers. `step` is 1 for a parameter's first update.
    OptimizerStep {
        optimizer: Optimizer,
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
            Kernel::Fill { len, value } => one_d(
                "fill",
                &[("y", Binding::ReadWrite, "f32")],
                "",
                *len,
                DEFAULT_WORKGROUP,
                &format!("    y[i] = {};", f32_lit(*value)),
            ),
            Kernel::OptimizerStep { optimizer, len, .. } => optimizer.step(*len),
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
        }
    }
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
    MatMul { a, b, tile: m.tile }
}
