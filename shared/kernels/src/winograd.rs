//! Winograd F(m x m, 3x3) for the 3x3, stride-1 convolutions of ResNets
//! and VGGs (Lavin and Gray, "Fast Algorithms for Convolutional Neural
//! Networks"): an `m x m` block of outputs costs `(m + 2)^2` multiplies per
//! channel pair instead of `9 m^2`, so the GEMM that remains does 2.25
//! (F(2x2, 3x3)) or 4 (F(4x4, 3x3)) times fewer FLOPs than the implicit
//! GEMM of [`Conv2d`].
//!
//! Four kernels, with the transformed tensors in scratch buffers; `a = m + 2`:
//!
//! 1. weight: `u[z, co, ci] = (G g G^T)[z]` for each 3x3 filter `g`;
//! 2. input: `v[z, ci, t] = (B^T d B)[z]` for each `a x a` patch `d` of a
//!    tile `t` (zero in the padding);
//! 3. a GEMM per transform element `z` (the template's batch):
//!    `m[z] = u[z] v[z]`, summing over the input channels;
//! 4. output: the `m x m` outputs `A^T m A` of each tile, plus the bias.
//!
//! The input gradient of the same convolution is again a 3x3 stride-1
//! convolution, of `dy` with the weight flipped in space and its channels
//! swapped, padded by `2 - p`: [`Winograd::backward_input`] is this module
//! with the weight read that way.
//!
//! The weight gradient differentiates the same product: with
//! `dm = A dY A^T` for each tile of `dy`, `du[z, co, ci] = sum_t dm[z, co, t]
//! v[z, ci, t]` (a GEMM per element whose long reduction over the tiles is
//! cut into parts), and `dg = G^T du G` ([`Winograd::weight_grad_of`]).
//!
//! Scratch buffers never exceed [`MAX_TEMP_BYTES`] (WebGPU's default
//! binding limit): a large batch runs in [`Chunk`]s of whole images.
//!
//! Only [`Precision::F32`]: mixed precision keeps the implicit GEMM on
//! tensor cores. Rounding: every transform is a fixed linear map, so an
//! output's error is bounded by its roundings along the longest path
//! ([`Winograd::rounding_levels`]) times the same computation on magnitudes
//! ([`Winograd::reference`]); F(4x4, 3x3)'s larger coefficients make that
//! sum, and so its error, larger than F(2x2, 3x3)'s.

use std::cell::Cell;

use super::conv::{Conv2d, MAX_PARTS, MIN_PART_TERMS};
use super::gemm::{Gemm, Precision, Tiling};
use super::spec::{Binding, DEFAULT_WORKGROUP, KernelSpec, f32_lit, one_d};

/// Largest scratch buffer, in bytes: WebGPU's default
/// `maxStorageBufferBindingSize`, which every adapter offers.
pub const MAX_TEMP_BYTES: usize = 128 << 20;

/// Fewest input and output channels for which the transforms pay off: with
/// fewer, the GEMM's short reduction leaves it memory-bound.
pub const MIN_CHANNELS: usize = 32;

/// Smallest output side for F(4x4, 3x3); below it F(2x2, 3x3) wastes less
/// on partial tiles.
pub const MIN_SIDE_FOR_4: usize = 8;

