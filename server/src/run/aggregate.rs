//! Combining the clusters' copies of a parameter at a sync, and spotting the
//! cluster whose copy is far from the others'.
//!
//! The mean is exact (what parity with one process needs) but a single lying
//! cluster moves it anywhere. The coordinate-wise median and CenteredClip
//! (Karimireddy, He and Jaggi, "Learning from History for Byzantine Robust
//! Optimization", 2021) bound what one cluster out of three or more can do:
//! the median ignores it, CenteredClip lets it pull by at most the clip
//! radius (the honest clusters' own spread) divided by the cluster count per
//! iteration.
//!
//! A sync's combining is [`AggregateWork`]: everything it needs, moved out
//! of the run, so that the server runs it on a blocking thread and the
//! coordinator goes on answering other jobs and providers meanwhile.

use std::collections::{BTreeMap, BTreeSet};

use rookery_job::{Aggregation, OuterOptimizer};
use rookery_model::DType;
use rookery_proto::{Bytes, ParamOptimState, WireDType, WireTensor};

use super::{f32_bytes, on_wire, param_bytes};

/// One sync's uploads, to combine into the parameters' new values.
#[derive(Debug)]
pub struct AggregateWork {
    /// Which sync of the run this is (see [`super::JobRun::on_aggregated`]).
    pub(super) round: u64,
    pub(super) step_done: u64,
    pub(super) rule: Aggregation,
    pub(super) clusters: usize,
    /// Name -> (cluster, its copy), in the order they arrived.
    pub(super) uploads: BTreeMap<String, Vec<(usize, WireTensor)>>,
    /// Each parameter's dtype in the graph.
    pub(super) dtypes: BTreeMap<String, DType>,
    /// Each cluster's optimizer state by parameter, to combine too (jobs
    /// with `average_optimizer`); empty otherwise.
    pub(super) optimizer: Vec<BTreeMap<String, ParamOptimState>>,
    /// DiLoCo's outer step, applied to the combined parameters.
    pub(super) outer: Option<OuterWork>,
    /// Each float parameter's value at the last sync, which int8 uploads
    /// (`[training.sync] compress = "int8"`) are changes from; empty
    /// otherwise. Shares the run's buffers.
    pub(super) bases: BTreeMap<String, WireTensor>,
    /// The parameters to keep each cluster's own copy of (the job's last
    /// sync with several clusters); `None` keeps none.
    pub(super) keep_copies: Option<BTreeSet<String>>,
}

/// What DiLoCo's outer step needs: the optimizer, each trainable
/// parameter's value at the last sync (the pseudo-gradient is taken from
/// it) and its momentum buffer (none before the first outer step), both
/// sharing the run's buffers.
#[derive(Debug)]
pub struct OuterWork {
    pub(super) optimizer: OuterOptimizer,
    pub(super) previous: BTreeMap<String, WireTensor>,
    pub(super) momentum: BTreeMap<String, WireTensor>,
}

impl OuterWork {
    /// The synced value of parameter `name` given the clusters' combined
    /// one, and its new momentum buffer: with the pseudo-gradient
    /// `g = previous - combined`, `torch.optim.SGD` keeps `buf = g` at its
    /// first step and `buf = momentum * buf + g` after, and steps by
    /// `lr * (g + momentum * buf)` with Nesterov, `lr * buf` without (`lr *
    /// g` without momentum). Each element in f64, rounded to f32 once.
    pub fn step(&self, name: &str, combined: Vec<f32>) -> (Vec<f32>, Option<WireTensor>) {
        let Some((shape, previous)) = self
            .previous
            .get(name)
            .and_then(|t| Some((t.shape_usize(), t.to_f32().ok()?)))
            .filter(|(_, p)| p.len() == combined.len())
        else {
            return (combined, None);
        };
        let OuterOptimizer {
            lr,
            momentum,
            nesterov,
        } = self.optimizer;
        let buffer = self
            .momentum
            .get(name)
            .and_then(|b| b.to_f32().ok())
            .filter(|b| b.len() == combined.len());
        let mut next = Vec::with_capacity(if momentum > 0.0 { combined.len() } else { 0 });
        let stepped = previous
            .iter()
            .zip(&combined)
            .enumerate()
            .map(|(i, (&before, &now))| {
                let g = f64::from(before) - f64::from(now);
                let d = if momentum > 0.0 {
                    let buf = match &buffer {
                        Some(b) => momentum * f64::from(b[i]) + g,
                        None => g,
                    };
                    next.push(buf as f32);
                    if nesterov { g + momentum * buf } else { buf }
                } else {
                    g
                };
                (f64::from(before) - lr * d) as f32
            })
            .collect();
        let next =
            (momentum > 0.0).then(|| WireTensor::from_f32(name, &shape, &next, WireDType::F32));
        (stepped, next)
    }
}

