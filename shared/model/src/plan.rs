//! The planner (`clusterize`): cuts a graph's topological order into pipeline
//! stages over donated providers, and groups providers into data-parallel
//! clusters.
//!
//! Cost model, per micro-batch of `b` samples and stage = nodes `[i, j)`:
//! - compute: (forward + backward FLOPs) * b / provider FLOP/s (backward is 2x
//!   forward unless an op says otherwise, so usually 3x forward);
//! - transfer: the tensors crossing the stage's two cuts, activations forward and
//!   their gradients back (the graph inputs only forward, the outputs stay on the
//!   Leaf for the loss), over the provider's link;
//! - memory: trainable bytes * (1 weights + 1 gradients + optimizer copies) +
//!   buffers + in-flight micro-batches * b * (activations + incoming tensors).
//!
//! Time is compute + transfer (no overlap assumed, so the estimate is
//! conservative). The objective is the slowest stage's time. For one ordering of
//! providers a dynamic programme over (node prefix, provider prefix) finds the
//! exact optimum among plans whose stages use providers in that order (providers
//! may be skipped); a second pass then minimises the summed stage time under that
//! bottleneck, which drops stages that do not help and leaves more standbys. With
//! up to [`EXACT_PERMUTATIONS_UP_TO`] providers every ordering is tried, so small
//! plans are exact; above that a few orderings (by speed and by memory, each way).

use std::collections::BTreeSet;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::error::PlanError;
use crate::graph::{Analysis, DType, Graph};

/// Group sizes up to which every provider ordering is tried (5! = 120 orderings).
pub const EXACT_PERMUTATIONS_UP_TO: usize = 5;

/// Where a provider runs; browsers usually report less memory and speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    Native,
    Browser,
}

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
}

/// How many data-parallel clusters to form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClusterCount {
    Fixed(usize),
    /// As many as possible whose bottleneck stays within `auto_factor` of the best single cluster.
    Auto,
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
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            micro_batch: 8,
            clusters: ClusterCount::Fixed(1),
            optimizer_copies: 2,
            in_flight_micro_batches: 1,
            auto_factor: 2.0,
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
    mb: f64,
    state_factor: u64,
    act_factor: u64,
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
            flops[i + 1] =
                flops[i] + (nd.forward_flops_per_sample + nd.backward_flops_per_sample) as f64;
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
        Costs {
            n,
            train,
            buffer,
            act,
            flops,
            cut_hold,
            cut_send,
            mb: o.micro_batch as f64,
            state_factor: 2 + u64::from(o.optimizer_copies),
            act_factor: o.micro_batch as u64 * u64::from(o.in_flight_micro_batches),
        }
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
        (self.flops[j] - self.flops[i]) * self.mb / (p.gflops * 1e9)
    }

    fn transfer_s(&self, i: usize, j: usize, p: &ProviderSpec) -> f64 {
        (self.cut_send[i] + self.cut_send[j]) as f64 * self.mb / (p.bandwidth_mbps * 1e6 / 8.0)
    }
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

const INF: f64 = f64::INFINITY;

/// A cluster's stages as `(first node, end node, provider index)`.
type Stages = Vec<(usize, usize, usize)>;

/// Best bottleneck over plans using providers `ord` in that order. Only values
/// below `bound` are searched (a known plan already achieves it, so this prunes
/// most of the inner loop); anything else comes back as >= `bound`.
fn bottleneck_dp(c: &Costs, provs: &[ProviderSpec], ord: &[usize], bound: f64) -> f64 {
    let n = c.n;
    let mut prev = vec![bound; n + 1];
    prev[0] = 0.0;
    let mut cur = prev.clone();
    for &pi in ord {
        let p = &provs[pi];
        // Skipping this provider keeps the previous row's value.
        cur.copy_from_slice(&prev);
        for (j, slot) in cur.iter_mut().enumerate().skip(1) {
            let mut best = *slot;
            for i in (0..j).rev() {
                if c.mem_monotone(i, j) > p.memory_bytes {
                    break;
                }
                let comp = c.compute_s(i, j, p);
                if comp >= best {
                    break;
                }
                if prev[i] >= best || c.mem(i, j) > p.memory_bytes {
                    continue;
                }
                let v = prev[i].max(comp + c.transfer_s(i, j, p));
                if v < best {
                    best = v;
                }
            }
            *slot = best;
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[n]
}

/// Stages `(first, end, provider)` minimising summed time with every stage <= `cap`.
fn min_sum_dp(c: &Costs, provs: &[ProviderSpec], ord: &[usize], cap: f64) -> Option<Stages> {
    let n = c.n;
    let m = ord.len();
    let mut g = vec![INF; (m + 1) * (n + 1)];
    // choice = start + 1 of the stage ending at j on provider k-1; 0 = provider skipped.
    let mut choice = vec![0u32; (m + 1) * (n + 1)];
    let at = |k: usize, j: usize| k * (n + 1) + j;
    for k in 0..=m {
        g[at(k, 0)] = 0.0;
    }
    for k in 1..=m {
        let p = &provs[ord[k - 1]];
        for j in 1..=n {
            let mut best = g[at(k - 1, j)];
            let mut ch = 0u32;
            for i in (0..j).rev() {
                if c.mem_monotone(i, j) > p.memory_bytes {
                    break;
                }
                let comp = c.compute_s(i, j, p);
                if comp > cap {
                    break;
                }
                let before = g[at(k - 1, i)];
                if before == INF || c.mem(i, j) > p.memory_bytes {
                    continue;
                }
                let t = comp + c.transfer_s(i, j, p);
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
    // Just above the limit so a plan exactly at it still counts.
    let mut bound = if limit < INF {
        limit * (1.0 + 1e-12)
    } else {
        INF
    };
    for ord in orderings(provs, group) {
        let t = bottleneck_dp(c, provs, &ord, bound);
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
    let plans = if k > 0 {
        plan_clusters(&c, providers, k, INF)
            .map_err(|(ci, g)| diagnose(&c, &analysis, providers, &g, ci))?
    } else {
        auto_clusters(&c, providers, options.auto_factor)
            .map_err(|(ci, g)| diagnose(&c, &analysis, providers, &g, ci))?
    };
    Ok(assemble(&c, &analysis, graph, providers, options, plans))
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
/// the bottleneck better (each gets fewer providers).
fn auto_clusters(
    c: &Costs,
    provs: &[ProviderSpec],
    factor: f64,
) -> Result<GroupPlans, (usize, Vec<usize>)> {
    let single = plan_clusters(c, provs, 1, INF)?;
    let limit = single[0].0 * factor;
    let try_k = |k: usize| plan_clusters(c, provs, k, limit).ok();
    let (mut good, mut good_plans) = (1, single);
    let mut bad = provs.len() + 1;
    let mut k = 2;
    while k < bad {
        match try_k(k) {
            Some(p) => {
                good = k;
                good_plans = p;
                k = (k * 2).min(provs.len() + 1);
            }
            None => bad = k,
        }
    }
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        match try_k(mid) {
            Some(p) => {
                good = mid;
                good_plans = p;
            }
            None => bad = mid,
        }
    }
    Ok(good_plans)
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
    });
    let members: Vec<usize> = (0..extended.len()).collect();
    let last = extended.len() - 1;
    let fits = |mem: u64, ext: &mut Vec<ProviderSpec>| {
        ext[last].memory_bytes = mem;
        orderings(ext, &members)
            .iter()
            .any(|o| bottleneck_dp(c, ext, o, INF) < INF)
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
                        time_s: compute_s + transfer_s,
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
