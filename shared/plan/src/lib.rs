//! The planner (`clusterize`): cuts a graph's topological order into pipeline
//! stages over donated providers, and groups providers into data-parallel
//! clusters.
//!
//! Cost model, per micro-batch of `b` samples and stage = nodes `[i, j)`:
//! - compute: (forward + backward FLOPs + a memory-traffic charge per output
//!   byte, [`MEMORY_FLOPS_PER_OUTPUT_BYTE`], + the CPU cost of the bytes
//!   crossing the stage's cuts, [`WIRE_FLOPS_PER_BYTE`]) * b / provider
//!   FLOP/s (backward is 2x forward unless an op says otherwise, so usually
//!   3x forward);
//! - transfer: the tensors crossing the stage's two cuts, activations forward and
//!   their gradients back (the graph inputs only forward, the outputs stay on the
//!   Leaf for the loss), over the provider's link;
//! - memory: trainable bytes * (1 weights + 1 gradients + optimizer copies) +
//!   buffers + in-flight micro-batches * b * (activations + incoming tensors).
//!
//! Time is the larger of compute and transfer ([`stage_time`]): a pipeline
//! sends one micro-batch while it computes the next. The objective is the slowest stage's time. For one ordering of
//! providers a dynamic programme over (node prefix, provider prefix) finds the
//! exact optimum among plans whose stages use providers in that order (providers
//! may be skipped); a second pass then minimises the summed stage time under that
//! bottleneck, which drops stages that do not help and leaves more standbys. With
//! up to [`EXACT_PERMUTATIONS_UP_TO`] providers every ordering is tried, so small
//! plans are exact; above that a few orderings (by speed and by memory, each way).
//!
//! Speed (the `bench_plan` example plans a 200-node model over 1,000 providers
//! well within 100 ms) comes from pruning that never changes a result: lower
//! bounds on a stage's time (its last node's compute plus the least it can send)
//! skip providers and stage ends that cannot beat the best plan so far, a plan
//! over an ordering's quickest providers bounds that ordering's DP up front, and
//! the inner loops jump over starts no plan reaches. [`ClusterCount::Auto`]
//! searches cluster counts with a feasibility check that stops at the first plan
//! under the limit, and plans only the count it picks in full.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use rookery_model::{Analysis, ClusterCount, DType, Graph};
pub use rookery_proto::ProviderKind;

mod error;
mod synthetic;

pub use error::PlanError;
pub use synthetic::{synthetic_chain, synthetic_providers};

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

/// Group sizes up to which every provider ordering is tried (5! = 120 orderings).
pub const EXACT_PERMUTATIONS_UP_TO: usize = 5;

/// What a provider reported about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProviderSpec {
    pub id: String,
    pub kind: ProviderKind,
    pub memory_bytes: u64,
    /// Sustained GFLOP/s from the provider's benchmark.
    pub gflops: f64,
    /// Link bandwidth to the server, Mbit/s.
    pub bandwidth_mbps: f64,
    /// Largest single buffer the provider's device can bind (a WebGPU
    /// adapter's `maxStorageBufferBindingSize`, capped by `maxBufferSize`):
    /// every parameter and every activation of a stage placed on it must fit.
    /// `None` for libtorch providers, whose tensors are bounded by memory only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_buffer_bytes: Option<u64>,
}

/// Planner knobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanOptions {
    pub micro_batch: usize,
    pub clusters: ClusterCount,
    /// Extra parameter-sized copies the optimizer keeps (Adam: 2, SGD momentum: 1).
    pub optimizer_copies: u32,
    /// Micro-batches whose activations a stage holds at once (the sync schedule
    /// holds all M of a step; 1F1B far fewer).
    pub in_flight_micro_batches: u32,
    /// For [`ClusterCount::Auto`].
    pub auto_factor: f64,
    /// When set, every cluster is a chain of exactly this many stages, each on
    /// its own provider (the cuts still minimise the slowest stage). For
    /// Requesters who want a deep pipeline even where the cost model would
    /// keep a model on fewer providers, e.g. to spread memory or to test.
    #[serde(default)]
    pub stages_per_cluster: Option<usize>,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            micro_batch: 8,
            clusters: ClusterCount::Fixed(1),
            optimizer_copies: 2,
            in_flight_micro_batches: 1,
            auto_factor: 2.0,
            stages_per_cluster: None,
        }
    }
}

/// A stage's position in its cluster's chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StageRole {
    /// Receives the inputs.
    Root,
    Stem,
    /// Computes the loss.
    Leaf,
    /// Both Root and Leaf: the whole model on one provider.
    Single,
}

/// A tensor crossing a cut between stages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BoundaryTensor {
    pub name: String,
    /// Shape for one micro-batch (the batch dimension set to the micro-batch size).
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub bytes_per_micro_batch: u64,
}

