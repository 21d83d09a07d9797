//! `cargo xtask bench kernels`: GFLOP/s of Rookery's generated WGSL kernels
//! (through wgpu on this machine's adapter; lavapipe, Mesa's software Vulkan,
//! where there is no GPU) against libtorch's CPU kernels on the same
//! machine, printed as ratios: matmul 1024^3, the demo CNN's
//! (`examples/mnist-cnn.toml`, batch 64) dense layers as GEMMs, and its two
//! convolutions forward and backward (input and weight gradients).
//!
//! Each workload runs once untimed (pipeline compilation, allocation), then
//! as many back-to-back dispatches as fill about `SECONDS`, submission to
//! completion, data resident on the device. libtorch runs the same shapes
//! in f32 on CPU tensors with its own thread pool. Its convolution backward
//! runs only inside autograd (tch exposes no direct `convolution_backward`),
//! so convolutions are compared forward and as whole forward+backward steps,
//! and our backward alone is printed without a ratio.

use std::time::Instant;

use anyhow::{Context, Result};
use rookery_kernels::GpuContext;
use rookery_kernels::conv::Conv2d;
use rookery_kernels::gemm::{Precision, Tiling};
use rookery_kernels::speed::{self, Measured};
use tch::{Device, Kind, Tensor};

/// Target seconds of timed work per measurement.
const SECONDS: f64 = 1.0;
/// The demo's batch size in the benchmark.
const BATCH: usize = 64;

/// Times `f` for about [`SECONDS`] after a warm-up; seconds per call.
fn time_torch(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    f();
    let once = start.elapsed().as_secs_f64().max(1e-6);
    let iterations = ((SECONDS / once) as usize).clamp(1, 1000);
    let start = Instant::now();
    for _ in 0..iterations {
        f();
    }
    start.elapsed().as_secs_f64() / iterations as f64
}

struct Row {
    name: String,
    flops: f64,
    gpu_s: f64,
    torch_s: f64,
}

impl Row {
    fn of(gpu: Measured, torch_s: f64) -> Self {
        Row {
            name: gpu.name,
            flops: gpu.flops,
            gpu_s: gpu.seconds,
            torch_s,
        }
    }
}

fn randn(shape: &[usize]) -> Tensor {
    let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu))
}

fn matmul_row(
    gpu: &GpuContext,
    m: usize,
    k: usize,
    n: usize,
    tiling: Option<Tiling>,
    precision: Precision,
) -> Result<Row> {
    let ours = pollster::block_on(speed::matmul(gpu, [m, k, n], tiling, precision, SECONDS))?;
    let (ta, tb) = (randn(&[m, k]), randn(&[k, n]));
    let torch_s = time_torch(|| {
        let _ = ta.matmul(&tb);
    });
    Ok(Row::of(ours, torch_s))
}

fn linear_rows(gpu: &GpuContext, rows: usize, inputs: usize, outputs: usize) -> Result<[Row; 2]> {
    let [fwd, bwd] = pollster::block_on(speed::linear(
        gpu,
        [rows, inputs, outputs],
        Precision::F32,
        SECONDS,
    ))?;
    let (tx, tw, tb, tdy) = (
        randn(&[rows, inputs]),
        randn(&[outputs, inputs]),
        randn(&[outputs]),
        randn(&[rows, outputs]),
    );
    let torch_fwd = time_torch(|| {
        let _ = tx.linear(&tw, Some(&tb));
    });
    // The two GEMMs of the backward, as autograd runs them.
    let torch_bwd = time_torch(|| {
        let _ = tdy.matmul(&tw);
        let _ = tdy.tr().matmul(&tx);
    });
    Ok([Row::of(fwd, torch_fwd), Row::of(bwd, torch_bwd)])
}

