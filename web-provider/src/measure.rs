//! The platform-free half of measuring a browser's device: the GPU
//! self-check and benchmark, and the CPU fallback's benchmark. Kept apart
//! from the browser glue so the host can test what needs no GPU natively.
// Natively only the tests call most of this; the browser glue is wasm-only.
#![cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]

use rookery_kernels::{GpuContext, GpuError, MATMUL_REL_TOLERANCE, check_matmul, sample_matrix};

/// Time the benchmark aims for, in seconds.
const BENCHMARK_BUDGET_S: f64 = 0.2;

/// Runs the kernel on a small shape that is no multiple of any tile and
/// compares it with the CPU reference: a GPU or driver that computes wrong
/// answers must not donate them.
pub(crate) async fn self_check(gpu: &GpuContext) -> Result<(), String> {
    let (m, k, n) = (37, 29, 19);
    let a = sample_matrix(m * k, 7);
    let b = sample_matrix(k * n, 8);
    let c = gpu
        .matmul(&a, &b, m, k, n)
        .await
        .map_err(|e| e.to_string())?;
    check_matmul(&a, &b, m, k, n, &c, MATMUL_REL_TOLERANCE).map_err(|e| e.to_string())
}

/// GFLOP/s of this GPU with the kernels its stages will run, in a few
/// hundred milliseconds.
pub(crate) async fn measure_gflops(gpu: &GpuContext) -> Result<f64, GpuError> {
    gpu.benchmark_gflops(BENCHMARK_BUDGET_S).await
}

/// Seconds each kernel line of [`kernel_speeds`] is timed for.
const KERNEL_LINE_S: f64 = 0.03;

/// Seconds after which no further kernel line starts: the donor waits.
const KERNEL_LINES_BUDGET_S: f64 = 1.0;

/// The GPU's kernels, one line each (`rookery_kernels::speed::donor_lines`):
/// what the Donate page lists under the GPU's figure.
pub(crate) async fn kernel_speeds(gpu: &GpuContext) -> Result<Vec<crate::KernelSpeed>, GpuError> {
    Ok(
        rookery_kernels::speed::donor_lines(gpu, KERNEL_LINE_S, KERNEL_LINES_BUDGET_S)
            .await?
            .into_iter()
            .map(|m| crate::KernelSpeed {
                gflops: m.gflops(),
                name: m.name,
            })
            .collect(),
    )
}

/// GFLOP/s of the CPU reference matmul, timed with `now_ms` (the browser's
/// clock): what a tab without WebGPU offers.
pub(crate) fn measure_cpu_gflops(now_ms: impl Fn() -> f64) -> f64 {
    const N: usize = 96;
    let a = sample_matrix(N * N, 1);
    let b = sample_matrix(N * N, 2);
    let flops = rookery_kernels::matmul_flops(N, N, N);
    let started = now_ms();
    let mut runs = 0u32;
    // At least 50 ms, so a coarse clock still measures something.
    while runs < 2 || now_ms() - started < 50.0 {
        std::hint::black_box(rookery_kernels::matmul_reference(&a, &b, N, N, N));
        runs += 1;
    }
    let seconds = ((now_ms() - started) / 1e3).max(1e-6);
    (flops * f64::from(runs) / seconds / 1e9).max(1e-3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_fallback_measures_a_positive_speed() {
        let start = std::time::Instant::now();
        let gflops = measure_cpu_gflops(|| start.elapsed().as_secs_f64() * 1e3);
        assert!(gflops > 0.0 && gflops.is_finite(), "{gflops}");
    }
}
