//! Weight stashing (PipeDream-2BW) on the libtorch executor, proven against
//! plain executors holding the weights each micro-batch must see: a
//! micro-batch forwarded before a step backpropagates through the weights
//! its forward used (bit for bit), and the next step applies its gradients to
//! the weights that step produced.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]

mod exec_common;

use std::collections::BTreeMap;

use exec_common::*;
use rookery_model::{Graph, Op, from_toml};
use rookery_torch::exec::{
    OptimizerConfig, TorchExecutor, TorchOptimizer, WeightVersion, stage_boundary,
};
use tch::{Device, Tensor};

type Named = Vec<(String, Tensor)>;

/// The MLP's last nodes as a stage (so its input needs a gradient) and
/// micro-batches of its input: the first node's outputs on pseudo-random data.
fn mlp_stage() -> (
    Graph,
    std::ops::Range<usize>,
    BTreeMap<String, Tensor>,
    Vec<Named>,
) {
    let g = from_toml(MLP).unwrap();
    let n = g.nodes.len();
    let params = init_params(&g, 17);
    let first = TorchExecutor::new(
        &g,
        0..1,
        stage_boundary(&g, 1).unwrap(),
        owned(&params),
        Device::Cpu,
    )
    .unwrap();
    let micro_batches = (0..4)
        .map(|k| {
            let x = Tensor::from_slice(&pseudo(3 * 6, 40 + k)).reshape([3, 6]);
            first.evaluate(&[("input".into(), x)]).unwrap()
        })
        .collect();
    (g, 1..n, params, micro_batches)
}

fn executor(
    g: &Graph,
    range: &std::ops::Range<usize>,
    params: Named,
    stash: bool,
) -> TorchExecutor {
    let outputs = stage_boundary(g, range.end).unwrap();
    TorchExecutor::new(g, range.clone(), outputs, params, Device::Cpu)
        .unwrap()
        .with_stash_weights(stash)
}

/// Pseudo-random gradients for `outputs`.
fn output_grads(outputs: &Named, seed: u64) -> Named {
    outputs
        .iter()
        .map(|(n, y)| {
            let g = Tensor::from_slice(&pseudo(y.numel(), seed)).reshape(y.size());
            (n.clone(), g)
        })
        .collect()
}

/// Exact equality, name by name (`torch.equal`: values, so -0 == 0).
fn assert_same(got: &Named, want: &Named, what: &str) {
    let names = |v: &Named| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(got), names(want), "{what}: names");
    for ((n, a), (_, b)) in got.iter().zip(want) {
        assert!(a.equal(b), "{what}: `{n}` differs\n got {a}\nwant {b}");
    }
}

/// `latest` extrapolated by the update from `before` (every parameter here
/// is trainable), as `rookery_stage::extrapolate` computes each element.
fn predicted(latest: &Named, before: &Named) -> Named {
    latest
        .iter()
        .map(|(n, l)| {
            let (_, b) = before.iter().find(|(m, _)| m == n).unwrap();
            (n.clone(), l + (l - b))
        })
        .collect()
}

fn copies(v: &Named) -> Named {
    v.iter().map(|(n, t)| (n.clone(), t.copy())).collect()
}

fn optimizers() -> [OptimizerConfig; 2] {
    [
        OptimizerConfig::Sgd {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.01,
        },
        OptimizerConfig::adam(0.01),
    ]
}

