//! Checks of Conv2d (implicit GEMM) against the direct reference, and the
//! convolutions every harness runs.

use super::gemm::accumulation_bound;
use super::{Builder, Check};
use crate::conv::Conv2d;
use crate::gemm::gemm_tol;
use crate::gemm::precision::{Precision, magnitudes};
use crate::sample_matrix;
use crate::winograd::Winograd;

/// Conv2d forward and backward (input, weight, bias) against the direct
/// reference; the weight gradient both whole and as partial sums over at
/// least 3 parts (where its reduction is that long), added up.
pub fn conv2d(conv: Conv2d, seed: u64) -> Check {
    let x = sample_matrix(conv.n * conv.c * conv.h * conv.w, seed);
    let weight = sample_matrix(
        conv.o * (conv.c / conv.groups) * conv.kh * conv.kw,
        seed ^ 1,
    );
    let bias = sample_matrix(conv.o, seed ^ 2);
    let dy = sample_matrix(conv.out_len(), seed ^ 3);
    let (want_y, want_dx, want_dw, _) =
        conv.reference(&x, &weight, conv.bias.then_some(&bias[..]), &dy);
    // The bias gradient is a plain sum of dy, never rounded.
    let mut exact = conv;
    exact.precision = Precision::F32;
    let want_db = exact.reference(&x, &weight, None, &dy).3;
    let (abs_y, abs_dx, abs_dw, _) = exact.reference(
        &magnitudes(&x),
        &magnitudes(&weight),
        None,
        &magnitudes(&dy),
    );
    let p = conv.precision;
    let (oh, ow) = conv.out_hw();
    let k_fwd = conv.c / conv.groups * conv.kh * conv.kw;
    let k_in = conv.o / conv.groups * conv.kh * conv.kw;
    let k_w = conv.n * oh * ow;
    let (x_len, weight_len) = (x.len(), weight.len());
    let values = (x.clone(), weight.clone(), bias.clone(), dy.clone());
    let mut c = Builder::default();
    let (x, weight, bias, dy) = (c.f32(x), c.f32(weight), c.f32(bias), c.f32(dy));
    let y = c.zeros(conv.out_len());
    let dx = c.zeros(x_len);
    let dweight = c.zeros(weight_len);
    let dbias = c.zeros(conv.o);
    let parts = conv.weight_parts().max(3);
    let dweight_parts = c.zeros(weight_len * parts as usize);
    let dweight_summed = c.zeros(weight_len);
    let forward = if conv.bias {
        vec![x, weight, bias, y]
    } else {
        vec![x, weight, y]
    };
    c.step(conv.forward(), forward);
    c.step(conv.backward_input(), [dy, weight, dx]);
    c.step(conv.backward_weight(), [dy, x, dweight]);
    c.step(conv.backward_weight_parts(parts), [dy, x, dweight_parts]);
    c.step(
        conv.sum_weight_parts(parts),
        [dweight_parts, dweight_summed],
    );
    let abs_dw_parts = abs_dw.clone();
    let want_dw_winograd = want_dw.clone();
    c.expect_gemm(
        "y",
        y,
        want_y.clone(),
        k_fwd,
        accumulation_bound(p, abs_y, k_fwd),
    );
    c.expect_gemm(
        "dx",
        dx,
        want_dx.clone(),
        k_in,
        accumulation_bound(p, abs_dx, k_in),
    );
    c.expect_gemm(
        "dweight",
        dweight,
        want_dw.clone(),
        k_w,
        accumulation_bound(p, abs_dw, k_w),
    );
    c.expect_gemm(
        "dweight in parts",
        dweight_summed,
        want_dw,
        k_w,
        accumulation_bound(p, abs_dw_parts, k_w),
    );
    if let Some((fwd, bwd)) = Winograd::forward_of(&conv).zip(Winograd::backward_input(&conv)) {
        // Small scratch buffers, so that even a check's batch runs in chunks.
        let (fwd, bwd) = (fwd.with_chunks_of(1), bwd.with_chunks_of(2));
        let (xs, ws, dys) = (&values.0, &values.1, &values.3);
        let mut y_mag = fwd.reference(&magnitudes(xs), &magnitudes(ws), true);
        if conv.bias {
            for (i, v) in y_mag.iter_mut().enumerate() {
                *v += f64::from(values.2[(i / (oh * ow)) % conv.o].abs());
            }
        }
        let dx_mag = bwd.reference(&magnitudes(dys), &magnitudes(ws), true);
        let y_w = winograd_steps(&mut c, &fwd, x, weight, conv.bias.then_some(bias));
        let dx_w = winograd_steps(&mut c, &bwd, dy, weight, None);
        c.expect_within(
            "y (winograd)",
            y_w,
            want_y,
            bound_of(fwd.rounding_levels(), &y_mag),
        );
        c.expect_within(
            "dx (winograd)",
            dx_w,
            want_dx,
            bound_of(bwd.rounding_levels(), &dx_mag),
        );
    }
    if let Some(grad) = Winograd::weight_grad_of(&conv) {
        let grad = grad.with_chunks_of(1);
        let (xs, dys) = (&values.0, &values.3);
        let magnitude = grad.weight_grad_reference(&magnitudes(xs), &magnitudes(dys), true);
        let dw_w = winograd_weight_steps(&mut c, &grad, dy, x);
        let bound = bound_of(grad.weight_grad_rounding_levels(), &magnitude);
        c.expect_within("dweight (winograd)", dw_w, want_dw_winograd, bound);
    }
    if conv.bias {
        c.step(conv.backward_bias(), [dy, dbias]);
        c.expect("dbias", dbias, want_db, gemm_tol(k_w));
    }
    c.build(format!("{conv:?}{}", p.mark()))
}