/// What [`AggregateWork::run`] found.
#[derive(Debug)]
pub struct Aggregated {
    pub(super) round: u64,
    pub(super) step_done: u64,
    /// Each parameter's new value as it travels.
    pub(super) params: BTreeMap<String, Bytes>,
    /// Each cluster's squared distance to the aggregate and the aggregate's
    /// squared norm, over every float parameter (robust rules only): to spot
    /// a far-off cluster.
    pub(super) squared_distances: Vec<f64>,
    pub(super) squared_norm: f64,
    /// The combined optimizer state of each parameter every cluster has
    /// state for (`average_optimizer`); empty otherwise.
    pub(super) optimizer: BTreeMap<String, ParamOptimState>,
    /// Each parameter's outer momentum buffer after this sync's outer step
    /// (DiLoCo with momentum); empty otherwise.
    pub(super) outer_momentum: BTreeMap<String, WireTensor>,
    /// Each cluster's own copy of the kept parameters (see
    /// [`AggregateWork::keep_copies`]), as f32 values.
    pub(super) cluster_copies: Vec<Vec<WireTensor>>,
}

impl AggregateWork {
    /// Combines the copies (blocking work: it reads every uploaded value).
    /// One cluster's copy is taken as it is, without a copy where it came as
    /// it travels: every rule gives a single copy back unchanged.
    pub fn run(mut self) -> Aggregated {
        self.uploads = resolve_changes(std::mem::take(&mut self.uploads), &self.bases);
        let cluster_copies = match &self.keep_copies {
            Some(names) => {
                let mut copies = vec![Vec::new(); self.clusters];
                let kept = self.uploads.iter().filter(|(n, _)| names.contains(*n));
                for (c, t) in kept.flat_map(|(_, uploaded)| uploaded) {
                    copies[*c].push(t.clone());
                }
                copies
            }
            None => Vec::new(),
        };
        let mut squared_distances = vec![0.0f64; self.clusters];
        let mut squared_norm = 0.0f64;
        let mut params = BTreeMap::new();
        let mut outer_momentum = BTreeMap::new();
        // An outer step that is plain averaging is skipped: it would only
        // round the average through a difference.
        let outer = self
            .outer
            .as_ref()
            .filter(|o| !o.optimizer.is_plain_average());
        for (name, copies) in self.uploads {
            let Some(&dtype) = self.dtypes.get(&name) else {
                continue;
            };
            let wire = on_wire(dtype, WireDType::F32);
            let stepped = dtype == DType::F32 && outer.is_some();
            let data = match dtype {
                DType::F32 if copies.len() > 1 || stepped => {
                    // Each copy was checked (size, finiteness) as it arrived.
                    let values: Vec<(usize, Vec<f32>)> = copies
                        .iter()
                        .map(|(c, t)| (*c, t.to_f32().unwrap_or_default()))
                        .collect();
                    let slices: Vec<&[f32]> = values.iter().map(|(_, v)| v.as_slice()).collect();
                    let value = aggregate(self.rule, &slices);
                    if self.rule != Aggregation::Mean {
                        for (c, copy) in &values {
                            squared_distances[*c] += distance(copy, &value).powi(2);
                        }
                        squared_norm += value.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>();
                    }
                    let value = match outer {
                        Some(o) => {
                            let (value, momentum) = o.step(&name, value);
                            if let Some(m) = momentum {
                                outer_momentum.insert(name.clone(), m);
                            }
                            value
                        }
                        None => value,
                    };
                    f32_bytes(value)
                }
                // Counters (BatchNorm's num_batches_tracked) agree across
                // clusters; and one copy is the aggregate of itself.
                _ => match copies.into_iter().next() {
                    Some((_, t)) if t.dtype == wire => t.data,
                    Some((_, t)) => param_bytes(dtype, t.to_f32().unwrap_or_default()),
                    None => continue,
                },
            };
            params.insert(name, data);
        }
        Aggregated {
            round: self.round,
            step_done: self.step_done,
            params,
            squared_distances,
            squared_norm,
            optimizer: combine_optimizer_states(self.rule, &self.optimizer),
            outer_momentum,
            cluster_copies,
        }
    }
}

