//! GFLOP/s of Rookery's generated WGSL kernels on this machine's adapter,
//! one line per kernel and shape; part of the GPU kit (`cargo xtask
//! gpu-kit`), which needs no libtorch. `--quick` times small shapes only
//! (software renderers such as lavapipe); the default adds the shapes real
//! GPUs are judged at: matmul 4096^3, a transformer's token x 768 x 3072 in
//! both orientations, and ResNet convolutions.
//!
//! A convolution that runs as Winograd is also timed with the other tile
//! size (F(2x2, 3x3) against F(4x4, 3x3)) and as the implicit GEMM, for the
//! comparison.
//!
//! `--sweep` also times every tiling [`Tiling::auto`] chooses from (and the
//! classic one) at each matmul and convolution shape, marking the one it
//! chose: how the choice is checked on a new GPU.
//!
//! Mixed precision (`precision = "mixed"`) follows: the same matmuls, the
//! dense layer and the convolutions with f16 operands, on tensor cores where
//! the adapter has them (then also in the plain form, for the comparison;
//! `--sweep` adds every tensor-core tiling).
//!
//! Usage: `kernel_speed [--quick] [--sweep] [--seconds S]`

use anyhow::{Context, Result, bail};
use rookery_kernels::GpuContext;
use rookery_kernels::conv::Conv2d;
use rookery_kernels::gemm::precision::force_tensor_cores;
use rookery_kernels::gemm::tensor::force_tiling;
use rookery_kernels::gemm::{AUTO_CANDIDATES, Precision, TENSOR_CANDIDATES, Tiling};
use rookery_kernels::speed::{self, Measured};
use rookery_kernels::winograd::{Winograd, force_tile};

fn conv(x: [usize; 4], out: usize) -> Result<Conv2d> {
    Conv2d::new(x, out, [3, 3], [1, 1], [1, 1], [1, 1], 1, true)
        .with_context(|| format!("conv shape {x:?} -> {out}"))
}

fn main() -> Result<()> {
    let mut quick = false;
    let mut sweep = false;
    let mut seconds = 0.5;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => quick = true,
            "--sweep" => sweep = true,
            "--seconds" => {
                let s = args.next().context("`--seconds` needs a number")?;
                seconds = s.parse().with_context(|| format!("`--seconds {s}`"))?;
            }
            other => {
                bail!("kernel_speed takes `--quick`, `--sweep` and `--seconds S`, got `{other}`")
            }
        }
    }
    let gpu = pollster::block_on(GpuContext::new()).context("no GPU adapter")?;
    println!("adapter: {}", gpu.adapter_description());
    let rated = pollster::block_on(gpu.benchmark_gflops(0.3)).context("self-measurement")?;
    println!("a provider on this adapter rates itself at {rated:.1} GFLOP/s");
    let tensor = gpu.tensor_cores();
    println!(
        "tensor cores for mixed precision: {}",
        if tensor { "yes" } else { "no (plain form)" }
    );
    let matmuls: &[[usize; 3]] = if quick {
        &[[256, 256, 256], [64, 1568, 128]]
    } else {
        &[
            [4096, 4096, 4096],
            [8192, 768, 3072],
            [8192, 3072, 768],
            [64, 1568, 128],
        ]
    };
    let convs = if quick {
        vec![
            conv([8, 16, 28, 28], 32)?,
            conv([8, 32, 28, 28], 32)?,
            conv([64, 1, 28, 28], 16)?,
        ]
    } else {
        vec![
            conv([256, 64, 56, 56], 64)?,
            conv([256, 128, 28, 28], 128)?,
            conv([64, 1, 28, 28], 16)?,
        ]
    };
    let block = |rows: Vec<Measured>| -> Result<()> {
        for r in rows {
            println!("{:<56} {:>12.1} GFLOP/s", r.name, r.gflops());
        }
        Ok(())
    };
    let tilings: Vec<Option<Tiling>> = if sweep {
        // Beyond the candidates: the scalar form of the largest block, and
        // shallower and deeper staging, to show what the choice leaves out.
        let extra = [
            (8, 8, 8, false),
            (8, 8, 16, false),
            (4, 4, 8, true),
            (8, 4, 8, true),
            (2, 2, 16, false),
            (1, 1, 16, false),
        ]
        .into_iter()
        .filter_map(|(r, c, d, v)| Tiling::new(16, r, c, d, v));
        std::iter::once(None)
            .chain(
                std::iter::once(Tiling::CLASSIC)
                    .chain(AUTO_CANDIDATES)
                    .chain(extra)
                    .map(Some),
            )
            .collect()
    } else {
        vec![None]
    };
    for &shape in matmuls {
        for &tiling in &tilings {
            let mut row =
                pollster::block_on(speed::matmul(&gpu, shape, tiling, Precision::F32, seconds))?;
            if sweep && tiling.is_none() {
                row.name += " [chosen]";
            }
            block(vec![row])?;
        }
    }
    for c in &convs {
        for &tiling in &tilings {
            let mut c = *c;
            c.tiling = tiling;
            let mut rows = pollster::block_on(speed::conv(&gpu, &c, seconds))?.to_vec();
            if sweep && tiling.is_none() {
                rows.iter_mut().for_each(|r| r.name += " [chosen]");
            }
            block(rows)?;
        }
        // Where the forward and input gradient run as Winograd, the
        // implicit GEMM beside it.
        if let Some(chosen) = Winograd::forward_of(c) {
            force_tile(Some(6 - chosen.tile));
            block(pollster::block_on(speed::conv(&gpu, c, seconds))?.to_vec())?;
            force_tile(None);
            let mut direct = *c;
            direct.winograd = false;
            let mut rows = pollster::block_on(speed::conv(&gpu, &direct, seconds))?.to_vec();
            rows.iter_mut()
                .for_each(|r| r.name = r.name.replacen(" k3x3", " k3x3 (implicit GEMM)", 1));
            block(rows)?;
        }
    }
    let dense = if quick {
        [64, 512, 128]
    } else {
        [8192, 768, 3072]
    };
    block(pollster::block_on(speed::linear(&gpu, dense, Precision::F32, seconds))?.to_vec())?;

    // Mixed precision: each form the adapter has, the chosen tiling first.
    let forms: &[bool] = if tensor { &[true, false] } else { &[false] };
    for &on in forms {
        force_tensor_cores(Some(on));
        let sweep_tensor: Vec<Option<_>> = if sweep && on {
            std::iter::once(None)
                .chain(TENSOR_CANDIDATES.into_iter().map(Some))
                .collect()
        } else {
            vec![None]
        };
        for &shape in matmuls {
            for &forced in &sweep_tensor {
                force_tiling(forced);
                let mut row = pollster::block_on(speed::matmul(
                    &gpu,
                    shape,
                    None,
                    Precision::Mixed,
                    seconds,
                ))?;
                if sweep && on && forced.is_none() {
                    row.name += " [chosen]";
                }
                block(vec![row])?;
            }
            force_tiling(None);
        }
        for c in &convs {
            let mut c = *c;
            c.precision = Precision::Mixed;
            block(pollster::block_on(speed::conv(&gpu, &c, seconds))?.to_vec())?;
        }
        block(pollster::block_on(speed::linear(&gpu, dense, Precision::Mixed, seconds))?.to_vec())?;
    }
    force_tensor_cores(None);
    Ok(())
}
