//! The tiled GEMM template every matrix product is generated from
//! ([`Gemm`]), and how its work is cut up ([`Tiling`]).
//!
//! Each workgroup of `tile x tile` invocations computes a block of the
//! result, `tile * rows` by `tile * cols`, staging `depth` steps of k of each
//! operand in workgroup memory per barrier pair; each invocation keeps
//! `rows x cols` accumulators in registers. The operands are read through
//! generated loader functions, so a transposed operand, a broadcast batch or
//! an im2col view of an image is a different loader, never a copy.
//!
//! Split-K ([`Gemm::split`]) cuts k into parts computed by separate
//! workgroups, for products with few outputs and a long reduction (a
//! convolution's weight gradient): the store then sees `part` and writes
//! partial sums the caller adds up in a fixed order, so results stay
//! deterministic.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::precision::{GRAD_SCALE, Precision, ROUND_HALF_WGSL, Side, tensor_cores};
use super::tensor::{self, TensorTiling};
use crate::spec::{Binding, KernelSpec, declare, kinds};

/// Largest workgroup side: `tile x tile` invocations must fit WebGPU's
/// guaranteed 256 per workgroup.
pub const MAX_GEMM_TILE: u32 = 16;

/// Largest register block side: up to 8 x 8 outputs per invocation, 64
/// accumulators, which every GPU's register file holds.
pub const MAX_PER_THREAD: u32 = 8;

/// Workgroup memory every WebGPU device guarantees.
pub const WORKGROUP_BYTES: u32 = 16_384;

/// The shape of a GEMM's work: workgroup side, register block, staged depth
/// and whether workgroup memory is read as `vec4`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tiling {
    /// Invocations per side of the (square) workgroup.
    pub tile: u32,
    /// Output rows each invocation computes.
    pub rows: u32,
    /// Output columns each invocation computes.
    pub cols: u32,
    /// Steps along k staged in workgroup memory between barriers.
    pub depth: u32,
    /// Each invocation owns groups of 4 adjacent rows and columns and reads
    /// them from workgroup memory as `vec4`: a quarter of the load
    /// instructions. Needs `rows` and `cols` multiples of 4.
    pub vector: bool,
}

impl Tiling {
    /// The tiling of the first GEMM kernels: 16 x 16 invocations of 4 x 4
    /// scalar outputs, 16 deep.
    pub const CLASSIC: Tiling = Tiling::square(16, 4);

    /// `tile x tile` invocations of `per_thread x per_thread` scalar outputs,
    /// `tile` deep.
    pub const fn square(tile: u32, per_thread: u32) -> Self {
        Self {
            tile,
            rows: per_thread,
            cols: per_thread,
            depth: tile,
            vector: false,
        }
    }

    /// A tiling, or `None` when a side is out of range, `vector` meets a
    /// register block that is not a multiple of 4, or the staged tiles
    /// exceed the workgroup memory WebGPU guarantees.
    pub fn new(tile: u32, rows: u32, cols: u32, depth: u32, vector: bool) -> Option<Self> {
        let t = Self {
            tile,
            rows,
            cols,
            depth,
            vector,
        };
        let side = |v: u32| (1..=MAX_PER_THREAD).contains(&v);
        let ok = (1..=MAX_GEMM_TILE).contains(&tile)
            && side(rows)
            && side(cols)
            && (1..=64).contains(&depth)
            && (!vector || (rows.is_multiple_of(4) && cols.is_multiple_of(4)))
            && t.workgroup_bytes() <= WORKGROUP_BYTES;
        ok.then_some(t)
    }

    /// Output rows of one workgroup's block.
    pub fn block_rows(&self) -> u32 {
        self.tile * self.rows
    }

    /// Output columns of one workgroup's block.
    pub fn block_cols(&self) -> u32 {
        self.tile * self.cols
    }

    /// Workgroup memory the staged tiles take, at most (with the padding
    /// of [`Self::strides`]).
    pub fn workgroup_bytes(&self) -> u32 {
        let a_rows = if self.vector {
            self.depth
        } else {
            self.block_rows()
        };
        [(false, false), (false, true), (true, false), (true, true)]
            .into_iter()
            .map(|(a_along_k, b_along_k)| {
                let (a, b) = self.strides(a_along_k, b_along_k);
                4 * (a * a_rows + b * self.depth)
            })
            .max()
            .unwrap_or(0)
    }