/// The uploads with every int8 change replaced by the value it stands for:
/// its parameter's value at the last sync plus the change, in f32 (the sum
/// the stage's next base is made of too). Each upload was checked as it
/// came (shape, dtype, scales), and the base is the run's own.
fn resolve_changes(
    uploads: BTreeMap<String, Vec<(usize, WireTensor)>>,
    bases: &BTreeMap<String, WireTensor>,
) -> BTreeMap<String, Vec<(usize, WireTensor)>> {
    uploads
        .into_iter()
        .map(|(name, copies)| {
            let base = bases.get(&name).and_then(|b| b.to_f32().ok());
            let copies = copies
                .into_iter()
                .map(|(c, t)| match &base {
                    Some(base) if t.dtype.is_quantized() => {
                        let change = t.to_f32().unwrap_or_default();
                        let value: Vec<f32> =
                            base.iter().zip(&change).map(|(b, d)| b + d).collect();
                        let shape = t.shape_usize();
                        (
                            c,
                            WireTensor::from_f32(&t.name, &shape, &value, WireDType::F32),
                        )
                    }
                    _ => (c, t),
                })
                .collect();
            (name, copies)
        })
        .collect()
}

/// The clusters' optimizer states combined slot by slot with the job's rule
/// (so a lying cluster moves its moments no further than its parameters).
/// A parameter is combined only where every cluster holds state for it with
/// the same slots; its step count is the largest (they agree when every
/// cluster stepped it alike).
fn combine_optimizer_states(
    rule: Aggregation,
    clusters: &[BTreeMap<String, ParamOptimState>],
) -> BTreeMap<String, ParamOptimState> {
    let Some((first, rest)) = clusters.split_first() else {
        return BTreeMap::new();
    };
    let mut combined = BTreeMap::new();
    for (name, state) in first {
        let copies: Vec<&ParamOptimState> = std::iter::once(state)
            .chain(rest.iter().filter_map(|c| c.get(name)))
            .collect();
        let same_slots = |s: &&ParamOptimState| {
            s.slots.len() == state.slots.len()
                && s.slots.iter().zip(&state.slots).all(|(a, b)| {
                    a.name == b.name && a.shape == b.shape && a.dtype == WireDType::F32
                })
        };
        if copies.len() != clusters.len() || !copies.iter().all(same_slots) {
            continue;
        }
        // Each slot was checked against its parameter's shape as it came.
        let slots: Option<Vec<WireTensor>> = state
            .slots
            .iter()
            .enumerate()
            .map(|(i, slot)| {
                let values: Vec<Vec<f32>> = copies
                    .iter()
                    .map(|s| s.slots[i].to_f32().ok())
                    .collect::<Option<_>>()?;
                let len = values.first().map_or(0, Vec::len);
                if values.iter().any(|v| v.len() != len) {
                    return None;
                }
                let slices: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
                let value = aggregate(rule, &slices);
                Some(WireTensor::from_f32(
                    &slot.name,
                    &slot.shape_usize(),
                    &value,
                    WireDType::F32,
                ))
            })
            .collect();
        let Some(slots) = slots else {
            continue;
        };
        combined.insert(
            name.clone(),
            ParamOptimState {
                name: name.clone(),
                steps: copies.iter().map(|s| s.steps).max().unwrap_or(0),
                slots,
            },
        );
    }
    combined
}

