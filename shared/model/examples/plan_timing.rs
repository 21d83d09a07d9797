//! Times the planner on the benchmark case (200 nodes over 1,000 providers), so
//! `cargo xtask bench plan` has a reference number until it exists:
//! `cargo run --release -p rookery-model --example plan_timing`.

use std::time::Instant;

use rookery_model::{ClusterCount, PlanOptions, clusterize, synthetic_chain, synthetic_providers};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let graph = synthetic_chain(200);
    let providers = synthetic_providers(1000, 1);
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
        let start = Instant::now();
        let plan = clusterize(&graph, &providers, &options)?;
        let took = start.elapsed();
        let stages: usize = plan.clusters.iter().map(|c| c.stages.len()).sum();
        println!(
            "{clusters:?}: {:.1} ms, {} clusters, {stages} stages, {} standbys, bottleneck {:.3} ms",
            took.as_secs_f64() * 1e3,
            plan.clusters.len(),
            plan.standbys.len(),
            plan.bottleneck_s() * 1e3
        );
    }
    Ok(())
}