/// A contiguous range of the topological order run by one provider.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stage {
    pub role: StageRole,
    pub provider: String,
    pub provider_kind: ProviderKind,
    pub provider_memory_bytes: u64,
    /// Positions `first..end` in [`Analysis::nodes`].
    pub first: usize,
    pub end: usize,
    pub nodes: Vec<String>,
    /// Parameters and buffers the stage owns (its optimizer steps them).
    pub params: Vec<String>,
    /// Tensors crossing the cut before the stage (for the Root: the graph inputs).
    pub inputs: Vec<BoundaryTensor>,
    /// Tensors crossing the cut after the stage (for the Leaf: the graph outputs, kept for the loss).
    pub outputs: Vec<BoundaryTensor>,
    pub memory_bytes: u64,
    pub compute_s: f64,
    pub transfer_s: f64,
    pub time_s: f64,
}

/// One pipeline: Root, Stem..., Leaf.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    pub stages: Vec<Stage>,
    /// The slowest stage's time per micro-batch, seconds.
    pub bottleneck_s: f64,
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub options: PlanOptions,
    pub clusters: Vec<Cluster>,
    /// Providers in no stage, ready to replace one that leaves.
    pub standbys: Vec<String>,
    pub node_count: usize,
    pub param_bytes: u64,
}

impl Plan {
    pub fn bottleneck_s(&self) -> f64 {
        self.clusters
            .iter()
            .map(|c| c.bottleneck_s)
            .fold(0.0, f64::max)
    }

    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(self)
    }
}

/// Per-stage cost lookups in O(1), from prefix sums over the topological order.
struct Costs {
    n: usize,
    train: Vec<u64>,
    buffer: Vec<u64>,
    act: Vec<u64>,
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
    /// `last_flops[j]`: FLOPs of node `j - 1`, the least a stage ending at `j` computes.
    last_flops: Vec<f64>,
    /// `least_send[j]`: the least bytes a stage ending at `j` sends, as f64.
    least_send: Vec<f64>,
    mb: f64,
    state_factor: u64,
    act_factor: u64,
    /// Each node's largest single tensor at the micro-batch size, for
    /// providers with a buffer limit.
    largest: RangeMax,
}

impl Costs {
    fn new(a: &Analysis, g: &Graph, o: &PlanOptions) -> Self {
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
                let both_ways = c > 0 && c < n && t.dtype == DType::F32;
                *send += per_sample * if both_ways { 2 } else { 1 };
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
            flops,
            cut_hold,
            cut_send,
            min_send_before,
            min_node_flops,
            min_stage_send,
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
    fn fits(&self, i: usize, j: usize, p: &ProviderSpec) -> bool {
        self.mem(i, j) <= p.memory_bytes && self.within_buffer_limit(i, j, p)
    }

    /// The part of [`Self::fits`] that can only fail more often as the stage
    /// grows: a DP loop that finds it false may stop.
    fn fits_monotone(&self, i: usize, j: usize, p: &ProviderSpec) -> bool {
        self.mem_monotone(i, j) <= p.memory_bytes && self.within_buffer_limit(i, j, p)
    }

    fn within_buffer_limit(&self, i: usize, j: usize, p: &ProviderSpec) -> bool {
        p.max_buffer_bytes
            .is_none_or(|limit| self.largest.max(i, j) <= limit)
    }

    /// Memory that only grows as the stage grows (prunes the DP's inner loop).
    fn mem_monotone(&self, i: usize, j: usize) -> u64 {
        (self.train[j] - self.train[i]) * self.state_factor
            + (self.buffer[j] - self.buffer[i])
            + (self.act[j] - self.act[i]) * self.act_factor
    }

    fn mem(&self, i: usize, j: usize) -> u64 {
        self.mem_monotone(i, j) + self.cut_hold[i] * self.act_factor
    }

    fn compute_s(&self, i: usize, j: usize, p: &ProviderSpec) -> f64 {
        let wire = WIRE_FLOPS_PER_BYTE * (self.cut_send[i] + self.cut_send[j]) as f64;
        (self.flops[j] - self.flops[i] + wire) * self.mb / (p.gflops * 1e9)
    }

    fn transfer_s(&self, i: usize, j: usize, p: &ProviderSpec) -> f64 {
        self.send_s(self.cut_send[i] + self.cut_send[j], p)
    }

    fn send_s(&self, bytes_per_sample: u64, p: &ProviderSpec) -> f64 {
        bytes_per_sample as f64 * self.mb / (p.bandwidth_mbps * 1e6 / 8.0)
    }

    // The bounds below prune the DPs without changing their results: they use the
    // same formulas as `compute_s` and `transfer_s` on smaller inputs, and rounding
    // is monotone, so they never exceed a time those functions return.

    /// No stage on `p` is faster than this.
    fn stage_floor_s(&self, p: &ProviderSpec) -> f64 {
        stage_time(
            self.min_node_flops * self.mb / (p.gflops * 1e9),
            self.send_s(self.min_stage_send, p),
        )
    }

    /// No stage ending at `j` on `p` spends less than this on transfer.
    fn transfer_floor_s(&self, j: usize, p: &ProviderSpec) -> f64 {
        self.send_s(self.min_send_before[j] + self.cut_send[j], p)
    }

    fn rates(&self, p: &ProviderSpec) -> Rates {
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
    fn may_end_within(&self, r: &Rates, j: usize, v: f64) -> bool {
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
fn stage_time(compute_s: f64, transfer_s: f64) -> f64 {
    compute_s.max(transfer_s)
}

/// A provider's seconds per FLOP and per byte at the micro-batch size.
struct Rates {
    per_flop: f64,
    per_byte: f64,
}

/// A tensor live across cuts `from..=to` (cut c sits before node position c).
struct Crossing {
    name: String,
    from: usize,
    to: usize,
    bytes: u64,
    dtype: DType,
}

fn crossing_tensors(a: &Analysis, g: &Graph) -> Vec<Crossing> {
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
            });
        }
    }
    out
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
struct RangeMax {
    /// `levels[k][i]`: the maximum of `values[i..i + 2^k]`.
    levels: Vec<Vec<u64>>,
}

impl RangeMax {
    fn new(values: Vec<u64>) -> Self {
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
    fn max(&self, i: usize, j: usize) -> u64 {
        if j <= i {
            return 0;
        }
        let k = (usize::BITS - 1 - (j - i).leading_zeros()) as usize;
        let level = &self.levels[k];
        level[i].max(level[j - (1 << k)])
    }
}

const INF: f64 = f64::INFINITY;

/// A cluster's stages as `(first node, end node, provider index)`.
type Stages = Vec<(usize, usize, usize)>;

/// The cuts a DP row reaches (value below a limit), so inner loops can jump
/// from one to the next nearer the start. Skipping the others changes nothing:
/// they would only be passed over, and the loops' early exits (memory, compute)
/// only grow towards the start, so an exit at a skipped cut fires at the next
/// reached one too.
struct Starts {
    /// `nearest[c]`: one more than the nearest reached cut at or before `c`; 0 if none.
    nearest: Vec<usize>,
}

impl Starts {
    fn new(row: &[f64], limit: f64) -> Self {
        let mut s = Starts {
            nearest: vec![0; row.len()],
        };
        s.update(row, limit);
        s
    }