/// `w`'s forward (or input gradient) of `input` (plus `bias`) into a new
/// buffer, through its own scratch buffers.
fn winograd_steps(
    c: &mut Builder,
    w: &Winograd,
    input: usize,
    weight: usize,
    bias: Option<usize>,
) -> usize {
    let out = c.zeros(w.n * w.cout * w.oh * w.ow);
    let scratch = [w.u_len(), w.v_len(), w.m_len()].map(|len| c.zeros(len));
    for (step, bufs) in w.product_steps(input, weight, bias, out, scratch) {
        c.step(w.spec(step), bufs);
    }
    out
}

/// `w`'s weight gradient from `dy` and `x` into a new buffer, through its
/// own scratch buffers.
fn winograd_weight_steps(c: &mut Builder, w: &Winograd, dy: usize, x: usize) -> usize {
    let out = c.zeros(w.cout * w.cin * 9);
    let scratch = [w.v_len(), w.m_len(), w.du_len()].map(|len| c.zeros(len));
    for (step, bufs) in w.weight_grad_steps(dy, x, out, scratch) {
        c.step(w.spec(step), bufs);
    }
    out
}

/// Each output's rounding error bound: `levels` roundings of at most half
/// an ulp of its magnitude sum, plus the direct reference's own rounding
/// to f32.
fn bound_of(levels: usize, magnitude: &[f64]) -> Vec<f32> {
    let levels = levels as f64 + 1.0;
    magnitude
        .iter()
        .map(|&s| (levels * 2f64.powi(-24) * s * 1.01) as f32)
        .collect()
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
        // A long weight-gradient reduction, cut into parts.
        ([12, 1, 28, 28], 4, [3, 3], [1, 1], [1, 1], [1, 1], 1, true),
        // Winograd's, with partial tiles, each padding, in chunks.
        ([3, 32, 7, 9], 40, [3, 3], [1, 1], [1, 1], [1, 1], 1, true),
        ([2, 33, 6, 5], 32, [3, 3], [1, 1], [0, 0], [1, 1], 1, false),
        ([2, 32, 4, 3], 36, [3, 3], [1, 1], [2, 2], [1, 1], 1, true),
        ([2, 32, 10, 9], 32, [3, 3], [1, 1], [1, 1], [1, 1], 1, true),
        (
            [1, 32, 11, 12],
            34,
            [3, 3],
            [1, 1],
            [0, 0],
            [1, 1],
            1,
            false,
        ),
    ]
    .into_iter()
    .filter_map(|(x, o, k, s, p, d, g, b)| Conv2d::new(x, o, k, s, p, d, g, b))
    .collect()
}
