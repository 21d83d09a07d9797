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

/// WGSL storing the `a x a` scalars `{name}{r}_{c}` of one `(row, col)`
/// pair where the GEMMs read them: element `e = r * a + c` at
/// `{buf}[(e * rows + row) * cols + col]`.
fn store_grid(
    buf: &str,
    name: &str,
    a: usize,
    (rows, row): (usize, &str),
    (cols, col): (usize, &str),
) -> String {
    let mut s = String::new();
    for e in 0..a * a {
        s += &format!(
            "    {buf}[({e}u * {rows}u + {row}) * {cols}u + {col}] = {name}{}_{};\n",
            e / a,
            e % a
        );
    }
    s
}

fn transpose(m: &[Vec<f64>]) -> Vec<Vec<f64>> {
    (0..m[0].len())
        .map(|c| m.iter().map(|row| row[c]).collect())
        .collect()
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

/// One kernel of a Winograd product, named by what it computes; its
/// bindings in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// `weight`, `u`.
    Weight,
    /// `x_in` (the whole batch), `v`.
    Input(Chunk),
    /// `u`, `v`, `m`.
    Gemm(Chunk),
    /// `m`, `bias` (when there is one), `y` (the whole batch).
    Output(Chunk),
    /// `dy` (the whole batch), `dm`.
    GradOutput(Chunk),
    /// `dm`, `v`, `du`.
    WeightGemm(Chunk),
    /// `du`, `dweight`: written when `first`, else added to.
    WeightFinish { chunk: Chunk, first: bool },
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

    /// The forward weight's tap that is this convolution's `(ky, kx)`
    /// (flipped in space for the input gradient); the filter is
    /// `[ci, co]` when [`Self::flipped`], else `[co, ci]`.
    fn tap(&self, ky: usize, kx: usize) -> usize {
        if self.flipped {
            (2 - ky) * 3 + (2 - kx)
        } else {
            ky * 3 + kx
        }
    }

    /// The kernel of `step`.
    pub fn spec(&self, step: Step) -> KernelSpec {
        match step {
            Step::Weight => self.transform_weight(),
            Step::Input(chunk) => self.transform_input(chunk),
            Step::Gemm(chunk) => self.gemm(chunk),
            Step::Output(chunk) => self.transform_output(chunk),
            Step::GradOutput(chunk) => self.transform_grad_output(chunk),
            Step::WeightGemm(chunk) => self.weight_grad_gemm(chunk),
            Step::WeightFinish { chunk, first } => self.finish_weight_grad(chunk, first),
        }
    }

    /// The forward (or input gradient) of `input` by `weight`, plus `bias`,
    /// into `out`, as steps with their bindings, in order: the weight
    /// transformed once, then each chunk's transforms and products through
    /// scratch buffers `u`, `v`, `m` of [`Self::u_len`], [`Self::v_len`]
    /// and [`Self::m_len`] elements. `B` is whatever names a buffer.
    pub fn product_steps<B: Copy>(
        &self,
        input: B,
        weight: B,
        bias: Option<B>,
        out: B,
        [u, v, m]: [B; 3],
    ) -> Vec<(Step, Vec<B>)> {
        let mut steps = vec![(Step::Weight, vec![weight, u])];
        for chunk in self.chunks() {
            steps.push((Step::Input(chunk), vec![input, v]));
            steps.push((Step::Gemm(chunk), vec![u, v, m]));
            let mut bufs = vec![m];
            bufs.extend(bias);
            bufs.push(out);
            steps.push((Step::Output(chunk), bufs));
        }
        steps
    }

    /// The weight gradient from `dy` and `x` into `out`, as steps with
    /// their bindings, in order: per chunk both transforms, the GEMM in
    /// parts, and the parts added up and transformed back into (or onto)
    /// `out`, through scratch buffers `v`, `dm`, `du` of [`Self::v_len`],
    /// [`Self::m_len`] and [`Self::du_len`] elements.
    pub fn weight_grad_steps<B: Copy>(
        &self,
        dy: B,
        x: B,
        out: B,
        [v, dm, du]: [B; 3],
    ) -> Vec<(Step, Vec<B>)> {
        let mut steps = Vec::new();
        for chunk in self.chunks() {
            steps.push((Step::Input(chunk), vec![x, v]));
            steps.push((Step::GradOutput(chunk), vec![dy, dm]));
            steps.push((Step::WeightGemm(chunk), vec![dm, v, du]));
            let first = chunk.start == 0;
            steps.push((Step::WeightFinish { chunk, first }, vec![du, out]));
        }
        steps
    }

    /// Weight transform: bindings `weight`, `u`.
    pub fn transform_weight(&self) -> KernelSpec {
        let (cout, cin) = (self.cout, self.cin);
        let mx = matrices(self.tile);
        let a = self.tile + 2;
        let mut body = format!("    let co = i / {cin}u;\n    let ci = i % {cin}u;\n");
        for ky in 0..3 {
            for kx in 0..3 {
                let filter = if self.flipped {
                    format!("(ci * {cout}u + co)")
                } else {
                    format!("(co * {cin}u + ci)")
                };
                let tap = self.tap(ky, kx);
                body += &format!("    let g{ky}_{kx} = weight[{filter} * 9u + {tap}u];\n");
            }
        }
        body += &sandwich(&mx.g, &mx.g, "g", 3, "u");
        body += &store_grid("u", "u", a, (cout, "co"), (cin, "ci"));
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
        body += &store_grid("v", "v", a, (cin, "ci"), (t, "ti"));
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

    /// Bytes of scratch a stage holds for `conv`'s Winograd products (none
    /// where it runs as an implicit GEMM): what the planner counts beside
    /// parameters and activations. An upper bound, as a stage reuses
    /// scratch buffers of equal length.
    pub fn scratch_bytes(conv: &Conv2d) -> u64 {
        let products = Self::forward_of(conv)
            .map(|w| w.u_len() + w.v_len() + w.m_len())
            .unwrap_or(0)
            + Self::backward_input(conv)
                .map(|w| w.u_len() + w.v_len() + w.m_len())
                .unwrap_or(0)
            + Self::weight_grad_of(conv)
                .map(|w| w.v_len() + w.m_len() + w.du_len())
                .unwrap_or(0);
        products as u64 * 4
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
        body += &store_grid("dm", "q", a, (cout, "co"), (t, "ti"));
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
}

mod reference;
#[cfg(test)]
mod tests;
