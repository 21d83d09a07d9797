//! Why nothing fits: the error a failed plan reports, naming the node or the
//! memory one more provider would have to bring.

use rookery_model::Analysis;
use rookery_proto::ProviderKind;

use crate::cost::Costs;
use crate::dp::{INF, Want, bottleneck_dp, orderings};
use crate::error::PlanError;
use crate::types::ProviderSpec;

/// Explains why nothing fits a group: a node too large for any provider, or how
/// much memory one more provider would need to bring.
pub(crate) fn diagnose(
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
