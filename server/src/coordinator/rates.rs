//! Claims checked against work. A provider's `Hello` says how fast it is;
//! its stages show how fast it was ([`Effect::Measured`](crate::run::Effect),
//! the server's own clock). Once measured, the planner and standbys use at
//! most [`PLAN_SLACK`] times the measured rate, and a claim more than
//! [`LIE_FACTOR`] times it for [`LIE_STEPS`] steps in a row is a fault.
//!
//! Benchmarks run a matmul at the device's best; stages run whole layers
//! with per-message costs, so honest providers measure several times below
//! their claim (more when several share one machine's cores). The factors
//! leave room for that.

use std::collections::HashMap;

use rookery_proto::Hello;

use super::Actor;
use crate::run::MIN_MEASURED_MS;

/// A claim more than this many times the measured rate is a lie ...
pub const LIE_FACTOR: f64 = 50.0;

/// ... once it has been so for this many steps in a row.
pub const LIE_STEPS: u32 = 3;

/// The planner takes a measured provider to compute at most this many times
/// its measured rate (stages differ in how well they use a device).
pub const PLAN_SLACK: f64 = 4.0;

/// What the server has measured of one identity.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rate {
    /// The latest measured rate, GFLOP/s.
    pub gflops: f64,
    /// Steps in a row its claim was more than [`LIE_FACTOR`] times that.
    pub lying_steps: u32,
}

/// What a provider's `Hello` claims it computes, its donor's GPU cap
/// counted: its measured GFLOP/s times the share of the time it may
/// compute ([`Hello::duty_cycle`]).
pub fn capped_claim(hello: &Hello) -> f64 {
    hello.gflops * hello.duty_cycle.clamp(rookery_proto::MIN_DUTY_CYCLE, 1.0)
}

/// The rate the planner uses for a provider that claims `claim` and was
/// measured at `measured` (none yet: the claim).
pub fn planning_gflops(claim: f64, measured: Option<f64>) -> f64 {
    match measured {
        Some(measured) => claim.min(measured * PLAN_SLACK),
        None => claim,
    }
}

/// Updates `rate` with a step measured at `gflops` from a provider that
/// claims `claim`; `true` when that makes [`LIE_STEPS`] lying steps in a
/// row (the count starts over).
pub fn observe(rate: &mut Rate, claim: f64, gflops: f64) -> bool {
    rate.gflops = gflops;
    if claim > LIE_FACTOR * gflops {
        rate.lying_steps += 1;
    } else {
        rate.lying_steps = 0;
    }
    if rate.lying_steps >= LIE_STEPS {
        rate.lying_steps = 0;
        return true;
    }
    false
}

/// Of `busy_ms`, the time not spent moving `bytes` over a link of
/// `bandwidth_mbps` (unmeasured: all of it); `None` when less than
/// [`MIN_MEASURED_MS`] is left, too little to tell computing from overhead.
pub fn computing_ms(busy_ms: f64, bytes: u64, bandwidth_mbps: Option<f64>) -> Option<f64> {
    let transfer_ms = match bandwidth_mbps {
        Some(mbps) if mbps > 0.0 => bytes as f64 * 8.0 / (mbps * 1e3),
        _ => 0.0,
    };
    let left = busy_ms - transfer_ms;
    (left >= MIN_MEASURED_MS).then_some(left)
}

/// Measured rates by identity, for as long as the server runs.
pub type Rates = HashMap<u64, Rate>;

impl Actor {
    /// A stage of `job_id` on `provider` did `work_gflop` in a step that kept
    /// it busy `busy_ms`, `bytes` of tensors moving to and from it. Their
    /// transfer at the provider's measured bandwidth is not computing: what
    /// is left, if enough, gives the rate.
    pub(super) async fn on_measured(
        &mut self,
        job_id: u64,
        provider: u64,
        work_gflop: f64,
        busy_ms: f64,
        bytes: u64,
    ) {
        let Some(live) = self.providers.get(&provider) else {
            return;
        };
        let (identity, claim) = (live.identity, capped_claim(&live.hello));
        let Some(compute_ms) = computing_ms(busy_ms, bytes, live.bandwidth_mbps) else {
            return;
        };
        let gflops = work_gflop / (compute_ms / 1e3);
        let rate = self.rates.entry(identity).or_default();
        tracing::debug!(
            job = job_id,
            provider,
            identity,
            claim,
            gflops,
            busy_ms,
            bytes,
            "measured a stage"
        );
        if observe(rate, claim, gflops) {
            let reason = format!(
                "it claims {claim:.1} GFLOP/s but computed its stage at {gflops:.2} GFLOP/s \
                 ({work_gflop:.1} GFLOP in {compute_ms:.0} ms a step, transfers aside) for {LIE_STEPS} steps"
            );
            self.on_fault(job_id, provider, reason, false).await;
        }
    }

