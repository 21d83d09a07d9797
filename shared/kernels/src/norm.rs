//! Normalisations: LayerNorm over the trailing `cols` elements of each row
//! (biased variance, as torch), and BatchNorm over `[N, C, spatial]` in
//! training mode (batch statistics, running statistics updated with torch's
//! unbiased variance) and eval mode (running statistics). Backward for
//! LayerNorm (x, weight, bias) and training-mode BatchNorm (x, weight, bias).
//! Weight and bias are always bound; a LayerNorm without them binds ones and
//! zeros.

use super::reduce::wg_sum_wgsl;
use super::spec::{Binding, DEFAULT_WORKGROUP, KernelSpec, declare, f32_lit, kinds, one_d};

/// LayerNorm over rows of `cols` elements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNorm {
    pub rows: usize,
    pub cols: usize,
    pub eps: f32,
}

impl LayerNorm {
    /// Forward, one invocation per row: bindings `x`, `w`, `b`, `y`, `mean`
    /// and `rstd` (per row, kept for the backward).
    pub fn forward(&self) -> KernelSpec {
        let d = self.cols;
        let body = format!(
            "    let base = i * {d}u;\n    var sum = 0.0;\n    for (var c = 0u; c < {d}u; c += 1u) {{ sum += x[base + c]; }}\n\
             \x20   let mu = sum / f32({d});\n    var sq = 0.0;\n\
             \x20   for (var c = 0u; c < {d}u; c += 1u) {{ let t = x[base + c] - mu; sq += t * t; }}\n\
             \x20   let r = inverseSqrt(sq / f32({d}) + {eps});\n    mean[i] = mu;\n    rstd[i] = r;\n\
             \x20   for (var c = 0u; c < {d}u; c += 1u) {{ y[base + c] = (x[base + c] - mu) * r * w[c] + b[c]; }}",
            eps = f32_lit(self.eps)
        );
        one_d(
            "layer_norm_fwd",
            &[
                ("x", Binding::Read, "f32"),
                ("w", Binding::Read, "f32"),
                ("b", Binding::Read, "f32"),
                ("y", Binding::ReadWrite, "f32"),
                ("mean", Binding::ReadWrite, "f32"),
                ("rstd", Binding::ReadWrite, "f32"),
            ],
            "",
            self.rows,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// `dx = rstd (dy w - mean(dy w) - xhat mean(dy w xhat))`, one
    /// invocation per row: bindings `x`, `w`, `mean`, `rstd`, `dy`, `dx`.
    pub fn backward_x(&self) -> KernelSpec {
        let d = self.cols;
        let body = format!(
            "    let base = i * {d}u;\n    let mu = mean[i];\n    let r = rstd[i];\n    var s1 = 0.0;\n    var s2 = 0.0;\n\
             \x20   for (var c = 0u; c < {d}u; c += 1u) {{ let g = dy[base + c] * w[c]; s1 += g; s2 += g * (x[base + c] - mu) * r; }}\n\
             \x20   let m1 = s1 / f32({d});\n    let m2 = s2 / f32({d});\n\
             \x20   for (var c = 0u; c < {d}u; c += 1u) {{ let xh = (x[base + c] - mu) * r; dx[base + c] = r * (dy[base + c] * w[c] - m1 - xh * m2); }}"
        );
        one_d(
            "layer_norm_bwd_x",
            &[
                ("x", Binding::Read, "f32"),
                ("w", Binding::Read, "f32"),
                ("mean", Binding::Read, "f32"),
                ("rstd", Binding::Read, "f32"),
                ("dy", Binding::Read, "f32"),
                ("dx", Binding::ReadWrite, "f32"),
            ],
            "",
            self.rows,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// `dw = sum_rows dy xhat`, `db = sum_rows dy`, one invocation per
    /// column: bindings `x`, `mean`, `rstd`, `dy`, `dw`, `db`.
    pub fn backward_params(&self) -> KernelSpec {
        let (rows, d) = (self.rows, self.cols);
        let body = format!(
            "    var sw = 0.0;\n    var sb = 0.0;\n\
             \x20   for (var r = 0u; r < {rows}u; r += 1u) {{ let g = dy[r * {d}u + i]; sw += g * (x[r * {d}u + i] - mean[r]) * rstd[r]; sb += g; }}\n\
             \x20   dw[i] = sw;\n    db[i] = sb;"
        );
        one_d(
            "layer_norm_bwd_params",
            &[
                ("x", Binding::Read, "f32"),
                ("mean", Binding::Read, "f32"),
                ("rstd", Binding::Read, "f32"),
                ("dy", Binding::Read, "f32"),
                ("dw", Binding::ReadWrite, "f32"),
                ("db", Binding::ReadWrite, "f32"),
            ],
            "",
            d,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// CPU reference in f64: `(y, dx, dw, db)`.
    pub fn reference(
        &self,
        x: &[f32],
        w: &[f32],
        b: &[f32],
        dy: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let d = self.cols;
        let mut y = vec![0.0; x.len()];
        let mut dx = vec![0.0; x.len()];
        let mut dw = vec![0.0f64; d];
        let mut db = vec![0.0f64; d];
        for r in 0..self.rows {
            let row: Vec<f64> = x[r * d..(r + 1) * d]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            let mu = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / d as f64;
            let rs = 1.0 / (var + f64::from(self.eps)).sqrt();
            let xh: Vec<f64> = row.iter().map(|v| (v - mu) * rs).collect();
            let g: Vec<f64> = (0..d)
                .map(|c| f64::from(dy[r * d + c]) * f64::from(w[c]))
                .collect();
            let m1 = g.iter().sum::<f64>() / d as f64;
            let m2 = g.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / d as f64;
            for c in 0..d {
                y[r * d + c] = (xh[c] * f64::from(w[c]) + f64::from(b[c])) as f32;
                dx[r * d + c] = (rs * (g[c] - m1 - xh[c] * m2)) as f32;
                dw[c] += f64::from(dy[r * d + c]) * xh[c];
                db[c] += f64::from(dy[r * d + c]);
            }
        }
        let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect();
        (y, dx, f(dw), f(db))
    }
}

/// Threads per channel of the BatchNorm kernels.
const BN_THREADS: u32 = 64;

/// BatchNorm over `x [n, channels, spatial]` (spatial = product of the
/// trailing dimensions).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchNorm {
    pub n: usize,
    pub channels: usize,
    pub spatial: usize,
    pub eps: f32,
    pub momentum: f32,
}

impl BatchNorm {
    fn per_channel(&self) -> usize {
        self.n * self.spatial
    }

    /// One workgroup per channel; `body` sees `c`, `lid`, `M` and `at(j)`,
    /// the flat index of the channel's `j`-th element.
    fn per_channel_spec(
        &self,
        label: &str,
        bindings: &[(&str, Binding, &str)],
        body: &str,
    ) -> KernelSpec {
        let (ch, sp) = (self.channels, self.spatial);
        let m = self.per_channel();
        let decls = declare(bindings);
        let wgsl = format!(
            "// {label}: generated by rookery_kernels.\n{decls}\n{red}\n\
             fn at(c: u32, j: u32) -> u32 {{ return (j / {sp}u) * {ch}u * {sp}u + c * {sp}u + j % {sp}u; }}\n\
             @compute @workgroup_size({t}, 1, 1)\n\
             fn main(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {{\n\
             \x20   let c = group.x;\n    let lid = local.x;\n    let M = {m}u;\n{body}\n}}\n",
            red = wg_sum_wgsl(BN_THREADS),
            t = BN_THREADS,
        );
        KernelSpec {
            label: label.into(),
            wgsl,
            entry: "main",
            bindings: kinds(bindings),
            workgroups: [ch as u32, 1, 1],
        }
    }

    /// Training forward: batch mean and biased variance per channel
    /// (two-pass), `y`, the saved mean and `rstd` for the backward, and the
    /// running statistics updated in place (`running_var` with the unbiased
    /// variance). Bindings `x`, `w`, `b`, `running_mean`, `running_var`, `y`,
    /// `save_mean`, `save_rstd`.
    pub fn forward_train(&self) -> KernelSpec {
        let m = self.per_channel();
        let t = BN_THREADS;
        let body = format!(
            "    var s = 0.0;\n    for (var j = lid; j < M; j += {t}u) {{ s += x[at(c, j)]; }}\n\
             \x20   let mu = wg_sum(s, lid) / f32(M);\n\
             \x20   var q = 0.0;\n    for (var j = lid; j < M; j += {t}u) {{ let d = x[at(c, j)] - mu; q += d * d; }}\n\
             \x20   let var_sum = wg_sum(q, lid);\n    let r = inverseSqrt(var_sum / f32(M) + {eps});\n\
             \x20   for (var j = lid; j < M; j += {t}u) {{ let k = at(c, j); y[k] = (x[k] - mu) * r * w[c] + b[c]; }}\n\
             \x20   if (lid == 0u) {{\n        save_mean[c] = mu;\n        save_rstd[c] = r;\n\
             \x20       running_mean[c] = {mom} * mu + {keep} * running_mean[c];\n\
             \x20       running_var[c] = {mom} * (var_sum / {unbiased}) + {keep} * running_var[c];\n    }}",
            eps = f32_lit(self.eps),
            mom = f32_lit(self.momentum),
            keep = f32_lit(1.0 - self.momentum),
            unbiased = f32_lit((m.max(2) - 1) as f32),
        );
        self.per_channel_spec(
            "batch_norm_fwd_train",
            &[
                ("x", Binding::Read, "f32"),
                ("w", Binding::Read, "f32"),
                ("b", Binding::Read, "f32"),
                ("running_mean", Binding::ReadWrite, "f32"),
                ("running_var", Binding::ReadWrite, "f32"),
                ("y", Binding::ReadWrite, "f32"),
                ("save_mean", Binding::ReadWrite, "f32"),
                ("save_rstd", Binding::ReadWrite, "f32"),
            ],
            &body,
        )
    }

    /// Eval forward with the running statistics, elementwise: bindings `x`,
    /// `w`, `b`, `running_mean`, `running_var`, `y`.
    pub fn forward_eval(&self) -> KernelSpec {
        let (ch, sp) = (self.channels, self.spatial);
        one_d(
            "batch_norm_fwd_eval",
            &[
                ("x", Binding::Read, "f32"),
                ("w", Binding::Read, "f32"),
                ("b", Binding::Read, "f32"),
                ("running_mean", Binding::Read, "f32"),
                ("running_var", Binding::Read, "f32"),
                ("y", Binding::ReadWrite, "f32"),
            ],
            "",
            self.n * ch * sp,
            DEFAULT_WORKGROUP,
            &format!(
                "    let c = (i / {sp}u) % {ch}u;\n    y[i] = (x[i] - running_mean[c]) * inverseSqrt(running_var[c] + {}) * w[c] + b[c];",
                f32_lit(self.eps)
            ),
        )
    }

    /// Training backward: `dx = w rstd (dy - mean(dy) - xhat mean(dy xhat))`,
    /// `dw = sum dy xhat`, `db = sum dy`. Bindings `x`, `w`, `save_mean`,
    /// `save_rstd`, `dy`, `dx`, `dw`, `db`.
    pub fn backward_train(&self) -> KernelSpec {
        let t = BN_THREADS;
        let body = format!(
            "    let mu = save_mean[c];\n    let r = save_rstd[c];\n    var s1 = 0.0;\n    var s2 = 0.0;\n\
             \x20   for (var j = lid; j < M; j += {t}u) {{ let k = at(c, j); s1 += dy[k]; s2 += dy[k] * (x[k] - mu) * r; }}\n\
             \x20   let sum_dy = wg_sum(s1, lid);\n    let sum_dy_xhat = wg_sum(s2, lid);\n\
             \x20   let scale = w[c] * r;\n\
             \x20   for (var j = lid; j < M; j += {t}u) {{ let k = at(c, j); let xh = (x[k] - mu) * r; dx[k] = scale * (dy[k] - sum_dy / f32(M) - xh * sum_dy_xhat / f32(M)); }}\n\
             \x20   if (lid == 0u) {{ dw[c] = sum_dy_xhat; db[c] = sum_dy; }}"
        );
        self.per_channel_spec(
            "batch_norm_bwd_train",
            &[
                ("x", Binding::Read, "f32"),
                ("w", Binding::Read, "f32"),
                ("save_mean", Binding::Read, "f32"),
                ("save_rstd", Binding::Read, "f32"),
                ("dy", Binding::Read, "f32"),
                ("dx", Binding::ReadWrite, "f32"),
                ("dw", Binding::ReadWrite, "f32"),
                ("db", Binding::ReadWrite, "f32"),
            ],
            &body,
        )
    }

    /// CPU reference of training mode in f64: `(y, running_mean,
    /// running_var, dx, dw, db)` after one step from the given running
    /// statistics.
    #[allow(clippy::type_complexity)]
    pub fn reference_train(
        &self,
        x: &[f32],
        w: &[f32],
        b: &[f32],
        running: (&[f32], &[f32]),
        dy: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (ch, sp) = (self.channels, self.spatial);
        let m = self.per_channel();
        let at = |c: usize, j: usize| (j / sp) * ch * sp + c * sp + j % sp;
        let mut y = vec![0.0f32; x.len()];
        let mut dx = vec![0.0f32; x.len()];
        let (mut rm, mut rv, mut dw, mut db) =
            (vec![0.0; ch], vec![0.0; ch], vec![0.0; ch], vec![0.0; ch]);
        let mom = f64::from(self.momentum);
        for c in 0..ch {
            let vals: Vec<f64> = (0..m).map(|j| f64::from(x[at(c, j)])).collect();
            let mu = vals.iter().sum::<f64>() / m as f64;
            let var_sum: f64 = vals.iter().map(|v| (v - mu).powi(2)).sum();
            let r = 1.0 / (var_sum / m as f64 + f64::from(self.eps)).sqrt();
            let (mut s1, mut s2) = (0.0, 0.0);
            for j in 0..m {
                let xh = (vals[j] - mu) * r;
                y[at(c, j)] = (xh * f64::from(w[c]) + f64::from(b[c])) as f32;
                s1 += f64::from(dy[at(c, j)]);
                s2 += f64::from(dy[at(c, j)]) * xh;
            }
            for j in 0..m {
                let xh = (vals[j] - mu) * r;
                let g = f64::from(dy[at(c, j)]);
                dx[at(c, j)] =
                    (f64::from(w[c]) * r * (g - s1 / m as f64 - xh * s2 / m as f64)) as f32;
            }
            rm[c] = (mom * mu + (1.0 - mom) * f64::from(running.0[c])) as f32;
            rv[c] = (mom * var_sum / (m.max(2) - 1) as f64 + (1.0 - mom) * f64::from(running.1[c]))
                as f32;
            dw[c] = s2 as f32;
            db[c] = s1 as f32;
        }
        (y, rm, rv, dx, dw, db)
    }

    /// CPU reference of eval mode.
    pub fn reference_eval(
        &self,
        x: &[f32],
        w: &[f32],
        b: &[f32],
        running: (&[f32], &[f32]),
    ) -> Vec<f32> {
        let (ch, sp) = (self.channels, self.spatial);
        x.iter()
            .enumerate()
            .map(|(i, &v)| {
                let c = (i / sp) % ch;
                ((f64::from(v) - f64::from(running.0[c]))
                    / (f64::from(running.1[c]) + f64::from(self.eps)).sqrt()
                    * f64::from(w[c])
                    + f64::from(b[c])) as f32
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::validate;
    use super::*;

    #[test]
    fn norm_shaders_validate() {
        for (rows, cols) in [(1, 1), (7, 33), (100, 5)] {
            let l = LayerNorm {
                rows,
                cols,
                eps: 1e-5,
            };
            for s in [l.forward(), l.backward_x(), l.backward_params()] {
                validate::spec(&s);
            }
        }
        for (n, channels, spatial) in [(2, 1, 1), (4, 3, 25), (1, 16, 7)] {
            let b = BatchNorm {
                n,
                channels,
                spatial,
                eps: 1e-5,
                momentum: 0.1,
            };
            for s in [b.forward_train(), b.forward_eval(), b.backward_train()] {
                validate::spec(&s);
            }
        }
    }

    #[test]
    fn layer_norm_output_has_zero_mean_and_unit_variance() {
        let l = LayerNorm {
            rows: 1,
            cols: 4,
            eps: 0.0,
        };
        let (y, ..) = l.reference(&[1.0, 2.0, 3.0, 4.0], &[1.0; 4], &[0.0; 4], &[0.0; 4]);
        assert!(y.iter().sum::<f32>().abs() < 1e-6);
        assert!((y.iter().map(|v| v * v).sum::<f32>() / 4.0 - 1.0).abs() < 1e-6);
    }
}
