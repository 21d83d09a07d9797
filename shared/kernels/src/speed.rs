//! How fast the kernels run on this machine's adapter: each workload runs
//! once untimed (pipeline compilation, allocation), then as many
//! back-to-back dispatches as fill about the seconds asked for, submission
//! to completion, data resident on the device. `cargo xtask bench kernels`
//! puts libtorch's figures beside these; the GPU kit's `kernel_speed`
//! prints them alone, on any machine with a Vulkan, Metal or DX12 driver;
//! a donating browser tab times [`donor_lines`] for its Donate page.

use crate::conv::Conv2d;
use crate::gemm::precision::tensor_cores;
use crate::gemm::{Linear, MatMul, Precision, Tiling};
use crate::winograd::Winograd;
use crate::{GpuBuffer, GpuContext, GpuError, KernelError, KernelSpec, sample_matrix};

/// One timed workload.
#[derive(Debug, Clone)]
pub struct Measured {
    pub name: String,
    /// Floating-point operations of one run.
    pub flops: f64,
    /// Seconds per run.
    pub seconds: f64,
}

impl Measured {
    pub fn gflops(&self) -> f64 {
        self.flops / self.seconds / 1e9
    }
}

/// Seconds per run of the kernel chain `steps`, each with its buffers.
pub async fn time_chain(
    gpu: &GpuContext,
    steps: &[(&KernelSpec, Vec<&GpuBuffer>)],
    seconds: f64,
) -> Result<f64, GpuError> {
    let chain: Vec<(&KernelSpec, &[&GpuBuffer])> =
        steps.iter().map(|(s, b)| (*s, b.as_slice())).collect();
    let run = |times: usize| {
        let all: Vec<(&KernelSpec, &[&GpuBuffer])> =
            (0..times).flat_map(|_| chain.iter().copied()).collect();
        async move {
            let start = crate::Clock::start();
            gpu.dispatch_all(&all).await?;
            gpu.wait_for_queue().await?;
            Ok::<f64, GpuError>(start.elapsed_seconds())
        }
    };
    run(1).await?;
    let once = run(1).await?.max(1e-6);
    let iterations = ((seconds / once) as usize).clamp(1, 1000);
    Ok(run(iterations).await? / iterations as f64)
}

fn upload(gpu: &GpuContext, len: usize, seed: u64) -> Result<GpuBuffer, GpuError> {
    gpu.upload_f32(&sample_matrix(len, seed))
}

/// What a workload's name says of its precision and form: nothing under
/// f32, else ` mixed` and whether it ran on tensor cores.
fn precision_mark(precision: Precision) -> &'static str {
    match precision {
        Precision::F32 => "",
        Precision::Mixed if tensor_cores() => " mixed (tensor cores)",
        Precision::Mixed => " mixed (plain)",
    }
}

/// `[m, k] x [k, n]` with `tiling` (`None`: the one chosen for the shape).
pub async fn matmul(
    gpu: &GpuContext,
    [m, k, n]: [usize; 3],
    tiling: Option<Tiling>,
    precision: Precision,
    seconds: f64,
) -> Result<Measured, GpuError> {
    let mut mm =
        MatMul::new(&[m, k], &[k, n]).ok_or(GpuError::Kernel(KernelError::TooLarge { m, k, n }))?;
    mm.tiling = tiling;
    mm.precision = precision;
    let (spec, used) = (mm.forward(), mm.forward_form());
    let (a, b, c) = (
        upload(gpu, m * k, 1)?,
        upload(gpu, k * n, 2)?,
        gpu.create_buffer(m * n)?,
    );
    Ok(Measured {
        name: format!("matmul {m}x{k}x{n}{} ({used})", precision_mark(precision)),
        flops: 2.0 * (m * k * n) as f64,
        seconds: time_chain(gpu, &[(&spec, vec![&a, &b, &c])], seconds).await?,
    })
}

/// A dense layer over `rows` rows: forward, then backward (input and weight
/// gradients).
pub async fn linear(
    gpu: &GpuContext,
    [rows, inputs, outputs]: [usize; 3],
    precision: Precision,
    seconds: f64,
) -> Result<[Measured; 2], GpuError> {
    let mut l = Linear::new(rows, inputs, outputs, true);
    l.precision = precision;
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
    let flops = 2.0 * (rows * inputs * outputs) as f64;
    let name = format!(
        "linear {rows}x{inputs} -> {outputs}{}",
        precision_mark(precision)
    );
    Ok([
        Measured {
            name: format!("{name} fwd"),
            flops,
            seconds: time_chain(gpu, &[(&fwd, vec![&x, &w, &b, &y])], seconds).await?,
        },
        Measured {
            name: format!("{name} bwd"),
            flops: 2.0 * flops,
            seconds: time_chain(
                gpu,
                &[(&bx, vec![&dy, &w, &dx]), (&bw, vec![&dy, &x, &dw])],
                seconds,
            )
            .await?,
        },
    ])
}

