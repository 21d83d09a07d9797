//! Synthetic models and provider pools for planner benchmarks and property
//! tests: deterministic, sized by a count, and shaped like real workloads
//! (residual blocks; a mix of strong native machines and small browser tabs).

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};

use rookery_model::{DType, Graph, Init, Input, Node, Op, Param, ParamKind};

use crate::{ProviderKind, ProviderSpec};

const WIDTH: usize = 512;

/// A chain of `nodes` nodes on a [1, 512] input: repeated residual blocks
/// (Linear, Relu, Linear, Add back to the block input), so residual tensors cross
/// some cuts. Parameters use PyTorch's default initialisers (never materialised here).
pub fn synthetic_chain(nodes: usize) -> Graph {
    let mut g = Graph {
        inputs: vec![Input {
            name: "x".into(),
            shape: vec![1, WIDTH],
            dtype: DType::F32,
        }],
        ..Graph::default()
    };
    let mut block_in = "x".to_string();
    let mut prev = "x".to_string();
    for i in 0..nodes.max(1) {
        let name = format!("n{i}");
        let (op, inputs) = match i % 4 {
            0 | 2 => {
                for (what, shape, init) in [
                    ("weight", vec![WIDTH, WIDTH], Init::torch_weight(WIDTH)),
                    ("bias", vec![WIDTH], Init::torch_bias(WIDTH)),
                ] {
                    g.params.push(Param {
                        name: format!("{name}.{what}"),
                        shape,
                        dtype: DType::F32,
                        kind: ParamKind::Trainable,
                        init,
                    });
                }
                let ins = vec![
                    prev.clone(),
                    format!("{name}.weight"),
                    format!("{name}.bias"),
                ];
                (Op::Linear, ins)
            }
            1 => (Op::Relu, vec![prev.clone()]),
            _ => (Op::Add, vec![prev.clone(), block_in.clone()]),
        };
        g.nodes.push(Node {
            name: name.clone(),
            op,
            inputs,
        });
        if i % 4 == 3 {
            block_in = name.clone();
        }
        prev = name;
    }
    g.outputs = vec![prev];
    g
}

/// `count` providers: about 40% browser tabs (0.25-2 GiB, 5-50 GFLOP/s,
/// 10-100 Mbit/s), the rest native (2-32 GiB, 20-500 GFLOP/s, 50-1000 Mbit/s).
pub fn synthetic_providers(count: usize, seed: u64) -> Vec<ProviderSpec> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut between = |lo: f64, hi: f64| {
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        lo + (hi - lo) * u
    };
    const GIB: f64 = (1u64 << 30) as f64;
    (0..count)
        .map(|i| {
            let browser = between(0.0, 1.0) < 0.4;
            let (mem, gflops, bw) = if browser {
                (between(0.25, 2.0), between(5.0, 50.0), between(10.0, 100.0))
            } else {
                (
                    between(2.0, 32.0),
                    between(20.0, 500.0),
                    between(50.0, 1000.0),
                )
            };
            ProviderSpec {
                id: format!("p{i:04}"),
                kind: if browser {
                    ProviderKind::Browser
                } else {
                    ProviderKind::Native
                },
                memory_bytes: (mem * GIB) as u64,
                gflops,
                bandwidth_mbps: bw,
                // WebGPU's default maxStorageBufferBindingSize.
                max_buffer_bytes: browser.then_some(128 << 20),
            }
        })
        .collect()
}
