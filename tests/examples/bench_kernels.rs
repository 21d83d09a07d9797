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
use rookery_kernels::conv::Conv2d;
use rookery_kernels::gemm::{DEFAULT_PER_THREAD, Linear, MatMul};
use rookery_kernels::{GpuBuffer, GpuContext, KernelSpec, sample_matrix};
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

/// Seconds per run of the kernel chain `steps`, each with its buffers.
fn time_gpu(gpu: &GpuContext, steps: &[(&KernelSpec, Vec<&GpuBuffer>)]) -> Result<f64> {
    let chain: Vec<(&KernelSpec, &[&GpuBuffer])> =
        steps.iter().map(|(s, b)| (*s, b.as_slice())).collect();
    let run = |times: usize| -> Result<f64> {
        let all: Vec<(&KernelSpec, &[&GpuBuffer])> =
            (0..times).flat_map(|_| chain.iter().copied()).collect();
        let start = Instant::now();
        pollster::block_on(gpu.dispatch_all(&all))?;
        pollster::block_on(gpu.wait_for_queue())?;
        Ok(start.elapsed().as_secs_f64())
    };
    run(1)?;
    let once = run(1)?.max(1e-6);
    let iterations = ((SECONDS / once) as usize).clamp(1, 1000);
    Ok(run(iterations)? / iterations as f64)
}

struct Row {
    name: String,
    flops: f64,
    gpu_s: f64,
    torch_s: f64,
}

fn upload(gpu: &GpuContext, len: usize, seed: u64) -> Result<GpuBuffer> {
    Ok(gpu.upload_f32(&sample_matrix(len, seed))?)
}

fn randn(shape: &[usize]) -> Tensor {
    let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu))
}

fn matmul_row(gpu: &GpuContext, m: usize, k: usize, n: usize, per_thread: u32) -> Result<Row> {
    let mut mm = MatMul::new(&[m, k], &[k, n]).context("matmul shape")?;
    mm.per_thread = per_thread;
    let spec = mm.forward();
    let (a, b, c) = (
        upload(gpu, m * k, 1)?,
        upload(gpu, k * n, 2)?,
        gpu.create_buffer(m * n)?,
    );
    let gpu_s = time_gpu(gpu, &[(&spec, vec![&a, &b, &c])])?;
    let (ta, tb) = (randn(&[m, k]), randn(&[k, n]));
    let torch_s = time_torch(|| {
        let _ = ta.matmul(&tb);
    });
    Ok(Row {
        name: format!("matmul {m}x{k}x{n} ({per_thread}x{per_thread} per invocation)"),
        flops: 2.0 * (m * k * n) as f64,
        gpu_s,
        torch_s,
    })
}

fn linear_rows(gpu: &GpuContext, rows: usize, inputs: usize, outputs: usize) -> Result<[Row; 2]> {
    let l = Linear::new(rows, inputs, outputs, true);
    let (x, w, b) = (
        upload(gpu, rows * inputs, 1)?,
        upload(gpu, outputs * inputs, 2)?,
        upload(gpu, outputs, 3)?,
    );
    let (y, dy) = (
        gpu.create_buffer(rows * outputs)?,
        upload(gpu, rows * outputs, 4)?,
    );
    let (dx, dw) = (
        gpu.create_buffer(rows * inputs)?,
        gpu.create_buffer(outputs * inputs)?,
    );
    let (fwd, bx, bw) = (l.forward(), l.backward_x(), l.backward_w());
    let gpu_fwd = time_gpu(gpu, &[(&fwd, vec![&x, &w, &b, &y])])?;
    let gpu_bwd = time_gpu(gpu, &[(&bx, vec![&dy, &w, &dx]), (&bw, vec![&dy, &x, &dw])])?;
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
    let flops = 2.0 * (rows * inputs * outputs) as f64;
    Ok([
        Row {
            name: format!("linear {rows}x{inputs}->{outputs} fwd"),
            flops,
            gpu_s: gpu_fwd,
            torch_s: torch_fwd,
        },
        Row {
            name: format!("linear {rows}x{inputs}->{outputs} bwd"),
            flops: 2.0 * flops,
            gpu_s: gpu_bwd,
            torch_s: torch_bwd,
        },
    ])
}