    /// Words between the rows of the staged tiles of A and B. The vector
    /// form stores both k-major (A as `[depth][rows + pad]`), the scalar
    /// form A row-major (`[rows][depth + pad]`) and B k-major. Where
    /// neighbouring invocations write down a tile's column (the layout's
    /// slow axis), rows one bank apart would put them all in one memory
    /// bank: a padding of one word (one `vec4` in the vector form) spreads
    /// them over many.
    fn strides(&self, a_along_k: bool, b_along_k: bool) -> (u32, u32) {
        let pad = if self.vector { 4 } else { 1 };
        let (bm, bn, d) = (self.block_rows(), self.block_cols(), self.depth);
        let a = if self.vector {
            bm + if a_along_k { pad } else { 0 }
        } else {
            d + if a_along_k { 0 } else { pad }
        };
        (a, bn + if b_along_k { pad } else { 0 })
    }

    /// Workgroups a `batch` of `m x n` outputs takes.
    pub fn blocks(&self, m: usize, n: usize, batch: usize) -> usize {
        coverage(self.block_rows(), self.block_cols(), m, n, batch).0
    }

    /// The tiling for a `batch` of `m x n` outputs: the largest register
    /// block that still leaves every part of a large GPU busy
    /// ([`BUSY_BLOCKS`] workgroups) and computes few outputs past the
    /// edges, since larger blocks load each staged element into more
    /// multiply-adds. Products too small for any of them take the largest
    /// small block that still does, or else the one that keeps the most
    /// workgroups doing useful work.
    pub fn auto(m: usize, n: usize, batch: usize) -> Self {
        Self::auto_for(m, n, batch, busy_blocks())
    }

    /// [`Self::auto`] for an adapter kept busy by `busy` workgroups.
    pub fn auto_for(m: usize, n: usize, batch: usize, busy: usize) -> Self {
        let fits = |t: &Tiling| {
            let (blocks, per_mille) = t.coverage(m, n, batch);
            blocks >= busy && per_mille >= 750
        };
        let enough = |t: &Tiling| {
            let (blocks, per_mille) = t.coverage(m, n, batch);
            blocks >= busy && per_mille >= 500
        };
        AUTO_CANDIDATES
            .into_iter()
            .find(fits)
            .or_else(|| SMALL_CANDIDATES.into_iter().find(enough))
            .unwrap_or_else(|| {
                most_useful(&SMALL_CANDIDATES, busy, |t| t.coverage(m, n, batch))
                    .unwrap_or(Tiling::CLASSIC)
            })
    }

    /// [`coverage`] of this tiling's blocks.
    fn coverage(&self, m: usize, n: usize, batch: usize) -> (usize, usize) {
        coverage(self.block_rows(), self.block_cols(), m, n, batch)
    }

    /// The tiling and split-K parts for a `batch` of `m x n` outputs each
    /// summing `k` terms, at least `min_part` terms per part: the largest
    /// candidate that computes few outputs past the edges and, with k cut
    /// into up to `max_parts` parts, keeps the adapter busy
    /// ([`busy_blocks`]).
    pub fn auto_split(
        m: usize,
        n: usize,
        batch: usize,
        k: usize,
        min_part: usize,
        max_parts: usize,
    ) -> (Self, u32) {
        let busy = busy_blocks();
        let parts = |t: &Tiling| t.split_for(m, n, batch, k, min_part, max_parts);
        let chosen = AUTO_CANDIDATES
            .into_iter()
            .find(|t| {
                let (blocks, per_mille) = t.coverage(m, n, batch);
                per_mille >= 750 && blocks * parts(t) as usize >= busy
            })
            .unwrap_or_else(|| Tiling::auto_for(m, n, batch, busy));
        (chosen, parts(&chosen))
    }

