//! The cost model: per-stage compute, transfer and memory from prefix sums
//! over the topological order, and the lower bounds the searches prune with.

use std::collections::BTreeSet;

use rookery_kernels::winograd::Winograd;
use rookery_model::{Analysis, DType, Graph};

use crate::types::{PlanOptions, ProviderSpec};

/// What moving one byte of a node's output costs, in FLOP-equivalents, per
/// training micro-batch. Elementwise ops, normalisation, pooling and
/// convolutions over few channels are bound by memory, not arithmetic: a
/// BatchNorm or a ReLU does a handful of FLOPs per element but streams the
/// tensor through memory several times (forward: read the input, write the
/// output; backward: read the saved tensors and the incoming gradient, write
/// the outgoing one), and devices move roughly a quarter as many bytes per
/// second as they do FLOPs. Measured on libtorch CPU with the demo's CNN: a
/// stage of conv (1 input channel), BatchNorm, ReLU and max-pool took 3.5x
/// its FLOP estimate, the conv-heavy stage after it 0.6x; without this term
/// the planner put both convolutions on one stage and left the others idle.
pub const MEMORY_FLOPS_PER_OUTPUT_BYTE: f64 = 16.0;

/// What one byte crossing a cut costs each of the two stages beside it, in
/// FLOP-equivalents of their own CPU, per micro-batch: the sender copies
/// the tensor into wire bytes and frames (and, as a WebSocket client, masks)
/// them; the receiver reads, checks and copies them into a tensor. Measured
/// with libtorch on the CPU: about 0.4 ns a byte for both sides together,
/// some 40 FLOPs at the 100 GFLOP/s a core measures. This is CPU, not link
/// time, so it adds to compute rather than overlapping it; without it the
/// planner cut the demo's CNN where tensors were largest and relayed 4.8 MB
/// a step to save less compute than the copies cost.
pub const WIRE_FLOPS_PER_BYTE: f64 = 20.0;

/// Per-stage cost lookups in O(1), from prefix sums over the topological order.
pub(crate) struct Costs {
    pub(crate) n: usize,
    train: Vec<u64>,
    buffer: Vec<u64>,
    act: Vec<u64>,
    /// Prefix sums of each node's scratch bytes at the micro-batch size
    /// ([`scratch_bytes`]).
    scratch: Vec<u64>,
    flops: Vec<f64>,
    /// Per-sample bytes held at each cut (the stage after it keeps them for backward).
    cut_hold: Vec<u64>,
    /// Per-sample bytes sent across each cut, both directions.
    cut_send: Vec<u64>,
    /// `min_send_before[j]`: least `cut_send` of any cut before `j` (where a
    /// stage ending at `j` could start); index 0 is unused.
    min_send_before: Vec<u64>,
    /// Least FLOPs of any one node: every stage computes at least this much.
    min_node_flops: f64,
    /// Least bytes any stage sends over its two cuts.
    min_stage_send: u64,
    /// Mean bytes sent across the cuts inside the model ([`Costs::unit_s`]).
    typical_cut_send: u64,
    /// `last_flops[j]`: FLOPs of node `j - 1`, the least a stage ending at `j` computes.
    last_flops: Vec<f64>,
    /// `least_send[j]`: the least bytes a stage ending at `j` sends, as f64.
    least_send: Vec<f64>,
    pub(crate) mb: f64,
    state_factor: u64,
    act_factor: u64,
    /// Each node's largest single tensor at the micro-batch size, for
    /// providers with a buffer limit.
    pub(crate) largest: RangeMax,
}

