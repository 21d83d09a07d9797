//! Per-token labels with ignored targets: the labels travel whole to the
//! Leaf, the step's mean divides by the counted targets of the whole step,
//! and accuracy counts tokens.

use super::*;

/// 8 samples of 3 labels, the middle one ignored: every sample counts 2
/// targets, whatever the seeded order puts in a batch.
fn token_data() -> Dataset {
    let Samples::Arrays { inputs, .. } = data(8).samples else {
        unreachable!("data() holds arrays")
    };
    Dataset {
        sample_shape: vec![4],
        label_shape: vec![3],
        samples: Samples::Arrays {
            inputs,
            labels: Labels::Classes((0..8).flat_map(|i| [i % 3, -100, (i + 1) % 3]).collect()),
        },
    }
}

fn one_cluster_over(train: Dataset) -> (JobRun, Vec<Effect>) {
    let graph = rookery_model::from_toml(MLP).unwrap();
    let mut spec = spec();
    spec.training.clusters = ClusterCount::Fixed(1);
    let plan = two_stage_plan(&graph, 10..12, 1);
    let ids = (10..12).map(|i| (i.to_string(), i)).collect();
    let analysis = graph.analyze().unwrap();
    JobRun::start(
        1,
        spec,
        graph.clone(),
        &analysis,
        &plan,
        &ids,
        train,
        None,
        None,
    )
    .unwrap()
}

fn leaf_loss(micro: u32, loss_sum: f64, correct: u64) -> ToServer {
    ToServer::LeafLoss(LeafLoss {
        job_id: 1,
        phase: Phase::Train { step: 0 },
        micro,
        loss_sum,
        correct,
        samples: 2,
    })
}

#[test]
fn token_labels_reach_the_leaf_whole_and_the_step_mean_divides_by_counted_targets() {
    let (mut run, _) = one_cluster_over(token_data());
    let (root, leaf) = (
        run.clusters[0].stages[0].provider,
        run.clusters[0].stages[1].provider,
    );
    let boundary = run.clusters[0].stages[0].outputs[0].0.clone();
    run.on_message(root, ToServer::Ready { job_id: 1 });
    let effects = run.on_message(leaf, ToServer::Ready { job_id: 1 });
    let feeds = sends(&effects);
    assert_eq!(feeds.len(), 2, "batch 4 in 2 micro-batches");
    for (_, m) in &feeds {
        let ToProvider::Forward(f) = m else {
            panic!("{m:?}")
        };
        // 4 samples, 8 counted targets (4 ignored).
        assert_eq!((f.step_samples, f.step_targets), (4, 8));
    }

    let mut seen = Vec::new();
    for micro in 0..2 {
        let relayed = run.on_message(root, activations(0, micro, &[2, 8], &boundary));
        let [(to, ToProvider::Forward(f))] = sends(&relayed)[..] else {
            panic!("{relayed:?}")
        };
        assert_eq!((to, f.step_targets), (leaf, 8));
        let labels = f.labels.as_ref().unwrap();
        assert_eq!(labels.shape, [2, 3], "a micro-batch's labels: [samples, T]");
        let values = labels.to_i64().unwrap();
        assert_eq!(values.iter().filter(|&&v| v == -100).count(), 2);
        seen.extend(values);
    }
    assert_eq!(seen.len(), 12);

    // More correct tokens than the micro-batch counts is a fault.
    let over = run.on_message(leaf, leaf_loss(0, 4.0, 5));
    assert_eq!(faults(&over).len(), 1, "{over:?}");
}

#[test]
fn the_step_loss_is_the_sum_over_the_step_counted_targets() {
    let (mut run, _) = one_cluster_over(token_data());
    let (root, leaf) = (
        run.clusters[0].stages[0].provider,
        run.clusters[0].stages[1].provider,
    );
    let boundary = run.clusters[0].stages[0].outputs[0].0.clone();
    run.on_message(root, ToServer::Ready { job_id: 1 });
    run.on_message(leaf, ToServer::Ready { job_id: 1 });
    for micro in 0..2 {
        run.on_message(root, activations(0, micro, &[2, 8], &boundary));
        // Each micro-batch: 4 counted targets, all 4 correct, summed loss 3.
        assert!(run.on_message(leaf, leaf_loss(micro, 3.0, 4)).is_empty());
    }
    run.on_message(root, step_done());
    let effects = run.on_message(leaf, step_done());
    let Some(Effect::Step(record)) = effects.iter().find(|e| matches!(e, Effect::Step(_))) else {
        panic!("{effects:?}")
    };
    // 6 / 8 targets, not 6 / 4 samples.
    assert!((record.loss - 0.75).abs() < 1e-12, "{}", record.loss);
}

fn step_done() -> ToServer {
    ToServer::StepDone(StepDone {
        job_id: 1,
        step: 0,
        compute_ms: 1.0,
        peak_held: 1,
    })
}