    /// Parts this tiling cuts a reduction of `k` terms into for a `batch`
    /// of `m x n` outputs: enough for twice [`busy_blocks`] workgroups, at
    /// least `min_part` terms each and at most `max_parts`, none empty.
    pub fn split_for(
        &self,
        m: usize,
        n: usize,
        batch: usize,
        k: usize,
        min_part: usize,
        max_parts: usize,
    ) -> u32 {
        let wanted = (2 * busy_blocks()).div_ceil(self.blocks(m, n, batch));
        let most = (k / min_part.max(1)).clamp(1, max_parts.max(1));
        split_parts(k, self.depth, wanted.min(most) as u32)
    }

    /// For people: `16x16 x 8x8 d8 vec4`.
    pub fn describe(&self) -> String {
        format!(
            "{t}x{t} x {r}x{c} d{d}{v}",
            t = self.tile,
            r = self.rows,
            c = self.cols,
            d = self.depth,
            v = if self.vector { " vec4" } else { "" }
        )
    }
}

/// Workgroups of `rows x cols` output blocks a `batch` of `m x n` outputs
/// takes, and the share of the outputs they compute that are inside the
/// result, in thousandths: what choosing a tiling weighs, in either GEMM
/// form.
pub(super) fn coverage(rows: u32, cols: u32, m: usize, n: usize, batch: usize) -> (usize, usize) {
    let blocks = m.div_ceil(rows as usize).max(1) * n.div_ceil(cols as usize).max(1) * batch.max(1);
    let computed = blocks * (rows * cols) as usize;
    (blocks, m * n * batch.max(1) * 1000 / computed)
}

/// Of `candidates` (largest block first), the one that keeps the most of
/// `busy` workgroups doing useful work by its `coverage`; ties go to the
/// larger block. `None` only without candidates.
pub(super) fn most_useful<T: Copy>(
    candidates: &[T],
    busy: usize,
    coverage: impl Fn(&T) -> (usize, usize),
) -> Option<T> {
    candidates.iter().rev().copied().max_by_key(|t| {
        let (blocks, per_mille) = coverage(t);
        blocks.min(busy) * per_mille
    })
}

/// Workgroups a product must fill before a larger register block is used:
/// several waves on the largest GPUs (132 compute units on an H100, each
/// holding about two of the largest blocks), so the last, partial wave
/// costs little. On an H200, 8192 x 3072 x 768 ran at 19.4 TFLOP/s in 384
/// blocks of 128 x 128 and 24.3 in 768 of 64 x 128.
pub const BUSY_BLOCKS: usize = 512;

static BUSY: AtomicUsize = AtomicUsize::new(BUSY_BLOCKS);

/// Workgroups [`Tiling::auto`] aims for in this process: [`BUSY_BLOCKS`]
/// unless the adapter opened said otherwise ([`set_busy_blocks`]).
pub fn busy_blocks() -> usize {
    BUSY.load(Ordering::Relaxed)
}

/// Tells [`Tiling::auto`] how many workgroups keep this process's adapter
/// busy; the GPU context sets it when it opens a software adapter, before
/// any stage generates its kernels.
pub fn set_busy_blocks(blocks: usize) {
    BUSY.store(blocks.max(1), Ordering::Relaxed);
}

/// [`Tiling::auto`]'s candidates, largest block first.
pub const AUTO_CANDIDATES: [Tiling; 4] = [
    Tiling {
        tile: 16,
        rows: 8,
        cols: 8,
        depth: 8,
        vector: true,
    },
    Tiling {
        tile: 16,
        rows: 4,
        cols: 8,
        depth: 16,
        vector: true,
    },
    Tiling {
        tile: 16,
        rows: 8,
        cols: 4,
        depth: 16,
        vector: true,
    },
    Tiling {
        tile: 16,
        rows: 4,
        cols: 4,
        depth: 16,
        vector: true,
    },
];

/// [`Tiling::auto`]'s choices for products too small to fill a large GPU
/// with any of [`AUTO_CANDIDATES`], largest block first.
pub const SMALL_CANDIDATES: [Tiling; 3] = [
    Tiling::CLASSIC,
    Tiling::square(16, 2),
    Tiling::square(16, 1),
];

