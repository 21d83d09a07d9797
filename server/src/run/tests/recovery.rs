//! Undisturbed, disturbed and resumed runs end the same.

use super::sim::{Sim, cluster_step, recovery_run, recovery_run_with, undisturbed};
use super::*;

#[test]
fn an_undisturbed_run_records_every_step_once_and_syncs_at_each_barrier() {
    let sim = undisturbed();
    let steps: Vec<u64> = sim.steps().iter().map(|s| s.0).collect();
    assert_eq!(steps, (0..8).collect::<Vec<_>>());
    assert_eq!(sim.resume_steps(), [2, 4, 6, 8]);
    let epochs = sim
        .out
        .iter()
        .filter(|e| matches!(e, Effect::Epoch(_)))
        .count();
    assert_eq!(epochs, 2);
    assert!(sim.completed().is_some());
    // Every stage's work on every step its cluster finished, once, for credit.
    let mut worked: BTreeMap<u64, (u32, f64)> = BTreeMap::new();
    for e in &sim.out {
        if let Effect::Worked { provider, gflop } = e {
            let entry = worked.entry(*provider).or_default();
            entry.0 += 1;
            entry.1 += gflop;
        }
    }
    let (run, _) = recovery_run(None);
    let planned: BTreeMap<u64, f64> = run
        .clusters
        .iter()
        .flat_map(|c| c.stages.iter().map(|s| (s.provider, s.work_gflop)))
        .collect();
    assert_eq!(worked.len(), 4);
    for (provider, (steps, gflop)) in worked {
        // Each cluster runs all 8 steps on its share of the data.
        assert_eq!(steps, 8, "provider {provider}");
        assert!(planned[&provider] > 0.0);
        assert!((gflop - 8.0 * planned[&provider]).abs() < 1e-9 * gflop);
    }
}

#[test]
fn a_single_cluster_trains_on_during_its_syncs_and_a_stage_lost_mid_sync_replays_from_the_one_before()
 {
    let single = |kill_during: Option<u64>| {
        let (mut run, effects) = recovery_run_with(1, None);
        let initial: BTreeMap<String, Vec<f32>> = run
            .params
            .iter()
            .map(|(n, v)| (n.clone(), v.values()))
            .collect();
        let mut sim = Sim::new(10..13);
        sim.push(effects);
        let mut overlapped = Vec::new();
        while !run.is_over() {
            sim.run_until(&mut run, |r| {
                r.background_sync.is_some_and(|s| !overlapped.contains(&s)) || r.is_over()
            });
            let Some(step) = run.background_sync else {
                break;
            };
            // The next step is under way while the sync's uploads are out.
            assert_eq!(cluster_step(&run, 0), Some(step));
            overlapped.push(step);
            if kill_during == Some(step) {
                let leaf = run.clusters[0].stages[1].provider;
                sim.kill(&mut run, leaf);
                assert_eq!(run.background_sync, None, "the sync is abandoned");
                assert_eq!(run.synced, step - 2, "back to the sync before");
                sim.push(run.fill(0, 1, 12));
            }
        }
        sim.run_until(&mut run, JobRun::is_over);
        (sim, initial, overlapped)
    };
    let (reference, initial, overlapped) = single(None);
    // 8 steps an epoch, a sync every 2: those at epoch ends block (the
    // evaluation needs them), the others run beside the next step.
    assert_eq!(overlapped, [2, 4, 6, 10, 12, 14]);
    let steps: Vec<u64> = reference.steps().iter().map(|s| s.0).collect();
    assert_eq!(steps, (0..16).collect::<Vec<_>>());
    let resumes: Vec<&ResumePoint> = reference
        .out
        .iter()
        .filter_map(|e| match e {
            Effect::ResumePoint(r) => Some(&**r),
            _ => None,
        })
        .collect();
    assert_eq!(
        resumes.iter().map(|r| r.step).collect::<Vec<_>>(),
        [2, 4, 6, 8, 10, 12, 14, 16]
    );
    // Each checkpoint holds the values after exactly its steps (the fake
    // stages add 1 per step), not some of the next step's.
    for point in &resumes {
        for w in &point.params {
            let expected: Vec<f32> = initial[&w.name]
                .iter()
                .map(|&v| (0..point.step).fold(v, |x, _| x + 1.0))
                .collect();
            assert_eq!(
                w.to_f32().unwrap(),
                expected,
                "`{}` at step {}",
                w.name,
                point.step
            );
        }
    }

    let (disturbed, _, _) = single(Some(4));
    assert_eq!(disturbed.steps(), reference.steps());
    assert_eq!(disturbed.completed(), reference.completed());
}

