//! Pooling over `[planes, h, w]` (planes = batch times channels):
//! MaxPool2d (forward records each window's argmax; backward gives each
//! input element the gradients of the windows whose argmax it is),
//! AvgPool2d (torch's defaults: floor mode, padding counted in the divisor,
//! which is then always `kh * kw`), and GlobalAveragePool. Backward kernels
//! own one input element each and visit the windows covering it, so no
//! atomics are needed.

use super::spec::{Binding, DEFAULT_WORKGROUP, KernelSpec, one_d};

/// Max or average pooling geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool2d {
    pub planes: usize,
    pub h: usize,
    pub w: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

impl Pool2d {
    /// `None` when a kernel or stride is 0, the padding exceeds half the
    /// kernel (torch refuses that too) or the output would be empty.
    pub fn new(
        planes: usize,
        h: usize,
        w: usize,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Option<Self> {
        if kernel.contains(&0)
            || stride.contains(&0)
            || padding[0] * 2 > kernel[0]
            || padding[1] * 2 > kernel[1]
        {
            return None;
        }
        if h + 2 * padding[0] < kernel[0] || w + 2 * padding[1] < kernel[1] {
            return None;
        }
        Some(Self {
            planes,
            h,
            w,
            kernel,
            stride,
            padding,
        })
    }

    pub fn out_hw(&self) -> (usize, usize) {
        (
            (self.h + 2 * self.padding[0] - self.kernel[0]) / self.stride[0] + 1,
            (self.w + 2 * self.padding[1] - self.kernel[1]) / self.stride[1] + 1,
        )
    }

    pub fn out_len(&self) -> usize {
        let (oh, ow) = self.out_hw();
        self.planes * oh * ow
    }

    /// WGSL decomposing output index `i` into `plane`, `oy`, `ox`.
    fn out_coords(&self) -> String {
        let (oh, ow) = self.out_hw();
        format!(
            "    let plane = i / {ohw}u;\n    let oy = (i % {ohw}u) / {ow}u;\n    let ox = i % {ow}u;\n",
            ohw = oh * ow
        )
    }

    /// WGSL looping over the windows covering input element `(iy, ix)` of
    /// `plane`: `body` sees `oi`, the flat output index.
    fn covering_windows(&self, body: &str) -> String {
        let (oh, ow) = self.out_hw();
        let ([kh, kw], [s0, s1], [p0, p1]) = (self.kernel, self.stride, self.padding);
        format!(
            "    for (var ky = 0u; ky < {kh}u; ky += 1u) {{\n        let ty = i32(iy + {p0}u) - i32(ky);\n\
             \x20       if (ty < 0i || u32(ty) % {s0}u != 0u || u32(ty) / {s0}u >= {oh}u) {{ continue; }}\n\
             \x20       for (var kx = 0u; kx < {kw}u; kx += 1u) {{\n            let tx = i32(ix + {p1}u) - i32(kx);\n\
             \x20           if (tx < 0i || u32(tx) % {s1}u != 0u || u32(tx) / {s1}u >= {ow}u) {{ continue; }}\n\
             \x20           let oi = (plane * {oh}u + u32(ty) / {s0}u) * {ow}u + u32(tx) / {s1}u;\n{body}\n        }}\n    }}\n"
        )
    }

    fn in_coords(&self) -> String {
        let (h, w) = (self.h, self.w);
        format!(
            "    let plane = i / {hw}u;\n    let iy = (i % {hw}u) / {w}u;\n    let ix = i % {w}u;\n",
            hw = h * w
        )
    }

    /// Max forward: bindings `x`, `y`, `argmax` (u32, the index within the
    /// plane, as torch's indices). NaN wins, as in torch. The running maximum
    /// starts at the window's first element rather than at -inf, which
    /// Chromium's WGSL compiler refuses to represent; padding is at most half
    /// the kernel, so every window has one.
    pub fn max_forward(&self) -> KernelSpec {
        let (h, w) = (self.h, self.w);
        let ([kh, kw], [s0, s1], [p0, p1]) = (self.kernel, self.stride, self.padding);
        let body = format!(
            "{}    let y0 = i32(oy * {s0}u) - {p0}i;\n    let x0 = i32(ox * {s1}u) - {p1}i;\n\
             \x20   var arg = u32(max(y0, 0i)) * {w}u + u32(max(x0, 0i));\n    var best = x[plane * {hw}u + arg];\n\
             \x20   for (var ky = 0i; ky < {kh}i; ky += 1i) {{\n        let iy = y0 + ky;\n        if (iy < 0i || iy >= {h}i) {{ continue; }}\n\
             \x20       for (var kx = 0i; kx < {kw}i; kx += 1i) {{\n            let ix = x0 + kx;\n            if (ix < 0i || ix >= {w}i) {{ continue; }}\n\
             \x20           let idx = u32(iy) * {w}u + u32(ix);\n            let v = x[plane * {hw}u + idx];\n\
             \x20           if (v > best || v != v) {{ best = v; arg = idx; }}\n        }}\n    }}\n\
             \x20   y[i] = best;\n    argmax[i] = arg;",
            self.out_coords(),
            hw = h * w
        );
        one_d(
            "max_pool2d_fwd",
            &[
                ("x", Binding::Read, "f32"),
                ("y", Binding::ReadWrite, "f32"),
                ("argmax", Binding::ReadWrite, "u32"),
            ],
            "",
            self.out_len(),
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// Max backward: bindings `argmax`, `dy`, `dx`.
    pub fn max_backward(&self) -> KernelSpec {
        let body = format!(
            "{}    let me = iy * {w}u + ix;\n    var acc = 0.0;\n{}    dx[i] = acc;",
            self.in_coords(),
            self.covering_windows("            if (argmax[oi] == me) { acc += dy[oi]; }"),
            w = self.w
        );
        one_d(
            "max_pool2d_bwd",
            &[
                ("argmax", Binding::Read, "u32"),
                ("dy", Binding::Read, "f32"),
                ("dx", Binding::ReadWrite, "f32"),
            ],
            "",
            self.planes * self.h * self.w,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// Average forward: bindings `x`, `y`.
    pub fn avg_forward(&self) -> KernelSpec {
        let (h, w) = (self.h, self.w);
        let ([kh, kw], [s0, s1], [p0, p1]) = (self.kernel, self.stride, self.padding);
        let body = format!(
            "{}    let y0 = i32(oy * {s0}u) - {p0}i;\n    let x0 = i32(ox * {s1}u) - {p1}i;\n    var sum = 0.0;\n\
             \x20   for (var ky = 0i; ky < {kh}i; ky += 1i) {{\n        let iy = y0 + ky;\n        if (iy < 0i || iy >= {h}i) {{ continue; }}\n\
             \x20       for (var kx = 0i; kx < {kw}i; kx += 1i) {{\n            let ix = x0 + kx;\n            if (ix < 0i || ix >= {w}i) {{ continue; }}\n\
             \x20           sum += x[plane * {hw}u + u32(iy) * {w}u + u32(ix)];\n        }}\n    }}\n\
             \x20   y[i] = sum / {div}.0;",
            self.out_coords(),
            hw = h * w,
            div = kh * kw
        );
        one_d(
            "avg_pool2d_fwd",
            &[
                ("x", Binding::Read, "f32"),
                ("y", Binding::ReadWrite, "f32"),
            ],
            "",
            self.out_len(),
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// Average backward: bindings `dy`, `dx`.
    pub fn avg_backward(&self) -> KernelSpec {
        let body = format!(
            "{}    var acc = 0.0;\n{}    dx[i] = acc / {div}.0;",
            self.in_coords(),
            self.covering_windows("            acc += dy[oi];"),
            div = self.kernel[0] * self.kernel[1]
        );
        one_d(
            "avg_pool2d_bwd",
            &[
                ("dy", Binding::Read, "f32"),
                ("dx", Binding::ReadWrite, "f32"),
            ],
            "",
            self.planes * self.h * self.w,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// Window positions `(iy, ix)` of output `(oy, ox)` inside the image.
    fn window(&self, oy: usize, ox: usize) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        for ky in 0..self.kernel[0] {
            for kx in 0..self.kernel[1] {
                let iy = (oy * self.stride[0] + ky) as isize - self.padding[0] as isize;
                let ix = (ox * self.stride[1] + kx) as isize - self.padding[1] as isize;
                if iy >= 0 && ix >= 0 && (iy as usize) < self.h && (ix as usize) < self.w {
                    v.push((iy as usize, ix as usize));
                }
            }
        }
        v
    }

    /// CPU reference of max pooling: `(y, argmax, dx)`.
    pub fn max_reference(&self, x: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
        let (oh, ow) = self.out_hw();
        let hw = self.h * self.w;
        let mut y = vec![0.0; self.out_len()];
        let mut arg = vec![0u32; self.out_len()];
        let mut dx = vec![0.0f64; x.len()];
        for p in 0..self.planes {
            for oy in 0..oh {
                for ox in 0..ow {
                    let oi = (p * oh + oy) * ow + ox;
                    let win = self.window(oy, ox);
                    let (mut best, mut at) = (f32::NEG_INFINITY, win[0].0 * self.w + win[0].1);
                    for (iy, ix) in win {
                        let v = x[p * hw + iy * self.w + ix];
                        if v > best || v.is_nan() {
                            best = v;
                            at = iy * self.w + ix;
                        }
                    }
                    y[oi] = best;
                    arg[oi] = at as u32;
                    dx[p * hw + at] += f64::from(dy[oi]);
                }
            }
        }
        (y, arg, dx.into_iter().map(|v| v as f32).collect())
    }

    /// CPU reference of average pooling: `(y, dx)`.
    pub fn avg_reference(&self, x: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let (oh, ow) = self.out_hw();
        let hw = self.h * self.w;
        let div = (self.kernel[0] * self.kernel[1]) as f64;
        let mut y = vec![0.0; self.out_len()];
        let mut dx = vec![0.0f64; x.len()];
        for p in 0..self.planes {
            for oy in 0..oh {
                for ox in 0..ow {
                    let oi = (p * oh + oy) * ow + ox;
                    let win = self.window(oy, ox);
                    y[oi] = (win
                        .iter()
                        .map(|&(iy, ix)| f64::from(x[p * hw + iy * self.w + ix]))
                        .sum::<f64>()
                        / div) as f32;
                    for (iy, ix) in win {
                        dx[p * hw + iy * self.w + ix] += f64::from(dy[oi]) / div;
                    }
                }
            }
        }
        (y, dx.into_iter().map(|v| v as f32).collect())
    }
}

/// GlobalAveragePool: `[planes, spatial] -> [planes]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalAvgPool {
    pub planes: usize,
    pub spatial: usize,
}

impl GlobalAvgPool {
    /// Bindings `x`, `y`.
    pub fn forward(&self) -> KernelSpec {
        let s = self.spatial;
        one_d(
            "global_avg_pool_fwd",
            &[
                ("x", Binding::Read, "f32"),
                ("y", Binding::ReadWrite, "f32"),
            ],
            "",
            self.planes,
            DEFAULT_WORKGROUP,
            &format!(
                "    var sum = 0.0;\n    for (var j = 0u; j < {s}u; j += 1u) {{ sum += x[i * {s}u + j]; }}\n    y[i] = sum / {s}.0;"
            ),
        )
    }

    /// Bindings `dy`, `dx`.
    pub fn backward(&self) -> KernelSpec {
        let s = self.spatial;
        one_d(
            "global_avg_pool_bwd",
            &[
                ("dy", Binding::Read, "f32"),
                ("dx", Binding::ReadWrite, "f32"),
            ],
            "",
            self.planes * s,
            DEFAULT_WORKGROUP,
            &format!("    dx[i] = dy[i / {s}u] / {s}.0;"),
        )
    }

    /// CPU reference: `(y, dx)`.
    pub fn reference(&self, x: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let s = self.spatial;
        let y = (0..self.planes)
            .map(|p| {
                (x[p * s..(p + 1) * s]
                    .iter()
                    .map(|&v| f64::from(v))
                    .sum::<f64>()
                    / s as f64) as f32
            })
            .collect();
        let dx = (0..self.planes * s).map(|i| dy[i / s] / s as f32).collect();
        (y, dx)
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::validate;
    use super::*;

    #[test]
    fn pool_shaders_validate() {
        for (planes, h, w, k, s, p) in [
            (1, 1, 1, [1, 1], [1, 1], [0, 0]),
            (6, 28, 28, [2, 2], [2, 2], [0, 0]),
            (3, 7, 5, [3, 2], [2, 1], [1, 1]),
        ] {
            let pool = Pool2d::new(planes, h, w, k, s, p).unwrap();
            for spec in [
                pool.max_forward(),
                pool.max_backward(),
                pool.avg_forward(),
                pool.avg_backward(),
            ] {
                validate::spec(&spec);
            }
        }
        let g = GlobalAvgPool {
            planes: 5,
            spatial: 49,
        };
        validate::spec(&g.forward());
        validate::spec(&g.backward());
    }

    #[test]
    fn pooling_references_match_hand_values() {
        let p = Pool2d::new(1, 2, 2, [2, 2], [2, 2], [0, 0]).unwrap();
        let (y, arg, dx) = p.max_reference(&[1.0, 4.0, 3.0, 2.0], &[5.0]);
        assert_eq!((y, arg, dx), (vec![4.0], vec![1], vec![0.0, 5.0, 0.0, 0.0]));
        let (y, dx) = p.avg_reference(&[1.0, 4.0, 3.0, 2.0], &[4.0]);
        assert_eq!((y, dx), (vec![2.5], vec![1.0; 4]));
        assert!(Pool2d::new(1, 4, 4, [2, 2], [1, 1], [2, 0]).is_none());
    }
}
