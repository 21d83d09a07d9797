//! The matmul kernel run through wgpu on a real adapter (lavapipe, Mesa's
//! software Vulkan, on CI) against the CPU reference. These tests fail, not
//! skip, when there is no adapter: a machine without one cannot vouch for the
//! kernel. Run with `cargo test -p rookery-kernels --features gpu`.
#![cfg(feature = "gpu")]

use proptest::prelude::*;
use rookery_kernels::{
    GpuContext, GpuError, KernelError, MATMUL_CHECK_SHAPES, MATMUL_REL_TOLERANCE, MatmulKernel,
    check_matmul, matmul_reference, sample_matrix,
};

fn context(kernel: MatmulKernel) -> GpuContext {
    match pollster::block_on(GpuContext::with_kernel(kernel)) {
        Ok(context) => context,
        Err(error) => panic!(
            "no usable GPU adapter ({error}); install a Vulkan driver such as \
             mesa-vulkan-drivers (lavapipe) to run these tests"
        ),
    }
}

/// Runs `m x k x n` on the GPU and checks it against the reference.
fn assert_matches_reference(gpu: &GpuContext, m: usize, k: usize, n: usize, seed: u64) {
    let a = sample_matrix(m * k, seed);
    let b = sample_matrix(k * n, seed.wrapping_add(1));
    let got = pollster::block_on(gpu.matmul(&a, &b, m, k, n))
        .unwrap_or_else(|e| panic!("{m}x{k}x{n} with tile {}: {e}", gpu.kernel().tile()));
    if let Err(error) = check_matmul(&a, &b, m, k, n, &got, MATMUL_REL_TOLERANCE) {
        panic!("{m}x{k}x{n} with tile {}: {error}", gpu.kernel().tile());
    }
}

#[test]
fn gpu_matmul_equals_the_reference_on_odd_and_even_shapes() {
    let gpu = context(MatmulKernel::default());
    for (i, &(m, k, n)) in MATMUL_CHECK_SHAPES.iter().enumerate() {
        assert_matches_reference(&gpu, m, k, n, i as u64);
    }
}

#[test]
fn every_tile_size_gives_the_same_answer() {
    for tile in [1, 3, 4, 8, 13] {
        let gpu = context(MatmulKernel::new(tile).unwrap());
        for (i, &(m, k, n)) in MATMUL_CHECK_SHAPES.iter().enumerate() {
            assert_matches_reference(&gpu, m, k, n, 100 + i as u64);
        }
    }
}

#[test]
fn small_integer_matmul_is_exact() {
    // Small integers multiply and add exactly in f32 in any order, so here
    // the GPU must match the reference bit for bit.
    let gpu = context(MatmulKernel::default());
    let (m, k, n) = (19, 23, 21);
    let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 - 3.0).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 - 2.0).collect();
    let got = pollster::block_on(gpu.matmul(&a, &b, m, k, n)).unwrap();
    assert_eq!(got, matmul_reference(&a, &b, m, k, n));
}

#[test]
fn pipeline_is_reused_across_calls_and_shapes() {
    let gpu = context(MatmulKernel::default());
    for round in 0..3 {
        assert_matches_reference(&gpu, 40, 9, 21, round);
        assert_matches_reference(&gpu, 7, 50, 3, round);
    }
}

#[test]
fn degenerate_and_wrong_shapes() {
    let gpu = context(MatmulKernel::default());
    assert_eq!(
        pollster::block_on(gpu.matmul(&[], &[], 0, 3, 0)).unwrap(),
        Vec::<f32>::new()
    );
    assert_eq!(
        pollster::block_on(gpu.matmul(&[], &[], 2, 0, 3)).unwrap(),
        vec![0.0; 6]
    );
    assert_eq!(
        pollster::block_on(gpu.matmul(&[1.0; 5], &[1.0; 6], 2, 3, 2)),
        Err(GpuError::Kernel(KernelError::ShapeMismatch {
            operand: "A",
            expected: 6,
            actual: 5
        }))
    );
}

#[test]
fn adapter_is_described_and_limits_are_exposed() {
    let gpu = context(MatmulKernel::default());
    let description = gpu.adapter_description();
    println!("adapter: {description}");
    assert!(description.contains(&gpu.adapter_info().name));
    assert!(description.contains(&gpu.adapter_info().backend.to_string()));
    // WebGPU's guaranteed minimums; every real adapter offers at least these.
    assert!(gpu.max_buffer_size() >= 256 << 20);
    assert!(gpu.max_storage_buffer_binding_size() >= 128 << 20);
}

#[test]
fn benchmark_reports_finite_positive_gflops() {
    let gpu = context(MatmulKernel::default());
    let gflops = pollster::block_on(gpu.benchmark_matmul_gflops(64, 4)).unwrap();
    println!(
        "{}: {gflops:.3} GFLOP/s at n = 64",
        gpu.adapter_description()
    );
    assert!(gflops.is_finite() && gflops > 0.0, "{gflops}");
    assert_eq!(
        pollster::block_on(gpu.benchmark_matmul_gflops(0, 4)),
        Err(GpuError::InvalidBenchmark {
            n: 0,
            iterations: 4
        })
    );
    assert!(pollster::block_on(gpu.benchmark_matmul_gflops(8, 0)).is_err());
    let rated = pollster::block_on(gpu.benchmark_gflops(0.05)).unwrap();
    println!("{rated:.3} GFLOP/s as a provider rates itself");
    assert!(rated.is_finite() && rated > 0.0, "{rated}");
}

#[test]
fn gpu_futures_are_send_natively() {
    // Native providers run these on multi-threaded executors.
    fn assert_send<T: Send>(_: &T) {}
    let gpu = context(MatmulKernel::default());
    assert_send(&GpuContext::new());
    assert_send(&gpu.matmul(&[1.0], &[1.0], 1, 1, 1));
    assert_send(&gpu.benchmark_matmul_gflops(8, 1));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any shape, tile and data: the GPU agrees with the reference.
    #[test]
    fn gpu_matmul_matches_reference_for_random_shapes(
        m in 1usize..80, k in 1usize..80, n in 1usize..80,
        tile in 1u32..=16, seed in any::<u64>()
    ) {
        let gpu = context(MatmulKernel::new(tile).unwrap());
        let a = sample_matrix(m * k, seed);
        let b = sample_matrix(k * n, seed ^ 0xff);
        let got = pollster::block_on(gpu.matmul(&a, &b, m, k, n)).unwrap();
        prop_assert_eq!(check_matmul(&a, &b, m, k, n, &got, MATMUL_REL_TOLERANCE), Ok(()));
    }
}