thread_local! {
    static FORCED_TILE: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Makes [`Winograd`]s made on this thread use output tiles of `tile`
/// (2 or 4) instead of choosing, until called with `None`: for benchmarks
/// comparing the two.
pub fn force_tile(tile: Option<usize>) {
    FORCED_TILE.with(|f| f.set(tile.filter(|t| [2, 4].contains(t))));
}

/// The three matrices of F(m x m, 3x3), `a = m + 2`: `bt` (`a x a`), `g`
/// (`a x 3`) and `at` (`m x a`).
struct Matrices {
    bt: Vec<Vec<f64>>,
    g: Vec<Vec<f64>>,
    at: Vec<Vec<f64>>,
}

fn matrices(tile: usize) -> Matrices {
    let rows = |r: &[&[f64]]| r.iter().map(|row| row.to_vec()).collect::<Vec<_>>();
    if tile == 2 {
        Matrices {
            bt: rows(&[
                &[1.0, 0.0, -1.0, 0.0],
                &[0.0, 1.0, 1.0, 0.0],
                &[0.0, -1.0, 1.0, 0.0],
                &[0.0, 1.0, 0.0, -1.0],
            ]),
            g: rows(&[
                &[1.0, 0.0, 0.0],
                &[0.5, 0.5, 0.5],
                &[0.5, -0.5, 0.5],
                &[0.0, 0.0, 1.0],
            ]),
            at: rows(&[&[1.0, 1.0, 1.0, 0.0], &[0.0, 1.0, -1.0, -1.0]]),
        }
    } else {
        Matrices {
            bt: rows(&[
                &[4.0, 0.0, -5.0, 0.0, 1.0, 0.0],
                &[0.0, -4.0, -4.0, 1.0, 1.0, 0.0],
                &[0.0, 4.0, -4.0, -1.0, 1.0, 0.0],
                &[0.0, -2.0, -1.0, 2.0, 1.0, 0.0],
                &[0.0, 2.0, -1.0, -2.0, 1.0, 0.0],
                &[0.0, 4.0, 0.0, -5.0, 0.0, 1.0],
            ]),
            g: rows(&[
                &[1.0 / 4.0, 0.0, 0.0],
                &[-1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0],
                &[-1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0],
                &[1.0 / 24.0, 1.0 / 12.0, 1.0 / 6.0],
                &[1.0 / 24.0, -1.0 / 12.0, 1.0 / 6.0],
                &[0.0, 0.0, 1.0],
            ]),
            at: rows(&[
                &[1.0, 1.0, 1.0, 1.0, 1.0, 0.0],
                &[0.0, 1.0, -1.0, 2.0, -2.0, 0.0],
                &[0.0, 1.0, 1.0, 4.0, 4.0, 0.0],
                &[0.0, 1.0, -1.0, 8.0, -8.0, 1.0],
            ]),
        }
    }
}

/// WGSL of `sum_k coef[k] * term(k)` over the nonzero coefficients, with
/// no multiply for a coefficient of +-1.
fn combination(coef: &[f64], term: impl Fn(usize) -> String) -> String {
    let mut out = String::new();
    for (k, &c) in coef.iter().enumerate() {
        if c == 0.0 {
            continue;
        }
        let sign = if c < 0.0 { " - " } else { " + " };
        let factor = if c.abs() == 1.0 {
            term(k)
        } else {
            format!("{} * {}", f32_lit(c.abs() as f32), term(k))
        };
        if out.is_empty() {
            out = if c < 0.0 {
                format!("-{factor}")
            } else {
                factor
            };
        } else {
            out += sign;
            out += &factor;
        }
    }
    if out.is_empty() { "0.0".into() } else { out }
}

/// WGSL declaring `{out}{i}_{j} = (L X R^T)[i][j]` for the named scalars
/// `{x}{k}_{l}` of X, through `{out}t{i}_{l} = (L X)[i][l]`.
fn sandwich(l: &[Vec<f64>], r: &[Vec<f64>], x: &str, cols: usize, out: &str) -> String {
    let mut s = String::new();
    for (i, row) in l.iter().enumerate() {
        for c in 0..cols {
            s += &format!(
                "    let {out}t{i}_{c} = {};\n",
                combination(row, |k| format!("{x}{k}_{c}"))
            );
        }
    }
    for i in 0..l.len() {
        for (j, rrow) in r.iter().enumerate() {
            s += &format!(
                "    let {out}{i}_{j} = {};\n",
                combination(rrow, |k| format!("{out}t{i}_{k}"))
            );
        }
    }
    s
}

/// `L X R^T` in f64, or with every coefficient by its magnitude.
fn sandwich_f64(l: &[Vec<f64>], r: &[Vec<f64>], x: &[Vec<f64>], magnitudes: bool) -> Vec<Vec<f64>> {
    let c = |v: f64| if magnitudes { v.abs() } else { v };
    let t: Vec<Vec<f64>> = l
        .iter()
        .map(|row| {
            (0..x[0].len())
                .map(|col| row.iter().zip(x).map(|(&a, xr)| c(a) * xr[col]).sum())
                .collect()
        })
        .collect();
    t.iter()
        .map(|trow| {
            r.iter()
                .map(|rrow| rrow.iter().zip(trow).map(|(&a, &v)| c(a) * v).sum())
                .collect()
        })
        .collect()
}

fn transpose(m: &[Vec<f64>]) -> Vec<Vec<f64>> {
    (0..m[0].len())
        .map(|c| m.iter().map(|row| row[c]).collect())
        .collect()
}

fn magnitude(v: f32, magnitudes: bool) -> f64 {
    let v = f64::from(v);
    if magnitudes { v.abs() } else { v }
}

/// Roundings of one `L X R^T` along its longest path: per side, the most
/// terms a row adds, one multiply, one coefficient rounded to f32.
fn sandwich_levels(l: &[Vec<f64>], r: &[Vec<f64>]) -> usize {
    let side = |m: &[Vec<f64>]| {
        m.iter()
            .map(|row| row.iter().filter(|&&c| c != 0.0).count())
            .max()
            .unwrap_or(1)
            + 1
    };
    side(l) + side(r)
}

/// A 3x3 stride-1 convolution as Winograd F(m x m, 3x3): the forward of a
/// [`Conv2d`], or its input gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Winograd {
    pub n: usize,
    /// Channels of the image read (`c` forward, `o` for the input gradient).
    pub cin: usize,
    /// Channels written.
    pub cout: usize,
    /// Size of the image read.
    pub h: usize,
    pub w: usize,
    pub padding: [usize; 2],
    /// Size of the image written.
    pub oh: usize,
    pub ow: usize,
    /// Output tile side `m`: 2 or 4.
    pub tile: usize,
    /// Whether the weight `[cin, cout, 3, 3]` is read flipped in space with
    /// its channels swapped (the input gradient of a `[cout, cin, 3, 3]`
    /// forward), instead of as `[cout, cin, 3, 3]`.
    pub flipped: bool,
    pub bias: bool,
    /// The GEMM's tiling; `None`: [`Tiling::auto`].
    pub tiling: Option<Tiling>,
    /// Largest scratch buffer in bytes ([`MAX_TEMP_BYTES`]; checks set it
    /// lower to cut small batches into chunks).
    pub temp_bytes: usize,
}

/// Whole images `start..start + count` of the batch, transformed together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Chunk {
    pub start: usize,
    pub count: usize,
}

impl Winograd {
    /// The forward of `conv` as Winograd, when it is a 3x3 stride-1
    /// undilated ungrouped f32 convolution with padding at most 2 and at
    /// least [`MIN_CHANNELS`] channels in and out.
    pub fn forward_of(conv: &Conv2d) -> Option<Self> {
        if !Self::suits(conv) {
            return None;
        }
        let (oh, ow) = conv.out_hw();
        Some(
            Self {
                n: conv.n,
                cin: conv.c,
                cout: conv.o,
                h: conv.h,
                w: conv.w,
                padding: conv.padding,
                oh,
                ow,
                tile: 2,
                flipped: false,
                bias: conv.bias,
                tiling: conv.tiling,
                temp_bytes: MAX_TEMP_BYTES,
            }
            .with_tile_chosen(),
        )
    }