    fn update(&mut self, row: &[f64], limit: f64) {
        let mut last = 0;
        for (c, (slot, &v)) in self.nearest.iter_mut().zip(row).enumerate() {
            if v < limit {
                last = c + 1;
            }
            *slot = last;
        }
    }

    /// Reached cuts before `j`, nearest first.
    fn below(&self, j: usize) -> impl Iterator<Item = usize> + '_ {
        let nearest = |c: usize| self.nearest[c].checked_sub(1);
        std::iter::successors(nearest(j - 1), move |&i| i.checked_sub(1).and_then(nearest))
    }
}

/// What [`bottleneck_dp`] is asked for.
#[derive(Clone, Copy, PartialEq)]
enum Want {
    /// The best bottleneck.
    Best,
    /// Only whether some plan beats the bound: stops at the first one found.
    AnyBelow,
}

/// Best bottleneck over plans using providers `ord` in that order. Only values
/// below `bound` are searched (a known plan already achieves it, so this prunes
/// most of the inner loop); anything else comes back as >= `bound`. With
/// [`Want::AnyBelow`] the answer is some plan's bottleneck below `bound`, not
/// necessarily the best, or >= `bound` when there is none.
fn bottleneck_dp(c: &Costs, provs: &[ProviderSpec], ord: &[usize], bound: f64, want: Want) -> f64 {
    let n = c.n;
    let mut prev = vec![bound; n + 1];
    prev[0] = 0.0;
    let mut cur = prev.clone();
    let mut starts = Starts::new(&prev, bound);
    let mut ends = Vec::with_capacity(n);
    for &pi in ord {
        let p = &provs[pi];
        // Every slot is below `bound`, so a provider with no stage faster than it
        // changes nothing; most of a large group is skipped here.
        if c.stage_floor_s(p) >= bound {
            continue;
        }
        // Most providers that pass can still improve no slot (prefixes are
        // already covered faster than their quickest stage there): skip those
        // slots, and the row when none is left.
        let r = c.rates(p);
        ends.clear();
        ends.extend((1..=n).filter(|&j| c.may_end_within(&r, j, prev[j])));
        if ends.is_empty() {
            continue;
        }
        // Skipping this provider keeps the previous row's value.
        cur.copy_from_slice(&prev);
        for &j in &ends {
            let mut best = prev[j];
            let floor = c.transfer_floor_s(j, p);
            for i in starts.below(j) {
                if !c.fits_monotone(i, j, p) {
                    break;
                }
                // Starting earlier only adds compute, and no start sends less
                // than `floor`: nothing further down can beat `best`.
                let comp = c.compute_s(i, j, p);
                if stage_time(comp, floor) >= best {
                    break;
                }
                if prev[i] >= best || !c.fits(i, j, p) {
                    continue;
                }
                let v = prev[i].max(stage_time(comp, c.transfer_s(i, j, p)));
                if v < best {
                    best = v;
                }
            }
            cur[j] = best;
        }
        std::mem::swap(&mut prev, &mut cur);
        if want == Want::AnyBelow && prev[n] < bound {
            break;
        }
        starts.update(&prev, bound);
    }
    prev[n]
}

/// Stages `(first, end, provider)` minimising summed time with every stage <= `cap`.
fn min_sum_dp(c: &Costs, provs: &[ProviderSpec], ord: &[usize], cap: f64) -> Option<Stages> {
    let n = c.n;
    // A provider with no stage within the cap would only add a row of skips.
    let ord: Vec<usize> = ord
        .iter()
        .copied()
        .filter(|&pi| c.stage_floor_s(&provs[pi]) <= cap)
        .collect();
    let m = ord.len();
    let mut g = vec![INF; (m + 1) * (n + 1)];
    // choice = start + 1 of the stage ending at j on provider k-1; 0 = provider skipped.
    let mut choice = vec![0u32; (m + 1) * (n + 1)];
    let at = |k: usize, j: usize| k * (n + 1) + j;
    for k in 0..=m {
        g[at(k, 0)] = 0.0;
    }
    let mut starts = Starts::new(&g[..=n], INF);
    for k in 1..=m {
        let p = &provs[ord[k - 1]];
        let r = c.rates(p);
        starts.update(&g[at(k - 1, 0)..=at(k - 1, n)], INF);
        for j in 1..=n {
            let mut best = g[at(k - 1, j)];
            let mut ch = 0u32;
            // Sums only grow, so a stage that beats `best` takes less than it.
            if !c.may_end_within(&r, j, cap.min(best)) {
                g[at(k, j)] = best;
                continue;
            }
            let floor = c.transfer_floor_s(j, p);
            for i in starts.below(j) {
                if !c.fits_monotone(i, j, p) {
                    break;
                }
                let comp = c.compute_s(i, j, p);
                let least = stage_time(comp, floor);
                if least > cap || least >= best {
                    break;
                }
                let before = g[at(k - 1, i)];
                if before == INF || !c.fits(i, j, p) {
                    continue;
                }
                let t = stage_time(comp, c.transfer_s(i, j, p));
                if t <= cap && before + t < best {
                    best = before + t;
                    ch = i as u32 + 1;
                }
            }
            g[at(k, j)] = best;
            choice[at(k, j)] = ch;
        }
    }
    if g[at(m, n)] == INF {
        return None;
    }
    let (mut k, mut j) = (m, n);
    let mut stages = Vec::new();
    while j > 0 {
        let ch = choice[at(k, j)];
        if ch > 0 {
            let i = ch as usize - 1;
            stages.push((i, j, ord[k - 1]));
            j = i;
        }
        k -= 1;
    }
    stages.reverse();
    Some(stages)
}

/// Provider orderings the DP tries for a group.
fn orderings(provs: &[ProviderSpec], group: &[usize]) -> Vec<Vec<usize>> {
    if group.len() <= EXACT_PERMUTATIONS_UP_TO {
        let mut all = Vec::new();
        permutations(&mut group.to_vec(), 0, &mut all);
        return all;
    }
    let mut by_speed = group.to_vec();
    by_speed.sort_by(|&a, &b| {
        provs[b]
            .gflops
            .total_cmp(&provs[a].gflops)
            .then(provs[b].memory_bytes.cmp(&provs[a].memory_bytes))
            .then(a.cmp(&b))
    });
    let mut by_mem = group.to_vec();
    by_mem.sort_by(|&a, &b| {
        provs[b]
            .memory_bytes
            .cmp(&provs[a].memory_bytes)
            .then(provs[b].gflops.total_cmp(&provs[a].gflops))
            .then(a.cmp(&b))
    });
    let rev = |v: &Vec<usize>| v.iter().rev().copied().collect::<Vec<_>>();
    vec![rev(&by_speed), rev(&by_mem), by_speed, by_mem]
}

fn permutations(v: &mut Vec<usize>, k: usize, out: &mut Vec<Vec<usize>>) {
    if k == v.len() {
        out.push(v.clone());
        return;
    }
    for i in k..v.len() {
        v.swap(k, i);
        permutations(v, k + 1, out);
        v.swap(k, i);
    }
}

/// The best plan for one group of providers, or None when nothing fits.
/// Only plans with a bottleneck of at most `limit` count.
fn plan_group(
    c: &Costs,
    provs: &[ProviderSpec],
    group: &[usize],
    limit: f64,
) -> Option<(f64, Stages)> {
    let mut best: Option<(f64, Vec<usize>)> = None;
    let mut bound = search_bound(limit);
    let all = orderings(provs, group);
    if let Some(first) = all.first() {
        // The DP prunes by its bound, and a loose one is slow (all of a large
        // group takes part): bound the first ordering by a plan of its own, from
        // the subsequence of its quickest providers. The ordering's optimum is at
        // most that plan and so below the new bound: the DP still finds it.
        let quick = quick_subsequence(c, provs, first);
        if quick.len() < first.len() {
            let ub = bottleneck_dp(c, provs, &quick, bound, Want::Best);
            let above = ub * (1.0 + 1e-12);
            if above > ub && above < bound {
                bound = above;
            }
        }
    }
    for ord in all {
        let t = bottleneck_dp(c, provs, &ord, bound, Want::Best);
        if t < bound {
            bound = t;
            best = Some((t, ord));
        }
    }
    let (t, ord) = best?;
    // A relative slack so rounding in the second pass cannot lose the optimum.
    let stages = min_sum_dp(c, provs, &ord, t * (1.0 + 1e-9) + 1e-15)?;
    Some((t, stages))
}

/// How many providers [`quick_subsequence`] keeps.
const QUICK_PROVIDERS: usize = 64;

/// The [`QUICK_PROVIDERS`] providers of `ord` with the fastest possible stage,
/// in `ord`'s order.
fn quick_subsequence(c: &Costs, provs: &[ProviderSpec], ord: &[usize]) -> Vec<usize> {
    if ord.len() <= QUICK_PROVIDERS {
        return ord.to_vec();
    }
    let floors: Vec<f64> = ord.iter().map(|&pi| c.stage_floor_s(&provs[pi])).collect();
    let mut by_floor: Vec<usize> = (0..ord.len()).collect();
    by_floor.select_nth_unstable_by(QUICK_PROVIDERS - 1, |&a, &b| {
        floors[a].total_cmp(&floors[b])
    });
    let mut keep = vec![false; ord.len()];
    for &k in &by_floor[..QUICK_PROVIDERS] {
        keep[k] = true;
    }
    ord.iter()
        .zip(keep)
        .filter_map(|(&pi, k)| k.then_some(pi))
        .collect()
}

/// Whether [`plan_group`] would find a plan, without finding the best one.
fn group_fits(c: &Costs, provs: &[ProviderSpec], group: &[usize], limit: f64) -> bool {
    let bound = search_bound(limit);
    orderings(provs, group)
        .iter()
        .any(|ord| bottleneck_dp(c, provs, ord, bound, Want::AnyBelow) < bound)
}

/// The DP bound for a bottleneck limit: just above it, so a plan exactly at the
/// limit still counts.
fn search_bound(limit: f64) -> f64 {
    if limit < INF {
        limit * (1.0 + 1e-12)
    } else {
        INF
    }
}

/// Deals providers (sorted by speed, fastest first) into `k` groups in snake order,
/// so groups get similar total speed.
fn deal(provs: &[ProviderSpec], k: usize, by_memory: bool) -> Vec<Vec<usize>> {
    let mut idx: Vec<usize> = (0..provs.len()).collect();
    idx.sort_by(|&a, &b| {
        let (pa, pb) = (&provs[a], &provs[b]);
        let primary = if by_memory {
            pb.memory_bytes.cmp(&pa.memory_bytes)
        } else {
            pb.gflops.total_cmp(&pa.gflops)
        };
        primary.then(pa.id.cmp(&pb.id))
    });
    let mut groups = vec![Vec::new(); k];
    for (r, p) in idx.into_iter().enumerate() {
        let round = r / k;
        let pos = r % k;
        let g = if round.is_multiple_of(2) {
            pos
        } else {
            k - 1 - pos
        };
        groups[g].push(p);
    }
    groups
}

type GroupPlans = Vec<(f64, Stages)>;

/// Whether [`plan_clusters`] would succeed (the same deals, in the same order),
/// without planning the groups in full.
fn clusters_fit(c: &Costs, provs: &[ProviderSpec], k: usize, limit: f64) -> bool {
    [false, true].into_iter().any(|by_memory| {
        deal(provs, k, by_memory)
            .iter()
            .all(|g| group_fits(c, provs, g, limit))
    })
}

/// Plans `k` clusters, trying a speed-balanced deal first and a memory-balanced one second.
/// On failure returns the index and members of the first group (of the
/// speed-balanced deal) that nothing fits.
fn plan_clusters(
    c: &Costs,
    provs: &[ProviderSpec],
    k: usize,
    limit: f64,
) -> Result<GroupPlans, (usize, Vec<usize>)> {
    let mut failed = None;
    for by_memory in [false, true] {
        let groups = deal(provs, k, by_memory);
        let mut plans = Vec::with_capacity(k);
        for (gi, g) in groups.iter().enumerate() {
            match plan_group(c, provs, g, limit) {
                Some(p) => plans.push(p),
                None => {
                    failed.get_or_insert_with(|| (gi, g.clone()));
                    break;
                }
            }
        }
        if plans.len() == k {
            return Ok(plans);
        }
    }
    Err(failed.unwrap_or_default())
}

/// Cuts `graph` into pipeline stages over `providers`; see the module docs for the cost model.
pub fn clusterize(
    graph: &Graph,
    providers: &[ProviderSpec],
    options: &PlanOptions,
) -> Result<Plan, PlanError> {
    let analysis = graph.analyze()?;
    validate(providers, options)?;
    let c = Costs::new(&analysis, graph, options);
    let k = match options.clusters {
        ClusterCount::Fixed(k) => {
            if k > providers.len() {
                return Err(PlanError::TooManyClusters {
                    requested: k,
                    providers: providers.len(),
                });
            }
            k
        }
        ClusterCount::Auto => 0,
    };
    if let Some(stages) = options.stages_per_cluster {
        let plans = fixed_stage_clusters(&c, &analysis, providers, options, stages)?;
        return Ok(assemble(&c, &analysis, graph, providers, options, plans));
    }
    let plans = if k > 0 {
        plan_clusters(&c, providers, k, INF)
            .map_err(|(ci, g)| diagnose(&c, &analysis, providers, &g, ci))?
    } else {
        auto_clusters(&c, providers, options.auto_factor)
            .map_err(|(ci, g)| diagnose(&c, &analysis, providers, &g, ci))?
    };
    Ok(assemble(&c, &analysis, graph, providers, options, plans))
}

/// [`PlanOptions::stages_per_cluster`]: clusters of exactly `stages` providers
/// (as many as fit, or the fixed count), each cut by an exact DP over every
/// provider ordering (up to [`EXACT_PERMUTATIONS_UP_TO`] providers; beyond,
/// the orderings [`orderings`] tries) into `stages` non-empty stages.
fn fixed_stage_clusters(
    c: &Costs,
    a: &Analysis,
    provs: &[ProviderSpec],
    options: &PlanOptions,
    stages: usize,
) -> Result<GroupPlans, PlanError> {
    if stages == 0 || stages > c.n {
        return Err(PlanError::Options(format!(
            "{stages} stages per cluster: the model has {} nodes, so it takes 1 to {} stages",
            c.n, c.n
        )));
    }
    let k = match options.clusters {
        ClusterCount::Fixed(k) => k,
        ClusterCount::Auto => provs.len() / stages,
    };
    if k == 0 || k * stages > provs.len() {
        return Err(PlanError::Options(format!(
            "{} cluster(s) of {stages} stages need {} providers, only {} are available",
            k.max(1),
            k.max(1) * stages,
            provs.len()
        )));
    }
    // The k * stages fastest providers, dealt so clusters are balanced.
    let mut idx: Vec<usize> = (0..provs.len()).collect();
    idx.sort_by(|&x, &y| provs[y].gflops.total_cmp(&provs[x].gflops).then(x.cmp(&y)));
    idx.truncate(k * stages);
    let chosen: Vec<ProviderSpec> = idx.iter().map(|&i| provs[i].clone()).collect();
    let groups = deal(&chosen, k, false);
    let mut plans = Vec::with_capacity(k);
    for (gi, group) in groups.iter().enumerate() {
        let group: Vec<usize> = group.iter().map(|&g| idx[g]).collect();
        let best = orderings(provs, &group)
            .into_iter()
            .filter_map(|ord| exact_chain(c, provs, &ord))
            .min_by(|x, y| x.0.total_cmp(&y.0));
        match best {
            Some(plan) => plans.push(plan),
            None => return Err(diagnose(c, a, provs, &group, gi)),
        }
    }
    Ok(plans)
}

/// Cuts the whole order into one non-empty stage per provider of `ord`, in
/// order, minimising the slowest stage: `best[k][j]` is the best bottleneck
/// of nodes `[0, j)` on the first `k` providers.
fn exact_chain(c: &Costs, provs: &[ProviderSpec], ord: &[usize]) -> Option<(f64, Stages)> {
    let (n, m) = (c.n, ord.len());
    let mut best = vec![vec![INF; n + 1]; m + 1];
    let mut from = vec![vec![0usize; n + 1]; m + 1];
    best[0][0] = 0.0;
    for k in 1..=m {
        let p = &provs[ord[k - 1]];
        for j in k..=n {
            for i in (k - 1)..j {
                if best[k - 1][i] == INF || !c.fits(i, j, p) {
                    continue;
                }
                let t = best[k - 1][i].max(stage_time(c.compute_s(i, j, p), c.transfer_s(i, j, p)));
                if t < best[k][j] {
                    best[k][j] = t;
                    from[k][j] = i;
                }
            }
        }
    }
    if best[m][n] == INF {
        return None;
    }
    let mut stages = Vec::with_capacity(m);
    let mut j = n;
    for k in (1..=m).rev() {
        let i = from[k][j];
        stages.push((i, j, ord[k - 1]));
        j = i;
    }
    stages.reverse();
    Some((best[m][n], stages))
}

fn validate(providers: &[ProviderSpec], o: &PlanOptions) -> Result<(), PlanError> {
    if providers.is_empty() {
        return Err(PlanError::NoProviders);
    }
    if o.micro_batch == 0 || o.in_flight_micro_batches == 0 {
        return Err(PlanError::Options(
            "micro_batch and in_flight_micro_batches must be >= 1".into(),
        ));
    }
    if o.clusters == ClusterCount::Fixed(0) {
        return Err(PlanError::Options("cluster count must be >= 1".into()));
    }
    if o.auto_factor.is_nan() || o.auto_factor < 1.0 {
        return Err(PlanError::Options(format!(
            "auto_factor {} must be >= 1",
            o.auto_factor
        )));
    }
    let mut ids = BTreeSet::new();
    for p in providers {
        let reason = if !(p.gflops > 0.0 && p.gflops.is_finite()) {
            "gflops must be a positive number"
        } else if !(p.bandwidth_mbps > 0.0 && p.bandwidth_mbps.is_finite()) {
            "bandwidth_mbps must be a positive number"
        } else if !ids.insert(p.id.as_str()) {
            "duplicate provider id"
        } else {
            continue;
        };
        return Err(PlanError::Provider {
            id: p.id.clone(),
            reason: reason.into(),
        });
    }
    Ok(())
}

/// Largest cluster count whose bottleneck stays within `factor` of the best single
/// cluster. Searches by doubling then bisection, assuming more clusters never make
/// the bottleneck better (each gets fewer providers). The search only asks whether
/// a count fits; the chosen count alone is planned in full.
fn auto_clusters(
    c: &Costs,
    provs: &[ProviderSpec],
    factor: f64,
) -> Result<GroupPlans, (usize, Vec<usize>)> {
    let single = plan_clusters(c, provs, 1, INF)?;
    let limit = single[0].0 * factor;
    let fits = |k: usize| clusters_fit(c, provs, k, limit);
    let mut good = 1;
    let mut bad = provs.len() + 1;
    let mut k = 2;
    while k < bad {
        if fits(k) {
            good = k;
            k = (k * 2).min(provs.len() + 1);
        } else {
            bad = k;
        }
    }
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if fits(mid) {
            good = mid;
        } else {
            bad = mid;
        }
    }
    if good == 1 {
        return Ok(single);
    }
    // The fit check and the full plan agree, so the fallback is never taken.
    Ok(plan_clusters(c, provs, good, limit).unwrap_or(single))
}

