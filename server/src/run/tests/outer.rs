//! DiLoCo-style syncs: the outer optimizer steps the synced parameters with
//! the clusters' pseudo-gradient, keeps its momentum in the resume point,
//! and at lr 1 without momentum is today's averaging.

use rookery_job::OuterOptimizer;

use super::sim::{Sim, recovery_run, recovery_run_with};
use super::*;

const NESTEROV: OuterOptimizer = OuterOptimizer {
    lr: 0.7,
    momentum: 0.9,
    nesterov: true,
};

fn outer_work(optimizer: OuterOptimizer, previous: &[f32], momentum: Option<&[f32]>) -> OuterWork {
    let w = |values: &[f32]| {
        [(
            "w".to_string(),
            WireTensor::from_f32("w", &[values.len()], values, WireDType::F32),
        )]
        .into()
    };
    OuterWork {
        optimizer,
        previous: w(previous),
        momentum: momentum.map(w).unwrap_or_default(),
    }
}

#[test]
fn the_outer_step_is_torchs_sgd_on_the_pseudo_gradient() {
    // previous 1.0, combined 0.5: the pseudo-gradient g is 0.5.
    let g = 0.5f64;
    let cases: [(OuterOptimizer, Option<f32>, f64, Option<f32>); 4] = [
        // Nesterov, first step: buf = g; d = g + m * buf.
        (NESTEROV, None, 1.0 - 0.7 * (g + 0.9 * g), Some(0.5)),
        // Nesterov with a buffer of 2: buf = 0.9 * 2 + g; d = g + 0.9 * buf.
        (
            NESTEROV,
            Some(2.0),
            1.0 - 0.7 * (g + 0.9 * (1.8 + g)),
            Some((1.8 + g) as f32),
        ),
        // Heavy ball: d = buf.
        (
            OuterOptimizer {
                lr: 0.7,
                momentum: 0.9,
                nesterov: false,
            },
            Some(2.0),
            1.0 - 0.7 * (1.8 + g),
            Some((1.8 + g) as f32),
        ),
        // No momentum: halfway back at lr 0.5, and no buffer kept.
        (
            OuterOptimizer {
                lr: 0.5,
                momentum: 0.0,
                nesterov: false,
            },
            None,
            0.75,
            None,
        ),
    ];
    for (optimizer, buffer, want, want_buffer) in cases {
        let work = outer_work(
            optimizer,
            &[1.0, 1.0],
            buffer.map(|b| [b, b]).as_ref().map(|b| &b[..]),
        );
        let (value, momentum) = work.step("w", vec![0.5, 0.5]);
        assert_eq!(value, [want as f32; 2], "{optimizer:?} {buffer:?}");
        assert_eq!(
            momentum.map(|m| m.to_f32().unwrap()),
            want_buffer.map(|b| vec![b; 2]),
            "{optimizer:?}"
        );
    }
    // A parameter it knows nothing of (a buffer, not trained) is left as combined.
    let work = outer_work(NESTEROV, &[1.0], None);
    assert_eq!(work.step("running_mean", vec![0.25]), (vec![0.25], None));
}

#[test]
fn a_sync_with_an_outer_optimizer_steps_from_the_last_sync_and_keeps_its_momentum() {
    let (mut run, _) = started_with(2, Aggregation::Mean);
    run.spec.training.outer_optimizer = Some(NESTEROV);
    let before: BTreeMap<String, Vec<f32>> = run
        .params
        .iter()
        .map(|(n, v)| (n.clone(), v.values()))
        .collect();
    syncing(&mut run);
    let effects = upload_all(&mut run, |c| [1.0, 3.0][c]);
    for (name, v) in &run.params {
        let want: Vec<f32> = before[name]
            .iter()
            .map(|&b| {
                let g = f64::from(b) - 2.0;
                (f64::from(b) - 0.7 * (g + 0.9 * g)) as f32
            })
            .collect();
        assert_eq!(v.values(), want, "{name}");
        assert_eq!(run.outer_momentum[name].shape_usize(), v.shape, "{name}");
    }
    // Everyone gets the stepped values, and the resume point the momentum.
    let set = sends(&effects)
        .iter()
        .filter(|(_, m)| matches!(m, ToProvider::SetParams(_)))
        .count();
    assert_eq!(set, 4);
    let resume = resume_point(&effects).unwrap();
    let names: BTreeSet<&str> = resume
        .outer_momentum
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(names, run.params.keys().map(String::as_str).collect());
}