    /// The input gradient of `conv` as Winograd, under the same conditions.
    pub fn backward_input(conv: &Conv2d) -> Option<Self> {
        if !Self::suits(conv) {
            return None;
        }
        let (oh, ow) = conv.out_hw();
        Some(
            Self {
                n: conv.n,
                cin: conv.o,
                cout: conv.c,
                h: oh,
                w: ow,
                padding: [2 - conv.padding[0], 2 - conv.padding[1]],
                oh: conv.h,
                ow: conv.w,
                tile: 2,
                flipped: true,
                bias: false,
                tiling: conv.tiling,
                temp_bytes: MAX_TEMP_BYTES,
            }
            .with_tile_chosen(),
        )
    }

    fn with_tile_chosen(self) -> Self {
        let chosen = if self.oh.min(self.ow) >= MIN_SIDE_FOR_4 {
            4
        } else {
            2
        };
        let tile = FORCED_TILE.with(Cell::get).unwrap_or(chosen);
        Self { tile, ..self }
    }

    fn suits(conv: &Conv2d) -> bool {
        conv.winograd
            && conv.kh == 3
            && conv.kw == 3
            && conv.stride == [1, 1]
            && conv.dilation == [1, 1]
            && conv.groups == 1
            && conv.padding.iter().all(|&p| p <= 2)
            && conv.c >= MIN_CHANNELS
            && conv.o >= MIN_CHANNELS
            && conv.precision == Precision::F32
            // One image's transforms fit a scratch buffer, at either tile.
            && 36 * conv.c.max(conv.o) * conv.out_hw().0.div_ceil(2) * conv.out_hw().1.div_ceil(2) * 4
                <= MAX_TEMP_BYTES
    }

    /// Transform elements per tile, `(m + 2)^2`.
    pub fn elems(&self) -> usize {
        (self.tile + 2) * (self.tile + 2)
    }

    fn image_bytes(&self) -> usize {
        let (th, tw) = self.tiles();
        self.elems() * self.cin.max(self.cout) * th * tw * 4
    }

    /// This with scratch buffers that hold `images` whole images, so that a
    /// small batch still runs in several chunks.
    pub fn with_chunks_of(self, images: usize) -> Self {
        Self {
            temp_bytes: self.image_bytes() * images.max(1),
            ..self
        }
    }

    /// WGSL naming invocation `i`'s channel `{channel}` and its tile `ti`
    /// of `chunk`: the tile's image `nb` and first output `(oy0, ox0)`.
    fn tile_prelude(&self, chunk: Chunk, channel: &str) -> String {
        let (th, tw) = self.tiles();
        let (t, m, per) = (self.tiles_of(chunk), self.tile, th * tw);
        format!(
            "    let {channel} = i / {t}u;\n    let ti = i % {t}u;\n\
             \x20   let nb = {start}u + ti / {per}u;\n\
             \x20   let oy0 = ((ti % {per}u) / {tw}u) * {m}u;\n\
             \x20   let ox0 = (ti % {tw}u) * {m}u;\n",
            start = chunk.start,
        )
    }

    /// Tile `ti` of `chunk`: its image, tile row and tile column.
    fn tile_at(&self, chunk: Chunk, ti: usize) -> (usize, usize, usize) {
        let (th, tw) = self.tiles();
        (chunk.start + ti / (th * tw), (ti % (th * tw)) / tw, ti % tw)
    }

    /// Tiles of one image: `(rows, cols)`.
    fn tiles(&self) -> (usize, usize) {
        (self.oh.div_ceil(self.tile), self.ow.div_ceil(self.tile))
    }

    /// The chunks of whole images the batch runs in, as even as can be.
    pub fn chunks(&self) -> Vec<Chunk> {
        let most = (self.temp_bytes / self.image_bytes().max(1)).max(1);
        let parts = self.n.div_ceil(most).max(1);
        let each = self.n.div_ceil(parts);
        (0..self.n)
            .step_by(each)
            .map(|start| Chunk {
                start,
                count: each.min(self.n - start),
            })
            .collect()
    }

    fn tiles_of(&self, chunk: Chunk) -> usize {
        let (th, tw) = self.tiles();
        chunk.count * th * tw
    }

    /// Elements of the transformed weight `u [elems, cout, cin]`.
    pub fn u_len(&self) -> usize {
        self.elems() * self.cout * self.cin
    }

    /// Elements of the largest chunk's transformed input `v [elems, cin, t]`.
    pub fn v_len(&self) -> usize {
        self.chunks()
            .iter()
            .map(|&c| self.elems() * self.cin * self.tiles_of(c))
            .max()
            .unwrap_or(0)
    }

    /// Elements of the largest chunk's products `m [elems, cout, t]`.
    pub fn m_len(&self) -> usize {
        self.chunks()
            .iter()
            .map(|&c| self.elems() * self.cout * self.tiles_of(c))
            .max()
            .unwrap_or(0)
    }

    /// Index of the forward weight's tap `(ky, kx)` of output channel `co`
    /// for input channel `ci`, as `(channel part, tap)`.
    fn weight_index(&self, ky: usize, kx: usize) -> (bool, usize) {
        if self.flipped {
            (true, (2 - ky) * 3 + (2 - kx))
        } else {
            (false, ky * 3 + kx)
        }
    }

