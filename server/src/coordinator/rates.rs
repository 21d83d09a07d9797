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

use super::Actor;

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

/// Measured rates by identity, for as long as the server runs.
pub type Rates = HashMap<u64, Rate>;

impl Actor {
    /// A stage of `job_id` on `provider` did its step's work at `gflops`.
    pub(super) async fn on_measured(
        &mut self,
        job_id: u64,
        provider: u64,
        gflops: f64,
        busy_ms: f64,
    ) {
        let Some(live) = self.providers.get(&provider) else {
            return;
        };
        let (identity, claim) = (live.identity, live.hello.gflops);
        let rate = self.rates.entry(identity).or_default();
        tracing::debug!(
            job = job_id,
            provider,
            identity,
            claim,
            gflops,
            busy_ms,
            "measured a stage"
        );
        if observe(rate, claim, gflops) {
            let reason = format!(
                "it claims {claim:.1} GFLOP/s but computed its stage at {gflops:.2} GFLOP/s \
                 ({busy_ms:.0} ms busy a step) for {LIE_STEPS} steps"
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