/// CenteredClip's iterations from the median; each moves the centre by at
/// most the radius.
const CLIP_ITERATIONS: usize = 3;
/// A cluster is far off when its distance to the aggregate is more than this
/// many times the clusters' median distance...
pub const FAR_FACTOR: f64 = 10.0;
/// ... and more than this fraction of the aggregate's norm (so that clusters
/// which barely differ, like identical copies, never count as far).
pub const FAR_FLOOR: f64 = 1e-2;

/// One value per coordinate from `copies` (one slice per cluster, all of the
/// same length).
pub fn aggregate(rule: Aggregation, copies: &[&[f32]]) -> Vec<f32> {
    match rule {
        Aggregation::Mean => mean(copies),
        Aggregation::Median => median(copies),
        Aggregation::CenteredClip => centered_clip(copies),
    }
}

pub fn mean(copies: &[&[f32]]) -> Vec<f32> {
    let Some(first) = copies.first() else {
        return Vec::new();
    };
    let n = copies.len() as f64;
    (0..first.len())
        .map(|i| (copies.iter().map(|c| f64::from(c[i])).sum::<f64>() / n) as f32)
        .collect()
}

/// The coordinate-wise median; with an even count, the mean of the middle two.
pub fn median(copies: &[&[f32]]) -> Vec<f32> {
    let Some(first) = copies.first() else {
        return Vec::new();
    };
    let n = copies.len();
    let mut column = Vec::with_capacity(n);
    (0..first.len())
        .map(|i| {
            column.clear();
            column.extend(copies.iter().map(|c| c[i]));
            column.sort_by(f32::total_cmp);
            if n % 2 == 1 {
                column[n / 2]
            } else {
                ((f64::from(column[n / 2 - 1]) + f64::from(column[n / 2])) / 2.0) as f32
            }
        })
        .collect()
}

/// CenteredClip from the median, with the radius set to the median of the
/// clusters' distances to the median: honest clusters sit inside it, a far
/// one is clipped to it.
pub fn centered_clip(copies: &[&[f32]]) -> Vec<f32> {
    if copies.len() < 3 {
        return mean(copies);
    }
    let mut centre: Vec<f64> = median(copies).into_iter().map(f64::from).collect();
    let as_f32 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    let radius = median_of(
        copies
            .iter()
            .map(|c| distance(c, &as_f32(&centre)))
            .collect(),
    );
    let n = copies.len() as f64;
    for _ in 0..CLIP_ITERATIONS {
        let mut step = vec![0.0f64; centre.len()];
        for copy in copies {
            let d = distance(copy, &as_f32(&centre));
            let scale = if d > radius { radius / d } else { 1.0 };
            for (s, (&x, &c)) in step.iter_mut().zip(copy.iter().zip(&centre)) {
                *s += (f64::from(x) - c) * scale;
            }
        }
        for (c, s) in centre.iter_mut().zip(step) {
            *c += s / n;
        }
    }
    as_f32(&centre)
}

/// Euclidean distance between two equally long vectors, in f64.
pub fn distance(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum::<f64>()
        .sqrt()
}

