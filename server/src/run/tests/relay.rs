//! Feeding Roots, relaying both ways, and dropping frames that are wrong, late or foreign.

use super::*;

#[test]
fn the_server_feeds_roots_relays_both_ways_and_averages_at_sync() {
    let (mut run, effects) = started();
    let assigns = sends(&effects);
    assert_eq!(assigns.len(), 4);
    assert!(
        assigns
            .iter()
            .all(|(_, m)| matches!(m, ToProvider::Assign(_)))
    );
    let [[root0, leaf0], [root1, leaf1]] = roles(&run);
    let boundary = run.clusters[0].stages[0].outputs[0].0.clone();

    // Nothing starts until every stage is ready; then each Root gets its micro-batches.
    for p in [root0, leaf0, root1] {
        assert!(run.on_message(p, ToServer::Ready { job_id: 1 }).is_empty());
    }
    let effects = run.on_message(leaf1, ToServer::Ready { job_id: 1 });
    assert!(matches!(effects[0], Effect::Running));
    let feeds = sends(&effects);
    assert_eq!(feeds.len(), 4);
    for (p, m) in &feeds {
        let ToProvider::Forward(f) = m else {
            panic!("{m:?}")
        };
        assert!([root0, root1].contains(p));
        assert_eq!((f.step_samples, f.inputs[0].shape.clone()), (4, vec![2, 4]));
        assert!(f.labels.is_none(), "labels wait for the Leaf");
    }

    // A wrongly shaped activation is dropped (a fault); a good one reaches
    // the Leaf with its labels.
    let dropped = run.on_message(root0, activations(0, 0, &[3, 8], &boundary));
    assert!(sends(&dropped).is_empty());
    assert_eq!(faults(&dropped).len(), 1);
    assert!(
        run.on_message(root0, activations(1, 0, &[2, 8], &boundary))
            .is_empty()
    );
    let relayed = run.on_message(root0, activations(0, 0, &[2, 8], &boundary));
    let [(to, ToProvider::Forward(f))] = sends(&relayed)[..] else {
        panic!("{relayed:?}")
    };
    assert_eq!(to, leaf0);
    assert_eq!(f.labels.as_ref().map(|l| l.shape.clone()), Some(vec![2]));

    // Gradients go back to the Root.
    let grads = ToServer::Gradients(Gradients {
        job_id: 1,
        step: 0,
        micro: 0,
        grads: vec![WireTensor::from_f32(
            &boundary,
            &[2, 8],
            &[0.1; 16],
            WireDType::F32,
        )],
        compute_ms: 1.0,
    });
    let back = run.on_message(leaf0, grads.clone());
    assert!(matches!(sends(&back)[..], [(p, ToProvider::Backward(_))] if p == root0));

    // A replayed relay (which the next stage would refuse, failing the job
    // in the honest provider's name) is dropped as a fault of its sender.
    for (from, again) in [
        (root0, activations(0, 0, &[2, 8], &boundary)),
        (leaf0, grads),
    ] {
        let replayed = run.on_message(from, again);
        assert!(sends(&replayed).is_empty(), "{replayed:?}");
        let [
            Effect::Fault {
                provider, reason, ..
            },
        ] = &replayed[..]
        else {
            panic!("{replayed:?}")
        };
        assert_eq!(*provider, from);
        assert!(reason.contains("already relayed"), "{reason}");
    }

    // Losses from every micro-batch of both clusters, then StepDone: a step
    // record and a sync.
    for (c, leaf) in [(0, leaf0), (1, leaf1)] {
        for micro in 0..2 {
            if c == 1 || micro == 1 {
                let root = if c == 0 { root0 } else { root1 };
                run.on_message(root, activations(0, micro, &[2, 8], &boundary));
            }
            let loss = ToServer::LeafLoss(LeafLoss {
                job_id: 1,
                phase: Phase::Train { step: 0 },
                micro,
                loss_sum: 2.0,
                correct: 1,
                samples: 2,
            });
            assert!(run.on_message(leaf, loss).is_empty());
        }
    }
    let done = |step| {
        ToServer::StepDone(StepDone {
            job_id: 1,
            step,
            compute_ms: 3.0,
            peak_held: 1,
        })
    };
    // A cluster that finished its step has its stages' work credited;
    // nothing else happens before the last cluster finishes.
    for p in [root0, leaf0, root1] {
        let effects = run.on_message(p, done(0));
        assert!(
            effects.iter().all(|e| matches!(e, Effect::Worked { .. })),
            "{effects:?}"
        );
    }
    let effects = run.on_message(leaf1, done(0));
    let Some(Effect::Step(record)) = effects.iter().find(|e| matches!(e, Effect::Step(_))) else {
        panic!("{effects:?}")
    };
    assert!((record.loss - 1.0).abs() < 1e-12, "8 samples, loss sum 8");
    assert_eq!(record.stages.len(), 4);
    let uploads = sends(&effects);
    assert_eq!(uploads.len(), 4);
    assert!(
        uploads
            .iter()
            .all(|(_, m)| matches!(m, ToProvider::UploadParams { step: 1, .. }))
    );

    // Each cluster uploads its own values; everyone gets the average back.
    let mut last = Vec::new();
    for (c, stage, p) in [(0, 0, root0), (0, 1, leaf0), (1, 0, root1), (1, 1, leaf1)] {
        let value = if c == 0 { 1.0 } else { 3.0 };
        let params = run.clusters[c].stages[stage]
            .params
            .iter()
            .map(|n| {
                let shape = run.params[n].shape.clone();
                let len = shape.iter().product();
                WireTensor::from_f32(n.clone(), &shape, &vec![value; len], WireDType::F32)
            })
            .collect();
        last = run.on_message(
            p,
            ToServer::Params(ParamSet {
                job_id: 1,
                step: 1,
                params,
            }),
        );
        last = settle(&mut run, last);
    }
    let sets = sends(&last);
    assert_eq!(
        (sets.len(), last.len()),
        (8, 10),
        "4 SetParams, 4 forwards, a checkpoint and its resume point"
    );
    assert!(
        last.iter()
            .any(|e| matches!(e, Effect::ResumePoint(r) if r.step == 1))
    );
    for (_, m) in sets.iter().take(4) {
        let ToProvider::SetParams(set) = m else {
            panic!("{m:?}")
        };
        for t in &set.params {
            assert!(t.to_f32().unwrap().iter().all(|&v| v == 2.0), "{}", t.name);
        }
    }
    assert!(
        last.iter()
            .any(|e| matches!(e, Effect::Checkpoint(w) if w.len() == 4))
    );
    // And step 1 starts.
    assert!(
        sends(&last)[4..].iter().all(
            |(_, m)| matches!(m, ToProvider::Forward(f) if f.phase == Phase::Train { step: 1 })
        )
    );
}