impl Costs {
    pub(crate) fn new(a: &Analysis, g: &Graph, o: &PlanOptions) -> Self {
        let n = a.nodes.len();
        let prefix = |f: &dyn Fn(usize) -> u64| {
            let mut v = vec![0u64; n + 1];
            for i in 0..n {
                v[i + 1] = v[i] + f(i);
            }
            v
        };
        let train = prefix(&|i| a.nodes[i].param_bytes);
        let buffer = prefix(&|i| a.nodes[i].buffer_bytes);
        let act = prefix(&|i| a.nodes[i].activation_bytes_per_sample);
        let scratch = prefix(&|i| scratch_bytes(a, g, i, o.micro_batch));
        let mut flops = vec![0.0; n + 1];
        for i in 0..n {
            let nd = &a.nodes[i];
            flops[i + 1] = flops[i]
                + (nd.forward_flops_per_sample + nd.backward_flops_per_sample) as f64
                + MEMORY_FLOPS_PER_OUTPUT_BYTE * nd.activation_bytes_per_sample as f64;
        }
        let mut hold_diff = vec![0i128; n + 2];
        let mut cut_send = vec![0u64; n + 1];
        for t in crossing_tensors(a, g) {
            let per_sample = t.bytes.div_ceil(a.batch as u64);
            hold_diff[t.from] += i128::from(per_sample);
            hold_diff[t.to + 1] -= i128::from(per_sample);
            for (c, send) in cut_send.iter_mut().enumerate().take(t.to + 1).skip(t.from) {
                // Gradients flow back only for floats between stages.
                let between = c > 0 && c < n;
                let both_ways = between && t.dtype == DType::F32;
                *send += per_sample * if both_ways { 2 } else { 1 };
                if between && !t.per_sample {
                    *send += UNSENDABLE_BYTES;
                }
            }
        }
        cut_send[n] = 0;
        let mut cut_hold = vec![0u64; n + 1];
        let mut run = 0i128;
        for c in 0..=n {
            run += hold_diff[c];
            cut_hold[c] = run.max(0) as u64;
        }
        let mut min_send_before = vec![u64::MAX; n + 1];
        for j in 1..=n {
            min_send_before[j] = min_send_before[j - 1].min(cut_send[j - 1]);
        }
        let min_stage_send = (1..=n)
            .map(|j| min_send_before[j] + cut_send[j])
            .min()
            .unwrap_or(0);
        // Differences of the same prefix sums `compute_s` uses, so the bound holds
        // after rounding too.
        let mut last_flops = vec![0.0; n + 1];
        let mut least_send = vec![0.0; n + 1];
        for j in 1..=n {
            last_flops[j] = flops[j] - flops[j - 1];
            least_send[j] = (min_send_before[j] + cut_send[j]) as f64;
        }
        let interior = &cut_send[1..n.max(1)];
        let typical_cut_send = interior.iter().sum::<u64>() / (interior.len().max(1) as u64);
        let min_node_flops = last_flops[1..]
            .iter()
            .copied()
            .reduce(f64::min)
            .unwrap_or(0.0);
        Costs {
            n,
            train,
            buffer,
            act,
            scratch,
            flops,
            cut_hold,
            cut_send,
            min_send_before,
            min_node_flops,
            min_stage_send,
            typical_cut_send,
            last_flops,
            least_send,
            mb: o.micro_batch as f64,
            state_factor: 2 + u64::from(o.optimizer_copies),
            act_factor: o.micro_batch as u64 * u64::from(o.in_flight_micro_batches),
            largest: RangeMax::new(
                (0..n)
                    .map(|i| largest_tensor_bytes(a, g, i, o.micro_batch))
                    .collect(),
            ),
        }
    }

    /// Whether nodes `[i, j)` fit `p`: memory, and each tensor within `p`'s
    /// buffer limit.
    pub(crate) fn fits(&self, i: usize, j: usize, p: &ProviderSpec) -> bool {
        self.mem(i, j) <= p.memory_bytes && self.within_buffer_limit(i, j, p)
    }

    /// The part of [`Self::fits`] that can only fail more often as the stage
    /// grows: a DP loop that finds it false may stop.
    pub(crate) fn fits_monotone(&self, i: usize, j: usize, p: &ProviderSpec) -> bool {
        self.mem_monotone(i, j) <= p.memory_bytes && self.within_buffer_limit(i, j, p)
    }

    pub(crate) fn within_buffer_limit(&self, i: usize, j: usize, p: &ProviderSpec) -> bool {
        p.max_buffer_bytes
            .is_none_or(|limit| self.largest.max(i, j) <= limit)
    }

    /// Memory that only grows as the stage grows (prunes the DP's inner loop).
    pub(crate) fn mem_monotone(&self, i: usize, j: usize) -> u64 {
        (self.train[j] - self.train[i]) * self.state_factor
            + (self.buffer[j] - self.buffer[i])
            + (self.scratch[j] - self.scratch[i])
            + (self.act[j] - self.act[i]) * self.act_factor
    }

    pub(crate) fn mem(&self, i: usize, j: usize) -> u64 {
        self.mem_monotone(i, j) + self.cut_hold[i] * self.act_factor
    }

    pub(crate) fn compute_s(&self, i: usize, j: usize, p: &ProviderSpec) -> f64 {
        let wire = WIRE_FLOPS_PER_BYTE * (self.cut_send[i] + self.cut_send[j]) as f64;
        (self.flops[j] - self.flops[i] + wire) * self.mb / (p.gflops * 1e9)
    }

    pub(crate) fn transfer_s(&self, i: usize, j: usize, p: &ProviderSpec) -> f64 {
        self.send_s(self.cut_send[i] + self.cut_send[j], p)
    }

    /// How long `p` takes for a micro-batch of the whole model's compute plus
    /// a typical cut's traffic: what ranks providers when they are dealt into
    /// clusters, so each cluster gets its share of quick links as well as of
    /// quick devices.
    pub(crate) fn unit_s(&self, p: &ProviderSpec) -> f64 {
        self.flops[self.n] * self.mb / (p.gflops * 1e9) + self.send_s(self.typical_cut_send, p)
    }

