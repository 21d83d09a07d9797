//! The tensor-core form of a mixed-precision [`Gemm`]: operands staged in
//! workgroup memory as f16, multiplied by cooperative matrices (16 x 16 x
//! 16, f16 in, f32 accumulators: NVIDIA's tensor cores through Vulkan's
//! `VK_KHR_cooperative_matrix`), each subgroup owning a grid of 16 x 16
//! output fragments. The loaders and the store are the GEMM's own, so a
//! transposed operand, an im2col view or split-K work as in the plain form.
//!
//! Generated only where the GPU context found the adapter able
//! ([`super::precision::tensor_cores`]): f16 shaders, subgroups of exactly
//! [`SUBGROUP`] invocations, cooperative matrices of that shape and type,
//! and the workgroup memory the largest [`TensorTiling`] stages.

use super::precision::ROUND_HALF_WGSL;
use super::template::{Gemm, coverage, most_useful, split_parts, staged};
use crate::spec::{KernelSpec, declare, kinds};

/// The side of one cooperative-matrix fragment.
pub const FRAGMENT: u32 = 16;

/// Invocations per subgroup the tensor-core form is generated for.
pub const SUBGROUP: u32 = 32;

/// Workgroup memory the tensor-core form may use (an adapter must offer it
/// for the form to be used): every candidate fits. NVIDIA's Vulkan driver
/// offers 48 KiB.
pub const TENSOR_WORKGROUP_BYTES: u32 = 49_152;

/// How a tensor-core GEMM cuts its work: a grid of subgroups per workgroup,
/// each owning a grid of fragments, and the k steps staged per barrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorTiling {
    pub warps_m: u32,
    pub warps_n: u32,
    pub frags_m: u32,
    pub frags_n: u32,
    /// A multiple of [`FRAGMENT`].
    pub depth: u32,
}

/// Halves between staged rows beyond the tile's width: rows stay 16-byte
/// aligned (cooperative loads need it) and land in different banks.
const PAD: u32 = 8;

impl TensorTiling {
    const fn new(warps_m: u32, warps_n: u32, frags_m: u32, frags_n: u32, depth: u32) -> Self {
        Self {
            warps_m,
            warps_n,
            frags_m,
            frags_n,
            depth,
        }
    }

    pub fn block_rows(&self) -> u32 {
        self.warps_m * self.frags_m * FRAGMENT
    }

    pub fn block_cols(&self) -> u32 {
        self.warps_n * self.frags_n * FRAGMENT
    }

    pub fn threads(&self) -> u32 {
        self.warps_m * self.warps_n * SUBGROUP
    }

    /// Halves between staged rows of A (`[rows][depth]`) and B
    /// (`[depth][cols]`).
    fn strides(&self) -> (u32, u32) {
        (self.depth + PAD, self.block_cols() + PAD)
    }

    /// Halves of the staged tiles of A and B.
    fn tile_lens(&self) -> (u32, u32) {
        let (sa, sb) = self.strides();
        (self.block_rows() * sa, self.depth * sb)
    }

    /// Workgroup memory: both staged tiles in f16 and a 16 x 16 f32
    /// scratch per subgroup for the store.
    pub fn workgroup_bytes(&self) -> u32 {
        let (a, b) = self.tile_lens();
        2 * (a + b) + 4 * FRAGMENT * FRAGMENT * self.warps_m * self.warps_n
    }

    /// [`coverage`] of this tiling's blocks.
    fn coverage(&self, m: usize, n: usize, batch: usize) -> (usize, usize) {
        coverage(self.block_rows(), self.block_cols(), m, n, batch)
    }

    /// The first candidate that keeps `busy` workgroups doing mostly useful
    /// work, else the one with the most useful work (as [`super::Tiling::auto`]).
    pub fn auto_for(m: usize, n: usize, batch: usize, busy: usize) -> Self {
        TENSOR_CANDIDATES
            .into_iter()
            .find(|t| {
                let (blocks, per_mille) = t.coverage(m, n, batch);
                blocks >= busy && per_mille >= 750
            })
            .or_else(|| most_useful(&TENSOR_CANDIDATES, busy, |t| t.coverage(m, n, batch)))
            .unwrap_or(TENSOR_CANDIDATES[0])
    }

