//! Checks of the GEMM-template kernels: MatMul (with the reductions over
//! broadcast batch dimensions) and Linear.

use super::{Builder, Check, shape_name, tol};
use crate::gemm::{Linear, MatMul, Tiling, gemm_tol};
use crate::sample_matrix;
use crate::spec::numel;

/// Matmul forward and both backwards, with the reductions over broadcast
/// batch dimensions where there are any, generated with `tiling`.
pub fn matmul(a_shape: &[usize], b_shape: &[usize], tiling: Tiling, seed: u64) -> Option<Check> {
    let mut mm = MatMul::new(a_shape, b_shape)?;
    mm.tiling = Some(tiling);
    let a = sample_matrix(numel(a_shape), seed);
    let b = sample_matrix(numel(b_shape), seed ^ 1);
    let out = mm.out_shape();
    let dc = sample_matrix(numel(&out), seed ^ 2);
    let (want_c, want_da, want_db) = mm.reference(&a, &b, &dc);
    let (m, k, n) = (
        a_shape[a_shape.len() - 2],
        a_shape[a_shape.len() - 1],
        b_shape[b_shape.len() - 1],
    );
    let (ua, ub) = mm.unreduced_lens();
    let z_a = ua / (m * k).max(1) / (a.len() / (m * k).max(1)).max(1);
    let z_b = ub / (k * n).max(1) / (b.len() / (k * n).max(1)).max(1);
    let (a_len, b_len) = (a.len(), b.len());
    let mut bufs = Builder::default();
    let (a, b, dc) = (bufs.f32(a), bufs.f32(b), bufs.f32(dc));
    let c = bufs.zeros(numel(&out));
    let (da, db) = (bufs.zeros(a_len), bufs.zeros(b_len));
    let (da_unreduced, db_unreduced) = (bufs.zeros(ua), bufs.zeros(ub));
    bufs.step(mm.forward(), [a, b, c]);
    match mm.reduce_a() {
        Some(reduce) => {
            bufs.step(mm.backward_a(), [dc, b, da_unreduced]);
            bufs.step(reduce, [da_unreduced, da]);
        }
        None => bufs.step(mm.backward_a(), [dc, b, da]),
    }
    match mm.reduce_b() {
        Some(reduce) => {
            bufs.step(mm.backward_b(), [a, dc, db_unreduced]);
            bufs.step(reduce, [db_unreduced, db]);
        }
        None => bufs.step(mm.backward_b(), [a, dc, db]),
    }
    bufs.expect("c", c, want_c, gemm_tol(k));
    bufs.expect("da", da, want_da, gemm_tol(n * z_a));
    bufs.expect("db", db, want_db, gemm_tol(m * z_b));
    Some(bufs.build(format!(
        "matmul({},{}) {}",
        shape_name(a_shape),
        shape_name(b_shape),
        tiling.describe()
    )))
}

/// Linear forward (bias fused) and backward for x, weight and bias.
pub fn linear(rows: usize, inputs: usize, outputs: usize, bias: bool, seed: u64) -> Check {
    let l = Linear::new(rows, inputs, outputs, bias);
    let x = sample_matrix(rows * inputs, seed);
    let w = sample_matrix(outputs * inputs, seed ^ 1);
    let b = sample_matrix(outputs, seed ^ 2);
    let dy = sample_matrix(rows * outputs, seed ^ 3);
    let (want_y, want_dx, want_dw, want_db) = l.reference(&x, &w, bias.then_some(&b[..]), &dy);
    let mut c = Builder::default();
    let (x, w, b, dy) = (c.f32(x), c.f32(w), c.f32(b), c.f32(dy));
    let y = c.zeros(rows * outputs);
    let dx = c.zeros(rows * inputs);
    let dw = c.zeros(outputs * inputs);
    let db = c.zeros(outputs);
    c.step(
        l.forward(),
        if bias {
            vec![x, w, b, y]
        } else {
            vec![x, w, y]
        },
    );
    c.step(l.backward_x(), [dy, w, dx]);
    c.step(l.backward_w(), [dy, x, dw]);
    c.expect("y", y, want_y, gemm_tol(inputs));
    c.expect("dx", dx, want_dx, gemm_tol(outputs));
    c.expect("dw", dw, want_dw, gemm_tol(rows));
    if bias {
        c.step(l.backward_bias(), [dy, db]);
        c.expect("db", db, want_db, tol::BROADCAST_SUM);
    }
    c.build(format!("linear({rows}x{inputs}->{outputs}, bias {bias})"))
}
