//! Aggregation at a sync: the mean, and robust rules that outvote a far-off cluster.

use super::*;

#[test]
fn robust_aggregation_outvotes_a_far_off_cluster_and_counts_it_against_its_providers() {
    // (rule, expected aggregate, far-off cluster's providers faulted)
    let cases = [
        (Aggregation::Mean, (1.0 + 1.2 + 1.1 + 1e4) / 4.0, false),
        (Aggregation::Median, 1.15, true),
        (Aggregation::CenteredClip, 1.15, true),
    ];
    for (rule, want, counted) in cases {
        let (mut run, _) = started_with(4, rule);
        syncing(&mut run);
        let values = [1.0, 1.2, 1.1, 1e4];
        let effects = upload_all(&mut run, |c| values[c]);
        for (name, p) in &run.params {
            let values = p.values();
            let worst = values
                .iter()
                .map(|v| ((v - want) / want).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < 0.05, "{rule:?}: {name} is {:?}", &values[..2]);
        }
        let found = faults(&effects);
        if counted {
            let outlier: Vec<u64> = run.clusters[3].stages.iter().map(|s| s.provider).collect();
            let blamed: Vec<u64> = found.iter().map(|f| f.0).collect();
            assert_eq!(blamed, outlier, "{rule:?}");
            assert!(found.iter().all(|f| !f.2 && f.1.contains("cluster 3")));
        } else {
            assert!(found.is_empty(), "{rule:?}: {found:?}");
        }
        // The sync finishes either way: everyone gets the aggregate.
        assert_eq!(
            sends(&effects)
                .iter()
                .filter(|(_, m)| matches!(m, ToProvider::SetParams(_)))
                .count(),
            8,
            "{rule:?}"
        );
    }
}

#[test]
fn honest_clusters_under_robust_aggregation_are_not_counted() {
    for rule in [Aggregation::Median, Aggregation::CenteredClip] {
        let (mut run, _) = started_with(3, rule);
        syncing(&mut run);
        let effects = upload_all(&mut run, |c| 1.0 + 0.01 * c as f32);
        assert!(faults(&effects).is_empty(), "{rule:?}");
    }
}

#[test]
fn several_clusters_are_combined_off_the_run_and_the_result_completes_the_sync() {
    let (mut run, _) = started_with(2, Aggregation::Mean);
    syncing(&mut run);
    let before: BTreeMap<String, Vec<f32>> = run
        .params
        .iter()
        .map(|(n, v)| (n.clone(), v.values()))
        .collect();
    let effects = upload_all_raw(&mut run, |c| [1.0, 3.0][c]);
    // Nothing goes out and nothing changes until the work's result is in.
    let [Effect::Aggregate(work)] = effects.as_slice() else {
        panic!("{effects:?}")
    };
    assert_eq!(work.step_done, 1);
    assert!(matches!(run.state, State::Syncing { step_done: 1 }));
    for (n, v) in &run.params {
        assert_eq!(v.values(), before[n], "{n}");
    }
    let Some(Effect::Aggregate(work)) = effects.into_iter().next() else {
        unreachable!()
    };
    let done = run.on_aggregated(work.run());
    for v in run.params.values() {
        assert!(v.values().iter().all(|&x| x == 2.0));
    }
    let set_params = sends(&done)
        .iter()
        .filter(|(_, m)| matches!(m, ToProvider::SetParams(_)))
        .count();
    assert_eq!(set_params, 4);
    assert!(
        done.iter()
            .any(|e| matches!(e, Effect::ResumePoint(r) if r.step == 1))
    );
    assert_eq!(run.synced, 1);
}

#[test]
fn an_aggregation_that_finishes_after_its_sync_was_abandoned_changes_nothing() {
    let (mut run, _) = started_with(2, Aggregation::Mean);
    syncing(&mut run);
    let before: BTreeMap<String, Vec<f32>> = run
        .params
        .iter()
        .map(|(n, v)| (n.clone(), v.values()))
        .collect();
    let Some(Effect::Aggregate(work)) = upload_all_raw(&mut run, |c| [1.0, 3.0][c]).pop() else {
        panic!("no aggregation asked for")
    };
    // A stage is lost while the work runs: the sync is redone later.
    let leaf1 = run.clusters[1].stages[1].provider;
    run.stage_lost(leaf1, "killed").unwrap();
    assert!(run.on_aggregated(work.run()).is_empty());
    for (n, v) in &run.params {
        assert_eq!(v.values(), before[n], "{n}");
    }
    assert_eq!(run.synced, 0);
}

