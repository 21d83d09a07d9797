//! What a training micro-batch costs a stage beyond its kernels on this
//! machine's GPU, for the demo CNN (`examples/mnist-cnn.toml`) and a wide
//! MLP: part of the GPU kit (`cargo xtask gpu-kit`), which needs no
//! libtorch. `--quick` runs small batches only (software renderers). Each
//! runs in f32, then in mixed precision (`precision = "mixed"`).
//!
//! Usage: `stage_speed [--quick] [--seconds S]`

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use rookery_model::Precision;
use rookery_model::spec::from_toml;
use rookery_stage::GpuDevice;
use rookery_stage::speed::micro_batch;

const CNN: &str = include_str!("../../../examples/mnist-cnn.toml");

/// A wide MLP: two dense layers of 4096, whose kernels dominate a GPU's
/// time the way a transformer's do.
const MLP: &str = r#"
name = "mlp-4096"
input_shape = [1024]

[[layers]]
type = "Dense"
units = 4096
activation = "relu"

[[layers]]
type = "Dense"
units = 1024
"#;

fn main() -> Result<()> {
    let mut quick = false;
    let mut seconds = 0.5;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => quick = true,
            "--seconds" => {
                let s = args.next().context("`--seconds` needs a number")?;
                seconds = s.parse().with_context(|| format!("`--seconds {s}`"))?;
            }
            other => bail!("stage_speed takes `--quick` and `--seconds S`, got `{other}`"),
        }
    }
    let device = Arc::new(pollster::block_on(GpuDevice::open()).context("no GPU adapter")?);
    println!("adapter: {}", device.context().adapter_description());
    let runs: &[(&str, &str, usize)] = if quick {
        &[("mnist-cnn", CNN, 16), ("mlp-4096", MLP, 8)]
    } else {
        &[
            ("mnist-cnn", CNN, 64),
            ("mnist-cnn", CNN, 512),
            ("mlp-4096", MLP, 1024),
            ("mlp-4096", MLP, 8192),
        ]
    };
    for &(name, toml, batch) in runs {
        let graph = from_toml(toml).with_context(|| format!("the {name} spec"))?;
        for precision in [Precision::F32, Precision::Mixed] {
            let label = format!("{name}{}", precision.mark());
            let time = pollster::block_on(micro_batch(
                device.clone(),
                &label,
                &graph,
                batch,
                precision,
                seconds,
            ))
            .with_context(|| format!("{label} at batch {batch}"))?;
            println!("{time}");
        }
    }
    Ok(())
}
