//! Stragglers: flagged only when slow enough to matter, and replaced from the checkpoint.

use super::sim::{FakeStage, Sim, recovery_run, undisturbed};
use super::*;

#[test]
fn a_stage_slower_only_by_a_few_milliseconds_is_no_straggler() {
    let (mut run, effects) = recovery_run(None);
    let mut sim = Sim::new(10..14);
    sim.step_ms = 1.0;
    sim.push(effects);
    let slow = run.clusters[1].stages[0].provider;
    sim.stages.insert(
        slow,
        FakeStage {
            stage: 0,
            stages: 2,
            params: Vec::new(),
            optimizer: BTreeMap::new(),
            outputs: Vec::new(),
            micro_batches: 2,
            done: 0,
            slow: 10.0,
        },
    );
    let mut flagged = false;
    while !run.is_over() && !sim.queue.is_empty() {
        let steps = sim.steps().len();
        sim.run_until(&mut run, |r| r.recorded > steps as u64 || r.is_over());
        flagged |= !run.stragglers().is_empty();
    }
    assert!(run.is_over());
    assert!(!flagged, "10 ms a step stalls nothing");
}

#[test]
fn a_stage_far_slower_than_the_others_is_flagged_and_replaced_from_the_checkpoint() {
    let (mut run, effects) = recovery_run(None);
    let mut sim = Sim::new(10..15);
    sim.push(effects);
    let slow = run.clusters[1].stages[0].provider;
    sim.run_until(&mut run, |r| r.synced == 2);
    // From now on cluster 1's Root takes 10 times as long per step.
    sim.stages.get_mut(&slow).unwrap().slow = 10.0;
    sim.run_until(&mut run, |r| !r.stragglers().is_empty());
    let [straggler] = run.stragglers()[..] else {
        panic!("{:?}", run.stragglers())
    };
    assert_eq!(
        (straggler.cluster, straggler.stage, straggler.provider),
        (1, 0, slow)
    );
    assert!(straggler.slowness > STRAGGLER_FACTOR, "{straggler:?}");
    let effects = run.replace(1, 0, 14, "too slow");
    assert!(matches!(&effects[0], Effect::Send(p, ToProvider::Release { .. }) if *p == slow));
    sim.push(effects);
    sim.run_until(&mut run, JobRun::is_over);
    assert!(run.stragglers().is_empty());
    let steps: Vec<u64> = sim.steps().iter().map(|s| s.0).collect();
    assert_eq!(steps, (0..8).collect::<Vec<_>>());
    assert_eq!(sim.completed(), undisturbed().completed());
}
