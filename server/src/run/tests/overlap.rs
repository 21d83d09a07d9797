//! The `async` schedule's window: past a barrier's step, a cluster is fed
//! the step after its current one at once, what that step reports early
//! waits for it, and a stage that reports steps out of order is at fault.

use super::*;
use rookery_proto::{PipelineSchedule, StepDone};

/// One cluster of Root -> Leaf (providers 10, 11) under `schedule`, 4 steps
/// of 4 samples with one sync at the end, every stage ready; the steps
/// whose forwards went out first.
fn ready(schedule: PipelineSchedule) -> (JobRun, Vec<u64>) {
    let graph = rookery_model::from_toml(MLP).unwrap();
    let mut spec = spec();
    spec.training.clusters = ClusterCount::Fixed(1);
    spec.training.sync_every = 4;
    spec.training.schedule = schedule;
    let plan = two_stage_plan(&graph, 10..12, 1);
    let ids = (10..12).map(|i: u64| (i.to_string(), i)).collect();
    let analysis = graph.analyze().unwrap();
    let (mut run, _) = JobRun::start(
        1,
        spec,
        graph.clone(),
        &analysis,
        &plan,
        &ids,
        data(16),
        None,
        None,
    )
    .unwrap();
    run.on_message(10, ToServer::Ready { job_id: 1 });
    let effects = run.on_message(11, ToServer::Ready { job_id: 1 });
    (run, fed_steps(&effects))
}

/// The steps of the training forwards among `effects`, in order, once each.
fn fed_steps(effects: &[Effect]) -> Vec<u64> {
    let mut steps: Vec<u64> = sends(effects)
        .into_iter()
        .filter_map(|(p, m)| match m {
            ToProvider::Forward(f) if p == 10 => match f.phase {
                Phase::Train { step } => Some(step),
                Phase::Eval { .. } => None,
            },
            _ => None,
        })
        .collect();
    steps.dedup();
    steps
}

fn done(step: u64) -> ToServer {
    ToServer::StepDone(StepDone {
        job_id: 1,
        step,
        compute_ms: 3.0,
        peak_held: 2,
    })
}

/// Steps 0 (the barrier's) done on both stages.
fn past_the_barriers_step(run: &mut JobRun) -> Vec<u64> {
    run.on_message(11, done(0));
    fed_steps(&run.on_message(10, done(0)))
}

#[test]
fn gpipe_feeds_one_step_and_async_two_once_the_barriers_step_is_done() {
    assert_eq!(ready(PipelineSchedule::Gpipe).1, vec![0]);
    assert_eq!(ready(PipelineSchedule::OneForwardOneBackward).1, vec![0]);
    let (mut run, fed) = ready(PipelineSchedule::Async);
    // Step 1 runs with step 0's update: it waits for it.
    assert_eq!(fed, vec![0]);
    assert_eq!(past_the_barriers_step(&mut run), vec![1, 2]);
    let (mut run, _) = ready(PipelineSchedule::Gpipe);
    assert_eq!(past_the_barriers_step(&mut run), vec![1]);
}

#[test]
fn an_async_step_done_early_waits_for_the_step_before_and_each_done_step_feeds_the_next() {
    let (mut run, _) = ready(PipelineSchedule::Async);
    past_the_barriers_step(&mut run);
    let [root, leaf] = [10, 11];
    assert!(run.on_message(leaf, done(1)).is_empty());
    // The Leaf is done with step 2 while the Root still backpropagates step 1.
    assert!(run.on_message(leaf, done(2)).is_empty());
    assert_eq!(run.clusters[0].state, ClusterState::Training { step: 1 });
    // Step 1 is done: step 2 becomes current with the Leaf's early report,
    // and step 3 is fed.
    let effects = run.on_message(root, done(1));
    assert!(faults(&effects).is_empty(), "{effects:?}");
    assert_eq!(fed_steps(&effects), vec![3]);
    assert_eq!(run.clusters[0].state, ClusterState::Training { step: 2 });
    assert!(run.clusters[0].stages[1].step_done);
    assert!(!run.clusters[0].stages[0].step_done);
    // Step 3 is the last before the sync: nothing is fed past it.
    let effects = run.on_message(root, done(2));
    assert!(fed_steps(&effects).is_empty(), "{effects:?}");
    assert_eq!(run.clusters[0].state, ClusterState::Training { step: 3 });
    assert!(run.clusters[0].ahead.is_none());
}

#[test]
fn an_async_stage_reporting_a_step_before_the_one_before_it_is_at_fault() {
    let (mut run, _) = ready(PipelineSchedule::Async);
    past_the_barriers_step(&mut run);
    let effects = run.on_message(11, done(2));
    let faults = faults(&effects);
    assert_eq!(faults.len(), 1, "{effects:?}");
    assert_eq!(faults[0].0, 11);
    assert!(faults[0].1.contains("before step 1"), "{faults:?}");
    // Two steps ahead is not in flight: dropped (as a rolled-back step's
    // frames are), counting nothing.
    let (mut run, _) = ready(PipelineSchedule::Async);
    past_the_barriers_step(&mut run);
    assert!(run.on_message(10, done(3)).is_empty());
    assert!(!run.clusters[0].stages[0].step_done);
    assert!(run.clusters[0].ahead.as_ref().unwrap().done[0].is_none());
}

#[test]
fn a_stage_reports_holding_up_to_two_steps_of_micro_batches_under_async_and_one_otherwise() {
    for (schedule, most) in [(PipelineSchedule::Gpipe, 2), (PipelineSchedule::Async, 4)] {
        let (mut run, _) = ready(schedule);
        let claim = ToServer::StepDone(StepDone {
            job_id: 1,
            step: 0,
            compute_ms: 1.0,
            peak_held: 9,
        });
        run.on_message(10, claim);
        assert_eq!(run.clusters[0].stages[0].peak_held, most, "{schedule:?}");
    }
}

/// A step's compute per stage is its own under `async`: relays of the step
/// fed ahead, and relays after a stage's `StepDone`, count toward the later
/// step (whose `StepDone` brings them), never twice.
#[test]
fn an_async_steps_compute_counts_neither_the_step_fed_ahead_nor_relays_after_its_step_done() {
    let (mut run, _) = ready(PipelineSchedule::Async);
    past_the_barriers_step(&mut run);
    let [root, leaf] = [10, 11];
    let boundary = run.clusters[0].stages[0].outputs[0].0.clone();
    let root_ms = |run: &JobRun| run.clusters[0].stages[0].compute_ms;
    run.on_message(root, activations(1, 0, &[2, 8], &boundary));
    assert_eq!(root_ms(&run), 1.0, "a partial total of step 1");
    run.on_message(root, activations(2, 0, &[2, 8], &boundary));
    assert_eq!(root_ms(&run), 1.0, "step 2 is fed ahead");
    run.on_message(root, done(1));
    assert_eq!(root_ms(&run), 3.0, "the StepDone's total");
    run.on_message(root, activations(2, 1, &[2, 8], &boundary));
    assert_eq!(
        root_ms(&run),
        3.0,
        "after its StepDone, a relay is step 2's"
    );
    let effects = run.on_message(leaf, done(1));
    let records: Vec<&StepRecord> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Step(r) => Some(r),
            _ => None,
        })
        .collect();
    let [record] = records[..] else {
        panic!("{effects:?}")
    };
    assert_eq!(record.step, 1);
    let computes: Vec<f64> = record.stages.iter().map(|t| t.compute_ms).collect();
    assert_eq!(computes, vec![3.0, 3.0]);
}
