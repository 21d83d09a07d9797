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
    /// Elements of the `mean` buffer the forward saves: each row's mean as
    /// f32 (`mean[i]`), then its residual (`mean[rows + i]`, the mean of
    /// `x - mean[i]`), so centred values stay accurate when a row's values
    /// are nearly equal and the f32 mean alone loses most of their spread.
    pub fn saved_mean_len(&self) -> usize {
        2 * self.rows
    }

    /// WGSL for `xc`, row `i`'s element `c` centred with the corrected mean.
    fn centred(&self, row: &str, col: &str) -> String {
        let (d, rows) = (self.cols, self.rows);
        format!("((x[{row} * {d}u + {col}] - mean[{row}]) - mean[{rows}u + {row}])")
    }

    /// Forward, one invocation per row: bindings `x`, `w`, `b`, `y`, `mean`
    /// ([`Self::saved_mean_len`]) and `rstd` (per row, kept for the
    /// backward). The variance is the corrected two-pass one: `(sum t^2 -
    /// (sum t)^2 / d) / d` with `t = x - mean`.
    pub fn forward(&self) -> KernelSpec {
        let (d, rows) = (self.cols, self.rows);
        let xc = self.centred("i", "c");
        let body = format!(
            "    let base = i * {d}u;\n    var sum = 0.0;\n    for (var c = 0u; c < {d}u; c += 1u) {{ sum += x[base + c]; }}\n\
             \x20   let mu = sum / f32({d});\n    var s0 = 0.0;\n    var sq = 0.0;\n\
             \x20   for (var c = 0u; c < {d}u; c += 1u) {{ let t = x[base + c] - mu; s0 += t; sq += t * t; }}\n\
             \x20   let lo = s0 / f32({d});\n\
             \x20   let r = inverseSqrt(max(sq - s0 * lo, 0.0) / f32({d}) + {eps});\n\
             \x20   mean[i] = mu;\n    mean[{rows}u + i] = lo;\n    rstd[i] = r;\n\
             \x20   for (var c = 0u; c < {d}u; c += 1u) {{ y[base + c] = {xc} * r * w[c] + b[c]; }}",
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

    /// `dx = rstd (g - mean(g) - xc sum(g xc) rstd^2 / d)` with `g = dy w`,
    /// one invocation per row: bindings `x`, `w`, `mean`, `rstd`, `dy`,
    /// `dx`. With few columns the bracket nearly cancels (over two columns
    /// it is `(1 - var rstd^2)` times its terms), so its error is measured
    /// against the terms: see [`Self::error_bounds`].
    pub fn backward_x(&self) -> KernelSpec {
        let d = self.cols;
        let xc = self.centred("i", "c");
        let body = format!(
            "    let base = i * {d}u;\n    let r = rstd[i];\n    var s1 = 0.0;\n    var s2 = 0.0;\n\
             \x20   for (var c = 0u; c < {d}u; c += 1u) {{ let g = dy[base + c] * w[c]; s1 += g; s2 += g * {xc}; }}\n\
             \x20   let m1 = s1 / f32({d});\n    let k = s2 * r * r / f32({d});\n\
             \x20   for (var c = 0u; c < {d}u; c += 1u) {{ dx[base + c] = r * ((dy[base + c] * w[c] - m1) - {xc} * k); }}"
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
        let xc = self.centred("r", "i");
        let body = format!(
            "    var sw = 0.0;\n    var sb = 0.0;\n\
             \x20   for (var r = 0u; r < {rows}u; r += 1u) {{ let g = dy[r * {d}u + i]; sw += g * ({xc} * rstd[r]); sb += g; }}\n\
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

    /// How far the kernels' `(y, dx, dw, db)` may be from the exact values,
    /// element by element: the first-order error of each f32 operation in
    /// the order the kernels do them, with WGSL's stated accuracy for
    /// division and `inverseSqrt` and the worst-case bound for each sum,
    /// doubled for the terms a first-order model leaves out.
    pub fn error_bounds(
        &self,
        x: &[f32],
        w: &[f32],
        b: &[f32],
        dy: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        use crate::accuracy::{DIV, INVERSE_SQRT, SAFETY, U, sum_error};
        let (d, rows) = (self.cols, self.rows);
        let df = d as f64;
        let mut by = vec![0.0f32; x.len()];
        let mut bdx = vec![0.0f32; x.len()];
        let mut bdw = vec![0.0f64; d];
        let mut bdb = vec![0.0f64; d];
        let mut dw_terms = vec![0.0f64; d];
        let (mut dw, mut db) = (vec![0.0f64; d], vec![0.0f64; d]);
        for r in 0..rows {
            let at = |c: usize| r * d + c;
            let row: Vec<f64> = (0..d).map(|c| f64::from(x[at(c)])).collect();
            let mu = row.iter().sum::<f64>() / df;
            let xc: Vec<f64> = row.iter().map(|v| v - mu).collect();
            let abs_xc: f64 = xc.iter().map(|v| v.abs()).sum();
            let s = xc.iter().map(|v| v * v).sum::<f64>();
            let var = s / df;
            let rs = 1.0 / (var + f64::from(self.eps)).sqrt();
            // `t = x - mean` and `t - lo`, each rounded, plus the error of
            // `lo` (a sum of `d` values of about `|xc|`, then a division).
            let e_xc: Vec<f64> = xc
                .iter()
                .map(|v| 2.0 * U * v.abs() + (sum_error(d, abs_xc) + U * abs_xc) / df)
                .collect();
            let e_s = 2.0 * xc.iter().zip(&e_xc).map(|(v, e)| v.abs() * e).sum::<f64>()
                + sum_error(d, s)
                + U * s;
            let e_var = e_s / df + DIV * var;
            let e_denominator = e_var + U * (var + f64::from(self.eps));
            let rel_r = 0.5 * e_denominator / (var + f64::from(self.eps)) + INVERSE_SQRT;
            let xh: Vec<f64> = xc.iter().map(|v| v * rs).collect();
            let e_xh: Vec<f64> = (0..d)
                .map(|c| rs * e_xc[c] + xh[c].abs() * (rel_r + U))
                .collect();
            let g: Vec<f64> = (0..d)
                .map(|c| f64::from(dy[at(c)]) * f64::from(w[c]))
                .collect();
            let abs_g: f64 = g.iter().map(|v| v.abs()).sum();
            let m1 = g.iter().sum::<f64>() / df;
            let e_m1 = (sum_error(d, abs_g) + U * abs_g) / df + DIV * m1.abs();
            let s2: f64 = g.iter().zip(&xc).map(|(a, b)| a * b).sum();
            let abs_gxc: f64 = g.iter().zip(&xc).map(|(a, b)| (a * b).abs()).sum();
            let e_s2 = g.iter().zip(&e_xc).map(|(a, e)| a.abs() * e).sum::<f64>()
                + 2.0 * U * abs_gxc
                + sum_error(d, abs_gxc);
            let k = s2 * rs * rs / df;
            let e_k = e_s2 * rs * rs / df + k.abs() * (2.0 * rel_r + 2.0 * U + DIV);
            for c in 0..d {
                let wc = f64::from(w[c]);
                let scaled = xh[c] * wc;
                let y = scaled + f64::from(b[c]);
                // The last `U |y|` is the reference's own rounding to f32.
                by[at(c)] = (SAFETY * (wc.abs() * e_xh[c] + U * scaled.abs() + U * y.abs())
                    + U * y.abs()) as f32;
                let a = g[c] - m1;
                let p = xc[c] * k;
                let t = a - p;
                let e_t = U * g[c].abs()
                    + e_m1
                    + U * a.abs()
                    + xc[c].abs() * e_k
                    + k.abs() * e_xc[c]
                    + U * p.abs()
                    + U * t.abs();
                let dx = rs * t;
                bdx[at(c)] = (SAFETY * (rs * e_t + t.abs() * rs * rel_r + U * dx.abs())) as f32;
                let dyv = f64::from(dy[at(c)]);
                bdw[c] += dyv.abs() * e_xh[c] + 2.0 * U * (dyv * xh[c]).abs();
                dw_terms[c] += (dyv * xh[c]).abs();
                dw[c] += dyv * xh[c];
                db[c] += dyv;
                bdb[c] += dyv.abs();
            }
        }
        let bdw = (0..d)
            .map(|c| (SAFETY * (bdw[c] + sum_error(rows, dw_terms[c])) + U * dw[c].abs()) as f32)
            .collect();
        let bdb = bdb
            .iter()
            .zip(&db)
            .map(|(&total, sum)| (SAFETY * sum_error(rows, total) + U * sum.abs()) as f32)
            .collect();
        (by, bdx, bdw, bdb)
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
pub(crate) const BN_THREADS: u32 = 64;

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
    /// Elements per channel: batch times space.
    pub fn per_channel(&self) -> usize {
        self.n * self.spatial
    }

    /// The flat index in `[n, channels, spatial]` of channel `c`'s `j`-th
    /// element (batch-major, then space).
    pub fn index(&self, c: usize, j: usize) -> usize {
        let (ch, sp) = (self.channels, self.spatial);
        (j / sp) * ch * sp + c * sp + j % sp
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
        let ch = self.channels;
        let m = self.per_channel();
        let at = |c: usize, j: usize| self.index(c, j);
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

    /// The kernels' operations in their order, in f32 with correct
    /// rounding (one implementation WGSL allows): `(y, dx, dw)`.
    fn emulate(l: &LayerNorm, x: &[f32], w: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (rows, d) = (l.rows, l.cols);
        let (mut y, mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; x.len()], vec![0.0; d]);
        let mut stats = Vec::new();
        for r in 0..rows {
            let row = &x[r * d..(r + 1) * d];
            let mu = row.iter().fold(0.0f32, |a, v| a + v) / d as f32;
            let (mut s0, mut sq) = (0.0f32, 0.0f32);
            for v in row {
                let t = v - mu;
                s0 += t;
                sq += t * t;
            }
            let lo = s0 / d as f32;
            let rs = 1.0 / ((sq - s0 * lo).max(0.0) / d as f32 + l.eps).sqrt();
            let xc = |c: usize| (row[c] - mu) - lo;
            let (mut s1, mut s2) = (0.0f32, 0.0f32);
            for c in 0..d {
                let g = dy[r * d + c] * w[c];
                s1 += g;
                s2 += g * xc(c);
                y[r * d + c] = xc(c) * rs * w[c];
            }
            let (m1, k) = (s1 / d as f32, s2 * rs * rs / d as f32);
            for c in 0..d {
                dx[r * d + c] = rs * ((dy[r * d + c] * w[c] - m1) - xc(c) * k);
            }
            stats.push((mu, lo, rs));
        }
        for (c, out) in dw.iter_mut().enumerate() {
            for (r, &(mu, lo, rs)) in stats.iter().enumerate() {
                *out += dy[r * d + c] * (((x[r * d + c] - mu) - lo) * rs);
            }
        }
        (y, dx, dw)
    }

    /// Rows whose values spread by `spread` around `centre`.
    fn rows_near(rows: usize, cols: usize, centre: f32, spread: f32, seed: u64) -> Vec<f32> {
        crate::sample_matrix(rows * cols, seed)
            .iter()
            .map(|v| centre + v * spread)
            .collect()
    }

    fn within(what: &str, got: &[f32], want: &[f32], bound: &[f32]) {
        for (i, ((g, w), b)) in got.iter().zip(want).zip(bound).enumerate() {
            let err = (f64::from(*g) - f64::from(*w)).abs();
            assert!(
                err <= f64::from(*b),
                "{what}[{i}]: {g} vs {w}, error {err:e} over its bound {b:e}"
            );
        }
    }

    #[test]
    fn layer_norm_in_f32_stays_within_its_error_bounds_even_over_two_nearly_equal_values() {
        for (rows, cols, centre, spread) in [
            (12, 2, 0.5, 3.0),
            (40, 2, 3.0, 1e-2),
            (40, 2, 3.0, 1e-3),
            (20, 3, -7.0, 1e-3),
            (8, 64, 0.5, 3.0),
            (8, 768, 100.0, 0.1),
        ] {
            let l = LayerNorm {
                rows,
                cols,
                eps: 1e-5,
            };
            for seed in 0..4u64 {
                let x = rows_near(rows, cols, centre, spread, seed);
                let w = crate::sample_matrix(cols, seed ^ 1);
                let dy = crate::sample_matrix(rows * cols, seed ^ 3);
                let (want_y, want_dx, want_dw, _) = l.reference(&x, &w, &vec![0.0; cols], &dy);
                let (by, bdx, bdw, _) = l.error_bounds(&x, &w, &vec![0.0; cols], &dy);
                let (y, dx, dw) = emulate(&l, &x, &w, &dy);
                let case = format!("{rows}x{cols} around {centre} by {spread}, seed {seed}");
                within(&format!("y ({case})"), &y, &want_y, &by);
                within(&format!("dx ({case})"), &dx, &want_dx, &bdx);
                within(&format!("dw ({case})"), &dw, &want_dw, &bdw);
            }
        }
    }

    #[test]
    fn layer_norm_error_bounds_are_tight_where_the_data_is_well_conditioned() {
        let l = LayerNorm {
            rows: 16,
            cols: 256,
            eps: 1e-5,
        };
        let x = rows_near(16, 256, 0.5, 3.0, 7);
        let w = crate::sample_matrix(256, 8);
        let dy = crate::sample_matrix(16 * 256, 9);
        let (_, want_dx, ..) = l.reference(&x, &w, &vec![0.0; 256], &dy);
        let (by, bdx, ..) = l.error_bounds(&x, &w, &vec![0.0; 256], &dy);
        let scale = want_dx.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let worst = bdx.iter().fold(0.0f32, |m, v| m.max(*v));
        assert!(
            worst < 1e-4 * scale,
            "dx bound {worst:e} against values up to {scale:e}"
        );
        assert!(
            by.iter().all(|b| *b < 1e-4),
            "y bounds up to {:e}",
            by.iter().fold(0.0f32, |m, v| m.max(*v))
        );
    }
}