fn median_of(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The clusters far from the aggregate, given each cluster's squared
/// distance to it (summed over every parameter) and the aggregate's squared
/// norm. Needs at least 3 clusters: with two, neither is "the other ones".
pub fn far_off(squared_distances: &[f64], squared_norm: f64) -> Vec<usize> {
    if squared_distances.len() < 3 {
        return Vec::new();
    }
    let d: Vec<f64> = squared_distances.iter().map(|x| x.sqrt()).collect();
    let typical = median_of(d.clone());
    let floor = FAR_FLOOR * squared_norm.sqrt();
    d.iter()
        .enumerate()
        .filter(|&(_, &x)| x > FAR_FACTOR * typical && x > floor)
        .map(|(c, _)| c)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` honest copies spread by `spread` around 1.0 (deterministic), plus
    /// optionally one planted copy at `outlier`.
    fn copies(n: usize, len: usize, spread: f32, outlier: Option<f32>) -> Vec<Vec<f32>> {
        let mut all: Vec<Vec<f32>> = (0..n)
            .map(|c| {
                (0..len)
                    .map(|i| 1.0 + spread * (((c * 7 + i * 3) % 5) as f32 - 2.0) / 2.0)
                    .collect()
            })
            .collect();
        if let Some(v) = outlier {
            all.push(vec![v; len]);
        }
        all
    }

    fn refs(v: &[Vec<f32>]) -> Vec<&[f32]> {
        v.iter().map(Vec::as_slice).collect()
    }

    #[test]
    fn every_rule_agrees_on_identical_copies_and_the_mean_is_exact() {
        let same = vec![vec![0.5f32, -2.0, 3.25]; 4];
        for rule in [
            Aggregation::Mean,
            Aggregation::Median,
            Aggregation::CenteredClip,
        ] {
            assert_eq!(aggregate(rule, &refs(&same)), same[0], "{rule:?}");
        }
        let two = [vec![1.0f32, 2.0], vec![3.0, 6.0]];
        assert_eq!(aggregate(Aggregation::Mean, &refs(&two)), vec![2.0, 4.0]);
        assert_eq!(median(&refs(&[vec![3.0], vec![1.0], vec![2.0]])), vec![2.0]);
        assert_eq!(median(&refs(&[vec![4.0], vec![1.0]])), vec![2.5]);
    }

    #[test]
    fn one_planted_outlier_among_three_or_more_moves_robust_rules_little_and_the_mean_far() {
        // (honest clusters, planted value): the robust result must stay within
        // the honest clusters' spread of their mean; the mean must not.
        for (honest, planted) in [(2, 1e6f32), (3, -1e4), (4, 1e3), (7, -5e5)] {
            let spread = 0.1;
            let all = copies(honest, 64, spread, Some(planted));
            let honest_mean = mean(&refs(&all[..honest]));
            for rule in [Aggregation::Median, Aggregation::CenteredClip] {
                let got = aggregate(rule, &refs(&all));
                let worst = got
                    .iter()
                    .zip(&honest_mean)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    worst <= spread,
                    "{rule:?}, {honest} honest + {planted}: off by {worst}"
                );
            }
            let plain = aggregate(Aggregation::Mean, &refs(&all));
            assert!(
                (plain[0] - honest_mean[0]).abs() > 100.0,
                "the plain mean is dragged: {}",
                plain[0]
            );
        }
    }

    #[test]
    fn centered_clip_with_no_outlier_stays_near_the_mean() {
        let all = copies(5, 32, 0.2, None);
        let got = centered_clip(&refs(&all));
        let want = mean(&refs(&all));
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 0.1, "{g} vs {w}");
        }
    }

    #[test]
    fn only_a_cluster_far_beyond_the_others_spread_is_far_off() {
        let norm2 = 100.0;
        // (squared distances, far-off clusters)
        let cases: [(&[f64], &[usize]); 5] = [
            (&[0.01, 0.02, 1e4], &[2]),
            (&[0.01, 0.02, 0.03, 0.04], &[]),
            (&[4.0, 1e6, 9.0, 1.0, 2.0], &[1]),
            // Two clusters: neither is the odd one out.
            (&[0.0, 1e6], &[]),
            // Identical honest copies: tiny differences are under the floor.
            (&[0.0, 0.0, 1e-6], &[]),
        ];
        for (d, want) in cases {
            assert_eq!(far_off(d, norm2), want, "{d:?}");
        }
    }
}