/// One GEMM `out[z][row][col] = sum_kk A(z,row,kk) * B(z,kk,col)` for `z` in
/// `0..batch`, with the loaders and the store written in WGSL.
#[derive(Debug, Clone)]
pub struct Gemm<'a> {
    pub label: String,
    /// `None`: [`Tiling::auto`] for the shape.
    pub tiling: Option<Tiling>,
    /// Parts k is cut into (1: none). The store sees `part` in `0..split`
    /// and must keep the parts' partial sums apart.
    pub split: u32,
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub bindings: &'a [(&'a str, Binding, &'a str)],
    /// Whether A's neighbours in memory are neighbours along k (a row-major
    /// A; false for a transposed one). Neighbouring invocations then load
    /// neighbouring steps of k, so their loads coalesce.
    pub a_along_k: bool,
    /// Whether B's neighbours in memory are neighbours along k (a
    /// transposed B, an image read by its batch and space).
    pub b_along_k: bool,
    /// Body of `fn load_a(z: u32, row: u32, kk: u32) -> f32`, called only
    /// in bounds.
    pub load_a: String,
    /// Body of `fn load_b(z: u32, kk: u32, col: u32) -> f32`.
    pub load_b: String,
    /// Statements storing `acc` for `(z, row, col)` (and `part`), run only
    /// in bounds.
    pub store: String,
    /// How the operands enter the multiply-adds ([`super::precision`]).
    pub precision: Precision,
    /// The operand that is a gradient, scaled into f16's range under
    /// [`Precision::Mixed`].
    pub gradient: Option<Side>,
}

/// The staging loop of one operand tile: `elems` elements over `threads`
/// invocations, the statements `body(round)` run for each `idx` (guarded
/// where the last round is partial).
pub(super) fn staged(elems: u32, threads: u32, body: &dyn Fn(u32) -> String) -> String {
    let mut s = String::new();
    for e in 0..elems.div_ceil(threads) {
        let guard = if (e + 1) * threads > elems {
            format!("if (lin + {}u < {elems}u) ", e * threads)
        } else {
            String::new()
        };
        s += &format!(
            "        {guard}{{\n            let idx = lin + {}u;\n{}        }}\n",
            e * threads,
            body(e)
        );
    }
    s
}

/// Parts [`Gemm::split`] actually makes of `k` for `tiling`: no part is
/// empty, so some requests give fewer.
pub fn split_parts(k: usize, depth: u32, split: u32) -> u32 {
    let steps = k.div_ceil(depth as usize).max(1);
    let per = steps.div_ceil(split.max(1) as usize);
    steps.div_ceil(per) as u32
}

