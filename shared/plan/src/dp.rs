//! The dynamic programmes over (node prefix, provider prefix) that cut the
//! topological order into stages for one ordering of providers, and the
//! orderings they are run over.

use std::cmp::Ordering;

use crate::cost::{Costs, stage_time};
use crate::types::ProviderSpec;

/// Group sizes up to which every provider ordering is tried (5! = 120 orderings).
pub const EXACT_PERMUTATIONS_UP_TO: usize = 5;

pub(crate) const INF: f64 = f64::INFINITY;

/// A cluster's stages as `(first node, end node, provider index)`.
pub(crate) type Stages = Vec<(usize, usize, usize)>;

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
pub(crate) enum Want {
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
pub(crate) fn bottleneck_dp(
    c: &Costs,
    provs: &[ProviderSpec],
    ord: &[usize],
    bound: f64,
    want: Want,
) -> f64 {
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
pub(crate) fn min_sum_dp(
    c: &Costs,
    provs: &[ProviderSpec],
    ord: &[usize],
    cap: f64,
) -> Option<Stages> {
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

/// Cuts the whole order into one non-empty stage per provider of `ord`, in
/// order, minimising the slowest stage: `best[k][j]` is the best bottleneck
/// of nodes `[0, j)` on the first `k` providers.
pub(crate) fn exact_chain(
    c: &Costs,
    provs: &[ProviderSpec],
    ord: &[usize],
) -> Option<(f64, Stages)> {
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

/// Provider orderings the DP tries for a group.
pub(crate) fn orderings(provs: &[ProviderSpec], group: &[usize]) -> Vec<Vec<usize>> {
    if group.len() <= EXACT_PERMUTATIONS_UP_TO {
        let mut all = Vec::new();
        permutations(&mut group.to_vec(), 0, &mut all);
        return all;
    }
    // Fastest (or roomiest) first, the other as tie-break, then the index.
    let speed = |a: usize, b: usize| provs[b].gflops.total_cmp(&provs[a].gflops);
    let memory = |a: usize, b: usize| provs[b].memory_bytes.cmp(&provs[a].memory_bytes);
    let sorted = |first: &dyn Fn(usize, usize) -> Ordering,
                  second: &dyn Fn(usize, usize) -> Ordering| {
        let mut v = group.to_vec();
        v.sort_by(|&a, &b| first(a, b).then(second(a, b)).then(a.cmp(&b)));
        v
    };
    let by_speed = sorted(&speed, &memory);
    let by_mem = sorted(&memory, &speed);
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