/// Explains why nothing fits a group: a node too large for any provider, or how
/// much memory one more provider would need to bring.
fn diagnose(
    c: &Costs,
    a: &Analysis,
    provs: &[ProviderSpec],
    group: &[usize],
    cluster: usize,
) -> PlanError {
    let micro_batch = c.mb as usize;
    let Some(largest) = group
        .iter()
        .map(|&i| &provs[i])
        .max_by_key(|p| p.memory_bytes)
    else {
        return PlanError::NoProviders;
    };
    for i in 0..c.n {
        let need = c.mem(i, i + 1);
        if need > largest.memory_bytes {
            return PlanError::NodeTooLarge {
                node: a.nodes[i].name.clone(),
                op: a.nodes[i].op.clone(),
                micro_batch,
                needed: need,
                provider: largest.id.clone(),
                available: largest.memory_bytes,
                missing: need - largest.memory_bytes,
            };
        }
    }
    // Browsers bind each tensor as one buffer: a node whose largest tensor no
    // provider of the group can bind fits nowhere, however much memory is free.
    let roomiest = group
        .iter()
        .map(|&i| &provs[i])
        .max_by_key(|p| p.max_buffer_bytes.unwrap_or(u64::MAX));
    if let Some(roomiest) = roomiest
        && let Some(limit) = roomiest.max_buffer_bytes
    {
        for i in 0..c.n {
            let needed = c.largest.max(i, i + 1);
            if needed > limit {
                return PlanError::BufferTooLarge {
                    node: a.nodes[i].name.clone(),
                    op: a.nodes[i].op.clone(),
                    micro_batch,
                    needed,
                    provider: roomiest.id.clone(),
                    limit,
                };
            }
        }
    }
    let needed = c.mem(0, c.n);
    let available: u64 = group.iter().map(|&i| provs[i].memory_bytes).sum();
    // Smallest memory of one extra provider (as fast as the group's fastest) that
    // makes a plan fit; the whole model always fits on a provider with `needed`.
    let fastest = group
        .iter()
        .map(|&i| &provs[i])
        .fold((1.0f64, 1.0f64), |(g, b), p| {
            (g.max(p.gflops), b.max(p.bandwidth_mbps))
        });
    let mut extended: Vec<ProviderSpec> = group.iter().map(|&i| provs[i].clone()).collect();
    extended.push(ProviderSpec {
        id: String::new(),
        kind: ProviderKind::Native,
        memory_bytes: 0,
        gflops: fastest.0,
        bandwidth_mbps: fastest.1,
        max_buffer_bytes: None,
    });
    let members: Vec<usize> = (0..extended.len()).collect();
    let last = extended.len() - 1;
    let fits = |mem: u64, ext: &mut Vec<ProviderSpec>| {
        ext[last].memory_bytes = mem;
        orderings(ext, &members)
            .iter()
            .any(|o| bottleneck_dp(c, ext, o, INF, Want::AnyBelow) < INF)
    };
    let (mut lo, mut hi) = (0u64, needed);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid, &mut extended) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    PlanError::NoFit {
        cluster,
        micro_batch,
        needed,
        providers: group.len(),
        available,
        missing: hi,
    }
}

