//! A residual stream crosses a cut as several tensors. Executors list a
//! stage's inputs in the order its nodes first read them, which need not be
//! the plan's order (a 14M GPT's Leaf sent `_unsafe_view_3` before
//! `add_422`): gradients are checked by name, each once.

use rookery_model::{DType, Init, Input, Node, Op, Param, ParamKind};
use rookery_plan::BoundaryTensor;

use super::*;

/// x -> n0 Linear -> n1 Relu -> n2 Linear -> n3 Add(n2, n0) -> n4 Linear [3].
fn residual_graph() -> Graph {
    let mut g = Graph {
        inputs: vec![Input {
            name: "x".into(),
            shape: vec![1, 4],
            dtype: DType::F32,
        }],
        ..Graph::default()
    };
    let linear = |g: &mut Graph, name: &str, input: &str, out: usize| {
        for (what, shape, init) in [
            ("weight", vec![out, 4], Init::torch_weight(4)),
            ("bias", vec![out], Init::torch_bias(4)),
        ] {
            g.params.push(Param {
                name: format!("{name}.{what}"),
                shape,
                dtype: DType::F32,
                kind: ParamKind::Trainable,
                init,
            });
        }
        g.nodes.push(Node {
            name: name.into(),
            op: Op::Linear,
            inputs: vec![
                input.into(),
                format!("{name}.weight"),
                format!("{name}.bias"),
            ],
        });
    };
    linear(&mut g, "n0", "x", 4);
    g.nodes.push(Node {
        name: "n1".into(),
        op: Op::Relu,
        inputs: vec!["n0".into()],
    });
    linear(&mut g, "n2", "n1", 4);
    g.nodes.push(Node {
        name: "n3".into(),
        op: Op::Add,
        inputs: vec!["n2".into(), "n0".into()],
    });
    linear(&mut g, "n4", "n3", 3);
    g.outputs = vec!["n4".into()];
    g
}

fn grads(names: &[&str]) -> ToServer {
    ToServer::Gradients(Gradients {
        job_id: 1,
        step: 0,
        micro: 0,
        grads: names
            .iter()
            .map(|n| WireTensor::from_f32(*n, &[2, 4], &[0.1; 8], WireDType::F32))
            .collect(),
        compute_ms: 1.0,
    })
}

/// Root `x .. n2`, Leaf `n3, n4`: `n0` and `n2` cross, in that order.
fn started() -> JobRun {
    let graph = residual_graph();
    let mut spec = spec();
    spec.training.clusters = ClusterCount::Fixed(1);
    let analysis = graph.analyze().unwrap();
    let mut plan = two_stage_plan(&graph, 10..12, 1);
    let names: Vec<String> = analysis.nodes.iter().map(|n| n.name.clone()).collect();
    let cut = names.iter().position(|n| n == "n3").unwrap();
    let crossing: Vec<BoundaryTensor> = ["n0", "n2"]
        .iter()
        .map(|n| BoundaryTensor {
            name: (*n).into(),
            shape: vec![2, 4],
            dtype: DType::F32,
            bytes_per_micro_batch: 32,
        })
        .collect();
    let params = |nodes: &[&str]| -> Vec<String> {
        nodes
            .iter()
            .flat_map(|n| [format!("{n}.weight"), format!("{n}.bias")])
            .collect()
    };
    let [root, leaf] = &mut plan.clusters[0].stages[..] else {
        panic!("two stages")
    };
    (root.end, leaf.first) = (cut, cut);
    root.nodes = names[..cut].to_vec();
    leaf.nodes = names[cut..].to_vec();
    root.params = params(&["n0", "n2"]);
    leaf.params = params(&["n4"]);
    root.outputs = crossing.clone();
    leaf.inputs = crossing;
    let ids = (10..12).map(|i: u64| (i.to_string(), i)).collect();
    let (mut run, _) =
        JobRun::start(1, spec, graph, &analysis, &plan, &ids, data(8), None, None).unwrap();
    for p in run.providers() {
        run.on_message(p, ToServer::Ready { job_id: 1 });
    }
    let root = run.clusters[0].stages[0].provider;
    run.on_message(
        root,
        ToServer::Activations(Activations {
            job_id: 1,
            phase: Phase::Train { step: 0 },
            micro: 0,
            outputs: ["n0", "n2"]
                .iter()
                .map(|n| WireTensor::from_f32(*n, &[2, 4], &[0.5; 8], WireDType::F32))
                .collect(),
            compute_ms: 1.0,
        }),
    );
    run
}

#[test]
fn gradients_in_the_order_an_executor_reads_its_inputs_are_relayed() {
    let mut run = started();
    let [root, leaf] = [
        run.clusters[0].stages[0].provider,
        run.clusters[0].stages[1].provider,
    ];
    // The Leaf's first node, n3 = Add(n2, n0), reads n2 first.
    let back = run.on_message(leaf, grads(&["n2", "n0"]));
    assert!(faults(&back).is_empty(), "{back:?}");
    let [(to, ToProvider::Backward(b))] = sends(&back)[..] else {
        panic!("{back:?}")
    };
    assert_eq!(to, root);
    let names: Vec<&str> = b.grads.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["n2", "n0"]);
}

#[test]
fn a_gradient_sent_twice_or_for_another_tensor_is_a_fault() {
    for (names, reason) in [
        (&["n2", "n2"][..], "twice"),
        (&["n3"][..], "not a float input"),
    ] {
        let mut run = started();
        let leaf = run.clusters[0].stages[1].provider;
        let effects = run.on_message(leaf, grads(names));
        assert!(
            faults(&effects)
                .iter()
                .any(|(p, why, _)| *p == leaf && why.contains(reason)),
            "{names:?}: {effects:?}"
        );
    }
}