#[test]
fn providers_killed_mid_step_and_mid_sync_cost_only_a_replay_from_the_last_checkpoint() {
    let reference = undisturbed();
    let (mut run, effects) = recovery_run(None);
    let mut sim = Sim::new(10..16);
    sim.push(effects);
    let [[_, _], [root1, leaf1]] = roles(&run);

    // Cluster 1's Leaf dies in the middle of step 3 (the last sync was at 2).
    sim.run_until(&mut run, |r| {
        cluster_step(r, 1) == Some(3) && r.clusters[1].reported.len() == 1
    });
    assert_eq!(run.synced, 2);
    sim.kill(&mut run, leaf1);
    assert_eq!(
        run.vacancies(),
        [Vacancy {
            cluster: 1,
            stage: 1,
            memory_bytes: run.clusters[1].stages[1].memory_bytes
        }]
    );
    assert!(run.providers().iter().all(|&p| p != leaf1));
    // Cluster 0 trains on to the barrier at step 4 and waits there.
    sim.run_until(&mut run, |_| false);
    assert_eq!(run.clusters[0].state, ClusterState::Idle);
    assert_eq!(run.clusters[1].state, ClusterState::Waiting);
    assert_eq!(run.state, State::Training);
    assert!(
        sim.steps().iter().all(|s| s.0 < 3),
        "step 3 waits for cluster 1"
    );

    // A standby takes the stage: the whole cluster restarts from step 2.
    let effects = run.fill(1, 1, 14);
    assert!(effects.iter().any(|e| matches!(
        e,
        Effect::Log {
            kind: "stage_reassigned",
            ..
        }
    )));
    let rebuilt: Vec<(u64, &Assignment)> = sends(&effects)
        .into_iter()
        .filter_map(|(p, m)| match m {
            ToProvider::Assign(a) => Some((p, &**a)),
            _ => None,
        })
        .collect();
    assert_eq!(rebuilt.len(), 2);
    for (p, a) in &rebuilt {
        assert!([root1, 14].contains(p));
        assert_eq!((a.cluster, a.start_step), (1, 2));
        // The checkpoint's momentum, taken after 2 updates.
        assert!(!a.optimizer_state.is_empty());
        assert!(a.optimizer_state.iter().all(|o| o.steps == 2));
    }
    sim.push(effects);

    // Then cluster 0's Root dies during the sync at step 4.
    sim.run_until(&mut run, |r| matches!(r.state, State::Syncing { .. }));
    assert_eq!(run.synced, 2);
    let root0 = run.clusters[0].stages[0].provider;
    sim.kill(&mut run, root0);
    assert_eq!(run.state, State::Training, "the sync is abandoned");
    sim.push(run.fill(0, 0, 15));
    sim.run_until(&mut run, JobRun::is_over);

    // Every step recorded once, in order, with the undisturbed run's losses
    // (so the same batches), and the same final weights.
    assert_eq!(sim.steps(), reference.steps());
    let epochs = |s: &Sim| {
        s.out
            .iter()
            .filter_map(|e| match e {
                Effect::Epoch(r) => Some((r.epoch, r.test_loss, r.samples)),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(epochs(&sim), epochs(&reference));
    assert_eq!(sim.completed(), reference.completed());
    let logs: Vec<&str> = sim
        .out
        .iter()
        .filter_map(|e| match e {
            Effect::Log { kind, .. } => Some(*kind),
            _ => None,
        })
        .collect();
    assert_eq!(
        logs,
        [
            "stage_lost",
            "stage_reassigned",
            "stage_lost",
            "stage_reassigned"
        ]
    );
}

#[test]
fn a_stage_lost_during_evaluation_is_rebuilt_and_its_share_evaluated_again() {
    let reference = undisturbed();
    let (mut run, effects) = recovery_run(None);
    let mut sim = Sim::new(10..15);
    sim.push(effects);
    sim.run_until(&mut run, |r| {
        matches!(r.state, State::Evaluating { .. }) && r.clusters[0].reported.len() == 1
    });
    let leaf0 = run.clusters[0].stages[1].provider;
    sim.kill(&mut run, leaf0);
    sim.push(run.fill(0, 1, 14));
    sim.run_until(&mut run, JobRun::is_over);
    assert_eq!(sim.steps(), reference.steps());
    assert_eq!(sim.completed(), reference.completed());
}

#[test]
fn a_run_resumed_from_a_resume_point_finishes_as_the_undisturbed_one() {
    let reference = undisturbed();
    let point = reference
        .out
        .iter()
        .find_map(|e| match e {
            Effect::ResumePoint(r) if r.step == 4 => Some((**r).clone()),
            _ => None,
        })
        .unwrap();
    let (mut run, effects) = recovery_run(Some(point));
    let mut sim = Sim::new(10..14);
    sim.push(effects);
    assert!(sim.assigns.is_empty());
    sim.run_until(&mut run, JobRun::is_over);
    assert!(sim.assigns.iter().all(|(_, a)| a.start_step == 4));
    // Step 4 ended epoch 0: its evaluation runs again, then steps 4.. follow.
    assert_eq!(sim.steps(), reference.steps()[4..]);
    assert_eq!(sim.completed(), reference.completed());
}

/// Ravnest's `val_freq`: with `val_every`, the test set is evaluated at
/// every multiple of it as well as at each epoch's end, each after a sync
/// (in the foreground even with one cluster, whose syncs otherwise run
/// beside training), and training goes on from the step evaluated.
#[test]
fn val_every_evaluates_at_its_multiples_and_each_epochs_end_after_a_sync() {
    // (clusters, val_every, (epoch, step) of each evaluation)
    type Case = (usize, Option<u64>, &'static [(u64, u64)]);
    let cases: [Case; 4] = [
        (2, None, &[(0, 4), (1, 8)]),
        (2, Some(3), &[(0, 3), (0, 4), (1, 6), (1, 8)]),
        (1, None, &[(0, 8), (1, 16)]),
        (1, Some(5), &[(0, 5), (0, 8), (1, 10), (1, 15), (1, 16)]),
    ];
    for (clusters, val_every, want) in cases {
        let (mut run, effects) = recovery_run_with(clusters, None);
        run.spec.training.val_every = val_every;
        let mut sim = Sim::new(10..10 + 2 * clusters as u64);
        sim.push(effects);
        sim.run_until(&mut run, JobRun::is_over);
        let evaluated: Vec<(u64, u64)> = sim
            .out
            .iter()
            .filter_map(|e| match e {
                Effect::Epoch(r) => Some((r.epoch, r.step)),
                _ => None,
            })
            .collect();
        assert_eq!(
            evaluated, want,
            "{clusters} clusters, val_every {val_every:?}"
        );
        let resumes = sim.resume_steps();
        for (_, step) in want {
            assert!(resumes.contains(step), "no sync at {step}: {resumes:?}");
        }
        let steps: Vec<u64> = sim.steps().iter().map(|s| s.0).collect();
        assert_eq!(steps, (0..8 * (3 - clusters as u64)).collect::<Vec<_>>());
        assert!(sim.completed().is_some());
    }
}

/// Each step's record puts the plan's estimate of every stage's compute
/// beside what the stage measured, so a plan's error shows per stage.
#[test]
fn step_records_carry_the_plans_estimate_beside_each_stages_measured_compute() {
    let (mut run, effects) = recovery_run(None);
    let planned: Vec<Vec<f64>> = run
        .clusters
        .iter()
        .map(|c| c.stages.iter().map(|s| s.planned_ms).collect())
        .collect();
    assert!(planned.iter().flatten().all(|&p| p > 0.0), "{planned:?}");
    let mut sim = Sim::new(10..14);
    sim.push(effects);
    sim.run_until(&mut run, JobRun::is_over);
    let mut records = 0;
    for e in &sim.out {
        if let Effect::Step(s) = e {
            records += 1;
            assert_eq!(s.stages.len(), 4);
            for t in &s.stages {
                assert_eq!(t.planned_ms, planned[t.cluster as usize][t.stage as usize]);
                assert!(t.compute_ms > 0.0);
            }
        }
    }
    assert_eq!(records, 8);
}
