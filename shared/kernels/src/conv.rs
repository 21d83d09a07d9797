//! Conv2d (stride, padding, dilation, groups) as implicit GEMMs on the tiled
//! [`Gemm`] template: the image is read through an im2col loader, never
//! unfolded in memory. Per group `g` (the GEMM's batch index `z`):
//!
//! - forward: `y[o, (n,oy,ox)] = sum_(c,ky,kx) w[o, (c,ky,kx)] x[n, c, oy*s-p+ky*d, ..]`,
//!   bias fused into the store;
//! - input gradient: `dx[c, (n,iy,ix)] = sum_(o,ky,kx) w[o, c, ky, kx] dy[n, o, oy, ox]`
//!   where `iy = oy*s - p + ky*d` (the transposed convolution, read
//!   through the same kind of loader);
//! - weight gradient: `dw[o, (c,ky,kx)] = sum_(n,oy,ox) dy[n, o, oy, ox] x[..]`;
//! - bias gradient: `dy` summed over batch and space.

use super::gemm::precision::{GRAD_SCALE, operand};
use super::gemm::{Gemm, Precision, Side, Tiling, sum_to_shape};
use super::spec::{Binding, KernelSpec};

/// Fewest terms of the weight gradient's reduction one part sums.
pub const MIN_PART_TERMS: usize = 256;

/// Most parts the weight gradient's reduction is cut into.
pub const MAX_PARTS: usize = 256;

const WEIGHT_BINDINGS: [(&str, Binding, &str); 3] = [
    ("dy", Binding::Read, "f32"),
    ("x", Binding::Read, "f32"),
    ("dweight", Binding::ReadWrite, "f32"),
];

const WEIGHT_PARTS_BINDINGS: [(&str, Binding, &str); 3] = [
    ("dy", Binding::Read, "f32"),
    ("x", Binding::Read, "f32"),
    ("dweight_parts", Binding::ReadWrite, "f32"),
];

/// A 2-D convolution of `x [n, c, h, w]` with `weight [o, c/groups, kh, kw]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2d {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub o: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
    pub bias: bool,
    /// `None`: chosen for each product's shape ([`Tiling::auto`]).
    pub tiling: Option<Tiling>,
    /// How the operands enter the multiply-adds.
    pub precision: Precision,
    /// Whether the forward and input gradient may run as Winograd
    /// F(2x2, 3x3) where it suits ([`crate::winograd::Winograd`]); true
    /// unless a benchmark or check wants the implicit GEMM.
    pub winograd: bool,
}