    /// The rate the server measured for `identity`, if any.
    pub(super) fn measured(&self, identity: u64) -> Option<f64> {
        self.rates.get(&identity).map(|r| r.gflops)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_far_above_the_measured_rate_is_a_fault_after_three_steps_in_a_row() {
        let mut rate = Rate::default();
        // (claim, measured this step, fault now)
        let steps = [
            (1000.0, 10.0, false),
            // An honest step breaks the run.
            (1000.0, 25.0, false),
            (1000.0, 19.0, false),
            (1000.0, 19.0, false),
            (1000.0, 19.0, true),
            // After a fault the count starts over.
            (1000.0, 19.0, false),
            // Honest: a few times under the benchmark is normal.
            (100.0, 10.0, false),
        ];
        for (i, (claim, measured, fault)) in steps.into_iter().enumerate() {
            assert_eq!(observe(&mut rate, claim, measured), fault, "step {i}");
            assert_eq!(rate.gflops, measured);
        }
    }

    #[test]
    fn transfers_at_the_measured_bandwidth_are_not_computing() {
        // (busy ms, bytes, Mbit/s, computing ms)
        let cases = [
            (500.0, 0, Some(100.0), Some(500.0)),
            // 10 MB at 200 Mbit/s is 400 ms of the 450.
            (450.0, 10_000_000, Some(200.0), None),
            (900.0, 10_000_000, Some(200.0), Some(500.0)),
            // An unmeasured link subtracts nothing.
            (500.0, 10_000_000, None, Some(500.0)),
            (50.0, 0, Some(100.0), None),
        ];
        for (busy, bytes, mbps, want) in cases {
            assert_eq!(
                computing_ms(busy, bytes, mbps),
                want,
                "{busy} {bytes} {mbps:?}"
            );
        }
    }

    #[test]
    fn the_planner_trusts_a_claim_only_to_a_few_times_the_measured_rate() {
        let cases = [
            (100.0, None, 100.0),
            (100.0, Some(50.0), 100.0),
            (100.0, Some(10.0), 40.0),
            (5000.0, Some(1.0), 4.0),
        ];
        for (claim, measured, want) in cases {
            assert_eq!(
                planning_gflops(claim, measured),
                want,
                "{claim} {measured:?}"
            );
        }
    }
}

#[cfg(test)]
mod cap_tests {
    use rookery_model::ClusterCount;
    use rookery_plan::{PlanOptions, ProviderSpec};
    use rookery_proto::{DonorCard, ProviderKind};

    use super::*;
    use crate::coordinator::LiveProvider;

    /// A browser tab claiming `gflops`, its donor's cap at `duty_cycle`.
    fn tab(id: u64, gflops: f64, duty_cycle: f64) -> LiveProvider {
        LiveProvider {
            id,
            identity: id,
            vouched_by: None,
            hello: Hello {
                protocol_version: rookery_proto::PROTOCOL_VERSION,
                kind: ProviderKind::Browser,
                device: "a GPU".into(),
                memory_bytes: 1 << 30,
                gflops,
                display_name: "browser tab".into(),
                max_buffer_bytes: Some(1 << 28),
                credential: None,
                requester_token: None,
                donor: Some(DonorCard {
                    name: "alice".into(),
                    team: None,
                }),
                duty_cycle,
            },
            measured_gflops: None,
            work: None,
            bandwidth_mbps: Some(1000.0),
        }
    }

    /// The provider a one-stage, one-cluster plan of a small MLP picks.
    fn chosen(providers: &[LiveProvider]) -> String {
        let graph = rookery_model::from_toml(
            "input_shape = [64]\n[[layers]]\ntype = \"Dense\"\nunits = 256\nactivation = \"relu\"\n\
             [[layers]]\ntype = \"Dense\"\nunits = 10\n",
        )
        .unwrap();
        let specs: Vec<ProviderSpec> = providers
            .iter()
            .filter_map(LiveProvider::candidate)
            .collect();
        let options = PlanOptions {
            micro_batch: 8,
            clusters: ClusterCount::Fixed(1),
            stages_per_cluster: Some(1),
            ..PlanOptions::default()
        };
        let plan = rookery_plan::clusterize(&graph, &specs, &options).unwrap();
        plan.clusters[0].stages[0].provider.clone()
    }

    #[test]
    fn a_capped_provider_is_planned_at_its_share_of_its_claim() {
        assert_eq!(tab(1, 100.0, 1.0).candidate().unwrap().gflops, 100.0);
        assert_eq!(tab(1, 100.0, 0.5).candidate().unwrap().gflops, 50.0);
        assert_eq!(tab(1, 100.0, 0.25).candidate().unwrap().gflops, 25.0);
        // A measured rate still bounds the capped claim.
        let measured = LiveProvider {
            measured_gflops: Some(5.0),
            ..tab(1, 100.0, 0.5)
        };
        assert_eq!(measured.candidate().unwrap().gflops, 5.0 * PLAN_SLACK);
    }

    #[test]
    fn the_planner_prefers_an_uncapped_provider_to_a_faster_one_capped_below_it() {
        // Uncapped, the 100 GFLOP/s tab is the faster and takes the stage.
        assert_eq!(chosen(&[tab(1, 100.0, 1.0), tab(2, 40.0, 1.0)]), "1");
        // Capped at a quarter it computes 25 GFLOP/s: the 40 one is faster.
        assert_eq!(chosen(&[tab(1, 100.0, 0.25), tab(2, 40.0, 1.0)]), "2");
    }
}
