//! Gradient clipping across a cluster's stages: the server sums the stages'
//! squared norms and sends every stage the same multiplier; a bad report is
//! the sender's fault, never a panic.

use super::*;
use rookery_proto::{GradNorm, GradScale};

/// One cluster of Root -> Leaf (providers 10, 11) that clips at `max_norm`,
/// every stage ready and step 0 fed.
fn clipping(max_norm: f64) -> JobRun {
    let graph = rookery_model::from_toml(MLP).unwrap();
    let mut spec = spec();
    spec.training.clusters = ClusterCount::Fixed(1);
    spec.training.clip_grad_norm = Some(max_norm);
    let plan = two_stage_plan(&graph, 10..12, 1);
    let ids = (10..12).map(|i: u64| (i.to_string(), i)).collect();
    let analysis = graph.analyze().unwrap();
    let (mut run, effects) = JobRun::start(
        1,
        spec,
        graph.clone(),
        &analysis,
        &plan,
        &ids,
        data(8),
        None,
        None,
    )
    .unwrap();
    for (_, m) in sends(&effects) {
        let ToProvider::Assign(a) = m else {
            panic!("{m:?}")
        };
        assert_eq!(a.clip_grad_norm, Some(max_norm));
    }
    for p in [10, 11] {
        run.on_message(p, ToServer::Ready { job_id: 1 });
    }
    assert_eq!(run.clusters[0].state, ClusterState::Training { step: 0 });
    run
}

fn norm(step: u64, sum_of_squares: f64) -> ToServer {
    ToServer::GradNorm(GradNorm {
        job_id: 1,
        step,
        sum_of_squares,
    })
}

#[test]
fn every_stage_gets_the_clip_grad_norm_multiplier_of_the_summed_squares() {
    let mut run = clipping(1.0);
    let [root, leaf] = [10, 11];
    // The Leaf reports first (it finishes backward first): nothing yet.
    assert!(run.on_message(leaf, norm(0, 9.0)).is_empty());
    let effects = run.on_message(root, norm(0, 16.0));
    let sent = sends(&effects);
    let want = 1.0 / (5.0 + 1e-6);
    assert_eq!(sent.len(), 2, "{effects:?}");
    for (p, m) in [root, leaf].into_iter().zip(&sent) {
        assert_eq!(
            (p, m.1),
            (
                m.0,
                &ToProvider::GradScale(GradScale {
                    job_id: 1,
                    step: 0,
                    scale: want
                })
            )
        );
    }
    assert_eq!(rookery_model::clip_scale(25.0, 1.0), want);
    // A second report of the same step is dropped, nobody's fault.
    let again = run.on_message(root, norm(0, 16.0));
    assert!(again.is_empty(), "{again:?}");
}

#[test]
fn a_norm_within_max_norm_leaves_gradients_alone() {
    let mut run = clipping(10.0);
    run.on_message(11, norm(0, 1.0));
    let effects = run.on_message(10, norm(0, 3.0));
    for (_, m) in sends(&effects) {
        assert!(
            matches!(m, ToProvider::GradScale(g) if g.scale == 1.0),
            "{m:?}"
        );
    }
}

#[test]
fn a_non_finite_or_negative_norm_is_a_fault_of_its_provider() {
    let mut run = clipping(1.0);
    for bad in [f64::NAN, f64::INFINITY, -1.0] {
        let effects = run.on_message(11, norm(0, bad));
        assert!(sends(&effects).is_empty());
        let f = faults(&effects);
        assert_eq!(f.len(), 1, "{effects:?}");
        assert_eq!(f[0].0, 11);
        assert!(f[0].1.contains("sum of squares"), "{}", f[0].1);
    }
    // The stage can still report a good one afterwards.
    assert!(run.on_message(11, norm(0, 1.0)).is_empty());
    assert_eq!(sends(&run.on_message(10, norm(0, 1.0))).len(), 2);
}

#[test]
fn a_norm_in_a_job_that_does_not_clip_or_for_another_step_is_dropped() {
    let (mut run, _) = started_with(1, Aggregation::Mean);
    for p in [10, 11] {
        run.on_message(p, ToServer::Ready { job_id: 1 });
    }
    let effects = run.on_message(10, norm(0, 1.0));
    assert_eq!(faults(&effects).len(), 1, "{effects:?}");

    let mut run = clipping(1.0);
    let late = run.on_message(10, norm(3, 1.0));
    assert!(
        sends(&late).is_empty() && faults(&late).is_empty(),
        "{late:?}"
    );
}

#[test]
fn a_schedule_longer_than_the_job_fails_its_start_naming_the_field() {
    let graph = rookery_model::from_toml(MLP).unwrap();
    let mut spec = spec();
    spec.training.clusters = ClusterCount::Fixed(1);
    // 8 samples at batch 4: 2 steps.
    spec.training.lr_schedule = rookery_model::LrSchedule::Cosine {
        warmup_steps: 3,
        total_steps: None,
        min_lr: 0.0,
    };
    let plan = two_stage_plan(&graph, 10..12, 1);
    let ids = (10..12).map(|i: u64| (i.to_string(), i)).collect();
    let analysis = graph.analyze().unwrap();
    let Err(e) = JobRun::start(
        1,
        spec,
        graph.clone(),
        &analysis,
        &plan,
        &ids,
        data(8),
        None,
        None,
    ) else {
        panic!("a 3-step warm-up in a 2-step job started")
    };
    let text = e.to_string();
    assert!(text.contains("training.lr_schedule.warmup_steps"), "{text}");
}