#[test]
fn a_micro_batch_forwarded_before_a_step_backpropagates_through_its_weights_and_feeds_the_next_step()
 {
    for config in optimizers() {
        let (g, range, init, mbs) = mlp_stage();
        let mut stash = executor(&g, &range, owned(&init), true);
        let mut stash_opt = TorchOptimizer::new(config).unwrap();
        // `a` takes the barrier's step and step 0 as a plain executor
        // would: W_init, then W0, then W1.
        let mut a = executor(&g, &range, owned(&init), false);
        let mut a_opt = TorchOptimizer::new(config).unwrap();

        // The barrier's step, its update with nothing in flight (the step
        // after it waits for it).
        for e in [&mut stash, &mut a] {
            e.set_step_seed(99);
            let f = e.forward_at(&mbs[3], true, 0).unwrap();
            let early = e.forward_at(&mbs[2], true, 3).unwrap();
            if e.stash_weights() {
                let err = e.step(&mut stash_opt).unwrap_err();
                assert!(err.to_string().contains("2 micro-batch(es)"), "{err}");
            }
            e.backward(f.micro_batch, &output_grads(&f.outputs, 98))
                .unwrap();
            e.backward(early.micro_batch, &output_grads(&early.outputs, 97))
                .unwrap();
        }
        stash.step(&mut stash_opt).unwrap();
        a.step(&mut a_opt).unwrap();
        let w0 = a.parameters().unwrap();
        // `b` holds W0 extrapolated by that update for step 1's
        // micro-batches.
        let mut b = executor(&g, &range, predicted(&w0, &owned(&init)), false);

        // Step 0 on W0 (`Previous`, what the barrier step's update made),
        // forwards and backwards.
        stash.set_step_seed(100);
        a.set_step_seed(100);
        for (k, mb) in mbs[..2].iter().enumerate() {
            let offset = 3 * k as u64;
            let s = stash
                .forward_version(mb, true, offset, WeightVersion::Previous)
                .unwrap();
            let r = a.forward_at(mb, true, offset).unwrap();
            assert_same(&s.outputs, &r.outputs, "step 0 outputs");
            let grads = output_grads(&r.outputs, 200 + k as u64);
            let s = stash.backward(s.micro_batch, &grads).unwrap();
            let r = a.backward(r.micro_batch, &grads).unwrap();
            assert_same(&s, &r, "step 0 input gradients");
        }
        // Step 1's micro-batches run forward on W0 extrapolated before step 0
        // is applied.
        stash.set_step_seed(101);
        b.set_step_seed(101);
        let mut pending = Vec::new();
        for (k, mb) in mbs[2..].iter().enumerate() {
            let offset = 3 * k as u64;
            let s = stash.forward_at(mb, true, offset).unwrap();
            let r = b.forward_at(mb, true, offset).unwrap();
            assert_same(&s.outputs, &r.outputs, "step 1 outputs");
            pending.push((
                s.micro_batch,
                r.micro_batch,
                output_grads(&r.outputs, 300 + k as u64),
            ));
        }
        assert_same(&stash.gradients().unwrap(), &a.gradients().unwrap(), "g0");
        stash.step(&mut stash_opt).unwrap();
        a.step(&mut a_opt).unwrap();
        let w1 = a.parameters().unwrap();
        assert_same(&stash.parameters().unwrap(), &w1, "W1");
        assert!(
            stash.gradients().unwrap().is_empty(),
            "step 0's gradients are spent"
        );

        // Their backwards use those weights and accumulate g1 alone.
        for (s, r, grads) in pending {
            let s = stash.backward(s, &grads).unwrap();
            let r = b.backward(r, &grads).unwrap();
            assert_same(&s, &r, "step 1 input gradients");
        }
        let g1 = b.gradients().unwrap();
        assert_same(&stash.gradients().unwrap(), &g1, "g1");
        assert_eq!(stash.in_flight(), 0);

        // Step 1 updates W1 (not W0) with g1, continuing the optimizer.
        stash.step(&mut stash_opt).unwrap();
        let w2 = copies(&w1);
        for (name, grad) in &g1 {
            let (_, w) = w2.iter().find(|(n, _)| n == name).unwrap();
            a_opt.update(name, w, grad).unwrap();
        }
        assert_same(&stash.parameters().unwrap(), &w2, "W2 = W1 updated with g1");

        // Previous is now W1 extrapolated by step 0's update, Current W2 by
        // step 1's.
        let p1 = predicted(&w1, &w0);
        let p2 = predicted(&w2, &w1);
        for (p, w) in [(&p1, &w1), (&p2, &w2)] {
            assert!(p.iter().zip(w).any(|((_, p), (_, w))| !p.equal(w)));
        }
        let mut a = executor(&g, &range, p1, false);
        a.set_step_seed(102);
        stash.set_step_seed(102);
        let mut c = executor(&g, &range, p2, false);
        c.set_step_seed(102);
        let on_w1 = stash
            .forward_version(&mbs[0], true, 0, WeightVersion::Previous)
            .unwrap();
        let r1 = a.forward_at(&mbs[0], true, 0).unwrap();
        assert_same(&on_w1.outputs, &r1.outputs, "Previous runs W1 + (W1 - W0)");
        let on_w2 = stash
            .forward_version(&mbs[1], true, 3, WeightVersion::Current)
            .unwrap();
        let r2 = c.forward_at(&mbs[1], true, 3).unwrap();
        assert_same(&on_w2.outputs, &r2.outputs, "Current runs W2 + (W2 - W1)");
        // Both backpropagate through their own weights; the next step would
        // apply the sum of both versions' gradients.
        let grads = output_grads(&r1.outputs, 400);
        let s = stash.backward(on_w1.micro_batch, &grads).unwrap();
        assert_same(
            &s,
            &a.backward(r1.micro_batch, &grads).unwrap(),
            "W1 input gradients",
        );
        let grads = output_grads(&r2.outputs, 401);
        let s = stash.backward(on_w2.micro_batch, &grads).unwrap();
        assert_same(
            &s,
            &c.backward(r2.micro_batch, &grads).unwrap(),
            "W2 input gradients",
        );
        let sum: Named = a
            .gradients()
            .unwrap()
            .into_iter()
            .zip(c.gradients().unwrap())
            .map(|((n, ga), (_, gc))| (n, gc + ga))
            .collect();
        assert_same(
            &stash.gradients().unwrap(),
            &sum,
            "both versions' gradients",
        );
    }
}

