//! Checks of the elementwise kernels: activations, broadcast binary ops and
//! dropout.

use super::{Builder, Check, shape_name, tol};
use crate::elementwise::{BinaryOp, Broadcast, Dropout, Operand, Unary};
use crate::sample_matrix;
use crate::spec::numel;

/// Forward and backward of an activation over `len` elements in `[-4, 4)`
/// (mapped into the op's domain).
pub fn unary(op: Unary, len: usize, seed: u64) -> Check {
    let x: Vec<f32> = sample_matrix(len, seed)
        .iter()
        .map(|v| op.domain(v * 4.0))
        .collect();
    unary_at(op, x, seed, &format!("[{len}]"))
}

/// Forward and backward of an activation at its kinks ([`Unary::kinks`]),
/// where the kernel must take the branch torch takes; `None` for an op
/// without any.
pub fn unary_kinks(op: Unary, seed: u64) -> Option<Check> {
    let x = op.kinks();
    (!x.is_empty()).then(|| unary_at(op, x, seed, "[kinks]"))
}

fn unary_at(op: Unary, x: Vec<f32>, seed: u64, what: &str) -> Check {
    let len = x.len();
    let dy = sample_matrix(len, seed ^ 0x55);
    let (want_y, want_dx) = (op.reference(&x), op.reference_backward(&x, &dy));
    let (y_bound, dx_bound) = op.error_bounds(&x, &dy);
    let mut c = Builder::default();
    let (x, dy) = (c.f32(x), c.f32(dy));
    let (y, dx) = (c.zeros(len), c.zeros(len));
    c.step(op.forward(len), [x, y]);
    c.step(op.backward(len), [x, dy, dx]);
    c.expect_within("y", y, want_y, y_bound);
    c.expect_within("dx", dx, want_dx, dx_bound);
    c.build(format!("{}{what}", op.label()))
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
    let want_y = op.reference(&s, &a, &b);
    let want_da = op.reference_backward(&s, &a, &b, &dy, Operand::A);
    let want_db = op.reference_backward(&s, &a, &b, &dy, Operand::B);
    let (a_len, b_len) = (a.len(), b.len());
    let mut c = Builder::default();
    let (a, b, dy) = (c.f32(a), c.f32(b), c.f32(dy));
    let y = c.zeros(numel(&s.out));
    let (da, db) = (c.zeros(a_len), c.zeros(b_len));
    c.step(op.forward(&s), [a, b, y]);
    c.step(op.backward(&s, Operand::A), [a, b, dy, da]);
    c.step(op.backward(&s, Operand::B), [a, b, dy, db]);
    c.expect("y", y, want_y, fwd_tol);
    c.expect("da", da, want_da, bwd_tol);
    c.expect("db", db, want_db, bwd_tol);
    Some(c.build(format!(
        "{}({},{})",
        op.name(),
        shape_name(a_shape),
        shape_name(b_shape)
    )))
}

/// Dropout forward and backward with drop probability `p`.
pub fn dropout(p: f32, len: usize, seed: u64) -> Check {
    let d = Dropout { p, len };
    let x = sample_matrix(len, seed);
    let dy = sample_matrix(len, seed ^ 3);
    let (want_y, want_dx) = (d.reference(seed, &x), d.reference(seed, &dy));
    let mut c = Builder::default();
    let uniform = c.u32(Dropout::seed_uniform(seed));
    let (x, dy) = (c.f32(x), c.f32(dy));
    let (y, dx) = (c.zeros(len), c.zeros(len));
    c.step(d.forward(), [uniform, x, y]);
    c.step(d.backward(), [uniform, dy, dx]);
    c.expect("y", y, want_y, tol::EXACT);
    c.expect("dx", dx, want_dx, tol::EXACT);
    c.build(format!("dropout(p={p})[{len}]"))
}
