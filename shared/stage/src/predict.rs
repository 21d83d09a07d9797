//! Forward-only inference of a whole graph on one backend (RavDL's
//! `predict()`): the graph as a single stage, built by any
//! [`BackendFactory`] (ours on a [`crate::CpuDevice`] or GPU, libtorch in
//! `rookery-torch`) and run in evaluation mode (no dropout). `rookery
//! generate` samples text through it.

use rookery_kernels::OptimizerConfig;
use rookery_model::Graph;
use rookery_proto::tensor::{WireDType, WireTensor};

use crate::worker::{Backend, BackendFactory, StageSpec};

/// Why a prediction failed, in the backend's words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PredictError {
    #[error("the graph has {0} inputs; prediction feeds exactly one")]
    Inputs(usize),
    #[error("the graph has no outputs")]
    Outputs,
    #[error("cannot build the model on this backend: {0}")]
    Build(String),
    #[error("{0}")]
    Run(String),
}

/// A whole graph on one backend, ready to run forward.
pub struct Predictor<B: Backend> {
    backend: B,
    input: String,
    outputs: Vec<String>,
}

impl<B: Backend> Predictor<B> {
    /// Builds `graph` (one input, one or more outputs) with `params` (every
    /// parameter and buffer, by name) on `factory`'s backend.
    pub fn new<F: BackendFactory<Backend = B>>(
        factory: &mut F,
        graph: &Graph,
        params: &[WireTensor],
    ) -> Result<Self, PredictError> {
        let [input] = graph.inputs.as_slice() else {
            return Err(PredictError::Inputs(graph.inputs.len()));
        };
        if graph.outputs.is_empty() {
            return Err(PredictError::Outputs);
        }
        let backend = factory
            .build(StageSpec {
                graph,
                range: 0..graph.nodes.len(),
                outputs: &graph.outputs,
                params,
                // Never stepped: prediction runs no backward.
                optimizer: OptimizerConfig::sgd(0.0),
                optimizer_state: &[],
                stash_weights: false,
                precision: Default::default(),
                // Outputs are read on the host, as f32.
                wire: crate::StageWire::F32,
            })
            .map_err(PredictError::Build)?;
        Ok(Self {
            backend,
            input: input.name.clone(),
            outputs: graph.outputs.clone(),
        })
    }

    /// The graph's first output for `input` (its tensor's name is ignored),
    /// floats as f32.
    pub async fn predict(&mut self, input: &WireTensor) -> Result<WireTensor, PredictError> {
        let mut all = self.predict_all(input).await?;
        Ok(all.swap_remove(0))
    }

    /// Every output of the graph for `input`, in the graph's order, each
    /// named as in the graph; floats as f32.
    pub async fn predict_all(
        &mut self,
        input: &WireTensor,
    ) -> Result<Vec<WireTensor>, PredictError> {
        let run = |e: B::Error| PredictError::Run(e.to_string());
        let x = self.backend.decode(input).map_err(run)?;
        let outputs = self
            .backend
            .evaluate(&[(self.input.clone(), x)])
            .await
            .map_err(run)?;
        self.outputs
            .iter()
            .map(|want| {
                let (name, y) = outputs
                    .iter()
                    .find(|(n, _)| n == want)
                    .ok_or_else(|| PredictError::Run(format!("no output `{want}`")))?;
                self.backend.encode(name, y, WireDType::F32).map_err(run)
            })
            .collect()
    }
}
