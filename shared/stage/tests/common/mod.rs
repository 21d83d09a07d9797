//! What the stage test binaries share: blocking on the backend's futures,
//! deterministic values and a middle stage cut from a layer spec.
#![allow(dead_code, clippy::unwrap_used)] // Each binary uses its share.

use std::future::Future;
use std::ops::Range;

use rookery_model::{Graph, from_toml};

pub fn block<F: Future>(f: F) -> F::Output {
    pollster::block_on(f)
}

/// The workspace's deterministic values in [-1, 1)
/// (`rookery_test_support::pseudo`), spread over magnitudes by `spread`
/// powers of two (1: not spread).
pub fn pseudo(n: usize, seed: u64, spread: i32) -> Vec<f32> {
    rookery_test_support::pseudo(n, seed)
        .into_iter()
        .enumerate()
        .map(|(i, v)| v * 2f32.powi(-((i / 7) as i32 % spread.max(1))))
        .collect()
}

/// A middle stage of a model: nodes `range`, fed by the node before it (so
/// its input gets a gradient), sending the model's outputs.
pub struct Case {
    pub name: &'static str,
    pub graph: Graph,
    pub range: Range<usize>,
    pub input: String,
    pub in_width: usize,
    pub output: String,
    pub out_width: usize,
}

impl Case {
    /// The layer spec `toml` from node `first` on.
    pub fn new(name: &'static str, toml: &str, first: usize) -> Self {
        let graph = from_toml(toml).unwrap();
        let analysis = graph.analyze().unwrap();
        let width = |k: usize| analysis.nodes[k].output.shape[1..].iter().product();
        let last = graph.nodes.len() - 1;
        Self {
            name,
            input: graph.nodes[first - 1].name.clone(),
            in_width: width(first - 1),
            output: graph.nodes[last].name.clone(),
            out_width: width(last),
            range: first..graph.nodes.len(),
            graph,
        }
    }
}