impl Gemm<'_> {
    /// The tiling this GEMM generates with.
    pub fn tiling(&self) -> Tiling {
        self.tiling
            .unwrap_or_else(|| Tiling::auto(self.m, self.n, self.batch))
    }

    /// Under mixed precision, the WGSL scaling A's and B's loads (the
    /// gradient's by [`GRAD_SCALE`]) and the sum back.
    pub(super) fn gradient_scales(&self) -> [String; 3] {
        let scale = |side| {
            if self.gradient == Some(side) {
                format!(" * {GRAD_SCALE:.1}")
            } else {
                String::new()
            }
        };
        let unscale = if self.gradient.is_some() {
            format!(" * {:e}", 1.0 / GRAD_SCALE)
        } else {
            String::new()
        };
        [scale(Side::A), scale(Side::B), unscale]
    }

    /// WGSL expressions of where staged element `idx` goes: `[ar, ak, bk,
    /// bc]`, its row and step of A's `bm x d` tile, and its step and column
    /// of B's `d x bn` one. Neighbouring invocations load neighbours in
    /// memory.
    pub(super) fn staging_indices(&self, d: u32, bm: u32, bn: u32) -> [String; 4] {
        let (ar, ak) = if self.a_along_k {
            (format!("idx / {d}u"), format!("idx % {d}u"))
        } else {
            (format!("idx % {bm}u"), format!("idx / {bm}u"))
        };
        let (bk, bc) = if self.b_along_k {
            (format!("idx % {d}u"), format!("idx / {d}u"))
        } else {
            (format!("idx / {bn}u"), format!("idx % {bn}u"))
        };
        [ar, ak, bk, bc]
    }

    /// WGSL of the loader functions `load_a` and `load_b`.
    pub(super) fn loaders(&self) -> String {
        format!(
            "fn load_a(z: u32, row: u32, kk: u32) -> f32 {{\n{}\n}}\nfn load_b(z: u32, kk: u32, col: u32) -> f32 {{\n{}\n}}\n",
            self.load_a, self.load_b
        )
    }

    /// The tensor-core tiling a mixed-precision GEMM takes where the
    /// adapter has them.
    pub fn tensor_tiling(&self) -> TensorTiling {
        tensor::forced_tiling().unwrap_or_else(|| {
            TensorTiling::auto_for(self.m, self.n, self.batch, tensor::busy_blocks())
        })
    }

    /// Whether this GEMM is generated in its tensor-core form: mixed
    /// precision on an adapter with tensor cores.
    fn on_tensor_cores(&self) -> bool {
        self.precision == Precision::Mixed && tensor_cores()
    }

    /// The WGSL: the tensor-core form for a mixed-precision GEMM where the
    /// adapter has tensor cores, else the plain form.
    pub fn spec(&self) -> KernelSpec {
        if self.on_tensor_cores() {
            return tensor::spec(self, self.tensor_tiling());
        }
        self.plain_spec()
    }

    /// For people: the tiling [`Self::spec`] generates with, tensor-core or
    /// plain.
    pub fn form(&self) -> String {
        if self.on_tensor_cores() {
            self.tensor_tiling().describe()
        } else {
            self.tiling().describe()
        }
    }

    /// The plain form, for every adapter: under [`Precision::Mixed`] each
    /// staged operand is rounded to f16's precision in f32
    /// ([`ROUND_HALF_WGSL`]).
    pub fn plain_spec(&self) -> KernelSpec {
        let tiling = self.tiling();
        let Tiling {
            tile: t,
            rows: rm,
            cols: rn,
            depth: d,
            vector,
        } = tiling;
        let (bm, bn) = (tiling.block_rows(), tiling.block_cols());
        let (m, n, k) = (self.m, self.n, self.k);
        let steps = k.div_ceil(d as usize).max(1);
        let split = split_parts(k, d, self.split);
        let steps_per = steps.div_ceil(split as usize);
        let threads = t * t;
        let decls = declare(self.bindings);
        let (a_elems, b_elems) = (bm * d, d * bn);
        let (a_stride, b_stride) = tiling.strides(self.a_along_k, self.b_along_k);
        let (a_stride4, b_stride4) = (a_stride / 4, b_stride / 4);
        let staged = |elems: u32, body: &str| staged(elems, threads, &|_| body.to_string());
        let (put_a, put_b) = if vector {
            (
                format!("tile_a[ak * {a_stride4}u + ar / 4u][ar % 4u] = av;"),
                format!("tile_b[bk * {b_stride4}u + bc / 4u][bc % 4u] = bv;"),
            )
        } else {
            (
                format!("tile_a[ar * {a_stride}u + ak] = av;"),
                format!("tile_b[bk * {b_stride}u + bc] = bv;"),
            )
        };
        let [ar, ak, bk, bc] = self.staging_indices(d, bm, bn);
        let mixed = self.precision == Precision::Mixed;
        let (round_open, round_close) = if mixed {
            ("round_half(", ")")
        } else {
            ("", "")
        };
        let [scale_a, scale_b, unscale] = if mixed {
            self.gradient_scales()
        } else {
            Default::default()
        };
        let loads = staged(
            a_elems,
            &format!(
                "            let ar = {ar};\n            let ak = {ak};\n            let gk = kbase + ak;\n\
                 \x20           var av = 0.0;\n            if (row0 + ar < {m}u && gk < {k}u) {{ av = {round_open}load_a(z, row0 + ar, gk){scale_a}{round_close}; }}\n\
                 \x20           {put_a}\n"
            ),
        ) + &staged(
            b_elems,
            &format!(
                "            let bk = {bk};\n            let bc = {bc};\n            let gk = kbase + bk;\n\
                 \x20           var bv = 0.0;\n            if (gk < {k}u && col0 + bc < {n}u) {{ bv = {round_open}load_b(z, gk, col0 + bc){scale_b}{round_close}; }}\n\
                 \x20           {put_b}\n"
            ),
        );
        let mut decl_acc = String::new();
        let mut inner = String::new();
        let mut store = String::new();
        let lanes = ["x", "y", "z", "w"];
        // Where output (i, j) of this invocation lives, and its accumulator.
        // Scalar: rows local.y + i*t, so neighbouring invocations read
        // neighbouring words. Vector: groups of 4, group q at q*t + local.
        let place: Box<dyn Fn(u32, u32) -> (String, String, String)> = if vector {
            for q in 0..rm / 4 {
                inner += &format!(
                    "            let a{q} = tile_a[kk * {a_stride4}u + local.y + {}u];\n",
                    q * t
                );
            }
            for q in 0..rn / 4 {
                inner += &format!(
                    "            let b{q} = tile_b[kk * {b_stride4}u + local.x + {}u];\n",
                    q * t
                );
            }
            for i in 0..rm {
                for q in 0..rn / 4 {
                    decl_acc += &format!("    var acc{i}_{q} = vec4<f32>();\n");
                    inner += &format!(
                        "            acc{i}_{q} += a{}.{} * b{q};\n",
                        i / 4,
                        lanes[(i % 4) as usize]
                    );
                }
            }
            Box::new(move |i, j| {
                (
                    format!("(local.y + {}u) * 4u + {}u", (i / 4) * t, i % 4),
                    format!("(local.x + {}u) * 4u + {}u", (j / 4) * t, j % 4),
                    format!("acc{i}_{}.{}", j / 4, lanes[(j % 4) as usize]),
                )
            })
        } else {
            for i in 0..rm {
                inner += &format!(
                    "            let a{i} = tile_a[(local.y + {}u) * {a_stride}u + kk];\n",
                    i * t
                );
            }
            for j in 0..rn {
                inner += &format!(
                    "            let b{j} = tile_b[kk * {b_stride}u + local.x + {}u];\n",
                    j * t
                );
            }
            for i in 0..rm {
                for j in 0..rn {
                    decl_acc += &format!("    var acc{i}_{j} = 0.0;\n");
                    inner += &format!("            acc{i}_{j} += a{i} * b{j};\n");
                }
            }
            Box::new(move |i, j| {
                (
                    format!("local.y + {}u", i * t),
                    format!("local.x + {}u", j * t),
                    format!("acc{i}_{j}"),
                )
            })
        };
        for i in 0..rm {
            for j in 0..rn {
                let (r, c, acc) = place(i, j);
                store += &format!(
                    "    {{\n        let row = row0 + {r};\n        let col = col0 + {c};\n        let acc = {acc}{unscale};\n\
                     \x20       if (row < {m}u && col < {n}u) {{\n{}\n        }}\n    }}\n",
                    self.store
                );
            }
        }
        let (tile_ty, a_len, b_len) = if vector {
            ("vec4<f32>", d * a_stride4, d * b_stride4)
        } else {
            ("f32", bm * a_stride, d * b_stride)
        };
        let wgsl = format!(
            r"// {label}: tiled GEMM {m}x{k}x{n} (batch {batch}, k in {split} parts), {desc}; generated by rookery_kernels.
{decls}
{loaders}{to_half}var<workgroup> tile_a: array<{tile_ty}, {a_len}>;
var<workgroup> tile_b: array<{tile_ty}, {b_len}>;

@compute @workgroup_size({t}, {t}, 1)
fn main(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {{
    let z = group.z / {split}u;
    let part = group.z % {split}u;
    let row0 = group.y * {bm}u;
    let col0 = group.x * {bn}u;
    let lin = local.y * {t}u + local.x;
{decl_acc}    for (var step = 0u; step < {steps_per}u; step += 1u) {{
        let kbase = (part * {steps_per}u + step) * {d}u;
        // Out-of-range elements load as zero and add nothing, which is what
        // makes sizes that are not block multiples work.
{loads}        workgroupBarrier();
        for (var kk = 0u; kk < {d}u; kk += 1u) {{
{inner}        }}
        // Nobody may overwrite the tiles while a neighbour still reads them.
        workgroupBarrier();
    }}
{store}}}
",
            label = self.label,
            batch = self.batch,
            desc = tiling.describe(),
            loaders = self.loaders(),
            to_half = if mixed { ROUND_HALF_WGSL } else { "" },
        );
        KernelSpec {
            label: self.label.clone(),
            wgsl,
            entry: "main",
            bindings: kinds(self.bindings),
            workgroups: [
                (n as u32).div_ceil(bn).max(1),
                (m as u32).div_ceil(bm).max(1),
                self.batch.max(1) as u32 * split,
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tilings_over_the_guaranteed_limits_are_refused() {
        assert!(Tiling::new(16, 8, 8, 8, true).is_some());
        assert!(Tiling::new(16, 8, 4, 16, false).is_some());
        assert!(
            Tiling::new(16, 8, 8, 16, false).is_none(),
            "16.6 KiB staged"
        );
        assert!(Tiling::new(16, 8, 8, 16, true).is_none(), "16.5 KiB staged");
        assert!(Tiling::new(16, 8, 8, 17, false).is_none(), "17 KiB staged");
        assert!(Tiling::new(16, 6, 4, 8, true).is_none(), "6 rows as vec4");
        assert!(Tiling::new(17, 1, 1, 1, false).is_none());
        assert!(Tiling::new(16, 9, 1, 1, false).is_none());
        for t in AUTO_CANDIDATES {
            assert_eq!(
                Tiling::new(t.tile, t.rows, t.cols, t.depth, t.vector),
                Some(t)
            );
        }
    }

    #[test]
    fn auto_tiling_keeps_large_gpus_busy() {
        let auto = |m, n, batch| Tiling::auto_for(m, n, batch, BUSY_BLOCKS);
        let big = auto(4096, 4096, 1);
        assert_eq!((big.rows, big.cols), (8, 8));
        let small = auto(64, 128, 1);
        assert!(small.blocks(64, 128, 1) >= 8, "{small:?}");
        // One input channel: a single row of outputs.
        let row = auto(1, 50_176, 1);
        assert_eq!(row.block_rows(), 16, "{row:?}");
        for (m, n, batch) in [(8192, 3072, 1), (64, 802_816, 1), (768, 768, 12)] {
            let t = auto(m, n, batch);
            assert!(
                t.blocks(m, n, batch) >= BUSY_BLOCKS,
                "{m}x{n}x{batch}: {t:?}"
            );
        }
        // A software adapter on two CPU threads runs large blocks fastest.
        let software = Tiling::auto_for(256, 256, 1, 2);
        assert_eq!((software.rows, software.cols), (8, 8), "{software:?}");
        assert_eq!(Tiling::auto_for(64, 128, 1, 2), AUTO_CANDIDATES[3]);
        assert_eq!(Tiling::auto_for(60, 100, 1, 2), Tiling::CLASSIC);
    }

    #[test]
    fn long_reductions_are_split_over_large_blocks() {
        // ResNet's 3x3 convolution of 64 channels at batch 256: the weight
        // gradient is 64 x 576, summed over 802,816 terms.
        let (t, parts) = Tiling::auto_split(64, 576, 1, 802_816, 256, 256);
        assert!(t.rows * t.cols >= 16, "{t:?}");
        assert!(t.blocks(64, 576, 1) * parts as usize >= BUSY_BLOCKS);
        // The demo's first convolution: 16 x 9 weights, 50,176 terms.
        let (t, parts) = Tiling::auto_split(16, 9, 1, 50_176, 256, 256);
        assert_eq!(t.block_rows(), 16, "{t:?}");
        assert!(parts >= 100, "{parts}");
        // Short reductions stay whole.
        assert_eq!(Tiling::auto_split(16, 9, 1, 300, 256, 256).1, 1);
    }

    #[test]
    fn split_parts_are_never_empty() {
        assert_eq!(split_parts(100, 16, 1), 1);
        assert_eq!(split_parts(1000, 16, 8), 8);
        // 7 steps of 16 in parts of 2 steps: 4 parts, not 5.
        assert_eq!(split_parts(100, 16, 5), 4);
        assert_eq!(split_parts(1, 16, 64), 1);
    }
}
