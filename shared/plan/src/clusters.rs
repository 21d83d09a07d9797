//! Grouping providers into clusters and picking, per group, the ordering
//! whose plan has the smallest bottleneck: a fixed cluster count, the
//! automatic count, and fixed-depth chains.

use rookery_model::{Analysis, ClusterCount};

use crate::cost::Costs;
use crate::diagnose::diagnose;
use crate::dp::{INF, Stages, Want, bottleneck_dp, exact_chain, min_sum_dp, orderings};
use crate::error::PlanError;
use crate::types::{PlanOptions, ProviderSpec};

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

/// What providers are ranked by before they are dealt into clusters.
#[derive(Debug, Clone, Copy, PartialEq)]
enum DealBy {
    /// Compute and link together ([`Costs::unit_s`]): each cluster gets its
    /// share of quick links as well as of quick devices.
    Speed,
    /// FLOP/s alone.
    Compute,
    Memory,
}

/// The deals tried, in order: the balanced ones first (the better of the
/// two is kept), memory last, for when nothing else fits.
const DEALS: [DealBy; 3] = [DealBy::Speed, DealBy::Compute, DealBy::Memory];

/// Deals providers (ranked fastest or largest first) into `k` groups in
/// snake order, so groups get similar totals.
fn deal(c: &Costs, provs: &[ProviderSpec], k: usize, by: DealBy) -> Vec<Vec<usize>> {
    let mut idx: Vec<usize> = (0..provs.len()).collect();
    let unit_s: Vec<f64> = match by {
        DealBy::Speed => provs.iter().map(|p| c.unit_s(p)).collect(),
        DealBy::Compute | DealBy::Memory => Vec::new(),
    };
    idx.sort_by(|&a, &b| {
        let (pa, pb) = (&provs[a], &provs[b]);
        let primary = match by {
            DealBy::Speed => unit_s[a].total_cmp(&unit_s[b]),
            DealBy::Compute => pb.gflops.total_cmp(&pa.gflops),
            DealBy::Memory => pb.memory_bytes.cmp(&pa.memory_bytes),
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

pub(crate) type GroupPlans = Vec<(f64, Stages)>;

/// The bottleneck of the slowest cluster.
fn slowest(plans: &GroupPlans) -> f64 {
    plans.iter().map(|p| p.0).fold(0.0, f64::max)
}

/// Plans each of `deals` in turn with `plan` and keeps the plans whose
/// slowest cluster is quickest; a memory deal is tried only while no other
/// has fitted. `Err` holds the first deal's failure (`None` only when no
/// deal was tried).
fn best_deal<E>(
    deals: &[DealBy],
    mut plan: impl FnMut(DealBy) -> Result<GroupPlans, E>,
) -> Result<GroupPlans, Option<E>> {
    let mut best: Option<GroupPlans> = None;
    let mut failed = None;
    for &by in deals {
        if by == DealBy::Memory && best.is_some() {
            break;
        }
        match plan(by) {
            Ok(plans) if best.as_ref().is_none_or(|b| slowest(&plans) < slowest(b)) => {
                best = Some(plans);
            }
            Ok(_) => {}
            Err(error) => {
                failed.get_or_insert(error);
            }
        }
    }
    best.ok_or(failed)
}

/// Whether [`plan_clusters`] would succeed (the same deals, in the same order),
/// without planning the groups in full.
fn clusters_fit(c: &Costs, provs: &[ProviderSpec], k: usize, limit: f64) -> bool {
    DEALS.into_iter().any(|by| {
        deal(c, provs, k, by)
            .iter()
            .all(|g| group_fits(c, provs, g, limit))
    })
}

/// Plans `k` clusters over each speed-balanced deal, keeping the one whose
/// slowest cluster is quickest, and over a memory-balanced deal when neither
/// fits. On failure returns the index and members of the first group (of the
/// first deal) that nothing fits.
pub(crate) fn plan_clusters(
    c: &Costs,
    provs: &[ProviderSpec],
    k: usize,
    limit: f64,
) -> Result<GroupPlans, (usize, Vec<usize>)> {
    best_deal(&DEALS, |by| {
        deal(c, provs, k, by)
            .into_iter()
            .enumerate()
            .map(|(gi, g)| plan_group(c, provs, &g, limit).ok_or((gi, g)))
            .collect()
    })
    .map_err(Option::unwrap_or_default)
}

/// Largest cluster count whose bottleneck stays within `factor` of the best single
/// cluster. Searches by doubling then bisection, assuming more clusters never make
/// the bottleneck better (each gets fewer providers). The search only asks whether
/// a count fits; the chosen count alone is planned in full.
pub(crate) fn auto_clusters(
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

/// [`PlanOptions::stages_per_cluster`]: clusters of exactly `stages` providers
/// (as many as fit, or the fixed count), each cut by an exact DP over every
/// provider ordering (up to [`crate::EXACT_PERMUTATIONS_UP_TO`] providers; beyond,
/// the orderings [`orderings`] tries) into `stages` non-empty stages.
pub(crate) fn fixed_stage_clusters(
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
    idx.sort_by(|&x, &y| {
        c.unit_s(&provs[x])
            .total_cmp(&c.unit_s(&provs[y]))
            .then(x.cmp(&y))
    });
    idx.truncate(k * stages);
    let chosen: Vec<ProviderSpec> = idx.iter().map(|&i| provs[i].clone()).collect();
    best_deal(&[DealBy::Speed, DealBy::Compute], |by| {
        deal(c, &chosen, k, by)
            .iter()
            .enumerate()
            .map(|(gi, group)| {
                let group: Vec<usize> = group.iter().map(|&g| idx[g]).collect();
                orderings(provs, &group)
                    .into_iter()
                    .filter_map(|ord| exact_chain(c, provs, &ord))
                    .min_by(|x, y| x.0.total_cmp(&y.0))
                    .ok_or_else(|| diagnose(c, a, provs, &group, gi))
            })
            .collect()
    })
    .map_err(|failed| {
        failed.unwrap_or_else(|| PlanError::Options("no deal of providers was tried".into()))
    })
}
