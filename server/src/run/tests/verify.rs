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
    let [check] = verifications(&effects)[..] else {
        panic!("{effects:?}")
    };
    assert_eq!((check.stage, check.provider), (1, leaf0));
    assert_eq!(check.forward, relayed);
    assert!(check.forward.labels.is_some());
    assert_eq!(check.expected, Outcome::Loss(1.25));
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
