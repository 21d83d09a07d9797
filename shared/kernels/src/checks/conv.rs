//! Checks of Conv2d (implicit GEMM) against the direct reference, and the
//! convolutions every harness runs.

use super::gemm::accumulation_bound;
use super::{Builder, Check};
use crate::conv::Conv2d;
use crate::gemm::gemm_tol;
use crate::gemm::precision::{Precision, magnitudes};
use crate::sample_matrix;

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
    c.expect_gemm("y", y, want_y, k_fwd, accumulation_bound(p, abs_y, k_fwd));
    c.expect_gemm("dx", dx, want_dx, k_in, accumulation_bound(p, abs_dx, k_in));
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
    if conv.bias {
        c.step(conv.backward_bias(), [dy, dbias]);
        c.expect("dbias", dbias, want_db, gemm_tol(k_w));
    }
    c.build(format!("{conv:?}{}", p.mark()))
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
    ]
    .into_iter()
    .filter_map(|(x, o, k, s, p, d, g, b)| Conv2d::new(x, o, k, s, p, d, g, b))
    .collect()
}