#[test]
fn a_parameter_with_no_gradient_since_a_stashed_step_is_skipped_as_pytorch_skips_it() {
    // Two outputs, one per weight: step 1's backward feeds only `y1`, so `w2`
    // has no gradient, though its leaf's gradient was zeroed in place (micro
    // batches were in flight on it when step 0 ran).
    let x = t(&pseudo(6, 1), &[2, 3]);
    let g = Graph {
        inputs: vec![input("x", &x)],
        params: vec![
            param("w1", &[2, 3], pseudo(6, 2)),
            param("w2", &[2, 3], pseudo(6, 3)),
        ],
        nodes: vec![
            node("y1", Op::Linear, &["x", "w1"]),
            node("y2", Op::Linear, &["x", "w2"]),
        ],
        outputs: vec!["y1".into(), "y2".into()],
    };
    let mut exec = executor(&g, &(0..2), owned(&init_params(&g, 0)), true);
    let mut opt = TorchOptimizer::new(OptimizerConfig::adam(0.1)).unwrap();
    let feed = [("x".to_string(), x.shallow_clone())];
    // The barrier's step (its update runs with nothing in flight).
    let f = exec.forward(&feed, true).unwrap();
    let both = output_grads(&f.outputs, 5);
    exec.backward(f.micro_batch, &both).unwrap();
    exec.step(&mut opt).unwrap();
    let f0 = exec.forward(&feed, true).unwrap();
    exec.backward(f0.micro_batch, &both).unwrap();
    let f1 = exec.forward(&feed, true).unwrap();
    exec.step(&mut opt).unwrap();
    assert_eq!((opt.steps("w1"), opt.steps("w2")), (2, 2));
    exec.backward(f1.micro_batch, &both[..1]).unwrap();
    let grads = exec.gradients().unwrap();
    assert_eq!(grads.len(), 1, "only w1 has a gradient");
    assert_eq!(grads[0].0, "w1");
    let before = exec.parameters().unwrap();
    exec.step(&mut opt).unwrap();
    let after = exec.parameters().unwrap();
    // Adam would move w2 on a zero gradient (its moments are not zero).
    assert_eq!((opt.steps("w1"), opt.steps("w2")), (3, 2));
    assert!(!after[0].1.equal(&before[0].1), "w1 steps");
    assert!(after[1].1.equal(&before[1].1), "w2 does not");
}