#[test]
fn every_frame_checkpoint_and_resume_point_shares_the_one_buffer_of_each_parameter() {
    let same = |a: &WireTensor, v: &ParamValue| a.data.as_ptr() == v.data.as_ptr();
    let (mut run, effects) = started_with(2, Aggregation::Mean);
    let mut assigned = 0;
    for (_, m) in sends(&effects) {
        let ToProvider::Assign(a) = m else { continue };
        for t in &a.params {
            assert!(
                same(t, &run.params[&t.name]),
                "Assign's `{}` is a copy",
                t.name
            );
            assigned += 1;
        }
    }
    assert_eq!(assigned, 2 * run.params.len());
    syncing(&mut run);
    let effects = upload_all(&mut run, |c| [1.0, 3.0][c]);
    for effect in &effects {
        let tensors: Vec<&WireTensor> = match effect {
            Effect::Send(_, ToProvider::SetParams(set)) => set.params.iter().collect(),
            Effect::Checkpoint(w) => w.iter().collect(),
            Effect::ResumePoint(r) => r.params.iter().collect(),
            _ => continue,
        };
        for t in tensors {
            assert!(same(t, &run.params[&t.name]), "`{}` is a copy", t.name);
        }
    }

    // One cluster: its upload becomes the parameter as it arrived.
    let (mut run, _) = started_with(1, Aggregation::Mean);
    syncing(&mut run);
    let mut uploaded = Vec::new();
    for s in 0..2 {
        let params = stage_params(&run, s, WireDType::F32);
        uploaded.extend(params.iter().map(|t| (t.name.clone(), t.data.as_ptr())));
        let effects = upload(&mut run, s, params);
        assert!(!effects.iter().any(|e| matches!(e, Effect::Aggregate(_))));
    }
    for (name, at) in uploaded {
        assert_eq!(run.params[&name].data.as_ptr(), at, "`{name}` was copied");
    }
}

/// Every stage of `run` sends optimizer state for the sync of step 1, each
/// slot of cluster `c` all `value(c)`, its step count `steps(c)`.
/// Every parameter of cluster 0's stage `s`, all 0.5, as `dtype`.
fn stage_params(run: &JobRun, s: usize, dtype: WireDType) -> Vec<WireTensor> {
    run.clusters[0].stages[s]
        .params
        .iter()
        .map(|name| {
            let shape = run.params[name].shape.clone();
            let n: usize = shape.iter().product();
            WireTensor::from_f32(name, &shape, &vec![0.5; n], dtype)
        })
        .collect()
}

/// Cluster 0's stage `s` uploads `params` at the sync after step 1.
fn upload(run: &mut JobRun, s: usize, params: Vec<WireTensor>) -> Vec<Effect> {
    let provider = run.clusters[0].stages[s].provider;
    run.on_message(
        provider,
        ToServer::Params(ParamSet {
            job_id: 1,
            step: 1,
            params,
        }),
    )
}

fn optimizer_all(run: &mut JobRun, value: impl Fn(usize) -> f32, steps: impl Fn(usize) -> u64) {
    let answers = each_stage_sends(run, |c, params| {
        ToServer::OptimizerState(OptimizerState {
            job_id: 1,
            step: 1,
            params: params
                .iter()
                .map(|(name, shape)| ParamOptimState {
                    name: name.clone(),
                    steps: steps(c),
                    slots: ["exp_avg", "exp_avg_sq"]
                        .iter()
                        .flat_map(|slot| filled(slot, shape, value(c)))
                        .collect(),
                })
                .collect(),
        })
    });
    for effects in answers {
        assert!(faults(&effects).is_empty(), "{effects:?}");
    }
}

