//! Spot checks as the run chooses and keeps them.

use super::*;

/// A run that checks every micro-batch, all stages ready and step 0 fed.
fn checking_everything() -> (JobRun, Vec<Effect>) {
    let (mut run, _) = started();
    run.spec.training.verify_rate = 1.0;
    let [[root0, leaf0], [root1, leaf1]] = roles(&run);
    for p in [root0, leaf0, root1] {
        run.on_message(p, ToServer::Ready { job_id: 1 });
    }
    let effects = run.on_message(leaf1, ToServer::Ready { job_id: 1 });
    (run, effects)
}

fn verifications(effects: &[Effect]) -> Vec<&Verification> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Verify(v) => Some(&**v),
            _ => None,
        })
        .collect()
}

#[test]
fn a_checked_micro_batch_is_handed_over_with_its_input_result_and_checkpoint() {
    let (mut run, fed) = checking_everything();
    let [[root0, leaf0], _] = roles(&run);
    let boundary = run.clusters[0].stages[0].outputs[0].0.clone();
    let (_, ToProvider::Forward(sent)) = sends(&fed)[0] else {
        panic!("{fed:?}")
    };
    let sent = sent.clone();
    // The Root's answer completes its check: the stage from the
    // checkpoint (without optimizer state), the same Forward, its result.
    let answer = activations(0, sent.micro, &[2, 8], &boundary);
    let effects = run.on_message(root0, answer.clone());
    let [check] = verifications(&effects)[..] else {
        panic!("{effects:?}")
    };
    let ToServer::Activations(a) = &answer else {
        unreachable!()
    };
    assert_eq!(
        (check.cluster, check.stage, check.step, check.provider),
        (0, 0, 0, root0)
    );
    assert_eq!(check.forward, sent);
    assert_eq!(check.expected, Outcome::Activations(a.outputs.clone()));
    assert_eq!(check.assignment.start_step, 0);
    assert!(check.assignment.optimizer_state.is_empty());
    assert!(!check.assignment.params.is_empty());
    // The Leaf's check holds what it was relayed (with the labels) and its loss.
    let [(_, ToProvider::Forward(relayed))] = sends(&effects)[..] else {
        panic!("{effects:?}")
    };
    let relayed = relayed.clone();
    let loss = ToServer::LeafLoss(LeafLoss {
        job_id: 1,
        phase: Phase::Train { step: 0 },
        micro: sent.micro,
        loss_sum: 1.25,
        correct: 1,
        samples: 2,
    });
    let effects = run.on_message(leaf0, loss);
    // Its input gradients complete it: they are checked too.
    assert!(verifications(&effects).is_empty(), "{effects:?}");
    let grads = gradients(0, sent.micro, &[2, 8], &boundary);
    let effects = run.on_message(leaf0, grads.clone());
    let [check] = verifications(&effects)[..] else {
        panic!("{effects:?}")
    };
    assert_eq!((check.stage, check.provider), (1, leaf0));
    assert_eq!(check.forward, relayed);
    assert!(check.forward.labels.is_some());
    assert_eq!(check.expected, Outcome::Loss(1.25));
    let ToServer::Gradients(g) = grads else {
        unreachable!()
    };
    assert_eq!(check.expected_grads, Some(g.grads));
    assert_eq!(check.backward, None, "a Leaf computes its own backward");
}

#[test]
fn a_stems_check_holds_the_backward_it_was_sent_and_the_gradients_it_answered() {
    let graph = rookery_model::from_toml(MLP).unwrap();
    let mut spec = spec();
    spec.training.clusters = ClusterCount::Fixed(1);
    spec.training.verify_rate = 1.0;
    let plan = plan_of(&graph, 10..13, 1, 3);
    let ids = (10..13).map(|i| (i.to_string(), i)).collect();
    let analysis = graph.analyze().unwrap();
    let (mut run, _) =
        JobRun::start(1, spec, graph, &analysis, &plan, &ids, data(8), None, None).unwrap();
    let stages = &run.clusters[0].stages;
    assert_eq!(stages.len(), 3);
    let [root, stem, leaf] = [0, 1, 2].map(|s| stages[s].provider);
    let output = |s: usize| run.clusters[0].stages[s].outputs[0].clone();
    let ((root_out, root_shape, _), (stem_out, stem_shape, _)) = (output(0), output(1));
    for p in [root, stem] {
        run.on_message(p, ToServer::Ready { job_id: 1 });
    }
    let fed = run.on_message(leaf, ToServer::Ready { job_id: 1 });
    let micro = match sends(&fed)[0] {
        (_, ToProvider::Forward(f)) => f.micro,
        other => panic!("{other:?}"),
    };
    let shape = |s: &[usize]| [2].into_iter().chain(s.iter().copied()).collect::<Vec<_>>();
    let (root_shape, stem_shape) = (shape(&root_shape), shape(&stem_shape));
    // A Root's check is its forward alone.
    let effects = run.on_message(root, activations(0, micro, &root_shape, &root_out));
    let [check] = verifications(&effects)[..] else {
        panic!("{effects:?}")
    };
    assert_eq!(
        (
            check.stage,
            check.backward.as_ref(),
            check.expected_grads.as_ref()
        ),
        (0, None, None)
    );
    // The Stem's waits for its backward.
    let effects = run.on_message(stem, activations(0, micro, &stem_shape, &stem_out));
    assert!(verifications(&effects).is_empty());
    let loss = ToServer::LeafLoss(LeafLoss {
        job_id: 1,
        phase: Phase::Train { step: 0 },
        micro,
        loss_sum: 0.5,
        correct: 0,
        samples: 2,
    });
    run.on_message(leaf, loss);
    let effects = run.on_message(leaf, gradients(0, micro, &stem_shape, &stem_out));
    let [leaf_check] = verifications(&effects)[..] else {
        panic!("{effects:?}")
    };
    assert_eq!(leaf_check.stage, 2);
    let backward = match sends(&effects)[..] {
        [(to, ToProvider::Backward(b))] if to == stem => b.clone(),
        ref other => panic!("{other:?}"),
    };
    let answered = gradients(0, micro, &root_shape, &root_out);
    let effects = run.on_message(stem, answered.clone());
    let [check] = verifications(&effects)[..] else {
        panic!("{effects:?}")
    };
    let ToServer::Gradients(answered) = answered else {
        unreachable!()
    };
    assert_eq!((check.stage, check.provider), (1, stem));
    assert_eq!(check.backward, Some(backward));
    assert_eq!(check.expected_grads, Some(answered.grads));
}

#[test]
fn a_refused_answer_is_not_checked_and_a_job_without_checks_keeps_none() {
    let (mut run, _) = checking_everything();
    let [[root0, _], _] = roles(&run);
    let boundary = run.clusters[0].stages[0].outputs[0].0.clone();
    // Misshapen: a fault, and nothing to compare.
    let effects = run.on_message(root0, activations(0, 0, &[3, 8], &boundary));
    assert_eq!(faults(&effects).len(), 1);
    assert!(verifications(&effects).is_empty());

    let (mut run, _) = started();
    let [[root0, leaf0], [root1, leaf1]] = roles(&run);
    for p in [root0, leaf0, root1, leaf1] {
        run.on_message(p, ToServer::Ready { job_id: 1 });
    }
    let effects = run.on_message(root0, activations(0, 0, &[2, 8], &boundary));
    assert!(verifications(&effects).is_empty());
    assert!(run.checks.is_empty());
}