fn conv_rows(gpu: &GpuContext, conv: Conv2d) -> Result<[Row; 3]> {
    let (oh, ow) = conv.out_hw();
    let x_len = conv.n * conv.c * conv.h * conv.w;
    let w_len = conv.o * conv.c / conv.groups * conv.kh * conv.kw;
    let (x, w, b) = (
        upload(gpu, x_len, 1)?,
        upload(gpu, w_len, 2)?,
        upload(gpu, conv.o, 3)?,
    );
    let (y, dy) = (
        gpu.create_buffer(conv.out_len())?,
        upload(gpu, conv.out_len(), 4)?,
    );
    let (dx, dw) = (gpu.create_buffer(x_len)?, gpu.create_buffer(w_len)?);
    let (fwd, bi, bw) = (
        conv.forward(),
        conv.backward_input(),
        conv.backward_weight(),
    );
    let gpu_fwd = time_gpu(gpu, &[(&fwd, vec![&x, &w, &b, &y])])?;
    let gpu_bwd = time_gpu(gpu, &[(&bi, vec![&dy, &w, &dx]), (&bw, vec![&dy, &x, &dw])])?;
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
    let gpu_both = time_gpu(
        gpu,
        &[
            (&fwd, vec![&x, &w, &b, &y]),
            (&bi, vec![&dy, &w, &dx]),
            (&bw, vec![&dy, &x, &dw]),
        ],
    )?;
    let name = format!(
        "conv2d {}x{}x{}x{} -> {} k{}x{}",
        conv.n, conv.c, conv.h, conv.w, conv.o, conv.kh, conv.kw
    );
    Ok([
        Row {
            name: format!("{name} fwd"),
            flops: conv.flops(),
            gpu_s: gpu_fwd,
            torch_s: torch_fwd,
        },
        // Backward alone on our side: the input- and weight-gradient GEMMs.
        // torch's backward is only measured inside autograd, so the row
        // after compares whole steps.
        Row {
            name: format!("{name} bwd (wgpu only)"),
            flops: 2.0 * conv.flops(),
            gpu_s: gpu_bwd,
            torch_s: f64::NAN,
        },
        Row {
            name: format!("{name} fwd+bwd"),
            flops: 3.0 * conv.flops(),
            gpu_s: gpu_both,
            torch_s: torch_both,
        },
    ])
}

fn main() -> Result<()> {
    let gpu = pollster::block_on(GpuContext::new())
        .context("no GPU adapter (install mesa-vulkan-drivers for lavapipe)")?;
    println!("wgpu adapter: {}", gpu.adapter_description());
    println!("libtorch: CPU, {} threads", tch::get_num_threads());
    // The default register block, and one output per invocation for
    // comparison.
    let mut rows = vec![
        matmul_row(&gpu, 1024, 1024, 1024, DEFAULT_PER_THREAD)?,
        matmul_row(&gpu, 1024, 1024, 1024, 1)?,
    ];
    // The demo CNN at batch 64: two convolutions, then Dense 1568->128 and 128->10.
    for conv in [
        Conv2d::new(
            [BATCH, 1, 28, 28],
            16,
            [3, 3],
            [1, 1],
            [1, 1],
            [1, 1],
            1,
            true,
        ),
        Conv2d::new(
            [BATCH, 16, 14, 14],
            32,
            [3, 3],
            [1, 1],
            [1, 1],
            [1, 1],
            1,
            true,
        ),
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
            println!("{:<52} {:>12.2} {:>13} {:>8}", r.name, g, "-", "-");
        } else {
            println!("{:<52} {:>12.2} {:>13.2} {:>8.3}", r.name, g, t, g / t);
        }
    }
    Ok(())
}