    /// For people: `2x2 warps x 4x4 frags d32`.
    pub fn describe(&self) -> String {
        format!(
            "tensor {}x{} warps x {}x{} frags d{}",
            self.warps_m, self.warps_n, self.frags_m, self.frags_n, self.depth
        )
    }
}

thread_local! {
    static FORCED: std::cell::Cell<Option<TensorTiling>> = const { std::cell::Cell::new(None) };
}

/// Makes every tensor-core GEMM this thread generates use `tiling` (`None`:
/// each chooses its own): how the benchmark's sweep and the checks time and
/// test every candidate.
pub fn force_tiling(tiling: Option<TensorTiling>) {
    FORCED.with(|f| f.set(tiling));
}

/// The tiling [`force_tiling`] set on this thread.
pub fn forced_tiling() -> Option<TensorTiling> {
    FORCED.with(|f| f.get())
}

/// Workgroups a tensor-core GEMM aims for: half of [`super::busy_blocks`],
/// since its blocks of 256 invocations hold more work each (on an H100,
/// 8192 x 3072 x 768 ran at 66 TFLOP/s in 384 blocks of 128 x 128 and 54
/// in 768 of 64 x 128).
pub fn busy_blocks() -> usize {
    super::busy_blocks().div_ceil(2)
}

/// The tensor-core tilings, fastest first where each keeps a GPU busy.
/// Timed on an H100 (`kernel_speed --sweep`, 2026-11-26) with two more
/// forms, both slower at every large shape and left out: B staged
/// transposed (read as column-major fragments), and the next step's
/// operands prefetched into registers (too many registers with 8 to 16
/// accumulator fragments an invocation).
pub const TENSOR_CANDIDATES: [TensorTiling; 8] = [
    TensorTiling::new(2, 4, 4, 4, 32),
    TensorTiling::new(4, 2, 4, 4, 32),
    TensorTiling::new(4, 2, 2, 4, 64),
    TensorTiling::new(4, 2, 2, 4, 32),
    TensorTiling::new(2, 2, 4, 4, 32),
    TensorTiling::new(2, 2, 2, 4, 32),
    TensorTiling::new(2, 2, 2, 2, 32),
    TensorTiling::new(2, 2, 1, 1, 32),
];

