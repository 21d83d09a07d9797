//! Softmax and LogSoftmax along one axis, forward and backward, and the
//! workgroup tree reduction (`wg_sum`) the per-channel kernels share. A
//! tensor is seen as `[outer, axis, inner]`; one invocation owns one
//! `(outer, inner)` row along the axis.

use super::spec::{Binding, DEFAULT_WORKGROUP, KernelSpec, one_d};

/// WGSL: `wg_sum(v, lid)` sums `v` over a workgroup of `threads`
/// invocations (a power of two); every invocation gets the total. Must be
/// called in uniform control flow, as it holds barriers.
pub(crate) fn wg_sum_wgsl(threads: u32) -> String {
    format!(
        r"var<workgroup> red: array<f32, {threads}>;
fn wg_sum(v: f32, lid: u32) -> f32 {{
    red[lid] = v;
    workgroupBarrier();
    for (var s = {half}u; s > 0u; s = s / 2u) {{
        if (lid < s) {{
            red[lid] += red[lid + s];
        }}
        workgroupBarrier();
    }}
    let total = red[0];
    workgroupBarrier();
    return total;
}}
",
        half = threads / 2
    )
}

/// `shape` seen as `(outer, axis, inner)` around dimension `axis`.
pub fn split_at_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        shape[..axis].iter().product(),
        shape[axis],
        shape[axis + 1..].iter().product(),
    )
}

/// Softmax (or, with `log`, LogSoftmax) along the middle of `[outer, axis, inner]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Softmax {
    pub outer: usize,
    pub axis: usize,
    pub inner: usize,
    pub log: bool,
}

impl Softmax {
    fn name(&self) -> &'static str {
        if self.log { "log_softmax" } else { "softmax" }
    }

    fn row_prelude(&self) -> String {
        let (a, inner) = (self.axis, self.inner);
        format!("    let base = (i / {inner}u) * {a}u * {inner}u + i % {inner}u;\n")
    }

    /// Forward: bindings `x`, `y`.
    pub fn forward(&self) -> KernelSpec {
        let (a, inner) = (self.axis, self.inner);
        let write = if self.log {
            "y[base + c * STRIDE] = x[base + c * STRIDE] - hi - log(sum);"
        } else {
            "y[base + c * STRIDE] = exp(x[base + c * STRIDE] - hi) / sum;"
        };
        let body = format!(
            "{}    var hi = x[base];\n    for (var c = 1u; c < {a}u; c += 1u) {{ hi = max(hi, x[base + c * {inner}u]); }}\n\
             \x20   var sum = 0.0;\n    for (var c = 0u; c < {a}u; c += 1u) {{ sum += exp(x[base + c * {inner}u] - hi); }}\n\
             \x20   for (var c = 0u; c < {a}u; c += 1u) {{ {} }}",
            self.row_prelude(),
            write.replace("STRIDE", &format!("{inner}u"))
        );
        one_d(
            format!("{}_fwd", self.name()),
            &[
                ("x", Binding::Read, "f32"),
                ("y", Binding::ReadWrite, "f32"),
            ],
            "",
            self.outer * inner,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// Backward from the forward's output `y`: softmax `dx = y (dy - sum(dy
    /// y))`, log-softmax `dx = dy - exp(y) sum(dy)`. Bindings `y`, `dy`, `dx`.
    pub fn backward(&self) -> KernelSpec {
        let (a, inner) = (self.axis, self.inner);
        let (sum_term, write) = if self.log {
            ("dy[k]", "dx[k] = dy[k] - exp(y[k]) * sum;")
        } else {
            ("dy[k] * y[k]", "dx[k] = y[k] * (dy[k] - sum);")
        };
        let body = format!(
            "{}    var sum = 0.0;\n    for (var c = 0u; c < {a}u; c += 1u) {{ let k = base + c * {inner}u; sum += {sum_term}; }}\n\
             \x20   for (var c = 0u; c < {a}u; c += 1u) {{ let k = base + c * {inner}u; {write} }}",
            self.row_prelude()
        );
        one_d(
            format!("{}_bwd", self.name()),
            &[
                ("y", Binding::Read, "f32"),
                ("dy", Binding::Read, "f32"),
                ("dx", Binding::ReadWrite, "f32"),
            ],
            "",
            self.outer * inner,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// CPU reference: `(y, dx)`, in f64.
    pub fn reference(&self, x: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let (a, inner) = (self.axis, self.inner);
        let mut y = vec![0.0f32; x.len()];
        let mut dx = vec![0.0f32; x.len()];
        for row in 0..self.outer * inner {
            let base = (row / inner) * a * inner + row % inner;
            let idx = |c: usize| base + c * inner;
            let hi = (0..a)
                .map(|c| f64::from(x[idx(c)]))
                .fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = (0..a).map(|c| (f64::from(x[idx(c)]) - hi).exp()).sum();
            let p: Vec<f64> = (0..a)
                .map(|c| (f64::from(x[idx(c)]) - hi).exp() / sum)
                .collect();
            if self.log {
                let s: f64 = (0..a).map(|c| f64::from(dy[idx(c)])).sum();
                for c in 0..a {
                    y[idx(c)] = (f64::from(x[idx(c)]) - hi - sum.ln()) as f32;
                    dx[idx(c)] = (f64::from(dy[idx(c)]) - p[c] * s) as f32;
                }
            } else {
                let s: f64 = (0..a).map(|c| f64::from(dy[idx(c)]) * p[c]).sum();
                for c in 0..a {
                    y[idx(c)] = p[c] as f32;
                    dx[idx(c)] = (p[c] * (f64::from(dy[idx(c)]) - s)) as f32;
                }
            }
        }
        (y, dx)
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::validate;
    use super::*;

    #[test]
    fn softmax_shaders_validate() {
        for log in [false, true] {
            for (outer, axis, inner) in [(1, 1, 1), (7, 10, 1), (3, 4, 5)] {
                let s = Softmax {
                    outer,
                    axis,
                    inner,
                    log,
                };
                validate::spec(&s.forward());
                validate::spec(&s.backward());
            }
        }
        assert!(super::super::spec::validate::check(&format!(
            "{}\n@compute @workgroup_size(64) fn main(@builtin(local_invocation_id) l: vec3<u32>) {{ let t = wg_sum(1.0, l.x); }}",
            wg_sum_wgsl(64)
        ))
        .is_ok());
    }

    #[test]
    fn softmax_rows_sum_to_one() {
        let s = Softmax {
            outer: 2,
            axis: 3,
            inner: 2,
            log: false,
        };
        let x: Vec<f32> = (0..12).map(|v| v as f32 * 0.3).collect();
        let (y, _) = s.reference(&x, &[0.0; 12]);
        let row: f32 = [0, 2, 4].iter().map(|&c| y[1 + c]).sum();
        assert!((row - 1.0).abs() < 1e-6);
        assert_eq!(split_at_axis(&[2, 3, 4, 5], 2), (6, 4, 5));
    }
}
