//! Seeded parameter initialisers. Each parameter draws from its own ChaCha8
//! stream, selected by a hash of its name, so a provider can materialise just
//! the parameters of its stage, in any order, and get the same values as every
//! other machine (native or wasm32) that uses the same seed.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use serde::{Deserialize, Serialize};

/// How a parameter's initial values are produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Init {
    Zeros,
    Ones,
    Constant {
        value: f32,
    },
    Uniform {
        low: f32,
        high: f32,
    },
    Normal {
        mean: f32,
        std: f32,
    },
    /// `torch.nn.init.kaiming_uniform_(w, a)`: U(-b, b) with
    /// b = sqrt(6 / ((1 + a^2) * fan_in)). PyTorch's Linear/Conv default is
    /// a = sqrt(5), which gives b = 1 / sqrt(fan_in).
    KaimingUniform {
        fan_in: usize,
        a: f32,
    },
    /// Explicit values, row-major; the length must match the shape.
    Values {
        data: Vec<f32>,
    },
}

impl Init {
    /// The PyTorch default for Linear/Conv weights.
    pub fn torch_weight(fan_in: usize) -> Self {
        Init::KaimingUniform {
            fan_in,
            a: 5f32.sqrt(),
        }
    }

    /// The PyTorch default for Linear/Conv biases: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    pub fn torch_bias(fan_in: usize) -> Self {
        let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
        Init::Uniform {
            low: -bound,
            high: bound,
        }
    }

    /// Produces `len` values for the parameter called `name`.
    pub fn materialize(&self, name: &str, len: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        // A per-name stream keeps parameters independent of their order in the graph.
        rng.set_stream(fnv1a(name));
        match self {
            Init::Zeros => vec![0.0; len],
            Init::Ones => vec![1.0; len],
            Init::Constant { value } => vec![*value; len],
            Init::Uniform { low, high } => uniform(&mut rng, len, *low, *high),
            Init::KaimingUniform { fan_in, a } => {
                let bound = (6.0 / ((1.0 + a * a) * (*fan_in).max(1) as f32)).sqrt();
                uniform(&mut rng, len, -bound, bound)
            }
            Init::Normal { mean, std } => (0..len)
                .map(|_| mean + std * standard_normal(&mut rng))
                .collect(),
            Init::Values { data } => data.clone(),
        }
    }
}

fn uniform(rng: &mut ChaCha8Rng, len: usize, low: f32, high: f32) -> Vec<f32> {
    (0..len).map(|_| low + (high - low) * unit(rng)).collect()
}

/// A float in [0, 1) from the top 24 bits, exactly representable in f32.
fn unit(rng: &mut ChaCha8Rng) -> f32 {
    (rng.next_u32() >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// Box-Muller; computed in f64 so the result is the same on every platform.
fn standard_normal(rng: &mut ChaCha8Rng) -> f32 {
    let u1 = ((rng.next_u64() >> 11) as f64 + 1.0) * (1.0 / (1u64 << 53) as f64);
    let u2 = (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// FNV-1a: tiny, stable across platforms and Rust versions (unlike `DefaultHasher`).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