#[test]
fn wrong_data_is_dropped_as_a_fault_of_its_sender_and_late_frames_are_not() {
    let (mut run, _) = started();
    let [[root0, leaf0], _] = roles(&run);
    for p in run.providers() {
        run.on_message(p, ToServer::Ready { job_id: 1 });
    }
    let boundary = run.clusters[0].stages[0].outputs[0].0.clone();
    let input = run.graph_input.0.clone();
    let nan = ToServer::Activations(Activations {
        job_id: 1,
        phase: Phase::Train { step: 0 },
        micro: 0,
        outputs: vec![WireTensor::from_f32(
            &boundary,
            &[2, 8],
            &[f32::NAN; 16],
            WireDType::F32,
        )],
        compute_ms: 1.0,
    });
    let mut other_job = activations(0, 0, &[2, 8], &boundary);
    if let ToServer::Activations(a) = &mut other_job {
        a.job_id = 2;
    }
    // (what, sender, frame, the reason names)
    let faulty: [(&str, u64, ToServer, &str); 6] = [
        ("another job's frame", root0, other_job, "job 2"),
        (
            "another job's Ready",
            root0,
            ToServer::Ready { job_id: 2 },
            "job 2",
        ),
        (
            "a wrong shape",
            root0,
            activations(0, 0, &[2, 9], &boundary),
            "shape",
        ),
        (
            "another stage's tensor",
            root0,
            activations(0, 0, &[2, 4], &input),
            "expected",
        ),
        (
            "the Leaf's activations",
            leaf0,
            activations(0, 0, &[2, 8], &boundary),
            "Leaf",
        ),
        ("a NaN", root0, nan, "finite"),
    ];
    for (what, sender, frame, names) in faulty {
        let effects = run.on_message(sender, frame);
        let found = faults(&effects);
        assert_eq!(found.len(), 1, "{what}: {effects:?}");
        let (provider, reason, dropped) = found[0];
        assert_eq!((provider, dropped), (sender, true), "{what}");
        assert!(reason.contains(names), "{what}: {reason}");
        assert_eq!(effects.len(), 1, "{what}: nothing is relayed");
    }
    // A late frame (a step that is not running) is dropped but no fault,
    // and the good frame still goes through.
    assert!(
        run.on_message(root0, activations(1, 0, &[2, 8], &boundary))
            .is_empty()
    );
    let relayed = run.on_message(root0, activations(0, 0, &[2, 8], &boundary));
    assert!(matches!(sends(&relayed)[..], [(p, ToProvider::Forward(_))] if p == leaf0));
}

#[test]
fn frames_for_another_job_or_from_strangers_are_dropped() {
    let (mut run, _) = started();
    assert!(run.on_message(99, ToServer::Ready { job_id: 1 }).is_empty());
    let [[root0, ..], _] = roles(&run);
    let dropped = run.on_message(root0, ToServer::Ready { job_id: 2 });
    assert!(matches!(&dropped[..], [Effect::Fault { .. }]));
    assert!(!run.clusters[0].stages[0].ready);
}

#[test]
fn a_stage_fails_the_job_only_on_three_identities_with_the_same_cause() {
    let (mut run, _) = started();
    let failed = |message: &str| ToServer::JobFailed {
        job_id: 1,
        message: message.into(),
    };
    // One provider's failure loses it the stage (dropped, a fault), whatever
    // it claims; the same provider saying it twice counts once.
    for (provider, cause) in [(10, "out of memory"), (10, "out of memory"), (11, "no")] {
        run.clusters[0].stages[0].provider = provider;
        let effects = run.on_message(provider, failed(cause));
        assert!(
            matches!(&effects[..], [Effect::Log { .. }, Effect::Fault { provider: p, frame_dropped: true, .. }] if *p == provider),
            "{effects:?}"
        );
        assert!(!run.is_over());
    }
    run.clusters[0].stages[0].provider = 12;
    assert!(
        !run.on_message(12, failed("out of memory"))
            .iter()
            .any(|e| matches!(e, Effect::Failed(_)))
    );
    // A new connection of an identity that failed already counts no more.
    run.clusters[0].stages[0].provider = 20;
    let again = run.on_message_from(20, 12, failed("out of memory"));
    assert!(
        !again.iter().any(|e| matches!(e, Effect::Failed(_))),
        "{again:?}"
    );
    // The third distinct provider with the same cause ends the job with it.
    run.clusters[0].stages[0].provider = 13;
    let effects = run.on_message(13, failed("out of memory"));
    assert!(
        matches!(&effects[..], [Effect::Failed(m)] if m.contains("3 providers: out of memory")),
        "{effects:?}"
    );
    assert!(run.is_over());
}
