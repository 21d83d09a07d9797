//! Turning the searches' stage lists into the [`Plan`] the server runs:
//! roles, parameters, boundary tensors and per-stage costs.

use std::collections::BTreeSet;

use rookery_model::{Analysis, Graph};

use crate::clusters::GroupPlans;
use crate::cost::{Costs, crossing_tensors, stage_time};
use crate::types::{BoundaryTensor, Cluster, Plan, PlanOptions, ProviderSpec, Stage, StageRole};

pub(crate) fn assemble(
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
                        provider_gflops: p.gflops,
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
