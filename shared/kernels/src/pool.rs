//! Pooling over `[planes, h, w]` (planes = batch times channels):
//! MaxPool2d (forward records each window's argmax; backward gives each
//! input element the gradients of the windows whose argmax it is),
//! AvgPool2d, and GlobalAveragePool, with torch's options: dilated taps,
//! `ceil_mode` (a last partial window where one would start inside the
//! input or its left padding) and, for the average, `count_include_pad`
//! (divide by the taps inside the padded input, torch's default, or by those
//! inside the input). Backward kernels own one input element each and visit
//! the windows covering it, so no atomics are needed.

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
    /// Spacing of a window's taps (1: adjacent).
    pub dilation: [usize; 2],
    /// Output sizes round up rather than down.
    pub ceil_mode: bool,
    /// The average divides by the window's taps inside the padded input
    /// (torch's default) rather than by those inside the input.
    pub count_include_pad: bool,
}

/// Outputs along one dimension, torch's rule: with `ceil_mode`, a last
/// window that would start in the right padding is dropped.
fn out_dim(len: usize, kernel: usize, stride: usize, pad: usize, dil: usize, ceil: bool) -> usize {
    let span = dil * (kernel - 1) + 1;
    let room = len + 2 * pad - span;
    let mut out = if ceil {
        room.div_ceil(stride)
    } else {
        room / stride
    } + 1;
    if ceil && (out - 1) * stride >= len + pad {
        out -= 1;
    }
    out
}