fn assemble(
    c: &Costs,
    a: &Analysis,
    g: &Graph,
    provs: &[ProviderSpec],
    options: &PlanOptions,
    plans: GroupPlans,
) -> Plan {
    let crossings = crossing_tensors(a, g);
    let mb = options.micro_batch;
    let boundary = |cut: usize| -> Vec<BoundaryTensor> {
        crossings
            .iter()
            .filter(|t| t.from <= cut && cut <= t.to)
            .filter_map(|t| {
                let info = a.tensors.get(&t.name)?;
                let mut shape = info.shape.clone();
                if shape.first() == Some(&a.batch) {
                    shape[0] = mb;
                }
                Some(BoundaryTensor {
                    name: t.name.clone(),
                    shape,
                    dtype: info.dtype,
                    bytes_per_micro_batch: t.bytes.div_ceil(a.batch as u64) * mb as u64,
                })
            })
            .collect()
    };
    let mut used = BTreeSet::new();
    let clusters = plans
        .into_iter()
        .map(|(bottleneck_s, stages)| {
            let count = stages.len();
            let stages = stages
                .into_iter()
                .enumerate()
                .map(|(s, (i, j, pi))| {
                    let p = &provs[pi];
                    used.insert(pi);
                    let role = match (s == 0, s + 1 == count) {
                        (true, true) => StageRole::Single,
                        (true, false) => StageRole::Root,
                        (false, true) => StageRole::Leaf,
                        (false, false) => StageRole::Stem,
                    };
                    let mut params = Vec::new();
                    for nd in &a.nodes[i..j] {
                        for name in &nd.params {
                            if !params.contains(name) {
                                params.push(name.clone());
                            }
                        }
                    }
                    let compute_s = c.compute_s(i, j, p);
                    let transfer_s = c.transfer_s(i, j, p);
                    Stage {
                        role,
                        provider: p.id.clone(),
                        provider_kind: p.kind,
                        provider_memory_bytes: p.memory_bytes,
                        first: i,
                        end: j,
                        nodes: a.nodes[i..j].iter().map(|n| n.name.clone()).collect(),
                        params,
                        inputs: boundary(i),
                        outputs: boundary(j),
                        memory_bytes: c.mem(i, j),
                        compute_s,
                        transfer_s,
                        time_s: stage_time(compute_s, transfer_s),
                    }
                })
                .collect();
            Cluster {
                stages,
                bottleneck_s,
            }
        })
        .collect();
    Plan {
        options: options.clone(),
        clusters,
        standbys: (0..provs.len())
            .filter(|i| !used.contains(i))
            .map(|i| provs[i].id.clone())
            .collect(),
        node_count: a.nodes.len(),
        param_bytes: a.total_param_bytes(),
    }
}

