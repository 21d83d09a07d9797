//! The planner benchmark behind `cargo xtask bench plan`: a 200-node model over
//! 1,000 providers, best of several runs per cluster setting, printed with the
//! model and provider counts and the ratio to the 100 ms target (under 1 meets it).

use std::time::{Duration, Instant};

use rookery_model::ClusterCount;
use rookery_plan::{PlanOptions, clusterize, synthetic_chain, synthetic_providers};

const NODES: usize = 200;
const PROVIDERS: usize = 1000;
const RUNS: usize = 5;
const TARGET: Duration = Duration::from_millis(100);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let graph = synthetic_chain(NODES);
    let providers = synthetic_providers(PROVIDERS, 1);
    println!(
        "planning a {}-node model over {} providers (best of {RUNS} runs; target {} ms)",
        graph.nodes.len(),
        providers.len(),
        TARGET.as_millis()
    );
    for clusters in [
        ClusterCount::Fixed(1),
        ClusterCount::Fixed(10),
        ClusterCount::Auto,
    ] {
        let options = PlanOptions {
            micro_batch: 32,
            clusters,
            ..PlanOptions::default()
        };
        let mut best = Duration::MAX;
        let mut plan = None;
        for _ in 0..RUNS {
            let start = Instant::now();
            let planned = clusterize(&graph, &providers, &options)?;
            best = best.min(start.elapsed());
            plan = Some(planned);
        }
        let Some(plan) = plan else { continue };
        let stages: usize = plan.clusters.iter().map(|c| c.stages.len()).sum();
        println!(
            "  clusters {:<9} {:>8.1} ms  ratio to target {:>5.2}  ({} clusters, {stages} stages, {} standbys, bottleneck {:.3} ms)",
            format!("{clusters:?}"),
            best.as_secs_f64() * 1e3,
            best.as_secs_f64() / TARGET.as_secs_f64(),
            plan.clusters.len(),
            plan.standbys.len(),
            plan.bottleneck_s() * 1e3
        );
    }
    Ok(())
}
