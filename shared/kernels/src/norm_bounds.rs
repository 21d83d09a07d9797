//! How far BatchNorm's kernels may be from the exact values, element by
//! element: the first-order error of each f32 operation in the order the
//! kernels do them ([`BatchNorm::forward_train`], `forward_eval`,
//! `backward_train`), with WGSL's stated accuracy for division and
//! `inverseSqrt` and the worst-case bound of each workgroup sum, doubled
//! ([`SAFETY`]) for the terms a first-order model leaves out, plus the
//! reference's own rounding to f32. The same model as
//! [`crate::norm::LayerNorm::error_bounds`], over a channel instead of a row.

use crate::accuracy::{DIV, INVERSE_SQRT, SAFETY, U, workgroup_sum_error};
use crate::norm::{BN_THREADS, BatchNorm};

/// The error of one of the kernels' per-channel sums.
fn sum_error(n: usize, abs_total: f64) -> f64 {
    workgroup_sum_error(n, BN_THREADS as usize, abs_total)
}

/// Per-element bounds of every output the BatchNorm kernels write.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchNormBounds {
    pub eval_y: Vec<f32>,
    pub y: Vec<f32>,
    pub running_mean: Vec<f32>,
    pub running_var: Vec<f32>,
    pub dx: Vec<f32>,
    pub dw: Vec<f32>,
    pub db: Vec<f32>,
}

/// The distance between two f32 evaluations of a value whose kernel error
/// is `error`: the kernel's, doubled, and the reference's rounding.
fn between(error: f64, value: f64) -> f32 {
    (SAFETY * error + U * value.abs()) as f32
}

