//! Checks of the losses (cross-entropy, MSE) and of softmax and
//! log-softmax, which share their `exp`/`log` tolerance.

use super::{Builder, Check, tol};
use crate::loss::{CrossEntropy, IGNORED, Mse};
use crate::reduce::Softmax;
use crate::sample_matrix;

/// Cross-entropy forward and backward on logits `[n, classes, inner]` in
/// `[-3, 3)`, every third target [`IGNORED`] when `ignored`; the backward
/// takes the mean over the counted rows. Tolerance: `exp`/`log` in f32
/// summed over rows.
pub fn cross_entropy(n: usize, classes: usize, inner: usize, ignored: bool, seed: u64) -> Check {
    let ce = CrossEntropy { n, classes, inner };
    let x: Vec<f32> = sample_matrix(n * classes * inner, seed)
        .iter()
        .map(|v| v * 3.0)
        .collect();
    let labels: Vec<u32> = sample_matrix(n * inner, seed ^ 1)
        .iter()
        .enumerate()
        .map(|(i, v)| {
            if ignored && i % 3 == 1 {
                IGNORED
            } else {
                (((v + 1.0) / 2.0 * classes as f32) as u32).min(classes as u32 - 1)
            }
        })
        .collect();
    let counted = labels.iter().filter(|&&l| l != IGNORED).count().max(1);
    let dsum = 0.75 / counted as f32;
    let (want_sum, want_dx) = ce.reference(&x, &labels, dsum);
    let mut c = Builder::default();
    let (x, labels, dsum) = (c.f32(x), c.u32(labels), c.f32(vec![dsum]));
    let (loss, dx) = (c.zeros(1), c.zeros(n * classes * inner));
    c.step(ce.forward(), [x, labels, loss]);
    c.step(ce.backward(), [x, labels, dsum, dx]);
    c.expect("loss", loss, vec![want_sum as f32], tol::LOSS);
    c.expect("dx", dx, want_dx, tol::LOSS);
    let tag = if ignored { ", ignoring" } else { "" };
    c.build(format!("cross_entropy({n}x{classes}x{inner}{tag})"))
}

/// MSE forward and backward over `len` elements.
pub fn mse(len: usize, seed: u64) -> Check {
    let m = Mse { len };
    let x = sample_matrix(len, seed);
    let t = sample_matrix(len, seed ^ 1);
    let (want_loss, want_dx) = m.reference(&x, &t, 1.5);
    let mut c = Builder::default();
    let (x, t, dloss) = (c.f32(x), c.f32(t), c.f32(vec![1.5]));
    let (loss, dx) = (c.zeros(1), c.zeros(len));
    c.step(m.forward(), [x, t, loss]);
    c.step(m.backward(), [x, t, dloss, dx]);
    c.expect("loss", loss, vec![want_loss], tol::LOSS);
    c.expect("dx", dx, want_dx, tol::ARITH);
    c.build(format!("mse[{len}]"))
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
    let (want_y, want_dx) = s.reference(&x, &dy);
    let mut c = Builder::default();
    let (x, dy) = (c.f32(x), c.f32(dy));
    let (y, dx) = (c.zeros(len), c.zeros(len));
    c.step(s.forward(), [x, y]);
    c.step(s.backward(), [y, dy, dx]);
    c.expect("y", y, want_y, tol::LOSS);
    c.expect("dx", dx, want_dx, tol::LOSS);
    let name = if log { "log_softmax" } else { "softmax" };
    c.build(format!("{name}({outer}x{axis}x{inner})"))
}