#[test]
fn merge_versions_makes_previous_the_current_weights_and_keeps_pending_gradients() {
    let (g, range, init, mbs) = mlp_stage();
    let mut stash = executor(&g, &range, owned(&init), true);
    let mut opt = TorchOptimizer::new(OptimizerConfig::adam(0.01)).unwrap();
    // The barrier's step: its update runs with nothing in flight.
    let f = stash.forward(&mbs[3], true).unwrap();
    stash
        .backward(f.micro_batch, &output_grads(&f.outputs, 0))
        .unwrap();
    stash.step(&mut opt).unwrap();
    // Step 0 with step 1's first micro-batch in flight across it.
    let f = stash.forward(&mbs[0], true).unwrap();
    stash
        .backward(f.micro_batch, &output_grads(&f.outputs, 1))
        .unwrap();
    let early = stash.forward(&mbs[1], true).unwrap();
    stash.step(&mut opt).unwrap();
    // One micro-batch on Previous (W0), one still in flight there.
    let f = stash
        .forward_version(&mbs[2], true, 0, WeightVersion::Previous)
        .unwrap();
    let g_early = output_grads(&early.outputs, 2);
    stash.backward(early.micro_batch, &g_early).unwrap();
    // Stepping or merging would drop the weights `f` needs.
    for e in [
        stash.merge_versions().unwrap_err(),
        stash.step(&mut opt).unwrap_err(),
    ] {
        assert!(e.to_string().contains("1 micro-batch(es)"), "{e}");
    }
    stash
        .backward(f.micro_batch, &output_grads(&f.outputs, 3))
        .unwrap();
    let pending = stash.gradients().unwrap();
    assert!(!pending.is_empty());

    let w1 = stash.parameters().unwrap();
    stash.merge_versions().unwrap();
    assert_same(&stash.parameters().unwrap(), &w1, "merging keeps Current");
    assert_same(
        &stash.gradients().unwrap(),
        &pending,
        "and the gradients not yet applied",
    );
    for version in [WeightVersion::Previous, WeightVersion::Current] {
        stash.set_step_seed(7);
        let f = stash.forward_version(&mbs[3], true, 0, version).unwrap();
        stash.discard(f.micro_batch).unwrap();
        let mut plain = executor(&g, &range, copies(&w1), false);
        plain.set_step_seed(7);
        let want = plain.forward_at(&mbs[3], true, 0).unwrap();
        assert_same(
            &f.outputs,
            &want.outputs,
            &format!("{version:?} after merging"),
        );
    }
    // A merge with nothing distinct is a no-op; stepping still works.
    stash.merge_versions().unwrap();
    stash.step(&mut opt).unwrap();
    assert!(stash.gradients().unwrap().is_empty());
}

#[test]
fn without_stashing_previous_is_current_and_a_step_waits_for_every_backward() {
    let (g, range, init, mbs) = mlp_stage();
    let mut exec = executor(&g, &range, owned(&init), false);
    let mut opt = TorchOptimizer::new(OptimizerConfig::sgd(0.1)).unwrap();
    let f = exec.forward(&mbs[0], true).unwrap();
    exec.backward(f.micro_batch, &output_grads(&f.outputs, 1))
        .unwrap();
    let early = exec.forward(&mbs[1], true).unwrap();
    let e = exec.step(&mut opt).unwrap_err();
    assert!(e.to_string().contains("1 micro-batch(es)"), "{e}");
    exec.discard(early.micro_batch).unwrap();
    exec.step(&mut opt).unwrap();
    exec.merge_versions().unwrap();
    exec.set_step_seed(3);
    let p = exec
        .forward_version(&mbs[2], true, 0, WeightVersion::Previous)
        .unwrap();
    exec.set_step_seed(3);
    let c = exec.forward_at(&mbs[2], true, 0).unwrap();
    assert_same(&p.outputs, &c.outputs, "Previous is Current");
}