/// (steps, completed weights) of the 2-cluster recovery run with `outer`.
fn finished_with(outer: Option<OuterOptimizer>, clusters: usize) -> (Sim, Vec<WireTensor>) {
    let (mut run, effects) = recovery_run_with(clusters, None);
    run.spec.training.outer_optimizer = outer;
    let mut sim = Sim::new(10..10 + 2 * clusters as u64);
    sim.push(effects);
    sim.run_until(&mut run, JobRun::is_over);
    let weights = sim.completed().unwrap().clone();
    (sim, weights)
}

#[test]
fn outer_sgd_at_lr_1_without_momentum_is_todays_averaging_exactly() {
    let plain_sgd = OuterOptimizer {
        lr: 1.0,
        momentum: 0.0,
        nesterov: false,
    };
    for clusters in [1, 2] {
        let (_, averaged) = finished_with(None, clusters);
        let (_, stepped) = finished_with(Some(plain_sgd), clusters);
        assert_eq!(stepped, averaged, "{clusters} cluster(s)");
        // Any other outer step changes the result.
        let (_, nesterov) = finished_with(Some(NESTEROV), clusters);
        assert_ne!(nesterov, averaged, "{clusters} cluster(s)");
    }
}

#[test]
fn a_single_cluster_with_an_outer_step_syncs_in_the_foreground_and_gets_the_stepped_values() {
    let (sim, _) = finished_with(Some(NESTEROV), 1);
    // Two stages, a sync every 2 of 16 steps.
    assert_eq!(sim.set_params.len(), 2 * 8);
    // Without the outer step nothing needs sending.
    let (sim, _) = finished_with(None, 1);
    assert!(sim.set_params.is_empty());
}

#[test]
fn a_run_resumed_mid_way_keeps_its_outer_momentum_and_finishes_as_the_undisturbed_one() {
    let (reference, weights) = finished_with(Some(NESTEROV), 2);
    let point = reference
        .out
        .iter()
        .find_map(|e| match e {
            Effect::ResumePoint(r) if r.step == 6 => Some((**r).clone()),
            _ => None,
        })
        .unwrap();
    assert!(!point.outer_momentum.is_empty());
    let (mut run, effects) = recovery_run(Some(point));
    run.spec.training.outer_optimizer = Some(NESTEROV);
    let mut sim = Sim::new(10..14);
    sim.push(effects);
    sim.run_until(&mut run, JobRun::is_over);
    assert_eq!(sim.completed(), Some(&weights));
}

/// What syncs cost on the wire is in the step records, each sync's bytes
/// in the record of the step after it (so the last sync, after the last
/// step, is in none): every sync moves the same bytes.
#[test]
fn steps_record_the_bytes_syncs_move_and_fewer_syncs_move_fewer() {
    let synced = |every: u64| {
        let (mut run, effects) = recovery_run(None);
        run.spec.training.sync_every = every;
        let mut sim = Sim::new(10..14);
        sim.push(effects);
        sim.run_until(&mut run, JobRun::is_over);
        let per_step: Vec<u64> = sim
            .out
            .iter()
            .filter_map(|e| match e {
                Effect::Step(s) => Some(s.bytes_synced),
                _ => None,
            })
            .collect();
        assert_eq!(per_step.len(), 8);
        per_step.iter().sum::<u64>()
    };
    // Syncs at 2, 4, 6 (and 8) against 4 (and 8, each epoch's end).
    let (often, rarely) = (synced(2), synced(4));
    assert!(rarely > 0);
    assert_eq!(often, 3 * rarely);
}