    pub(crate) fn send_s(&self, bytes_per_sample: u64, p: &ProviderSpec) -> f64 {
        bytes_per_sample as f64 * self.mb / (p.bandwidth_mbps * 1e6 / 8.0)
    }

    // The bounds below prune the DPs without changing their results: they use the
    // same formulas as `compute_s` and `transfer_s` on smaller inputs, and rounding
    // is monotone, so they never exceed a time those functions return.

    /// No stage on `p` is faster than this.
    pub(crate) fn stage_floor_s(&self, p: &ProviderSpec) -> f64 {
        stage_time(
            self.min_node_flops * self.mb / (p.gflops * 1e9),
            self.send_s(self.min_stage_send, p),
        )
    }

    /// No stage ending at `j` on `p` spends less than this on transfer.
    pub(crate) fn transfer_floor_s(&self, j: usize, p: &ProviderSpec) -> f64 {
        self.send_s(self.min_send_before[j] + self.cut_send[j], p)
    }

    pub(crate) fn rates(&self, p: &ProviderSpec) -> Rates {
        Rates {
            per_flop: self.mb / (p.gflops * 1e9),
            per_byte: self.mb / (p.bandwidth_mbps * 1e6 / 8.0),
        }
    }

    /// Whether a stage ending at `j` might take at most `v`. A screen run for every
    /// (provider, end) pair before the exact checks, so it multiplies where the
    /// cost functions divide; the slack covers the few ulps that changes, so it
    /// only answers false when the exact floor (compute of the last node plus
    /// [`Self::transfer_floor_s`]) is above `v` too.
    pub(crate) fn may_end_within(&self, r: &Rates, j: usize, v: f64) -> bool {
        stage_time(
            r.per_flop * self.last_flops[j],
            r.per_byte * self.least_send[j],
        ) <= v * (1.0 + 1e-9)
    }
}

/// A stage's time per micro-batch: the slower of its compute and its
/// transfers, which overlap. A provider sends micro-batch m's outputs (and
/// receives m+1's inputs) while it computes, and the server relays on its
/// own, so in a running pipeline the slower of the two sets the pace. (Adding
/// them, as this planner once did, made a 3.7 Gbit/s loopback link look
/// slower than the convolutions and kept whole CNNs on one stage.)
pub(crate) fn stage_time(compute_s: f64, transfer_s: f64) -> f64 {
    compute_s.max(transfer_s)
}

/// A provider's seconds per FLOP and per byte at the micro-batch size.
pub(crate) struct Rates {
    per_flop: f64,
    per_byte: f64,
}

/// A tensor live across cuts `from..=to` (cut c sits before node position c).
pub(crate) struct Crossing {
    pub(crate) name: String,
    pub(crate) from: usize,
    pub(crate) to: usize,
    pub(crate) bytes: u64,
    dtype: DType,
    /// Whether it depends on a graph input, so has the batch in front. A
    /// tensor made from parameters alone (a position embedding's rows) has
    /// no batch dimension, and the wire carries only batched tensors.
    per_sample: bool,
}

/// What a cut costs when a tensor without a batch dimension would cross it:
/// far more than any real transfer, so a plan never cuts there while it has
/// another choice.
const UNSENDABLE_BYTES: u64 = 1 << 40;

pub(crate) fn crossing_tensors(a: &Analysis, g: &Graph) -> Vec<Crossing> {
    let n = a.nodes.len();
    let mut last_use = std::collections::HashMap::<&str, usize>::new();
    for (p, nd) in a.nodes.iter().enumerate() {
        for t in &g.nodes[nd.index].inputs {
            let e = last_use.entry(t.as_str()).or_insert(p);
            *e = (*e).max(p);
        }
    }
    for o in &g.outputs {
        // Outputs must reach the end of the chain, where the loss is computed.
        last_use.insert(o.as_str(), n);
    }
    // Tensors that depend on a graph input; nodes are in topological order.
    let mut batched: std::collections::HashSet<&str> =
        g.inputs.iter().map(|i| i.name.as_str()).collect();
    for nd in &a.nodes {
        let node = &g.nodes[nd.index];
        if node.inputs.iter().any(|i| batched.contains(i.as_str())) {
            batched.insert(nd.name.as_str());
        }
    }
    let mut out = Vec::new();
    let produced = g.inputs.iter().map(|i| (i.name.as_str(), 0usize)).chain(
        a.nodes
            .iter()
            .enumerate()
            .map(|(p, nd)| (nd.name.as_str(), p + 1)),
    );
    for (name, from) in produced {
        let Some(&to) = last_use.get(name) else {
            continue;
        };
        if to < from {
            continue;
        }
        if let Some(t) = a.tensors.get(name) {
            out.push(Crossing {
                name: name.to_string(),
                from,
                to,
                bytes: t.bytes(),
                dtype: t.dtype,
                per_sample: batched.contains(name),
            });
        }
    }
    out
}