impl Conv2d {
    /// `None` when the groups do not divide the channels, a stride or
    /// dilation is 0, or the output would be empty.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        x: [usize; 4],
        o: usize,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        groups: usize,
        bias: bool,
    ) -> Option<Self> {
        let [n, c, h, w] = x;
        if groups == 0
            || !c.is_multiple_of(groups)
            || !o.is_multiple_of(groups)
            || stride.contains(&0)
            || dilation.contains(&0)
            || kernel.contains(&0)
        {
            return None;
        }
        let conv = Self {
            n,
            c,
            h,
            w,
            o,
            kh: kernel[0],
            kw: kernel[1],
            stride,
            padding,
            dilation,
            groups,
            bias,
            tiling: None,
            precision: Precision::F32,
            winograd: true,
        };
        let span =
            |size: usize, p: usize, d: usize, k: usize| (size + 2 * p).checked_sub(d * (k - 1) + 1);
        span(h, padding[0], dilation[0], conv.kh)?;
        span(w, padding[1], dilation[1], conv.kw)?;
        Some(conv)
    }

    /// `(oh, ow)`.
    pub fn out_hw(&self) -> (usize, usize) {
        let out = |size: usize, p: usize, d: usize, k: usize, s: usize| {
            (size + 2 * p - d * (k - 1) - 1) / s + 1
        };
        (
            out(
                self.h,
                self.padding[0],
                self.dilation[0],
                self.kh,
                self.stride[0],
            ),
            out(
                self.w,
                self.padding[1],
                self.dilation[1],
                self.kw,
                self.stride[1],
            ),
        )
    }

    pub fn out_len(&self) -> usize {
        let (oh, ow) = self.out_hw();
        self.n * self.o * oh * ow
    }

    /// Multiply-adds times two of the forward; each backward GEMM has as many.
    pub fn flops(&self) -> f64 {
        let (oh, ow) = self.out_hw();
        2.0 * (self.n * self.o * oh * ow) as f64 * (self.c / self.groups * self.kh * self.kw) as f64
    }

    fn cg(&self) -> usize {
        self.c / self.groups
    }

    fn og(&self) -> usize {
        self.o / self.groups
    }

    /// WGSL reading `x[nb, z*cg + ci, oy*s - p + ky*d, ox*s - p + kx*d]`, or 0
    /// in the padding.
    fn x_at(&self, nb: &str, ci: &str, oy: &str, ox: &str, ky: &str, kx: &str) -> String {
        let (h, w, c, cg) = (self.h, self.w, self.c, self.cg());
        let ([s0, s1], [p0, p1], [d0, d1]) = (self.stride, self.padding, self.dilation);
        format!(
            "    let iy = i32({oy} * {s0}u + {ky} * {d0}u) - {p0}i;\n    let ix = i32({ox} * {s1}u + {kx} * {d1}u) - {p1}i;\n\
             \x20   if (iy < 0i || ix < 0i || iy >= {h}i || ix >= {w}i) {{ return 0.0; }}\n\
             \x20   return x[(({nb} * {c}u + z * {cg}u + {ci}) * {h}u + u32(iy)) * {w}u + u32(ix)];"
        )
    }

    /// Forward: bindings `x`, `weight`, `bias` (when present), `y`.
    pub fn forward(&self) -> KernelSpec {
        let (oh, ow) = self.out_hw();
        let (kh, kw, og, o) = (self.kh, self.kw, self.og(), self.o);
        let kk_len = self.cg() * kh * kw;
        let with_bias = [
            ("x", Binding::Read, "f32"),
            ("weight", Binding::Read, "f32"),
            ("bias", Binding::Read, "f32"),
            ("y", Binding::ReadWrite, "f32"),
        ];
        let without = [
            ("x", Binding::Read, "f32"),
            ("weight", Binding::Read, "f32"),
            ("y", Binding::ReadWrite, "f32"),
        ];
        let add_bias = if self.bias {
            format!(" + bias[z * {og}u + row]")
        } else {
            String::new()
        };
        Gemm {
            label: "conv2d_fwd".into(),
            precision: self.precision,
            gradient: None,
            tiling: self.tiling,
            split: 1,
            batch: self.groups,
            m: og,
            n: self.n * oh * ow,
            k: kk_len,
            bindings: if self.bias { &with_bias } else { &without },
            a_along_k: true,
            b_along_k: false,
            load_a: format!("    return weight[(z * {og}u + row) * {kk_len}u + kk];"),
            load_b: format!(
                "    let ci = kk / {khw}u;\n    let ky = (kk % {khw}u) / {kw}u;\n    let kx = kk % {kw}u;\n\
                 \x20   let nb = col / {ohw}u;\n    let oy = (col % {ohw}u) / {ow}u;\n    let ox = col % {ow}u;\n{}",
                self.x_at("nb", "ci", "oy", "ox", "ky", "kx"),
                khw = kh * kw,
                ohw = oh * ow,
            ),
            store: format!(
                "        let nb = col / {ohw}u;\n        let sp = col % {ohw}u;\n        y[(nb * {o}u + z * {og}u + row) * {ohw}u + sp] = acc{add_bias};",
                ohw = oh * ow
            ),
        }
        .spec()
    }

    /// Input gradient: bindings `dy`, `weight`, `dx`.
    pub fn backward_input(&self) -> KernelSpec {
        let (oh, ow) = self.out_hw();
        let (h, w, c, o, kh, kw, og, cg) = (
            self.h,
            self.w,
            self.c,
            self.o,
            self.kh,
            self.kw,
            self.og(),
            self.cg(),
        );
        let ([s0, s1], [p0, p1], [d0, d1]) = (self.stride, self.padding, self.dilation);
        Gemm {
            label: "conv2d_bwd_input".into(),
            precision: self.precision,
            gradient: Some(Side::B),
            tiling: self.tiling,
            split: 1,
            batch: self.groups,
            m: cg,
            n: self.n * h * w,
            k: og * kh * kw,
            bindings: &[
                ("dy", Binding::Read, "f32"),
                ("weight", Binding::Read, "f32"),
                ("dx", Binding::ReadWrite, "f32"),
            ],
            a_along_k: true,
            b_along_k: false,
            load_a: format!(
                "    let oc = kk / {khw}u;\n    return weight[((z * {og}u + oc) * {cg}u + row) * {khw}u + kk % {khw}u];",
                khw = kh * kw
            ),
            load_b: format!(
                "    let oc = kk / {khw}u;\n    let ky = (kk % {khw}u) / {kw}u;\n    let kx = kk % {kw}u;\n\
                 \x20   let nb = col / {hw}u;\n    let iy = (col % {hw}u) / {w}u;\n    let ix = col % {w}u;\n\
                 \x20   let ty = i32(iy + {p0}u) - i32(ky * {d0}u);\n    let tx = i32(ix + {p1}u) - i32(kx * {d1}u);\n\
                 \x20   if (ty < 0i || tx < 0i) {{ return 0.0; }}\n\
                 \x20   let uy = u32(ty);\n    let ux = u32(tx);\n\
                 \x20   if (uy % {s0}u != 0u || ux % {s1}u != 0u) {{ return 0.0; }}\n\
                 \x20   let oy = uy / {s0}u;\n    let ox = ux / {s1}u;\n\
                 \x20   if (oy >= {oh}u || ox >= {ow}u) {{ return 0.0; }}\n\
                 \x20   return dy[((nb * {o}u + z * {og}u + oc) * {oh}u + oy) * {ow}u + ox];",
                khw = kh * kw,
                hw = h * w,
            ),
            store: format!(
                "        let nb = col / {hw}u;\n        dx[(nb * {c}u + z * {cg}u + row) * {hw}u + col % {hw}u] = acc;",
                hw = h * w
            ),
        }
        .spec()
    }

    /// Weight gradient: bindings `dy`, `x`, `dweight`.
    pub fn backward_weight(&self) -> KernelSpec {
        self.weight_gemm(1)
    }

    /// Parts [`Self::backward_weight_parts`] cuts the weight gradient's
    /// reduction into (1: none): enough to keep a large GPU busy when the
    /// weight has few elements and the reduction over batch and space is
    /// long (a first convolution of one channel has 144 weights and 50,176
    /// terms each), with at least [`MIN_PART_TERMS`] terms per part.
    pub fn weight_parts(&self) -> u32 {
        self.weight_plan().1
    }

    /// The weight gradient's tiling and parts.
    fn weight_plan(&self) -> (Tiling, u32) {
        let (oh, ow) = self.out_hw();
        let (m, n, k) = (self.og(), self.cg() * self.kh * self.kw, self.n * oh * ow);
        match self.tiling {
            // A fixed tiling (the checks' and the sweep's) still splits.
            Some(t) => (
                t,
                t.split_for(m, n, self.groups, k, MIN_PART_TERMS, MAX_PARTS),
            ),
            None => Tiling::auto_split(m, n, self.groups, k, MIN_PART_TERMS, MAX_PARTS),
        }
    }

    /// Elements of the weight, `o * c / groups * kh * kw`.
    pub fn weight_len(&self) -> usize {
        self.o * self.cg() * self.kh * self.kw
    }

    /// The sum that adds `parts` partial weight gradients up, as `(from,
    /// to)` shapes of [`sum_to_shape`]: `[parts, weight]` to `[weight]`.
    pub fn weight_parts_sum_shapes(&self, parts: u32) -> (Vec<usize>, Vec<usize>) {
        let w_len = self.weight_len();
        (vec![parts as usize, w_len], vec![w_len])
    }

    /// The kernel adding `parts` partial weight gradients up, in order:
    /// bindings `dweight_parts`, `dweight`.
    pub fn sum_weight_parts(&self, parts: u32) -> KernelSpec {
        let (from, to) = self.weight_parts_sum_shapes(parts);
        sum_to_shape(&from, &to)
    }

    /// The weight gradient as `parts` partial sums over the batch and space,
    /// `[parts, o, c / groups, kh, kw]`, which add up to it (in any order
    /// the caller fixes): bindings `dy`, `x`, `dweight_parts`.
    pub fn backward_weight_parts(&self, parts: u32) -> KernelSpec {
        self.weight_gemm(parts)
    }

    fn weight_gemm(&self, parts: u32) -> KernelSpec {
        self.weight_gemm_def(parts).spec()
    }

    fn weight_gemm_def(&self, parts: u32) -> Gemm<'static> {
        let tiling = if parts > 1 {
            Some(self.weight_plan().0)
        } else {
            self.tiling
        };
        let (oh, ow) = self.out_hw();
        let (o, kh, kw, og, cg) = (self.o, self.kh, self.kw, self.og(), self.cg());
        let kk_len = cg * kh * kw;
        let w_len = self.weight_len();
        let (bindings, out) = if parts > 1 {
            (&WEIGHT_PARTS_BINDINGS, "dweight_parts")
        } else {
            (&WEIGHT_BINDINGS, "dweight")
        };
        Gemm {
            label: "conv2d_bwd_weight".into(),
            precision: self.precision,
            gradient: Some(Side::A),
            tiling,
            split: parts,
            batch: self.groups,
            m: og,
            n: kk_len,
            k: self.n * oh * ow,
            bindings,
            a_along_k: true,
            b_along_k: true,
            load_a: format!(
                "    let nb = kk / {ohw}u;\n    return dy[(nb * {o}u + z * {og}u + row) * {ohw}u + kk % {ohw}u];",
                ohw = oh * ow
            ),
            load_b: format!(
                "    let ci = col / {khw}u;\n    let ky = (col % {khw}u) / {kw}u;\n    let kx = col % {kw}u;\n\
                 \x20   let nb = kk / {ohw}u;\n    let oy = (kk % {ohw}u) / {ow}u;\n    let ox = kk % {ow}u;\n{}",
                self.x_at("nb", "ci", "oy", "ox", "ky", "kx"),
                khw = kh * kw,
                ohw = oh * ow,
            ),
            store: format!(
                "        {out}[part * {w_len}u + (z * {og}u + row) * {kk_len}u + col] = acc;"
            ),
        }
    }

    /// Bias gradient: bindings `dy`, `dbias`.
    pub fn backward_bias(&self) -> KernelSpec {
        let (oh, ow) = self.out_hw();
        sum_to_shape(&[self.n, self.o, oh * ow], &[self.o, 1])
    }

    /// CPU reference in f64: `(y, dx, dweight, dbias)`.
    pub fn reference(
        &self,
        x: &[f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        dy: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (x, weight, dy) = (
            operand(self.precision, x, 1.0),
            operand(self.precision, weight, 1.0),
            operand(self.precision, dy, GRAD_SCALE),
        );
        let (oh, ow) = self.out_hw();
        let (cg, og) = (self.cg(), self.og());
        let mut y = vec![0.0f64; self.out_len()];
        let mut dx = vec![0.0f64; x.len()];
        let mut dw = vec![0.0f64; weight.len()];
        let mut db = vec![0.0f64; self.o];
        for nb in 0..self.n {
            for oc in 0..self.o {
                let g = oc / og;
                for oy in 0..oh {
                    for ox in 0..ow {
                        let yi = ((nb * self.o + oc) * oh + oy) * ow + ox;
                        let grad = f64::from(dy[yi]);
                        let mut acc = bias.map_or(0.0, |b| f64::from(b[oc]));
                        db[oc] += grad;
                        for ci in 0..cg {
                            for ky in 0..self.kh {
                                for kx in 0..self.kw {
                                    let iy = (oy * self.stride[0] + ky * self.dilation[0]) as isize
                                        - self.padding[0] as isize;
                                    let ix = (ox * self.stride[1] + kx * self.dilation[1]) as isize
                                        - self.padding[1] as isize;
                                    if iy < 0
                                        || ix < 0
                                        || iy >= self.h as isize
                                        || ix >= self.w as isize
                                    {
                                        continue;
                                    }
                                    let xi = ((nb * self.c + g * cg + ci) * self.h + iy as usize)
                                        * self.w
                                        + ix as usize;
                                    let wi = ((oc * cg + ci) * self.kh + ky) * self.kw + kx;
                                    acc += f64::from(x[xi]) * f64::from(weight[wi]);
                                    dx[xi] += grad * f64::from(weight[wi]);
                                    dw[wi] += grad * f64::from(x[xi]);
                                }
                            }
                        }
                        y[yi] = acc;
                    }
                }
            }
        }
        let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect();
        (f(y), f(dx), f(dw), f(db))
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::validate;
    use super::*;

    #[test]
    fn conv_shaders_validate_and_are_tiled() {
        for (x, o, k, s, p, d, g) in [
            ([1, 1, 5, 5], 1, [3, 3], [1, 1], [0, 0], [1, 1], 1),
            ([2, 4, 9, 7], 6, [3, 2], [2, 1], [1, 0], [1, 2], 2),
            ([32, 1, 28, 28], 8, [5, 5], [1, 1], [2, 2], [1, 1], 1),
        ] {
            for bias in [false, true] {
                let c = Conv2d::new(x, o, k, s, p, d, g, bias).unwrap();
                for spec in [
                    c.forward(),
                    c.backward_input(),
                    c.backward_weight(),
                    c.backward_bias(),
                ] {
                    validate::spec(&spec);
                }
                assert!(c.forward().wgsl.contains("var<workgroup> tile_b"));
            }
        }
    }

    #[test]
    fn invalid_convolutions_are_refused() {
        assert!(Conv2d::new([1, 3, 5, 5], 4, [3, 3], [1, 1], [0, 0], [1, 1], 2, true).is_none());
        assert!(Conv2d::new([1, 1, 2, 2], 1, [3, 3], [1, 1], [0, 0], [1, 1], 1, true).is_none());
        assert!(Conv2d::new([1, 1, 5, 5], 1, [3, 3], [0, 1], [0, 0], [1, 1], 1, true).is_none());
        let c = Conv2d::new([1, 1, 28, 28], 8, [5, 5], [2, 2], [2, 2], [1, 1], 1, true).unwrap();
        assert_eq!(c.out_hw(), (14, 14));
    }

    #[test]
    fn reference_of_a_one_by_one_kernel_is_a_channel_mix() {
        let c = Conv2d::new([1, 2, 1, 2], 1, [1, 1], [1, 1], [0, 0], [1, 1], 1, true).unwrap();
        let (y, ..) = c.reference(
            &[1.0, 2.0, 3.0, 4.0],
            &[10.0, 100.0],
            Some(&[0.5]),
            &[0.0, 0.0],
        );
        assert_eq!(y, vec![310.5, 420.5]);
    }
}