/// A convolution: forward, backward (input and weight gradients), and the
/// two as one training step, in the forms a stage runs them: Winograd
/// where it suits ([`Winograd`]; the name then says so), else implicit
/// GEMMs with the weight gradient in parts where its reduction is long.
pub async fn conv(
    gpu: &GpuContext,
    conv: &Conv2d,
    seconds: f64,
) -> Result<[Measured; 3], GpuError> {
    let x_len = conv.n * conv.c * conv.h * conv.w;
    let w_len = conv.weight_len();
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
    let parts = conv.weight_parts();
    let dw_parts = gpu.create_buffer(w_len * parts as usize)?;
    let winograd = Winograd::forward_of(conv).zip(Winograd::backward_input(conv));
    // Scratch buffers sized for both Winograd convolutions, shared.
    let scratch = match &winograd {
        Some((f, i)) => Some([
            gpu.create_buffer(f.u_len().max(i.u_len()))?,
            gpu.create_buffer(f.v_len().max(i.v_len()))?,
            gpu.create_buffer(f.m_len().max(i.m_len()))?,
        ]),
        None => None,
    };
    let (fwd, input_grad) = match (&winograd, &scratch) {
        (Some((f, i)), Some(s)) => (
            winograd_steps(f, [&x, &w], Some(&b).filter(|_| conv.bias), &y, s),
            winograd_steps(i, [&dy, &w], None, &dx, s),
        ),
        _ => {
            let mut fwd_bufs = vec![&x, &w];
            if conv.bias {
                fwd_bufs.push(&b);
            }
            fwd_bufs.push(&y);
            (
                vec![(conv.forward(), fwd_bufs)],
                vec![(conv.backward_input(), vec![&dy, &w, &dx])],
            )
        }
    };
    let grad = Winograd::weight_grad_of(conv);
    let du = match &grad {
        Some(g) => Some(gpu.create_buffer(g.du_len())?),
        None => None,
    };
    let weight_grad = if let (Some(g), Some([_, v, m]), Some(du)) = (&grad, &scratch, &du) {
        g.weight_grad_steps(&dy, &x, &dw, [v, m, du])
            .into_iter()
            .map(|(step, bufs)| (g.spec(step), bufs))
            .collect()
    } else if parts > 1 {
        vec![
            (conv.backward_weight_parts(parts), vec![&dy, &x, &dw_parts]),
            (conv.sum_weight_parts(parts), vec![&dw_parts, &dw]),
        ]
    } else {
        vec![(conv.backward_weight(), vec![&dy, &x, &dw])]
    };
    let forward_steps = fwd.len();
    let specs: Vec<_> = fwd
        .into_iter()
        .chain(input_grad)
        .chain(weight_grad)
        .collect();
    let steps: Vec<(&KernelSpec, Vec<&GpuBuffer>)> =
        specs.iter().map(|(s, b)| (s, b.clone())).collect();
    let name = format!(
        "conv2d {}x{}x{}x{} -> {} k{}x{}{}{}{}",
        conv.n,
        conv.c,
        conv.h,
        conv.w,
        conv.o,
        conv.kh,
        conv.kw,
        precision_mark(conv.precision),
        winograd
            .map(|(f, _)| format!(" (winograd {0}x{0})", f.tile))
            .unwrap_or_default(),
        conv.tiling
            .map(|t| format!(" ({})", t.describe()))
            .unwrap_or_default()
    );
    Ok([
        Measured {
            name: format!("{name} fwd"),
            flops: conv.flops(),
            seconds: time_chain(gpu, &steps[..forward_steps], seconds).await?,
        },
        Measured {
            name: format!("{name} bwd"),
            flops: 2.0 * conv.flops(),
            seconds: time_chain(gpu, &steps[forward_steps..], seconds).await?,
        },
        Measured {
            name: format!("{name} fwd+bwd"),
            flops: 3.0 * conv.flops(),
            seconds: time_chain(gpu, &steps, seconds).await?,
        },
    ])
}

/// The kernels of one Winograd convolution reading `[input, weight]` (and
/// `bias`) into `out`, through `scratch` (`u`, `v`, `m`).
fn winograd_steps<'a>(
    w: &Winograd,
    [input, weight]: [&'a GpuBuffer; 2],
    bias: Option<&'a GpuBuffer>,
    out: &'a GpuBuffer,
    [u, v, m]: &'a [GpuBuffer; 3],
) -> Vec<(KernelSpec, Vec<&'a GpuBuffer>)> {
    w.product_steps(input, weight, bias, out, [u, v, m])
        .into_iter()
        .map(|(step, bufs)| (w.spec(step), bufs))
        .collect()
}

/// The kernel lines a donor's Donate page shows for its GPU, each timed for
/// about `seconds`: a matmul in f32 and in mixed precision, a dense layer
/// forward and backward, and the demo CNN's second convolution's training
/// step, in that order. A donor waits for them before the tab connects, so
/// once `budget` seconds have gone no further line starts: a GPU gives all
/// five at once, a software renderer the first few.
pub async fn donor_lines(
    gpu: &GpuContext,
    seconds: f64,
    budget: f64,
) -> Result<Vec<Measured>, GpuError> {
    let clock = crate::Clock::start();
    let mut lines = vec![matmul(gpu, [256, 256, 256], None, Precision::F32, seconds).await?];
    if clock.elapsed_seconds() < budget {
        lines.push(matmul(gpu, [256, 256, 256], None, Precision::Mixed, seconds).await?);
    }
    if clock.elapsed_seconds() < budget {
        lines.extend(linear(gpu, [64, 512, 128], Precision::F32, seconds).await?);
    }
    // A valid geometry, so always `Some`.
    let demo = Conv2d::new([8, 16, 28, 28], 32, [3, 3], [1, 1], [1, 1], [1, 1], 1, true);
    if let Some(c) = demo.filter(|_| clock.elapsed_seconds() < budget) {
        let [_, _, step] = conv(gpu, &c, seconds).await?;
        lines.push(step);
    }
    Ok(lines)
}