impl BatchNorm {
    /// Bounds for inputs `x`, `w`, `b`, running statistics `(mean, var)`
    /// before the step, and `dy`.
    pub fn error_bounds(
        &self,
        x: &[f32],
        w: &[f32],
        b: &[f32],
        running: (&[f32], &[f32]),
        dy: &[f32],
    ) -> BatchNormBounds {
        let ch = self.channels;
        let m = self.per_channel();
        let mf = m as f64;
        let at = |c: usize, j: usize| self.index(c, j);
        let eps = f64::from(self.eps);
        let mom = f64::from(self.momentum);
        // The WGSL literal `1 - momentum` is rounded to f32; the reference
        // computes it in f64.
        let keep = 1.0 - mom;
        let mut out = BatchNormBounds {
            eval_y: vec![0.0; x.len()],
            y: vec![0.0; x.len()],
            running_mean: vec![0.0; ch],
            running_var: vec![0.0; ch],
            dx: vec![0.0; x.len()],
            dw: vec![0.0; ch],
            db: vec![0.0; ch],
        };
        for c in 0..ch {
            let (wc, bc) = (f64::from(w[c]), f64::from(b[c]));
            let xs: Vec<f64> = (0..m).map(|j| f64::from(x[at(c, j)])).collect();
            let abs_x: f64 = xs.iter().map(|v| v.abs()).sum();
            let mu = xs.iter().sum::<f64>() / mf;
            let e_mu = sum_error(m, abs_x) / mf + DIV * mu.abs();
            let d: Vec<f64> = xs.iter().map(|v| v - mu).collect();
            let e_d: Vec<f64> = d.iter().map(|v| e_mu + U * v.abs()).collect();
            let var_sum: f64 = d.iter().map(|v| v * v).sum();
            let e_vs = d
                .iter()
                .zip(&e_d)
                .map(|(v, e)| 2.0 * v.abs() * e + U * v * v)
                .sum::<f64>()
                + sum_error(m, var_sum);
            let var = var_sum / mf;
            let den = var + eps;
            let e_den = e_vs / mf + DIV * var + U * den;
            let r = 1.0 / den.sqrt();
            let e_r = r * (0.5 * e_den / den + INVERSE_SQRT);
            let xh: Vec<f64> = d.iter().map(|v| v * r).collect();
            let e_xh: Vec<f64> = (0..m)
                .map(|j| r * e_d[j] + d[j].abs() * e_r + U * xh[j].abs())
                .collect();
            // Training forward: ((x - mu) * r) * w + b.
            for j in 0..m {
                let scaled = xh[j] * wc;
                let y = scaled + bc;
                let e = wc.abs() * e_xh[j] + U * scaled.abs() + U * y.abs();
                out.y[at(c, j)] = between(e, y);
            }
            // Running statistics.
            let (rm, rv) = (f64::from(running.0[c]), f64::from(running.1[c]));
            let kept_mean = keep * rm;
            let new_mean = mom * mu + kept_mean;
            let e =
                mom * e_mu + U * (mom * mu).abs() + 2.0 * U * kept_mean.abs() + U * new_mean.abs();
            out.running_mean[c] = between(e, new_mean);
            let unbiased = (m.max(2) - 1) as f64;
            let vu = var_sum / unbiased;
            let kept_var = keep * rv;
            let new_var = mom * vu + kept_var;
            let e = mom * (e_vs / unbiased + DIV * vu)
                + U * (mom * vu).abs()
                + 2.0 * U * kept_var.abs()
                + U * new_var.abs();
            out.running_var[c] = between(e, new_var);
            // Evaluation forward: ((x - rm) * inverseSqrt(rv + eps)) * w + b.
            let re = 1.0 / (rv + eps).sqrt();
            let rel_re = 0.5 * U + INVERSE_SQRT;
            for j in 0..m {
                let dv = xs[j] - rm;
                let t = dv * re;
                let scaled = t * wc;
                let y = scaled + bc;
                let e_t = re * U * dv.abs() + t.abs() * rel_re + U * t.abs();
                let e = wc.abs() * e_t + U * scaled.abs() + U * y.abs();
                out.eval_y[at(c, j)] = between(e, y);
            }
            // Backward: sums of dy and dy * xhat, then
            // dx = (w r) (dy - s1 / M - xhat s2 / M).
            let g: Vec<f64> = (0..m).map(|j| f64::from(dy[at(c, j)])).collect();
            let abs_g: f64 = g.iter().map(|v| v.abs()).sum();
            let s1: f64 = g.iter().sum();
            let e_s1 = sum_error(m, abs_g);
            let terms: Vec<f64> = (0..m).map(|j| g[j] * xh[j]).collect();
            let abs_terms: f64 = terms.iter().map(|v| v.abs()).sum();
            let s2: f64 = terms.iter().sum();
            let e_s2 = (0..m)
                .map(|j| g[j].abs() * e_xh[j] + U * terms[j].abs())
                .sum::<f64>()
                + sum_error(m, abs_terms);
            out.db[c] = between(e_s1, s1);
            out.dw[c] = between(e_s2, s2);
            let scale = wc * r;
            let e_scale = wc.abs() * e_r + U * scale.abs();
            let a = s1 / mf;
            let e_a = e_s1 / mf + DIV * a.abs();
            for j in 0..m {
                let bq = xh[j] * s2;
                let e_bq = xh[j].abs() * e_s2 + s2.abs() * e_xh[j] + U * bq.abs();
                let q = bq / mf;
                let e_q = e_bq / mf + DIV * q.abs();
                let first = g[j] - a;
                let inner = first - q;
                let e_inner = e_a + e_q + U * first.abs() + U * inner.abs();
                let dx = scale * inner;
                let e = scale.abs() * e_inner + inner.abs() * e_scale + U * dx.abs();
                out.dx[at(c, j)] = between(e, dx);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::{BatchNormInputs, batch_norm_inputs};

    /// A sum in the kernels' order: strided per invocation, then a tree.
    fn wg_sum(values: impl Iterator<Item = f32>) -> f32 {
        let t = BN_THREADS as usize;
        let mut partial = vec![0.0f32; t];
        for (j, v) in values.enumerate() {
            partial[j % t] += v;
        }
        let mut half = t / 2;
        while half > 0 {
            for i in 0..half {
                partial[i] += partial[i + half];
            }
            half /= 2;
        }
        partial[0]
    }

    /// `v` moved `ulps` ULPs away from zero: a GPU using the slack WGSL
    /// allows its division and `inverseSqrt`.
    fn slack(v: f32, ulps: u32) -> f32 {
        (0..ulps).fold(v, |v, _| if v >= 0.0 { v.next_up() } else { v.next_down() })
    }

    /// The kernels' operations in their order in f32, with every division
    /// 2 ULPs and every `inverseSqrt` 2 ULPs off: `(eval_y, y, rm, rv, dx,
    /// dw, db)`.
    #[allow(clippy::type_complexity)]
    fn emulate(
        bn: &BatchNorm,
        x: &[f32],
        w: &[f32],
        b: &[f32],
        (rm, rv): (&[f32], &[f32]),
        dy: &[f32],
    ) -> [Vec<f32>; 7] {
        let ch = bn.channels;
        let m = bn.per_channel();
        let at = |c: usize, j: usize| bn.index(c, j);
        let div = |a: f32, b: f32| slack(a / b, 2);
        let inv_sqrt = |v: f32| slack(1.0 / v.sqrt(), 2);
        let keep = 1.0 - bn.momentum;
        let mut out: [Vec<f32>; 7] = [
            vec![0.0; x.len()],
            vec![0.0; x.len()],
            vec![0.0; ch],
            vec![0.0; ch],
            vec![0.0; x.len()],
            vec![0.0; ch],
            vec![0.0; ch],
        ];
        for c in 0..ch {
            let re = inv_sqrt(rv[c] + bn.eps);
            for j in 0..m {
                out[0][at(c, j)] = (x[at(c, j)] - rm[c]) * re * w[c] + b[c];
            }
            let mu = div(wg_sum((0..m).map(|j| x[at(c, j)])), m as f32);
            let vs = wg_sum((0..m).map(|j| {
                let d = x[at(c, j)] - mu;
                d * d
            }));
            let r = inv_sqrt(div(vs, m as f32) + bn.eps);
            for j in 0..m {
                out[1][at(c, j)] = (x[at(c, j)] - mu) * r * w[c] + b[c];
            }
            out[2][c] = bn.momentum * mu + keep * rm[c];
            out[3][c] = bn.momentum * div(vs, (m.max(2) - 1) as f32) + keep * rv[c];
            let s1 = wg_sum((0..m).map(|j| dy[at(c, j)]));
            let s2 = wg_sum((0..m).map(|j| dy[at(c, j)] * ((x[at(c, j)] - mu) * r)));
            let scale = w[c] * r;
            for j in 0..m {
                let xh = (x[at(c, j)] - mu) * r;
                out[4][at(c, j)] =
                    scale * (dy[at(c, j)] - div(s1, m as f32) - div(xh * s2, m as f32));
            }
            out[5][c] = s2;
            out[6][c] = s1;
        }
        out
    }

    fn case(n: usize, channels: usize, spatial: usize, centre: f32, spread: f32, seed: u64) {
        let bn = BatchNorm {
            n,
            channels,
            spatial,
            eps: 1e-5,
            momentum: 0.1,
        };
        let BatchNormInputs {
            x,
            w,
            b,
            rm,
            rv,
            dy,
        } = batch_norm_inputs(&bn, centre, spread, seed);
        let eval = bn.reference_eval(&x, &w, &b, (&rm, &rv));
        let (y, nrm, nrv, dx, dw, db) = bn.reference_train(&x, &w, &b, (&rm, &rv), &dy);
        let bounds = bn.error_bounds(&x, &w, &b, (&rm, &rv), &dy);
        let got = emulate(&bn, &x, &w, &b, (&rm, &rv), &dy);
        let expected = [eval, y, nrm, nrv, dx, dw, db];
        let bound = [
            &bounds.eval_y,
            &bounds.y,
            &bounds.running_mean,
            &bounds.running_var,
            &bounds.dx,
            &bounds.dw,
            &bounds.db,
        ];
        let names = [
            "eval y",
            "y",
            "running_mean",
            "running_var",
            "dx",
            "dw",
            "db",
        ];
        for k in 0..7 {
            for (i, ((g, e), bd)) in got[k].iter().zip(&expected[k]).zip(bound[k]).enumerate() {
                let err = (f64::from(*g) - f64::from(*e)).abs();
                assert!(
                    err <= f64::from(*bd),
                    "{}[{i}] of {n}x{channels}x{spatial} around {centre} by {spread}: \
                     {g} vs {e}, error {err:e} over its bound {bd:e}",
                    names[k]
                );
            }
        }
    }

    #[test]
    fn batch_norm_in_f32_with_wgsls_slack_stays_within_its_error_bounds() {
        for seed in 0..3 {
            case(4, 3, 9, 1.0, 2.0, seed);
            case(64, 2, 1, 0.5, 3.0, seed);
            // Nearly equal values: the variance is far below eps.
            case(32, 2, 4, 3.0, 1e-3, seed);
            case(8, 4, 49, -20.0, 0.5, seed);
        }
    }

    #[test]
    fn batch_norm_error_bounds_are_tight_where_the_data_is_well_conditioned() {
        let bn = BatchNorm {
            n: 16,
            channels: 4,
            spatial: 64,
            eps: 1e-5,
            momentum: 0.1,
        };
        let len = 16 * 4 * 64;
        let x = crate::sample_matrix(len, 1);
        let (w, b) = (crate::sample_matrix(4, 2), crate::sample_matrix(4, 3));
        let dy = crate::sample_matrix(len, 4);
        let (rm, rv) = (vec![0.0; 4], vec![1.0; 4]);
        let (y, .., dx, _, _) = bn.reference_train(&x, &w, &b, (&rm, &rv), &dy);
        let bounds = bn.error_bounds(&x, &w, &b, (&rm, &rv), &dy);
        let max = |v: &[f32]| v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(
            max(&bounds.y) < 1e-4 * max(&y),
            "y bound {:e}",
            max(&bounds.y)
        );
        assert!(
            max(&bounds.dx) < 1e-3 * max(&dx),
            "dx bound {:e}",
            max(&bounds.dx)
        );
        assert!(
            max(&bounds.eval_y) < 1e-5,
            "eval bound {:e}",
            max(&bounds.eval_y)
        );
    }
}