/// The tensor-core WGSL of `gemm` with `tiling`.
pub fn spec(gemm: &Gemm<'_>, tiling: TensorTiling) -> KernelSpec {
    let TensorTiling {
        warps_m: _,
        warps_n,
        frags_m: fm,
        frags_n: fn_,
        depth: d,
    } = tiling;
    let (bm, bn) = (tiling.block_rows(), tiling.block_cols());
    let (m, n, k) = (gemm.m, gemm.n, gemm.k);
    let steps = k.div_ceil(d as usize).max(1);
    let split = split_parts(k, d, gemm.split);
    let steps_per = steps.div_ceil(split as usize);
    let threads = tiling.threads();
    let (sa, sb) = tiling.strides();
    let [scale_a, scale_b, unscale] = gemm.gradient_scales();
    let [ar, ak, bk, bc] = gemm.staging_indices(d, bm, bn);
    // Each invocation's share of a step's operands passes through
    // registers (`ra{e}`, `rb{e}`): loaded (bounds-checked, scaled, rounded)
    // by `fetch`, written to workgroup memory by `put`.
    let (a_elems, b_elems) = (bm * d, d * bn);
    let rounds = |elems: u32| elems.div_ceil(threads);
    let each = |elems: u32, body: &dyn Fn(u32) -> String| staged(elems, threads, body);
    let mut registers = String::new();
    for e in 0..rounds(a_elems) {
        registers += &format!("    var ra{e}: f16;\n");
    }
    for e in 0..rounds(b_elems) {
        registers += &format!("    var rb{e}: f16;\n");
    }
    let kbase = format!("(part * {steps_per}u + step) * {d}u");
    let fetch = each(a_elems, &|e| {
        format!(
            "            let ar = {ar};\n            let gk = {kbase} + {ak};\n\
                 \x20           var av = 0.0;\n            if (row0 + ar < {m}u && gk < {k}u) {{ av = load_a(z, row0 + ar, gk){scale_a}; }}\n\
                 \x20           ra{e} = to_half(av);\n"
        )
    }) + &each(b_elems, &|e| {
        format!(
            "            let bc = {bc};\n            let gk = {kbase} + {bk};\n\
                 \x20           var bv = 0.0;\n            if (gk < {k}u && col0 + bc < {n}u) {{ bv = load_b(z, gk, col0 + bc){scale_b}; }}\n\
                 \x20           rb{e} = to_half(bv);\n"
        )
    });
    let put = each(a_elems, &|e| {
        format!(
            "            let ar = {ar};\n            let ak = {ak};\n            tile_a[ar * {sa}u + ak] = ra{e};\n"
        )
    }) + &each(b_elems, &|e| {
        format!(
            "            let bk = {bk};\n            let bc = {bc};\n            tile_b[bk * {sb}u + bc] = rb{e};\n"
        )
    });
    let staging = fetch + &put;
    let mut decl_acc = String::new();
    let mut inner = String::new();
    let mut store = String::new();
    for f in 0..fm {
        inner += &format!(
            "            let a{f} = coopLoadT<coop_mat16x16<f16, A>>(&tile_a[(wr + {}u) * {sa}u + kk], {sa}u);\n",
            f * FRAGMENT
        );
    }
    for g in 0..fn_ {
        inner += &format!(
            "            let b{g} = coopLoadT<coop_mat16x16<f16, B>>(&tile_b[kk * {sb}u + wc + {}u], {sb}u);\n",
            g * FRAGMENT
        );
    }
    for f in 0..fm {
        for g in 0..fn_ {
            // Workgroup memory starts zeroed: the scratch is a zero matrix.
            decl_acc += &format!(
                "    var acc{f}_{g} = coopLoadT<coop_mat16x16<f32, C>>(&tile_c[scratch], 16u);\n"
            );
            inner +=
                &format!("            acc{f}_{g} = coopMultiplyAdd(a{f}, b{g}, acc{f}_{g});\n");
            store += &format!(
                "    coopStoreT(acc{f}_{g}, &tile_c[scratch], 16u);\n    workgroupBarrier();\n\
                 \x20   for (var e = lane; e < 256u; e += {SUBGROUP}u) {{\n\
                 \x20       let row = row0 + wr + {}u + e / 16u;\n\
                 \x20       let col = col0 + wc + {}u + e % 16u;\n\
                 \x20       let acc = tile_c[scratch + e]{unscale};\n\
                 \x20       if (row < {m}u && col < {n}u) {{\n{}\n        }}\n    }}\n    workgroupBarrier();\n",
                f * FRAGMENT,
                g * FRAGMENT,
                gemm.store
            );
        }
    }
    let decls = declare(gemm.bindings);
    let wgsl = format!(
        r"// {label}: tensor-core GEMM {m}x{k}x{n} (batch {batch}, k in {split} parts), {desc}; generated by rookery_kernels.
enable f16;
enable wgpu_cooperative_matrix;
{decls}
{loaders}{round_half}fn to_half(v: f32) -> f16 {{
    return f16(round_half(v));
}}
var<workgroup> tile_a: array<f16, {a_len}>;
var<workgroup> tile_b: array<f16, {b_len}>;
var<workgroup> tile_c: array<f32, {c_len}>;

@compute @workgroup_size({threads}, 1, 1)
fn main(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lin: u32,
        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {{
    let z = group.z / {split}u;
    let part = group.z % {split}u;
    let row0 = group.y * {bm}u;
    let col0 = group.x * {bn}u;
    let wr = (sg / {warps_n}u) * {wm_rows}u;
    let wc = (sg % {warps_n}u) * {wn_cols}u;
    let scratch = sg * 256u;
{decl_acc}{registers}    for (var step = 0u; step < {steps_per}u; step += 1u) {{
{staging}        workgroupBarrier();
        for (var kk = 0u; kk < {d}u; kk += 16u) {{
{inner}        }}
        workgroupBarrier();
    }}
{store}}}
",
        label = gemm.label,
        batch = gemm.batch,
        desc = tiling.describe(),
        loaders = gemm.loaders(),
        a_len = tiling.tile_lens().0,
        b_len = tiling.tile_lens().1,
        c_len = 256 * tiling.warps_m * warps_n,
        wm_rows = fm * FRAGMENT,
        round_half = ROUND_HALF_WGSL,
        wn_cols = fn_ * FRAGMENT,
    );
    KernelSpec {
        label: gemm.label.clone(),
        wgsl,
        entry: "main",
        bindings: kinds(gemm.bindings),
        workgroups: [
            (n as u32).div_ceil(bn).max(1),
            (m as u32).div_ceil(bm).max(1),
            gemm.batch.max(1) as u32 * split,
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conv::Conv2d;
    use crate::gemm::{Linear, MatMul, Precision};
    use crate::spec::validate;

    /// Every mixed GEMM the kernels generate, both forms: forward and
    /// backward of a linear layer, a batched matmul and a convolution (its
    /// weight gradient split).
    fn mixed_specs() -> Vec<KernelSpec> {
        let mut l = Linear::new(37, 50, 19, true);
        l.precision = Precision::Mixed;
        let mut mm = MatMul::new(&[3, 20, 33], &[33, 18]).unwrap();
        mm.precision = Precision::Mixed;
        let mut c = Conv2d::new([4, 3, 9, 9], 5, [3, 3], [1, 1], [1, 1], [1, 1], 1, true).unwrap();
        c.precision = Precision::Mixed;
        vec![
            l.forward(),
            l.backward_x(),
            l.backward_w(),
            mm.forward(),
            mm.backward_a(),
            mm.backward_b(),
            c.forward(),
            c.backward_input(),
            c.backward_weight_parts(3),
        ]
    }

    #[test]
    fn both_forms_of_every_mixed_gemm_validate() {
        use naga::valid::Capabilities as C;
        let caps = C::SHADER_FLOAT16 | C::SUBGROUP | C::COOPERATIVE_MATRIX;
        crate::gemm::precision::force_tensor_cores(Some(false));
        for plain in mixed_specs() {
            assert!(plain.wgsl.contains("round_half"), "{}", plain.label);
            validate::spec(&plain);
        }
        crate::gemm::precision::force_tensor_cores(Some(true));
        let mut tensor = mixed_specs();
        for t in TENSOR_CANDIDATES {
            force_tiling(Some(t));
            tensor.extend(mixed_specs());
        }
        force_tiling(None);
        crate::gemm::precision::force_tensor_cores(None);
        for spec in tensor {
            assert!(spec.wgsl.contains("coopMultiplyAdd"), "{}", spec.label);
            if let Err(e) = validate::check_with(&spec.wgsl, caps) {
                panic!("{}: {e}\n{}", spec.label, spec.wgsl);
            }
        }
    }

    #[test]
    fn every_candidate_fits_its_workgroup_memory_and_aligns_its_rows() {
        for t in TENSOR_CANDIDATES {
            assert!(t.workgroup_bytes() <= TENSOR_WORKGROUP_BYTES, "{t:?}");
            assert!(t.threads() <= 256, "{t:?}");
            assert_eq!(t.depth % FRAGMENT, 0);
            let (sa, sb) = t.strides();
            // Cooperative loads of f16 rows need 16-byte aligned strides.
            assert_eq!((2 * sa) % 16, 0, "{t:?}");
            assert_eq!((2 * sb) % 16, 0, "{t:?}");
        }
    }

    #[test]
    fn tensor_tiling_keeps_large_gpus_busy_and_small_products_whole() {
        let big = TensorTiling::auto_for(4096, 4096, 1, 512);
        assert!(big.coverage(4096, 4096, 1).0 >= 512, "{big:?}");
        assert!(big.block_rows() * big.block_cols() >= 128 * 128, "{big:?}");
        let small = TensorTiling::auto_for(16, 9, 1, 512);
        assert_eq!(small, TENSOR_CANDIDATES[TENSOR_CANDIDATES.len() - 1]);
    }
}
