//! Checks of the normalisation kernels: LayerNorm and BatchNorm (training,
//! with the running statistics update, and evaluation).

use super::{Builder, Check};
use crate::norm::{BatchNorm, LayerNorm};
use crate::sample_matrix;

/// LayerNorm forward and backward (x, weight, bias) on `rows x cols`.
pub fn layer_norm(rows: usize, cols: usize, seed: u64) -> Check {
    layer_norm_around(rows, cols, 0.5, 3.0, seed)
}

/// LayerNorm forward and backward on rows whose values lie within
/// `spread` of `centre`: a small spread over few columns is where the
/// f32 mean loses the values' differences and the backward cancels.
pub fn layer_norm_around(rows: usize, cols: usize, centre: f32, spread: f32, seed: u64) -> Check {
    let l = LayerNorm {
        rows,
        cols,
        eps: 1e-5,
    };
    let x: Vec<f32> = sample_matrix(rows * cols, seed)
        .iter()
        .map(|v| v * spread + centre)
        .collect();
    let w = sample_matrix(cols, seed ^ 1);
    let b = sample_matrix(cols, seed ^ 2);
    let dy = sample_matrix(rows * cols, seed ^ 3);
    let (want_y, want_dx, want_dw, want_db) = l.reference(&x, &w, &b, &dy);
    let (bound_y, bound_dx, bound_dw, bound_db) = l.error_bounds(&x, &w, &b, &dy);
    let mut c = Builder::default();
    let (x, w, b, dy) = (c.f32(x), c.f32(w), c.f32(b), c.f32(dy));
    let y = c.zeros(rows * cols);
    let (mean, rstd) = (c.zeros(l.saved_mean_len()), c.zeros(rows));
    let dx = c.zeros(rows * cols);
    let (dw, db) = (c.zeros(cols), c.zeros(cols));
    c.step(l.forward(), [x, w, b, y, mean, rstd]);
    c.step(l.backward_x(), [x, w, mean, rstd, dy, dx]);
    c.step(l.backward_params(), [x, mean, rstd, dy, dw, db]);
    c.expect_within("y", y, want_y, bound_y);
    c.expect_within("dx", dx, want_dx, bound_dx);
    c.expect_within("dw", dw, want_dw, bound_dw);
    c.expect_within("db", db, want_db, bound_db);
    c.build(format!(
        "layer_norm({rows}x{cols} around {centre} by {spread})"
    ))
}

/// A BatchNorm check's inputs.
pub struct BatchNormInputs {
    pub x: Vec<f32>,
    pub w: Vec<f32>,
    pub b: Vec<f32>,
    /// Running mean and variance before the step.
    pub rm: Vec<f32>,
    pub rv: Vec<f32>,
    pub dy: Vec<f32>,
}

/// Inputs for `bn`: `x` within `spread` of `centre`, positive running
/// variances, everything else in `[-1, 1)`.
pub fn batch_norm_inputs(bn: &BatchNorm, centre: f32, spread: f32, seed: u64) -> BatchNormInputs {
    let (len, channels) = (bn.n * bn.channels * bn.spatial, bn.channels);
    BatchNormInputs {
        x: sample_matrix(len, seed)
            .iter()
            .map(|v| centre + v * spread)
            .collect(),
        w: sample_matrix(channels, seed ^ 1),
        b: sample_matrix(channels, seed ^ 2),
        rm: sample_matrix(channels, seed ^ 3),
        rv: sample_matrix(channels, seed ^ 4)
            .iter()
            .map(|v| v.abs() + 0.5)
            .collect(),
        dy: sample_matrix(len, seed ^ 5),
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
    let BatchNormInputs {
        x,
        w,
        b,
        rm,
        rv,
        dy,
    } = batch_norm_inputs(&bn, 1.0, 2.0, seed);
    let want_eval = bn.reference_eval(&x, &w, &b, (&rm, &rv));
    let (want_y, want_rm, want_rv, want_dx, want_dw, want_db) =
        bn.reference_train(&x, &w, &b, (&rm, &rv), &dy);
    let bound = bn.error_bounds(&x, &w, &b, (&rm, &rv), &dy);
    let mut c = Builder::default();
    let (x, w, b, rm, rv) = (c.f32(x), c.f32(w), c.f32(b), c.f32(rm), c.f32(rv));
    let y = c.zeros(len);
    let (save_mean, save_rstd) = (c.zeros(channels), c.zeros(channels));
    let dy = c.f32(dy);
    let dx = c.zeros(len);
    let (dw, db) = (c.zeros(channels), c.zeros(channels));
    let eval_y = c.zeros(len);
    // Evaluation first, on the statistics training then updates.
    c.step(bn.forward_eval(), [x, w, b, rm, rv, eval_y]);
    c.step(
        bn.forward_train(),
        [x, w, b, rm, rv, y, save_mean, save_rstd],
    );
    c.step(
        bn.backward_train(),
        [x, w, save_mean, save_rstd, dy, dx, dw, db],
    );
    c.expect_within("eval y", eval_y, want_eval, bound.eval_y);
    c.expect_within("y", y, want_y, bound.y);
    c.expect_within("running_mean", rm, want_rm, bound.running_mean);
    c.expect_within("running_var", rv, want_rv, bound.running_var);
    c.expect_within("dx", dx, want_dx, bound.dx);
    c.expect_within("dw", dw, want_dw, bound.dw);
    c.expect_within("db", db, want_db, bound.db);
    c.build(format!("batch_norm({n}x{channels}x{spatial})"))
}