    /// Weight transform: bindings `weight`, `u`.
    pub fn transform_weight(&self) -> KernelSpec {
        let (cout, cin) = (self.cout, self.cin);
        let mx = matrices(self.tile);
        let a = self.tile + 2;
        let mut body = format!("    let co = i / {cin}u;\n    let ci = i % {cin}u;\n");
        for ky in 0..3 {
            for kx in 0..3 {
                let (swapped, tap) = self.weight_index(ky, kx);
                let filter = if swapped {
                    format!("(ci * {cout}u + co)")
                } else {
                    format!("(co * {cin}u + ci)")
                };
                body += &format!("    let g{ky}_{kx} = weight[{filter} * 9u + {tap}u];\n");
            }
        }
        body += &sandwich(&mx.g, &mx.g, "g", 3, "u");
        for r in 0..a {
            for c in 0..a {
                body += &format!(
                    "    u[({}u * {cout}u + co) * {cin}u + ci] = u{r}_{c};\n",
                    r * a + c
                );
            }
        }
        one_d(
            "winograd_weight",
            &[
                ("weight", Binding::Read, "f32"),
                ("u", Binding::ReadWrite, "f32"),
            ],
            "",
            cout * cin,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// Input transform of `chunk`: bindings `x_in` (the whole batch), `v`.
    pub fn transform_input(&self, chunk: Chunk) -> KernelSpec {
        let t = self.tiles_of(chunk);
        let (cin, h, w, m) = (self.cin, self.h, self.w, self.tile);
        let a = m + 2;
        let [p0, p1] = self.padding;
        let mut body = self.tile_prelude(chunk, "ci");
        body += &format!(
            "    let y0 = i32(oy0) - {p0}i;\n    let x0 = i32(ox0) - {p1}i;\n\
             \x20   let base = (nb * {cin}u + ci) * {h}u;\n"
        );
        for r in 0..a {
            for c in 0..a {
                body += &format!("    let d{r}_{c} = at(base, y0 + {r}i, x0 + {c}i);\n");
            }
        }
        let mx = matrices(self.tile);
        body += &sandwich(&mx.bt, &mx.bt, "d", a, "v");
        for r in 0..a {
            for c in 0..a {
                body += &format!(
                    "    v[({}u * {cin}u + ci) * {t}u + ti] = v{r}_{c};\n",
                    r * a + c
                );
            }
        }
        let helper = format!(
            "fn at(base: u32, y: i32, x: i32) -> f32 {{\n\
             \x20   if (y < 0i || x < 0i || y >= {h}i || x >= {w}i) {{ return 0.0; }}\n\
             \x20   return x_in[(base + u32(y)) * {w}u + u32(x)];\n}}\n"
        );
        one_d(
            "winograd_input",
            &[
                ("x_in", Binding::Read, "f32"),
                ("v", Binding::ReadWrite, "f32"),
            ],
            &helper,
            cin * t,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// The products of `chunk`, one GEMM per transform element: bindings
    /// `u`, `v`, `m`.
    pub fn gemm(&self, chunk: Chunk) -> KernelSpec {
        let t = self.tiles_of(chunk);
        let (cin, cout) = (self.cin, self.cout);
        Gemm {
            label: "winograd_gemm".into(),
            precision: Precision::F32,
            gradient: None,
            tiling: self.tiling,
            split: 1,
            batch: self.elems(),
            m: cout,
            n: t,
            k: cin,
            bindings: &[
                ("u", Binding::Read, "f32"),
                ("v", Binding::Read, "f32"),
                ("m", Binding::ReadWrite, "f32"),
            ],
            a_along_k: true,
            b_along_k: false,
            load_a: format!("    return u[(z * {cout}u + row) * {cin}u + kk];"),
            load_b: format!("    return v[(z * {cin}u + kk) * {t}u + col];"),
            store: format!("        m[(z * {cout}u + row) * {t}u + col] = acc;"),
        }
        .spec()
    }

    /// Output transform of `chunk`: bindings `m`, `bias` (when there is
    /// one), `y` (the whole batch).
    pub fn transform_output(&self, chunk: Chunk) -> KernelSpec {
        let t = self.tiles_of(chunk);
        let (cout, oh, ow, m) = (self.cout, self.oh, self.ow, self.tile);
        let a = m + 2;
        let mut body = self.tile_prelude(chunk, "co");
        for e in 0..a * a {
            body += &format!(
                "    let p{}_{} = m[({e}u * {cout}u + co) * {t}u + ti];\n",
                e / a,
                e % a
            );
        }
        let mx = matrices(self.tile);
        body += &sandwich(&mx.at, &mx.at, "p", a, "y");
        let bias = if self.bias { " + bias[co]" } else { "" };
        for r in 0..m {
            for c in 0..m {
                body += &format!(
                    "    if (oy0 + {r}u < {oh}u && ox0 + {c}u < {ow}u) {{\n\
                     \x20       y[((nb * {cout}u + co) * {oh}u + oy0 + {r}u) * {ow}u + ox0 + {c}u] = y{r}_{c}{bias};\n    }}\n"
                );
            }
        }
        let with_bias = [
            ("m", Binding::Read, "f32"),
            ("bias", Binding::Read, "f32"),
            ("y", Binding::ReadWrite, "f32"),
        ];
        let without = [
            ("m", Binding::Read, "f32"),
            ("y", Binding::ReadWrite, "f32"),
        ];
        one_d(
            "winograd_output",
            if self.bias { &with_bias } else { &without },
            "",
            cout * t,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// The weight gradient of `conv` as Winograd, under the forward's
    /// conditions.
    pub fn weight_grad_of(conv: &Conv2d) -> Option<Self> {
        Self::forward_of(conv).map(|w| Self { bias: false, ..w })
    }

    /// The weight gradient GEMM's tiling and the parts its reduction over
    /// `chunk`'s tiles is cut into: enough to keep the GPU busy, each at
    /// least [`MIN_PART_TERMS`] terms, and all the parts' partial sums
    /// within one scratch buffer.
    fn weight_plan(&self, chunk: Chunk) -> (Tiling, u32) {
        let k = self.tiles_of(chunk);
        let most = (self.temp_bytes / (self.u_len() * 4).max(1)).clamp(1, MAX_PARTS);
        let (m, n, batch) = (self.cout, self.cin, self.elems());
        match self.tiling {
            Some(t) => (t, t.split_for(m, n, batch, k, MIN_PART_TERMS, most)),
            None => Tiling::auto_split(m, n, batch, k, MIN_PART_TERMS, most),
        }
    }

    /// Parts of `chunk`'s weight gradient reduction.
    pub fn weight_parts(&self, chunk: Chunk) -> u32 {
        self.weight_plan(chunk).1
    }

    /// Elements of the largest chunk's partial weight gradients
    /// `du [parts, elems, cout, cin]`.
    pub fn du_len(&self) -> usize {
        self.chunks()
            .iter()
            .map(|&c| self.weight_parts(c) as usize * self.u_len())
            .max()
            .unwrap_or(0)
    }

    /// Output-gradient transform of `chunk`: bindings `dy` (the whole
    /// batch's), `dm` (`[elems, cout, t]`, as [`Self::m_len`]).
    pub fn transform_grad_output(&self, chunk: Chunk) -> KernelSpec {
        let t = self.tiles_of(chunk);
        let (cout, oh, ow, m) = (self.cout, self.oh, self.ow, self.tile);
        let a = m + 2;
        let mut body = self.tile_prelude(chunk, "co");
        body += &format!("    let base = (nb * {cout}u + co) * {oh}u;\n");
        for r in 0..m {
            for c in 0..m {
                body += &format!("    let e{r}_{c} = at(base, oy0 + {r}u, ox0 + {c}u);\n");
            }
        }
        let mx = matrices(self.tile);
        let a_mat = transpose(&mx.at);
        body += &sandwich(&a_mat, &a_mat, "e", m, "q");
        for r in 0..a {
            for c in 0..a {
                body += &format!(
                    "    dm[({}u * {cout}u + co) * {t}u + ti] = q{r}_{c};\n",
                    r * a + c
                );
            }
        }
        let helper = format!(
            "fn at(base: u32, y: u32, x: u32) -> f32 {{\n\
             \x20   if (y >= {oh}u || x >= {ow}u) {{ return 0.0; }}\n\
             \x20   return dy[(base + y) * {ow}u + x];\n}}\n"
        );
        one_d(
            "winograd_grad_output",
            &[
                ("dy", Binding::Read, "f32"),
                ("dm", Binding::ReadWrite, "f32"),
            ],
            &helper,
            cout * t,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// `chunk`'s partial weight gradients, one GEMM per transform element
    /// with its reduction over the tiles in parts: bindings `dm`, `v`,
    /// `du`.
    pub fn weight_grad_gemm(&self, chunk: Chunk) -> KernelSpec {
        let t = self.tiles_of(chunk);
        let (cin, cout, elems) = (self.cin, self.cout, self.elems());
        let (tiling, parts) = self.weight_plan(chunk);
        Gemm {
            label: "winograd_weight_gemm".into(),
            precision: Precision::F32,
            gradient: None,
            tiling: Some(tiling),
            split: parts,
            batch: elems,
            m: cout,
            n: cin,
            k: t,
            bindings: &[
                ("dm", Binding::Read, "f32"),
                ("v", Binding::Read, "f32"),
                ("du", Binding::ReadWrite, "f32"),
            ],
            a_along_k: true,
            b_along_k: true,
            load_a: format!("    return dm[(z * {cout}u + row) * {t}u + kk];"),
            load_b: format!("    return v[(z * {cin}u + col) * {t}u + kk];"),
            store: format!(
                "        du[((part * {elems}u + z) * {cout}u + row) * {cin}u + col] = acc;"
            ),
        }
        .spec()
    }

    /// Adds `chunk`'s partial weight gradients up in part order and turns
    /// them into the 3x3 filters' `G^T du G`, written into `dweight`
    /// (`first`) or added to it: bindings `du`, `dweight`.
    pub fn finish_weight_grad(&self, chunk: Chunk, first: bool) -> KernelSpec {
        let (cout, cin, elems) = (self.cout, self.cin, self.elems());
        let parts = self.weight_parts(chunk);
        let a = self.tile + 2;
        let mut body = format!(
            "    let co = i / {cin}u;\n    let ci = i % {cin}u;\n\
             \x20   var s: array<f32, {elems}>;\n\
             \x20   for (var p = 0u; p < {parts}u; p = p + 1u) {{\n\
             \x20       for (var z = 0u; z < {elems}u; z = z + 1u) {{\n\
             \x20           s[z] = s[z] + du[((p * {elems}u + z) * {cout}u + co) * {cin}u + ci];\n\
             \x20       }}\n    }}\n"
        );
        for r in 0..a {
            for c in 0..a {
                body += &format!("    let f{r}_{c} = s[{}u];\n", r * a + c);
            }
        }
        let mx = matrices(self.tile);
        let gt = transpose(&mx.g);
        body += &sandwich(&gt, &gt, "f", a, "w");
        for ky in 0..3 {
            for kx in 0..3 {
                let at = format!("(co * {cin}u + ci) * 9u + {}u", ky * 3 + kx);
                body += &if first {
                    format!("    dweight[{at}] = w{ky}_{kx};\n")
                } else {
                    format!("    dweight[{at}] = dweight[{at}] + w{ky}_{kx};\n")
                };
            }
        }
        one_d(
            "winograd_weight_finish",
            &[
                ("du", Binding::Read, "f32"),
                ("dweight", Binding::ReadWrite, "f32"),
            ],
            "",
            cout * cin,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// `chunk`'s transformed output gradient `dm [elems, cout, t]` in f64;
    /// with `magnitudes`, of `|dy|` through `|A|`.
    pub fn grad_output_values(&self, chunk: Chunk, dy: &[f32], magnitudes: bool) -> Vec<f64> {
        let mx = matrices(self.tile);
        let a_mat = transpose(&mx.at);
        let m = self.tile;

        let t_len = self.tiles_of(chunk);
        let mut dm = vec![0.0; self.elems() * self.cout * t_len];
        for co in 0..self.cout {
            for ti in 0..t_len {
                let (nb, ty, tx) = self.tile_at(chunk, ti);
                let e: Vec<Vec<f64>> = (0..m)
                    .map(|r| {
                        (0..m)
                            .map(|c| {
                                let (oy, ox) = (ty * m + r, tx * m + c);
                                if oy >= self.oh || ox >= self.ow {
                                    return 0.0;
                                }
                                let at = ((nb * self.cout + co) * self.oh + oy) * self.ow + ox;
                                magnitude(dy[at], magnitudes)
                            })
                            .collect()
                    })
                    .collect();
                let q = sandwich_f64(&a_mat, &a_mat, &e, magnitudes);
                for (z, value) in q.iter().flatten().enumerate() {
                    dm[(z * self.cout + co) * t_len + ti] = *value;
                }
            }
        }
        dm
    }

    /// `chunk`'s weight gradient in the transform's terms,
    /// `du [elems, cout, cin]`, in f64.
    pub fn weight_grad_products(&self, chunk: Chunk, dm: &[f64], v: &[f64]) -> Vec<f64> {
        let t_len = self.tiles_of(chunk);
        let (cin, cout) = (self.cin, self.cout);
        let mut du = vec![0.0; self.u_len()];
        for z in 0..self.elems() {
            for co in 0..cout {
                let a = &dm[(z * cout + co) * t_len..][..t_len];
                for ci in 0..cin {
                    let b = &v[(z * cin + ci) * t_len..][..t_len];
                    du[(z * cout + co) * cin + ci] = a.iter().zip(b).map(|(x, y)| x * y).sum();
                }
            }
        }
        du
    }

    /// Adds `G^T du G` of each filter to `dweight [cout, cin, 3, 3]`; with
    /// `magnitudes`, through `|G|`.
    pub fn weight_grad_values(&self, du: &[f64], magnitudes: bool, dweight: &mut [f64]) {
        let mx = matrices(self.tile);
        let gt = transpose(&mx.g);
        let a = self.tile + 2;
        let cells = self.cout * self.cin;
        for co in 0..self.cout {
            for ci in 0..self.cin {
                let f: Vec<Vec<f64>> = (0..a)
                    .map(|r| {
                        (0..a)
                            .map(|c| du[(r * a + c) * cells + co * self.cin + ci])
                            .collect()
                    })
                    .collect();
                let w = sandwich_f64(&gt, &gt, &f, magnitudes);
                for (tap, value) in w.iter().flatten().enumerate() {
                    dweight[(co * self.cin + ci) * 9 + tap] += value;
                }
            }
        }
    }

    /// The weight gradient computed on the CPU in f64 through the same
    /// transforms as the kernels; with `magnitudes`, the magnitude sums
    /// (see [`Self::reference`]).
    pub fn weight_grad_reference(&self, x: &[f32], dy: &[f32], magnitudes: bool) -> Vec<f64> {
        let mut dweight = vec![0.0; self.cout * self.cin * 9];
        for chunk in self.chunks() {
            let v = self.input_values(chunk, x, magnitudes);
            let dm = self.grad_output_values(chunk, dy, magnitudes);
            let du = self.weight_grad_products(chunk, &dm, &v);
            self.weight_grad_values(&du, magnitudes, &mut dweight);
        }
        dweight
    }

    /// Roundings along the longest path to a weight gradient: both
    /// transforms', the product (1), the sum over every tile of the batch
    /// (in parts, then the parts and the chunks), the inverse transform's.
    pub fn weight_grad_rounding_levels(&self) -> usize {
        let mx = matrices(self.tile);
        let (a_mat, gt) = (transpose(&mx.at), transpose(&mx.g));
        let (th, tw) = self.tiles();
        sandwich_levels(&a_mat, &a_mat)
            + sandwich_levels(&mx.bt, &mx.bt)
            + 1
            + self.n * th * tw
            + MAX_PARTS
            + self.chunks().len()
            + sandwich_levels(&gt, &gt)
    }

    /// The transformed weight `u [elems, cout, cin]` in f64 from the
    /// forward weight; with `magnitudes`, of `|weight|` through `|G|`.
    pub fn weight_values(&self, weight: &[f32], magnitudes: bool) -> Vec<f64> {
        let mx = matrices(self.tile);
        let cells = self.cout * self.cin;
        let mut u = vec![0.0; self.u_len()];
        for co in 0..self.cout {
            for ci in 0..self.cin {
                let g: Vec<Vec<f64>> = (0..3)
                    .map(|ky| {
                        (0..3)
                            .map(|kx| {
                                let (swapped, tap) = self.weight_index(ky, kx);
                                let filter = if swapped {
                                    ci * self.cout + co
                                } else {
                                    co * self.cin + ci
                                };
                                magnitude(weight[filter * 9 + tap], magnitudes)
                            })
                            .collect()
                    })
                    .collect();
                let t = sandwich_f64(&mx.g, &mx.g, &g, magnitudes);
                for (e, value) in t.iter().flatten().enumerate() {
                    u[e * cells + co * self.cin + ci] = *value;
                }
            }
        }
        u
    }

    /// The transformed input `v [elems, cin, t]` of `chunk` in f64, from
    /// the whole batch `x`; with `magnitudes`, of `|x|` through `|B|`.
    pub fn input_values(&self, chunk: Chunk, x: &[f32], magnitudes: bool) -> Vec<f64> {
        let mx = matrices(self.tile);
        let (m, a) = (self.tile, self.tile + 2);

        let t_len = self.tiles_of(chunk);
        let [p0, p1] = self.padding;
        let mut v = vec![0.0; self.elems() * self.cin * t_len];
        for ci in 0..self.cin {
            for ti in 0..t_len {
                let (nb, ty, tx) = self.tile_at(chunk, ti);
                let d: Vec<Vec<f64>> = (0..a)
                    .map(|r| {
                        (0..a)
                            .map(|c| {
                                let iy = (ty * m + r) as isize - p0 as isize;
                                let ix = (tx * m + c) as isize - p1 as isize;
                                if iy < 0
                                    || ix < 0
                                    || iy >= self.h as isize
                                    || ix >= self.w as isize
                                {
                                    return 0.0;
                                }
                                let at = ((nb * self.cin + ci) * self.h + iy as usize) * self.w
                                    + ix as usize;
                                magnitude(x[at], magnitudes)
                            })
                            .collect()
                    })
                    .collect();
                let t = sandwich_f64(&mx.bt, &mx.bt, &d, magnitudes);
                for (e, value) in t.iter().flatten().enumerate() {
                    v[(e * self.cin + ci) * t_len + ti] = *value;
                }
            }
        }
        v
    }

    /// The products `m [elems, cout, t]` of `chunk`: `u[z] v[z]` in f64.
    pub fn products(&self, chunk: Chunk, u: &[f64], v: &[f64]) -> Vec<f64> {
        let t_len = self.tiles_of(chunk);
        let (cin, cout) = (self.cin, self.cout);
        let mut out = vec![0.0; self.elems() * cout * t_len];
        for z in 0..self.elems() {
            for co in 0..cout {
                let row = &mut out[(z * cout + co) * t_len..][..t_len];
                for ci in 0..cin {
                    let a = u[(z * cout + co) * cin + ci];
                    let vs = &v[(z * cin + ci) * t_len..][..t_len];
                    for (o, &b) in row.iter_mut().zip(vs) {
                        *o += a * b;
                    }
                }
            }
        }
        out
    }

    /// Writes `chunk`'s outputs `A^T m A` (without the bias) into `y`, the
    /// whole batch's output; with `magnitudes`, through `|A|`.
    pub fn output_values(&self, chunk: Chunk, prod: &[f64], magnitudes: bool, y: &mut [f64]) {
        let mx = matrices(self.tile);
        let (m, a) = (self.tile, self.tile + 2);

        let t_len = self.tiles_of(chunk);
        for co in 0..self.cout {
            for ti in 0..t_len {
                let (nb, ty, tx) = self.tile_at(chunk, ti);
                let p: Vec<Vec<f64>> = (0..a)
                    .map(|r| {
                        (0..a)
                            .map(|c| prod[((r * a + c) * self.cout + co) * t_len + ti])
                            .collect()
                    })
                    .collect();
                let out = sandwich_f64(&mx.at, &mx.at, &p, magnitudes);
                for (r, row) in out.iter().enumerate() {
                    for (c, &value) in row.iter().enumerate() {
                        let (oy, ox) = (ty * m + r, tx * m + c);
                        if oy < self.oh && ox < self.ow {
                            y[((nb * self.cout + co) * self.oh + oy) * self.ow + ox] = value;
                        }
                    }
                }
            }
        }
    }

    /// The convolution without its bias, computed on the CPU in f64 from
    /// `x [n, cin, h, w]` and the forward weight through the same
    /// transforms as the kernels: with `magnitudes`, every input and every
    /// coefficient is taken by its absolute value, giving the sum of the
    /// magnitudes of the terms each output adds (the scale of its rounding
    /// errors).
    pub fn reference(&self, x: &[f32], weight: &[f32], magnitudes: bool) -> Vec<f64> {
        let u = self.weight_values(weight, magnitudes);
        let mut y = vec![0.0f64; self.n * self.cout * self.oh * self.ow];
        for chunk in self.chunks() {
            let v = self.input_values(chunk, x, magnitudes);
            let prod = self.products(chunk, &u, &v);
            self.output_values(chunk, &prod, magnitudes, &mut y);
        }
        y
    }

    /// At most how many times the direct convolution's an output's
    /// magnitude sum is when every input and weight has the same size: the
    /// factor the transforms' coefficients put on rounding errors.
    pub fn magnification(&self) -> f64 {
        let a = self.tile + 2;
        let one = self.one_tile();
        let sums = one.reference(&vec![1.0; a * a], &[1.0; 9], true);
        sums.into_iter().fold(0.0, f64::max) / 9.0
    }

    /// [`Self::magnification`] of the weight gradient: its magnitude sums
    /// over the direct sum's, for one tile of equal inputs.
    pub fn weight_grad_magnification(&self) -> f64 {
        let one = self.one_tile();
        let (m, a) = (self.tile, self.tile + 2);
        let sums = one.weight_grad_reference(&vec![1.0; a * a], &vec![1.0; m * m], true);
        sums.into_iter().fold(0.0, f64::max) / (m * m) as f64
    }

    /// This geometry cut down to one image of one tile and one channel.
    fn one_tile(&self) -> Self {
        let a = self.tile + 2;
        Self {
            n: 1,
            cin: 1,
            cout: 1,
            h: a,
            w: a,
            padding: [0, 0],
            oh: self.tile,
            ow: self.tile,
            flipped: false,
            bias: false,
            temp_bytes: MAX_TEMP_BYTES,
            ..*self
        }
    }

    /// Roundings along the longest path to an output: the weight and input
    /// transforms', the product (1), the sum over the input channels
    /// (`cin`, in any order), the output transform's and the bias (1).
    /// Each operation is correctly rounded in WGSL, so an output is within
    /// `levels * 2^-24 * (its magnitude sum)` of the exact result, to first
    /// order.
    pub fn rounding_levels(&self) -> usize {
        let mx = matrices(self.tile);
        sandwich_levels(&mx.g, &mx.g)
            + sandwich_levels(&mx.bt, &mx.bt)
            + 1
            + self.cin
            + sandwich_levels(&mx.at, &mx.at)
            + 1
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::validate;
    use super::*;
    use crate::sample_matrix;

    fn conv(x: [usize; 4], o: usize, pad: usize) -> Conv2d {
        Conv2d::new(x, o, [3, 3], [1, 1], [pad, pad], [1, 1], 1, true).unwrap()
    }

    #[test]
    fn only_wide_three_by_three_stride_one_convolutions_use_winograd() {
        assert!(Winograd::forward_of(&conv([2, 32, 8, 8], 32, 1)).is_some());
        assert!(Winograd::forward_of(&conv([2, 16, 8, 8], 32, 1)).is_none());
        assert!(Winograd::forward_of(&conv([2, 1, 28, 28], 16, 1)).is_none());
        let strided =
            Conv2d::new([2, 32, 8, 8], 32, [3, 3], [2, 2], [1, 1], [1, 1], 1, true).unwrap();
        assert!(Winograd::forward_of(&strided).is_none());
        let mut off = conv([2, 32, 8, 8], 32, 1);
        off.winograd = false;
        assert!(Winograd::forward_of(&off).is_none());
        let mut mixed = conv([2, 32, 8, 8], 32, 1);
        mixed.precision = Precision::Mixed;
        assert!(Winograd::forward_of(&mixed).is_none());
    }

    #[test]
    fn a_large_batch_runs_in_even_chunks_under_the_binding_limit() {
        let w = Winograd::forward_of(&conv([256, 128, 28, 28], 128, 1)).unwrap();
        assert_eq!(w.tile, 4);
        let chunks = w.chunks();
        assert_eq!(chunks.len(), 2);
        assert!(chunks.iter().all(|c| c.count == 128));
        assert_eq!(chunks.iter().map(|c| c.count).sum::<usize>(), 256);
        assert!(w.v_len() * 4 <= MAX_TEMP_BYTES && w.m_len() * 4 <= MAX_TEMP_BYTES);
        let odd = Winograd::forward_of(&conv([7, 32, 5, 5], 32, 1)).unwrap();
        assert_eq!(odd.chunks(), vec![Chunk { start: 0, count: 7 }]);
    }

    /// The transforms in f64 give the direct convolution's forward, input
    /// gradient and weight gradient, at both tile sizes, odd sizes (partial
    /// tiles) and every padding.
    #[test]
    fn reference_transforms_equal_the_direct_convolution() {
        let cases = [
            (2, [2, 32, 7, 5], 33, 1),
            (2, [1, 32, 4, 6], 32, 0),
            (2, [1, 34, 3, 3], 32, 2),
            (4, [2, 32, 9, 7], 33, 1),
            (4, [1, 32, 6, 10], 32, 0),
            (4, [1, 32, 5, 3], 32, 2),
        ];
        for (tile, x, o, pad) in cases {
            let c = conv(x, o, pad);
            let xs = sample_matrix(c.n * c.c * c.h * c.w, 1);
            let ws = sample_matrix(c.weight_len(), 2);
            let dy = sample_matrix(c.out_len(), 3);
            let (y, dx, dw, _) = c.reference(&xs, &ws, None, &dy);
            force_tile(Some(tile));
            let fwd = Winograd::forward_of(&c).unwrap();
            let bwd = Winograd::backward_input(&c).unwrap();
            let grad = Winograd::weight_grad_of(&c).unwrap();
            force_tile(None);
            assert_eq!((fwd.tile, bwd.tile, grad.tile), (tile, tile, tile));
            let computed = [
                (fwd.reference(&xs, &ws, false), y),
                (bwd.reference(&dy, &ws, false), dx),
                (grad.weight_grad_reference(&xs, &dy, false), dw),
            ];
            for (got, want) in computed {
                assert_eq!(got.len(), want.len());
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - f64::from(*w)).abs() < 1e-4, "{g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn larger_tiles_magnify_rounding_more() {
        let c = conv([1, 32, 16, 16], 32, 1);
        force_tile(Some(2));
        let two = Winograd::forward_of(&c).unwrap().magnification();
        force_tile(Some(4));
        let four = Winograd::forward_of(&c).unwrap().magnification();
        force_tile(None);
        assert!((1.0..16.0).contains(&two), "{two}");
        assert!(four > two && four < 1000.0, "{four}");
        let g = |t| {
            force_tile(Some(t));
            let w = Winograd::weight_grad_of(&c)
                .unwrap()
                .weight_grad_magnification();
            force_tile(None);
            w
        };
        let (g2, g4) = (g(2), g(4));
        assert!(g2 >= 1.0 && g4 > g2, "{g2} {g4}");
    }

    #[test]
    fn winograd_shaders_validate() {
        let c = conv([3, 32, 9, 7], 40, 1);
        let small = conv([3, 32, 5, 5], 40, 1);
        for w in [
            Winograd::forward_of(&c).unwrap(),
            Winograd::backward_input(&c).unwrap(),
            Winograd::forward_of(&small).unwrap(),
        ] {
            for chunk in w.chunks() {
                for spec in [
                    w.transform_input(chunk),
                    w.gemm(chunk),
                    w.transform_output(chunk),
                ] {
                    validate::spec(&spec);
                }
            }
            validate::spec(&w.transform_weight());
        }
        let w = Winograd::weight_grad_of(&c).unwrap();
        for chunk in w.chunks() {
            validate::spec(&w.transform_grad_output(chunk));
            validate::spec(&w.weight_grad_gemm(chunk));
            validate::spec(&w.finish_weight_grad(chunk, chunk.start == 0));
        }
    }
}