/// Human-readable units.
fn bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn ms(s: f64) -> String {
    format!("{:.3}", s * 1e3)
}

fn names(ts: &[BoundaryTensor]) -> String {
    if ts.is_empty() {
        return "-".into();
    }
    ts.iter()
        .map(|t| t.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A table per cluster: one row per stage.
pub fn render(plan: &Plan) -> String {
    let mut out = String::new();
    let o = &plan.options;
    let _ = writeln!(
        out,
        "Plan: {} cluster(s), {} nodes, {} of parameters, micro-batch {}, {} in flight, optimizer copies {}; bottleneck {} ms/micro-batch",
        plan.clusters.len(),
        plan.node_count,
        bytes(plan.param_bytes),
        o.micro_batch,
        o.in_flight_micro_batches,
        o.optimizer_copies,
        ms(plan.bottleneck_s()),
    );
    let header = [
        "#",
        "role",
        "provider",
        "kind",
        "nodes",
        "params",
        "memory used/avail",
        "compute ms",
        "transfer ms",
        "total ms",
        "in",
        "out",
    ];
    for (ci, cl) in plan.clusters.iter().enumerate() {
        let _ = writeln!(
            out,
            "\nCluster {ci}: {} stage(s), bottleneck {} ms",
            cl.stages.len(),
            ms(cl.bottleneck_s)
        );
        let rows: Vec<Vec<String>> = cl
            .stages
            .iter()
            .enumerate()
            .map(|(si, s)| {
                let span = match s.nodes.as_slice() {
                    [one] => format!("{one} [{}]", s.first),
                    [first, .., last] => format!("{first}..{last} [{}..{}]", s.first, s.end - 1),
                    [] => "-".into(),
                };
                vec![
                    si.to_string(),
                    format!("{:?}", s.role),
                    s.provider.clone(),
                    format!("{:?}", s.provider_kind).to_lowercase(),
                    span,
                    s.params.len().to_string(),
                    format!(
                        "{} / {}",
                        bytes(s.memory_bytes),
                        bytes(s.provider_memory_bytes)
                    ),
                    ms(s.compute_s),
                    ms(s.transfer_s),
                    ms(s.time_s),
                    names(&s.inputs),
                    names(&s.outputs),
                ]
            })
            .collect();
        let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
        for r in &rows {
            for (w, cell) in widths.iter_mut().zip(r) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |cells: Vec<&str>| {
            let mut l = String::from(" ");
            for (w, cell) in widths.iter().zip(cells) {
                let _ = write!(l, " {cell:<w$} |");
            }
            l.pop();
            l.trim_end().to_string()
        };
        let _ = writeln!(out, "{}", line(header.to_vec()));
        let _ = writeln!(
            out,
            "{}",
            line(
                widths
                    .iter()
                    .map(|&w| "-".repeat(w))
                    .collect::<Vec<_>>()
                    .iter()
                    .map(String::as_str)
                    .collect()
            )
        );
        for r in &rows {
            let _ = writeln!(out, "{}", line(r.iter().map(String::as_str).collect()));
        }
    }
    let _ = writeln!(
        out,
        "\nStandbys ({}): {}",
        plan.standbys.len(),
        if plan.standbys.is_empty() {
            "-".to_string()
        } else {
            plan.standbys.join(", ")
        }
    );
    out
}