fn conv_rows(gpu: &GpuContext, conv: Conv2d) -> Result<[Row; 3]> {
    let [fwd, bwd, both] = pollster::block_on(speed::conv(gpu, &conv, SECONDS))?;
    let (oh, ow) = conv.out_hw();
    let tx = randn(&[conv.n, conv.c, conv.h, conv.w]).set_requires_grad(true);
    let tw = randn(&[conv.o, conv.c / conv.groups, conv.kh, conv.kw]).set_requires_grad(true);
    let tb = randn(&[conv.o]);
    let tdy = randn(&[conv.n, conv.o, oh, ow]);
    let i64s = |v: [usize; 2]| [v[0] as i64, v[1] as i64];
    let forward = || {
        tx.conv2d(
            &tw,
            Some(&tb),
            i64s(conv.stride),
            i64s(conv.padding),
            i64s(conv.dilation),
            conv.groups as i64,
        )
    };
    let torch_fwd = time_torch(|| {
        let _ = tch::no_grad(forward);
    });
    let torch_both = time_torch(|| {
        let y = forward();
        let grads =
            Tensor::run_backward(&[(&y * &tdy).sum(Kind::Float)], &[&tx, &tw], false, false);
        drop(grads);
    });
    // Backward alone on our side: the input- and weight-gradient GEMMs.
    // torch's backward is only measured inside autograd, so the row after
    // compares whole steps.
    Ok([
        Row::of(fwd, torch_fwd),
        Row::of(bwd, f64::NAN),
        Row::of(both, torch_both),
    ])
}

fn main() -> Result<()> {
    let gpu = pollster::block_on(GpuContext::new())
        .context("no GPU adapter (install mesa-vulkan-drivers for lavapipe)")?;
    println!("wgpu adapter: {}", gpu.adapter_description());
    println!("libtorch: CPU, {} threads", tch::get_num_threads());
    // The tiling chosen for the shape, the classic 4x4 register block, and
    // one output per invocation for comparison.
    let mut rows = vec![
        matmul_row(&gpu, 1024, 1024, 1024, None, Precision::F32)?,
        matmul_row(
            &gpu,
            1024,
            1024,
            1024,
            Some(Tiling::CLASSIC),
            Precision::F32,
        )?,
        matmul_row(
            &gpu,
            1024,
            1024,
            1024,
            Some(Tiling::square(16, 1)),
            Precision::F32,
        )?,
        // Mixed precision's cost where it runs in the plain form (against
        // torch's f32, the same reference as the rows above).
        matmul_row(&gpu, 1024, 1024, 1024, None, Precision::Mixed)?,
    ];
    // The demo CNN at batch 64: two convolutions, then Dense 1568->128 and
    // 128->10; and a wider convolution.
    let same = |x: [usize; 4], o: usize| Conv2d::new(x, o, [3, 3], [1, 1], [1, 1], [1, 1], 1, true);
    for conv in [
        same([BATCH, 1, 28, 28], 16),
        same([BATCH, 16, 14, 14], 32),
        // A wider layer, which runs as Winograd.
        same([BATCH, 32, 14, 14], 32),
    ] {
        rows.extend(conv_rows(&gpu, conv.context("demo conv shape")?)?);
    }
    rows.extend(linear_rows(&gpu, BATCH, 32 * 7 * 7, 128)?);
    rows.extend(linear_rows(&gpu, BATCH, 128, 10)?);
    println!(
        "\n{:<44} {:>12} {:>12} {:>8}",
        "kernel", "wgpu GFLOP/s", "torch GFLOP/s", "ratio"
    );
    for r in &rows {
        let (g, t) = (r.flops / r.gpu_s / 1e9, r.flops / r.torch_s / 1e9);
        if t.is_nan() {
            println!(
                "{:<52} {:>12.2} {:>13} {:>8}",
                format!("{} (wgpu only)", r.name),
                g,
                "-",
                "-"
            );
        } else {
            println!("{:<52} {:>12.2} {:>13.2} {:>8.3}", r.name, g, t, g / t);
        }
    }
    // A whole micro-batch of the demo CNN as a stage runs it, against its
    // kernels alone: the time transfers, binding and submission add.
    let cnn = rookery_model::spec::from_toml(include_str!("../../examples/mnist-cnn.toml"))
        .context("examples/mnist-cnn.toml")?;
    let device = std::sync::Arc::new(rookery_stage::GpuDevice::new(gpu));
    let time = pollster::block_on(rookery_stage::speed::micro_batch(
        device,
        "mnist-cnn",
        &cnn,
        BATCH,
        Precision::F32,
        SECONDS,
    ))?;
    println!("\n{time}");
    Ok(())
}