/// Scratch bytes node `pos` needs beside its tensors at the micro-batch
/// size: a wide 3x3 convolution's Winograd transforms, as our kernels run
/// it (an upper bound for libtorch, whose own workspace it stands for).
fn scratch_bytes(a: &Analysis, g: &Graph, pos: usize, micro_batch: usize) -> u64 {
    let node = &g.nodes[a.nodes[pos].index];
    let shape = |at: usize| {
        node.inputs
            .get(at)
            .and_then(|name| a.tensors.get(name))
            .map(|t| t.shape.clone())
    };
    let (Some(mut x), Some(w)) = (shape(0), shape(1)) else {
        return 0;
    };
    if let Some(n) = x.first_mut() {
        *n = micro_batch;
    }
    node.op
        .conv_geometry(&x, &w, node.inputs.len() > 2)
        .map_or(0, |conv| Winograd::scratch_bytes(&conv))
}

/// Bytes of the largest tensor node `pos` (in topological order) reads or
/// writes at the micro-batch size: its parameters, its inputs and its output.
/// Activations are scaled from the example batch the analysis used.
fn largest_tensor_bytes(a: &Analysis, g: &Graph, pos: usize, micro_batch: usize) -> u64 {
    let info = &a.nodes[pos];
    let params: BTreeSet<&str> = info.params.iter().map(String::as_str).collect();
    let scaled = |name: &str| {
        a.tensors.get(name).map_or(0, |t| {
            if params.contains(name) || t.shape.first() != Some(&a.batch) {
                t.bytes()
            } else {
                (t.bytes() / a.batch.max(1) as u64).saturating_mul(micro_batch as u64)
            }
        })
    };
    g.nodes[info.index]
        .inputs
        .iter()
        .map(|t| scaled(t))
        .chain(std::iter::once(scaled(&info.name)))
        .max()
        .unwrap_or(0)
}

/// Range maximum in O(1) after O(n log n) set-up (a sparse table): the DPs
/// ask for the largest tensor of a stage in their innermost loops.
pub(crate) struct RangeMax {
    /// `levels[k][i]`: the maximum of `values[i..i + 2^k]`.
    levels: Vec<Vec<u64>>,
}

impl RangeMax {
    pub(crate) fn new(values: Vec<u64>) -> Self {
        let n = values.len();
        let mut levels = vec![values];
        let mut half = 1;
        while half * 2 <= n {
            let prev = levels.last().expect("level 0 exists");
            let next = (0..=n - half * 2)
                .map(|i| prev[i].max(prev[i + half]))
                .collect();
            levels.push(next);
            half *= 2;
        }
        Self { levels }
    }

    /// The maximum of `[i, j)`; 0 for an empty range.
    pub(crate) fn max(&self, i: usize, j: usize) -> u64 {
        if j <= i {
            return 0;
        }
        let k = (usize::BITS - 1 - (j - i).leading_zeros()) as usize;
        let level = &self.levels[k];
        level[i].max(level[j - (1 << k)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_kernels::conv::Conv2d;
    use rookery_model::from_toml;

    const WIDE: &str = r#"
input_shape = [32, 12, 12]
[[layers]]
type = "Conv2D"
filters = 48
kernel_size = 3
padding = 1
[[layers]]
type = "Flatten"
[[layers]]
type = "Dense"
units = 10
"#;

    #[test]
    fn a_stage_with_a_wide_convolution_holds_its_winograd_scratch() {
        let g = from_toml(WIDE).unwrap();
        let a = g.analyze().unwrap();
        let o = PlanOptions {
            micro_batch: 8,
            ..PlanOptions::default()
        };
        let costs = Costs::new(&a, &g, &o);
        let conv =
            Conv2d::new([8, 32, 12, 12], 48, [3, 3], [1, 1], [1, 1], [1, 1], 1, true).unwrap();
        let scratch = Winograd::scratch_bytes(&conv);
        assert!(scratch > 0);
        assert_eq!(costs.scratch[costs.n], scratch);
        let without = (costs.train[costs.n] * costs.state_factor)
            + costs.buffer[costs.n]
            + (costs.act[costs.n] + costs.cut_hold[0]) * costs.act_factor;
        assert_eq!(costs.mem(0, costs.n), without + scratch);
        // The demo CNN's convolutions are too narrow: no scratch.
        let demo = from_toml(include_str!("../../../examples/mnist-cnn.toml")).unwrap();
        let demo_costs = Costs::new(&demo.analyze().unwrap(), &demo, &o);
        assert_eq!(demo_costs.scratch[demo_costs.n], 0);
    }
}
