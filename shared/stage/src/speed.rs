//! What a training micro-batch costs a stage beyond its kernels: uploading
//! its inputs and output gradients, binding, submitting, and reading back
//! its outputs and input gradients. A whole micro-batch (forward, then
//! backward) is timed against the same kernels replayed with no transfers
//! ([`StageExecutor::replay_kernels`]); the difference is the overhead a
//! faster GPU cannot remove. `cargo xtask bench kernels` and the GPU kit's
//! `stage_speed` print it.

use std::time::Instant;

use rookery_kernels::{OptimizerConfig, sample_matrix};
use rookery_model::{DType, Graph};

use crate::{Device, HostTensor, StageError, StageExecutor};

/// One stage's micro-batch, timed both ways.
#[derive(Debug, Clone)]
pub struct MicroBatchTime {
    pub name: String,
    pub batch: usize,
    /// Seconds of a whole micro-batch, forward and backward with their
    /// transfers.
    pub whole_s: f64,
    /// Seconds of its kernels alone.
    pub kernels_s: f64,
    /// Bytes crossing between host and device per micro-batch.
    pub transfer_bytes: usize,
}

impl MicroBatchTime {
    /// Seconds per micro-batch beyond the kernels.
    pub fn beyond_s(&self) -> f64 {
        (self.whole_s - self.kernels_s).max(0.0)
    }
}

impl std::fmt::Display for MicroBatchTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stage {} batch {}: micro-batch {:.3} ms, kernels {:.3} ms, beyond the kernels {:.3} ms ({:.0}%), {:.2} MB moved",
            self.name,
            self.batch,
            self.whole_s * 1e3,
            self.kernels_s * 1e3,
            self.beyond_s() * 1e3,
            100.0 * self.beyond_s() / self.whole_s.max(1e-12),
            self.transfer_bytes as f64 / 1e6,
        )
    }
}

/// Times the whole of `graph` as one stage on `device` at `batch` samples
/// per micro-batch, for about `seconds` each way. The graph's first input
/// must be f32 (images, features).
pub async fn micro_batch<D: Device>(
    device: D,
    name: &str,
    graph: &Graph,
    batch: usize,
    precision: rookery_kernels::gemm::Precision,
    seconds: f64,
) -> Result<MicroBatchTime, StageError> {
    let input = graph
        .inputs
        .first()
        .filter(|i| i.dtype == DType::F32)
        .ok_or_else(|| StageError::Graph("the benchmark needs an f32 first input".into()))?;
    let mut shape = input.shape.clone();
    shape[0] = batch;
    let data = sample_matrix(shape.iter().product(), 1);
    let inputs = vec![(input.name.clone(), HostTensor { shape, data })];
    let mut exec = StageExecutor::new(
        device,
        graph,
        0..graph.nodes.len(),
        &graph.outputs,
        &graph.initial_values(1),
        OptimizerConfig::sgd(0.01),
    )?;
    exec.set_precision(precision)?;
    // The first micro-batch finds the outputs' shapes, and so the gradients
    // every later one sends back (drawn once: drawing them is host work no
    // stage does).
    let (mb, outputs) = exec.forward(&inputs).await?;
    let grads: Vec<(String, HostTensor)> = outputs
        .iter()
        .map(|(n, t)| {
            let data = sample_matrix(t.data.len(), 2);
            let shape = t.shape.clone();
            (n.clone(), HostTensor { shape, data })
        })
        .collect();
    let input_grads = exec.backward(mb, &grads).await?;
    let words = |ts: &[(String, HostTensor)]| ts.iter().map(|(_, t)| t.data.len()).sum::<usize>();
    let transfer_bytes =
        4 * (words(&inputs) + words(&outputs) + words(&grads) + words(&input_grads));
    let mut once = async || -> Result<(), StageError> {
        let (mb, _) = exec.forward(&inputs).await?;
        exec.backward(mb, &grads).await?;
        Ok(())
    };
    let start = Instant::now();
    once().await?;
    let first = start.elapsed().as_secs_f64().max(1e-6);
    let times = ((seconds / first) as usize).clamp(2, 200);
    let start = Instant::now();
    for _ in 0..times {
        once().await?;
    }
    let whole_s = start.elapsed().as_secs_f64() / times as f64;
    exec.replay_kernels(batch, 1).await?;
    let start = Instant::now();
    exec.replay_kernels(batch, times).await?;
    let kernels_s = start.elapsed().as_secs_f64() / times as f64;
    Ok(MicroBatchTime {
        name: name.to_string(),
        batch,
        whole_s,
        kernels_s,
        transfer_bytes,
    })
}
