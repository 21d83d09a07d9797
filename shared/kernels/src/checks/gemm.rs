//! Checks of the GEMM-template kernels: MatMul (with the reductions over
//! broadcast batch dimensions) and Linear.

use super::{Builder, Check, shape_name, tol};
use crate::gemm::precision::magnitudes;
use crate::gemm::{Linear, MatMul, Precision, Tiling};
use crate::sample_matrix;
use crate::spec::numel;

/// How far a mixed-precision GEMM output may be from the f64 product of
/// its rounded operands beyond [`crate::gemm::gemm_tol`], from each output's `sum |a_i
/// b_i|` (`sum_abs`) over `k` terms: tensor cores sum 16 products at a time
/// into f32 partial sums and may truncate rather than round each addition,
/// so every one of the `k / 16 + 16` additions an output sees may be off by
/// a unit in the last place of a sum no larger than `sum |a_i b_i|`. Zero
/// under f32, where [`crate::gemm::gemm_tol`] alone applies.
pub fn accumulation_bound(precision: Precision, sum_abs: Vec<f32>, k: usize) -> Vec<f32> {
    let additions = (k.div_ceil(16) + 16) as f32;
    let ulp = 2f32.powi(-23);
    match precision {
        Precision::F32 => vec![0.0; sum_abs.len()],
        Precision::Mixed => sum_abs.into_iter().map(|s| additions * ulp * s).collect(),
    }
}

/// `(c, da, db)` of `mm` on the operands' magnitudes in f32: each output's
/// `sum |a_i b_i|`.
fn magnitude_sums(mm: &MatMul, a: &[f32], b: &[f32], dc: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut exact = mm.clone();
    exact.precision = Precision::F32;
    exact.reference(&magnitudes(a), &magnitudes(b), &magnitudes(dc))
}

/// Matmul forward and both backwards, with the reductions over broadcast
/// batch dimensions where there are any, generated with `tiling`.
/// Under [`Precision::Mixed`] the reference is that of the operands rounded
/// as every executor rounds them, within f32 accumulation error.
pub fn matmul(
    a_shape: &[usize],
    b_shape: &[usize],
    tiling: Tiling,
    precision: Precision,
    seed: u64,
) -> Option<Check> {
    let mut mm = MatMul::new(a_shape, b_shape)?;
    mm.tiling = Some(tiling);
    mm.precision = precision;
    let a = sample_matrix(numel(a_shape), seed);
    let b = sample_matrix(numel(b_shape), seed ^ 1);
    let out = mm.out_shape();
    let dc = sample_matrix(numel(&out), seed ^ 2);
    let (want_c, want_da, want_db) = mm.reference(&a, &b, &dc);
    let (abs_c, abs_da, abs_db) = magnitude_sums(&mm, &a, &b, &dc);
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
    bufs.expect_gemm("c", c, want_c, k, accumulation_bound(precision, abs_c, k));
    bufs.expect_gemm(
        "da",
        da,
        want_da,
        n * z_a,
        accumulation_bound(precision, abs_da, n * z_a),
    );
    bufs.expect_gemm(
        "db",
        db,
        want_db,
        m * z_b,
        accumulation_bound(precision, abs_db, m * z_b),
    );
    Some(bufs.build(format!(
        "matmul({},{}) {}{}",
        shape_name(a_shape),
        shape_name(b_shape),
        tiling.describe(),
        precision.mark()
    )))
}

/// Linear forward (bias fused) and backward for x, weight and bias.
pub fn linear(
    rows: usize,
    inputs: usize,
    outputs: usize,
    bias: bool,
    precision: Precision,
    seed: u64,
) -> Check {
    let mut l = Linear::new(rows, inputs, outputs, bias);
    l.precision = precision;
    let x = sample_matrix(rows * inputs, seed);
    let w = sample_matrix(outputs * inputs, seed ^ 1);
    let b = sample_matrix(outputs, seed ^ 2);
    let dy = sample_matrix(rows * outputs, seed ^ 3);
    let (want_y, want_dx, want_dw, _) = l.reference(&x, &w, bias.then_some(&b[..]), &dy);
    // The bias gradient is a plain sum of dy, never rounded.
    let mut exact = l;
    exact.precision = Precision::F32;
    let want_db = exact.reference(&x, &w, None, &dy).3;
    let (abs_y, abs_dx, abs_dw, _) =
        exact.reference(&magnitudes(&x), &magnitudes(&w), None, &magnitudes(&dy));
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
    c.expect_gemm(
        "y",
        y,
        want_y,
        inputs,
        accumulation_bound(precision, abs_y, inputs),
    );
    c.expect_gemm(
        "dx",
        dx,
        want_dx,
        outputs,
        accumulation_bound(precision, abs_dx, outputs),
    );
    c.expect_gemm(
        "dw",
        dw,
        want_dw,
        rows,
        accumulation_bound(precision, abs_dw, rows),
    );
    if bias {
        c.step(l.backward_bias(), [dy, db]);
        c.expect("db", db, want_db, tol::BROADCAST_SUM);
    }
    c.build(format!(
        "linear({rows}x{inputs}->{outputs}, bias {bias}){}",
        precision.mark()
    ))
}
