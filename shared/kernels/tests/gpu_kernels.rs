//! Every generated kernel run through wgpu on a real adapter (lavapipe
//! natively) against its CPU reference: the fixed spread of
//! [`checks::standard_checks`] (the same cases the browser harness runs) and
//! property tests over random shapes, odd sizes included. Fails, not skips,
//! without an adapter. Run with `cargo test -p rookery-kernels --features gpu`.
#![cfg(feature = "gpu")]

mod common;

use common::gpu;
use proptest::prelude::*;
use rookery_kernels::GpuContext;
use rookery_kernels::checks::{self, Check};
use rookery_kernels::elementwise::{BINARY_OPS, UNARIES};
use rookery_kernels::gemm::{Precision, Tiling};

fn run(check: &Check) -> Result<(), String> {
    pollster::block_on(checks::run(gpu(), check)).map_err(|e| e.to_string())
}

#[test]
fn every_standard_check_matches_its_reference_on_the_gpu() {
    let failures: Vec<String> = checks::standard_checks()
        .iter()
        .filter_map(|c| run(c).err())
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_wrong_kernel_fails_its_check() {
    // The harness itself must be able to fail: swap relu's forward for
    // identity and the check must catch it.
    let mut check = checks::unary(UNARIES[0], 100, 3);
    check.steps[0].0 = rookery_kernels::elementwise::Unary::Identity.forward(100);
    assert!(run(&check).is_err());
}

#[test]
fn mixed_gemms_multiply_operands_rounded_to_f16_and_scale_gradients() {
    use rookery_kernels::Tol;
    use rookery_kernels::checks::{Expect, Fill};
    use rookery_kernels::gemm::Linear;
    use rookery_kernels::gemm::precision::{GRAD_SCALE, round_f16};
    // Every sum below is exact in f32, so any executor, in any order, must
    // give these values to the bit; f32 operands would give others.
    let (rows, inputs, outputs) = (20, 48, 24);
    let mut l = Linear::new(rows, inputs, outputs, false);
    l.precision = Precision::Mixed;
    // 1 + 2^-13 is within half a unit of f16's last place of 1.
    let x = 1.0 + 2f32.powi(-13);
    // Below f16's normal range: kept only because gradients are scaled.
    let dy = 1e-7f32;
    let dy_seen = round_f16(dy * GRAD_SCALE) / GRAD_SCALE;
    assert!((dy_seen - dy).abs() < dy * 1e-3 && round_f16(dy) != dy_seen);
    let check = Check {
        name: "mixed rounding".into(),
        buffers: vec![
            Fill::F32(vec![x; rows * inputs]),
            Fill::F32(vec![1.0; outputs * inputs]),
            Fill::F32(vec![dy; rows * outputs]),
            Fill::Zeros(rows * outputs),
            Fill::Zeros(rows * inputs),
            Fill::Zeros(outputs * inputs),
        ],
        steps: vec![
            (l.forward(), vec![0, 1, 3]),
            (l.backward_x(), vec![2, 1, 4]),
            (l.backward_w(), vec![2, 0, 5]),
        ],
        expect: vec![
            Expect::new("y", 3, vec![inputs as f32; rows * outputs], Tol::EXACT),
            Expect::new(
                "dx",
                4,
                vec![outputs as f32 * dy_seen; rows * inputs],
                Tol::EXACT,
            ),
            Expect::new(
                "dw",
                5,
                vec![rows as f32 * dy_seen; outputs * inputs],
                Tol::EXACT,
            ),
        ],
    };
    assert_eq!(run(&check), Ok(()));
    // In f32 the same check fails: it can tell the precisions apart.
    let mut f32_check = check.clone();
    let mut exact = l;
    exact.precision = Precision::F32;
    f32_check.steps[0].0 = exact.forward();
    assert!(run(&f32_check).is_err());
}

#[test]
fn every_tensor_core_tiling_matches_its_reference() {
    use rookery_kernels::gemm::TENSOR_CANDIDATES;
    use rookery_kernels::gemm::tensor::force_tiling;
    // Where the adapter has no tensor cores this checks the plain form once
    // per candidate; where it has, each candidate's own kernels, edges and
    // split-K included.
    let mut failures = Vec::new();
    for t in TENSOR_CANDIDATES {
        force_tiling(Some(t));
        let mut conv = rookery_kernels::conv::Conv2d::new(
            [3, 5, 11, 9],
            7,
            [3, 3],
            [1, 1],
            [1, 1],
            [1, 1],
            1,
            true,
        )
        .expect("valid geometry");
        conv.precision = Precision::Mixed;
        let built = [
            checks::linear(150, 200, 300, true, Precision::Mixed, 5),
            checks::matmul(
                &[2, 70, 45],
                &[45, 130],
                Tiling::CLASSIC,
                Precision::Mixed,
                6,
            )
            .expect("valid shapes"),
            checks::conv2d(conv, 7),
        ];
        force_tiling(None);
        failures.extend(
            built
                .iter()
                .filter_map(|c| run(c).err().map(|e| format!("{}: {e}", t.describe()))),
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn pipelines_are_cached_per_generated_source() {
    // A context of its own: the shared one gains pipelines from the tests
    // running beside this one.
    let own = pollster::block_on(GpuContext::new()).expect("an adapter, as gpu() found");
    let on_own = |check: &Check| pollster::block_on(checks::run(&own, check)).unwrap();
    on_own(&checks::unary(UNARIES[1], 77, 1));
    let before = own.cached_pipelines();
    assert!(before > 0);
    // The same kernel on other data compiles nothing new; another shape does.
    on_own(&checks::unary(UNARIES[1], 77, 2));
    assert_eq!(own.cached_pipelines(), before);
    on_own(&checks::unary(UNARIES[1], 78, 2));
    assert!(own.cached_pipelines() > before);
}

fn shape(max_rank: usize, max_dim: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1..=max_dim, 1..=max_rank)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn activations_match_reference_on_random_lengths(
        op in 0..UNARIES.len(), len in 1usize..3000, seed in any::<u64>()
    ) {
        prop_assert_eq!(run(&checks::unary(UNARIES[op], len, seed)), Ok(()));
    }

    #[test]
    fn broadcast_binary_ops_match_reference_on_random_shapes(
        op in 0..BINARY_OPS.len(), a in shape(4, 6), mask in prop::collection::vec(any::<bool>(), 4),
        drop_lead in 0usize..3, seed in any::<u64>()
    ) {
        // b: a with some dimensions set to 1 and some leading ones removed,
        // so it broadcasts against a.
        let mut b: Vec<usize> = a.iter().zip(&mask).map(|(&d, &m)| if m { 1 } else { d }).collect();
        let drop = drop_lead.min(b.len() - 1);
        b.drain(..drop);
        let check = checks::binary(BINARY_OPS[op], &a, &b, seed).expect("broadcastable");
        prop_assert_eq!(run(&check), Ok(()));
        let swapped = checks::binary(BINARY_OPS[op], &b, &a, seed).expect("broadcastable");
        prop_assert_eq!(run(&swapped), Ok(()));
    }

    #[test]
    fn dropout_matches_reference(p in 0.0f32..1.0, len in 1usize..5000, seed in any::<u64>()) {
        prop_assert_eq!(run(&checks::dropout(p, len, seed)), Ok(()));
    }
}

/// Any tiling WebGPU's guaranteed limits allow.
fn precision() -> impl Strategy<Value = Precision> {
    prop_oneof![Just(Precision::F32), Just(Precision::Mixed)]
}

fn tiling() -> impl Strategy<Value = Tiling> {
    (1u32..=16, 1u32..=8, 1u32..=8, 1u32..=32, any::<bool>()).prop_filter_map(
        "within the guaranteed workgroup memory",
        |(t, r, c, d, vector)| {
            let quad = |v: u32| if vector { v.div_ceil(4) * 4 } else { v };
            Tiling::new(t, quad(r), quad(c), d, vector)
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10))]

    #[test]
    fn matmul_matches_reference_on_random_batched_shapes(
        m in 1usize..40, k in 1usize..40, n in 1usize..40,
        batch_a in prop::collection::vec(1usize..4, 0..3), b_lead in any::<bool>(),
        tiling in tiling(), precision in precision(), seed in any::<u64>()
    ) {
        let mut a = batch_a.clone();
        a.extend([m, k]);
        // b: a's batch with the first dimension broadcast (or none), so
        // both operands' reductions are exercised.
        let mut b: Vec<usize> = if b_lead { batch_a.iter().skip(1).copied().collect() } else { batch_a.iter().map(|_| 1).collect() };
        b.extend([k, n]);
        let check = checks::matmul(&a, &b, tiling, precision, seed).expect("valid shapes");
        prop_assert_eq!(run(&check), Ok(()));
    }

    #[test]
    fn linear_matches_reference_on_random_shapes(
        rows in 1usize..50, inputs in 1usize..70, outputs in 1usize..30, bias in any::<bool>(),
        precision in precision(), seed in any::<u64>()
    ) {
        prop_assert_eq!(run(&checks::linear(rows, inputs, outputs, bias, precision, seed)), Ok(()));
    }

    #[test]
    fn losses_match_reference_on_random_shapes(
        n in 1usize..60, classes in 1usize..20, inner in 1usize..4, ignored in any::<bool>(), seed in any::<u64>()
    ) {
        prop_assert_eq!(run(&checks::cross_entropy(n, classes, inner, ignored, seed)), Ok(()));
        prop_assert_eq!(run(&checks::mse(n * classes, seed)), Ok(()));
    }

    #[test]
    fn optimizers_match_reference_on_random_lengths(
        case in 0usize..12, len in 1usize..3000, seed in any::<u64>()
    ) {
        let o = rookery_kernels::optim::optimizer_cases()[case];
        prop_assert_eq!(run(&checks::optimizer(o, len, seed)), Ok(()));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10))]

    #[test]
    fn softmax_and_layer_norm_match_reference_on_random_shapes(
        outer in 1usize..20, axis in 1usize..40, inner in 1usize..5, log in any::<bool>(), seed in any::<u64>()
    ) {
        prop_assert_eq!(run(&checks::softmax(outer, axis, inner, log, seed)), Ok(()));
        prop_assert_eq!(run(&checks::layer_norm(outer * inner, axis, seed)), Ok(()));
    }

    #[test]
    fn batch_norm_matches_reference_on_random_shapes(
        n in 1usize..9, channels in 1usize..6, spatial in 1usize..50, seed in any::<u64>()
    ) {
        // Training needs more than one value per channel, as torch insists.
        prop_assume!(n * spatial > 1);
        prop_assert_eq!(run(&checks::batch_norm(n, channels, spatial, seed)), Ok(()));
    }

    #[test]
    fn transpose_concat_gather_match_reference_on_random_shapes(
        shape in shape(4, 5), rot in 0usize..4, sizes in prop::collection::vec(1usize..5, 1..4),
        outer in 1usize..4, inner in 1usize..6, axis in 1usize..12, count in 1usize..20, seed in any::<u64>()
    ) {
        let rank = shape.len();
        let perm: Vec<usize> = (0..rank).map(|d| (d + rot) % rank).collect();
        prop_assert_eq!(run(&checks::transpose(&shape, &perm, seed).expect("a permutation")), Ok(()));
        prop_assert_eq!(run(&checks::concat(outer, &sizes, inner, seed)), Ok(()));
        prop_assert_eq!(run(&checks::gather(outer, axis, inner, count, seed)), Ok(()));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10))]

    #[test]
    fn conv2d_matches_reference_on_random_geometry(
        n in 1usize..3, cg in 1usize..4, og in 1usize..4, groups in 1usize..3,
        h in 1usize..12, w in 1usize..12, kh in 1usize..4, kw in 1usize..4,
        stride in (1usize..3, 1usize..3), padding in (0usize..2, 0usize..2), dilation in (1usize..3, 1usize..3),
        bias in any::<bool>(), tiling in tiling(), precision in precision(), seed in any::<u64>()
    ) {
        let conv = rookery_kernels::conv::Conv2d::new(
            [n, cg * groups, h, w], og * groups, [kh, kw], [stride.0, stride.1],
            [padding.0, padding.1], [dilation.0, dilation.1], groups, bias,
        );
        prop_assume!(conv.is_some());
        let mut conv = conv.unwrap();
        conv.tiling = Some(tiling);
        conv.precision = precision;
        prop_assert_eq!(run(&checks::conv2d(conv, seed)), Ok(()));
    }

    #[test]
    fn pools_match_reference_on_random_geometry(
        planes in 1usize..5, h in 1usize..15, w in 1usize..15, k in (1usize..4, 1usize..4),
        s in (1usize..4, 1usize..4), p in (0usize..2, 0usize..2), d in (1usize..3, 1usize..3),
        ceil in any::<bool>(), include in any::<bool>(), seed in any::<u64>()
    ) {
        let pool = rookery_kernels::pool::Pool2d::new(planes, h, w, [k.0, k.1], [s.0, s.1], [p.0, p.1])
            .and_then(|pool| pool.with_options([d.0, d.1], ceil, include));
        prop_assume!(pool.is_some());
        prop_assert_eq!(run(&checks::pool2d(pool.unwrap(), seed)), Ok(()));
        prop_assert_eq!(run(&checks::global_avg_pool(planes, h * w, seed)), Ok(()));
    }
}

proptest! {
    // Each case's references walk every weight of 32+ channels.
    #![proptest_config(ProptestConfig::with_cases(5))]

    /// Wide 3x3 stride-1 convolutions, which run forward and input
    /// gradient as Winograd: both tile sizes, partial tiles, every padding,
    /// any GEMM tiling.
    #[test]
    fn winograd_convolutions_match_reference_on_random_geometry(
        n in 1usize..3, c in 32usize..37, o in 32usize..37, h in 1usize..13, w in 1usize..13,
        padding in 0usize..3, bias in any::<bool>(), tiling in tiling(), seed in any::<u64>()
    ) {
        let conv = rookery_kernels::conv::Conv2d::new(
            [n, c, h, w], o, [3, 3], [1, 1], [padding, padding], [1, 1], 1, bias,
        );
        prop_assume!(conv.is_some());
        let mut conv = conv.unwrap();
        conv.tiling = Some(tiling);
        prop_assert!(rookery_kernels::winograd::Winograd::forward_of(&conv).is_some());
        prop_assert_eq!(run(&checks::conv2d(conv, seed)), Ok(()));
    }
}