impl Pool2d {
    /// Adjacent taps, floor mode, padding counted: torch's defaults. `None`
    /// when a kernel or stride is 0, the padding exceeds half the window
    /// (torch refuses that too) or the output would be empty.
    pub fn new(
        planes: usize,
        h: usize,
        w: usize,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Option<Self> {
        Self {
            planes,
            h,
            w,
            kernel,
            stride,
            padding,
            dilation: [1, 1],
            ceil_mode: false,
            count_include_pad: true,
        }
        .checked()
    }

    /// The same geometry with torch's other options; `None` where they make
    /// it invalid, or leave a window without a tap inside the input.
    pub fn with_options(
        self,
        dilation: [usize; 2],
        ceil_mode: bool,
        count_include_pad: bool,
    ) -> Option<Self> {
        Self {
            dilation,
            ceil_mode,
            count_include_pad,
            ..self
        }
        .checked()
    }

    fn checked(self) -> Option<Self> {
        let dims = [(self.h, 0), (self.w, 1)];
        for (len, i) in dims {
            let (k, s, p, d) = (
                self.kernel[i],
                self.stride[i],
                self.padding[i],
                self.dilation[i],
            );
            if k == 0 || s == 0 || d == 0 || len == 0 {
                return None;
            }
            let span = d.checked_mul(k - 1)?.checked_add(1)?;
            if p.checked_mul(2)? > span || len.checked_add(2 * p)? < span {
                return None;
            }
            // Every window needs a tap inside the input (the max starts
            // there). Windows starting inside it have one; those starting in
            // the left padding (o * s < p) are checked at their first tap
            // past it, and a stranger's graph cannot make that many.
            let left = p.div_ceil(s).min(out_dim(len, k, s, p, d, self.ceil_mode));
            if left > 1 << 16 {
                return None;
            }
            let has_tap = |o: usize| {
                let before = p - o * s;
                let t = before.div_ceil(d);
                t < k && t * d - before < len
            };
            if !(0..left).all(has_tap) {
                return None;
            }
        }
        Some(self)
    }

    pub fn out_hw(&self) -> (usize, usize) {
        let dim = |len, i: usize| {
            out_dim(
                len,
                self.kernel[i],
                self.stride[i],
                self.padding[i],
                self.dilation[i],
                self.ceil_mode,
            )
        };
        (dim(self.h, 0), dim(self.w, 1))
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
    /// `plane`: `body` sees `oi`, the flat output index, and `wy`, `wx`,
    /// the window's output coordinates.
    fn covering_windows(&self, body: &str) -> String {
        let (oh, ow) = self.out_hw();
        let ([kh, kw], [s0, s1], [p0, p1], [d0, d1]) =
            (self.kernel, self.stride, self.padding, self.dilation);
        format!(
            "    for (var ky = 0u; ky < {kh}u; ky += 1u) {{\n        let ty = i32(iy + {p0}u) - i32(ky * {d0}u);\n\
             \x20       if (ty < 0i || u32(ty) % {s0}u != 0u || u32(ty) / {s0}u >= {oh}u) {{ continue; }}\n\
             \x20       for (var kx = 0u; kx < {kw}u; kx += 1u) {{\n            let tx = i32(ix + {p1}u) - i32(kx * {d1}u);\n\
             \x20           if (tx < 0i || u32(tx) % {s1}u != 0u || u32(tx) / {s1}u >= {ow}u) {{ continue; }}\n\
             \x20           let wy = u32(ty) / {s0}u;\n            let wx = u32(tx) / {s1}u;\n\
             \x20           let oi = (plane * {oh}u + wy) * {ow}u + wx;\n{body}\n        }}\n    }}\n"
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
    /// starts at the window's first tap inside the input rather than at
    /// -inf, which Chromium's WGSL compiler refuses to represent; every
    /// window has one ([`Pool2d::with_options`] checks).
    pub fn max_forward(&self) -> KernelSpec {
        let (h, w) = (self.h, self.w);
        let ([kh, kw], [s0, s1], [p0, p1], [d0, d1]) =
            (self.kernel, self.stride, self.padding, self.dilation);
        let body = format!(
            "{}    let y0 = i32(oy * {s0}u) - {p0}i;\n    let x0 = i32(ox * {s1}u) - {p1}i;\n\
             \x20   let fy = select(0i, (-y0 + {d0}i - 1i) / {d0}i, y0 < 0i);\n\
             \x20   let fx = select(0i, (-x0 + {d1}i - 1i) / {d1}i, x0 < 0i);\n\
             \x20   var arg = u32(y0 + fy * {d0}i) * {w}u + u32(x0 + fx * {d1}i);\n    var best = x[plane * {hw}u + arg];\n\
             \x20   for (var ky = 0i; ky < {kh}i; ky += 1i) {{\n        let iy = y0 + ky * {d0}i;\n        if (iy < 0i || iy >= {h}i) {{ continue; }}\n\
             \x20       for (var kx = 0i; kx < {kw}i; kx += 1i) {{\n            let ix = x0 + kx * {d1}i;\n            if (ix < 0i || ix >= {w}i) {{ continue; }}\n\
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

    /// WGSL `fn taps(oy, ox) -> f32`: the divisor of window `(oy, ox)`.
    fn taps_wgsl(&self) -> String {
        let (h, w) = (self.h, self.w);
        let ([kh, kw], [s0, s1], [p0, p1], [d0, d1]) =
            (self.kernel, self.stride, self.padding, self.dilation);
        // `fn name(start)`: the taps inside [lo, hi) along one dimension of
        // a window starting at `start`.
        let along = |name: &str, k: usize, d: usize, lo: i64, hi: i64| {
            format!(
                "fn {name}(start: i32) -> f32 {{\n    var n = 0.0;\n\
                 \x20   for (var t = 0i; t < {k}i; t += 1i) {{ let at = start + t * {d}i; \
                 if (at >= {lo}i && at < {hi}i) {{ n += 1.0; }} }}\n    return n;\n}}\n",
            )
        };
        let (lo_y, hi_y, lo_x, hi_x) = if self.count_include_pad {
            (-(p0 as i64), (h + p0) as i64, -(p1 as i64), (w + p1) as i64)
        } else {
            (0, h as i64, 0, w as i64)
        };
        format!(
            "{}{}fn taps(oy: u32, ox: u32) -> f32 {{\n    return taps_along_y(i32(oy * {s0}u) - {p0}i) * \
             taps_along_x(i32(ox * {s1}u) - {p1}i);\n}}\n",
            along("taps_along_y", kh, d0, lo_y, hi_y),
            along("taps_along_x", kw, d1, lo_x, hi_x),
        )
    }

    /// Average forward: bindings `x`, `y`.
    pub fn avg_forward(&self) -> KernelSpec {
        let (h, w) = (self.h, self.w);
        let ([kh, kw], [s0, s1], [p0, p1], [d0, d1]) =
            (self.kernel, self.stride, self.padding, self.dilation);
        let body = format!(
            "{}    let y0 = i32(oy * {s0}u) - {p0}i;\n    let x0 = i32(ox * {s1}u) - {p1}i;\n    var sum = 0.0;\n\
             \x20   for (var ky = 0i; ky < {kh}i; ky += 1i) {{\n        let iy = y0 + ky * {d0}i;\n        if (iy < 0i || iy >= {h}i) {{ continue; }}\n\
             \x20       for (var kx = 0i; kx < {kw}i; kx += 1i) {{\n            let ix = x0 + kx * {d1}i;\n            if (ix < 0i || ix >= {w}i) {{ continue; }}\n\
             \x20           sum += x[plane * {hw}u + u32(iy) * {w}u + u32(ix)];\n        }}\n    }}\n\
             \x20   y[i] = sum / taps(oy, ox);",
            self.out_coords(),
            hw = h * w,
        );
        one_d(
            "avg_pool2d_fwd",
            &[
                ("x", Binding::Read, "f32"),
                ("y", Binding::ReadWrite, "f32"),
            ],
            &self.taps_wgsl(),
            self.out_len(),
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// Average backward: bindings `dy`, `dx`.
    pub fn avg_backward(&self) -> KernelSpec {
        let body = format!(
            "{}    var acc = 0.0;\n{}    dx[i] = acc;",
            self.in_coords(),
            self.covering_windows("            acc += dy[oi] / taps(wy, wx);"),
        );
        one_d(
            "avg_pool2d_bwd",
            &[
                ("dy", Binding::Read, "f32"),
                ("dx", Binding::ReadWrite, "f32"),
            ],
            &self.taps_wgsl(),
            self.planes * self.h * self.w,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// Taps of window `(oy, ox)` inside the image, as `(iy, ix)`.
    fn window(&self, oy: usize, ox: usize) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        for (iy, inside_y) in self.taps_along(0, oy) {
            for (ix, inside_x) in self.taps_along(1, ox) {
                if inside_y && inside_x {
                    v.push((iy as usize, ix as usize));
                }
            }
        }
        v
    }

    /// Positions of a window's taps along dimension `dim`, each with
    /// whether it is inside the input.
    fn taps_along(&self, dim: usize, o: usize) -> Vec<(isize, bool)> {
        let len = [self.h, self.w][dim] as isize;
        let start = (o * self.stride[dim]) as isize - self.padding[dim] as isize;
        (0..self.kernel[dim])
            .map(|t| start + (t * self.dilation[dim]) as isize)
            .map(|at| (at, at >= 0 && at < len))
            .collect()
    }

    /// The average's divisor for window `(oy, ox)`.
    fn divisor(&self, oy: usize, ox: usize) -> f64 {
        let count = |dim: usize, o: usize| {
            let (len, pad) = ([self.h, self.w][dim] as isize, self.padding[dim] as isize);
            self.taps_along(dim, o)
                .iter()
                .filter(|&&(at, inside)| inside || (self.count_include_pad && at < len + pad))
                .count() as f64
        };
        count(0, oy) * count(1, ox)
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
        let mut y = vec![0.0; self.out_len()];
        let mut dx = vec![0.0f64; x.len()];
        for p in 0..self.planes {
            for oy in 0..oh {
                for ox in 0..ow {
                    let oi = (p * oh + oy) * ow + ox;
                    let div = self.divisor(oy, ox);
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
            let plain = Pool2d::new(planes, h, w, k, s, p).unwrap();
            let options = plain.with_options([2, 1], true, false);
            for spec in [plain].into_iter().chain(options).flat_map(|pool| {
                [
                    pool.max_forward(),
                    pool.max_backward(),
                    pool.avg_forward(),
                    pool.avg_backward(),
                ]
            }) {
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

    #[test]
    fn ceil_mode_and_excluded_padding_follow_torch() {
        // 5 wide, kernel 2, stride 2: floor gives 2 windows, ceil a third
        // over the last column alone.
        let floor = Pool2d::new(1, 1, 5, [1, 2], [1, 2], [0, 0]).unwrap();
        let ceil = floor.with_options([1, 1], true, true).unwrap();
        assert_eq!((floor.out_hw(), ceil.out_hw()), ((1, 2), (1, 3)));
        let x = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(ceil.avg_reference(&x, &[0.0; 3]).0, [1.5, 3.5, 5.0]);
        // Padding 1, kernel 2, stride 2 over 5: a fourth window would start
        // in the right padding, so ceil mode drops it (torch's rule).
        let drop = Pool2d::new(1, 1, 5, [1, 2], [1, 2], [0, 1]).unwrap();
        let drop_ceil = drop.with_options([1, 1], true, true).unwrap();
        assert_eq!((drop.out_hw(), drop_ceil.out_hw()), ((1, 3), (1, 3)));
        // Padding 1, kernel 3, stride 2 over 4: ceil mode adds a window at
        // 3, whose divisor counts the taps inside the padded input only.
        let padded = Pool2d::new(1, 1, 4, [1, 3], [1, 2], [0, 1]).unwrap();
        let padded_ceil = padded.with_options([1, 1], true, true).unwrap();
        let x = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(padded_ceil.avg_reference(&x, &[0.0; 3]).0, [1.0, 3.0, 2.0]);
        // Counting the padding: (0 + 1 + 2) / 3; without: (1 + 2) / 2.
        assert_eq!(padded.avg_reference(&x, &[0.0; 2]).0, [1.0, 3.0]);
        let excluded = padded.with_options([1, 1], false, false).unwrap();
        assert_eq!(excluded.avg_reference(&x, &[0.0; 2]).0, [1.5, 3.0]);
        // Dilation 2: taps 0, 2 and 1, 3.
        let dilated = Pool2d::new(1, 1, 4, [1, 2], [1, 1], [0, 0])
            .unwrap()
            .with_options([1, 2], false, true)
            .unwrap();
        assert_eq!(dilated.max_reference(&x, &[0.0; 2]).0, [3.0, 4.0]);
        // A window of padding only has no maximum: refused.
        assert!(
            Pool2d::new(1, 1, 1, [1, 2], [1, 1], [0, 1])
                .unwrap()
                .with_options([1, 2], false, true)
                .is_none()
        );
    }
}