#[test]
fn average_optimizer_combines_the_clusters_moments_and_sends_them_before_the_parameters() {
    for average in [false, true] {
        let (mut run, _) = started_with(2, Aggregation::Mean);
        run.spec.training.average_optimizer = average;
        syncing(&mut run);
        optimizer_all(&mut run, |c| [2.0, 6.0][c], |c| [1, 3][c]);
        let effects = upload_all(&mut run, |c| [1.0, 3.0][c]);
        let sent = sends(&effects);
        let states: Vec<(u64, &OptimizerState)> = sent
            .iter()
            .filter_map(|(p, m)| match m {
                ToProvider::SetOptimizerState(o) => Some((*p, o)),
                _ => None,
            })
            .collect();
        let resume = resume_point(&effects).unwrap();
        if !average {
            assert!(states.is_empty(), "{states:?}");
            // Each cluster keeps its own moments in the checkpoint.
            let first = |c: usize| resume.optimizer[c][0].slots[0].to_f32().unwrap()[0];
            assert_eq!((first(0), first(1)), (2.0, 6.0));
            continue;
        }
        // Every stage of both clusters gets the mean of its parameters' state.
        assert_eq!(states.len(), 4, "{states:?}");
        for (provider, o) in &states {
            let (c, s) = run.locate(*provider).unwrap();
            let names: Vec<&String> = o.params.iter().map(|p| &p.name).collect();
            assert_eq!(
                names,
                run.clusters[c].stages[s].params.iter().collect::<Vec<_>>()
            );
            for p in &o.params {
                assert_eq!(p.steps, 3);
                for slot in &p.slots {
                    assert!(slot.to_f32().unwrap().iter().all(|&v| v == 4.0), "{slot:?}");
                }
            }
            // Sent before the same stage's SetParams.
            let at = |f: &dyn Fn(&ToProvider) -> bool| {
                sent.iter()
                    .position(|(p, m)| p == provider && f(m))
                    .unwrap()
            };
            assert!(
                at(&|m| matches!(m, ToProvider::SetOptimizerState(_)))
                    < at(&|m| matches!(m, ToProvider::SetParams(_)))
            );
        }
        // The checkpoint holds the combined state for each cluster.
        for cluster in &resume.optimizer {
            assert!(
                cluster
                    .iter()
                    .all(|p| p.slots[1].to_f32().unwrap()[0] == 4.0)
            );
        }
    }
}

#[test]
fn a_job_with_several_clusters_ends_with_each_clusters_own_weights_beside_the_combined() {
    let (mut run, _) = started_with(2, Aggregation::Mean);
    run.total_steps = 1;
    syncing(&mut run);
    let effects = upload_all(&mut run, |c| [1.0, 3.0][c]);
    let weights = trained(&effects).expect("the last sync completes the job");
    assert_eq!(weights.clusters.len(), 2);
    let names = |w: &[WireTensor]| w.iter().map(|t| t.name.clone()).collect::<BTreeSet<_>>();
    for (c, want) in [(0, 1.0), (1, 3.0)] {
        let own = &weights.clusters[c];
        assert_eq!(names(own), names(&weights.combined), "cluster {c}");
        assert!(
            own.iter()
                .all(|t| t.to_f32().unwrap().iter().all(|&v| v == want))
        );
    }
    assert!(
        weights
            .combined
            .iter()
            .all(|t| t.to_f32().unwrap().iter().all(|&v| v == 2.0))
    );

    // One cluster's weights are the combined ones: nothing kept twice.
    let (mut single, _) = started_with(1, Aggregation::Mean);
    single.total_steps = 1;
    syncing(&mut single);
    let effects = upload_all(&mut single, |_| 1.0);
    assert!(trained(&effects).unwrap().clusters.is_empty());
}

#[test]
fn parameters_uploaded_as_int8_are_refused() {
    let (mut run, _) = started_with(2, Aggregation::Mean);
    syncing(&mut run);
    let provider = run.clusters[0].stages[0].provider;
    let params = stage_params(&run, 0, WireDType::I8Block);
    let effects = upload(&mut run, 0, params);
    let found = faults(&effects);
    assert!(
        found.len() == 1 && found[0].0 == provider && found[0].1.contains("is int8"),
        "{found:?}"
    );
    assert!(!run.clusters[0].stages[0].uploaded);
}
