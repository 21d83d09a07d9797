//! Whatever the server sends, a StageWorker answers with replies, never a
//! panic: messages that do not fit the assignment or the stage's state fail the
//! job with a message that says what was wrong.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]
// A chain of one stage is a list of one node range.
#![allow(clippy::single_range_in_vec_init)]

mod exec_common;
mod worker_common;

use exec_common::*;
use rookery_model::{Loss, LrSchedule, OptimizerConfig, from_toml};
use rookery_proto::{
    Assignment, Backward, Forward, GradScale, ParamSet, Phase, ToProvider, ToServer, WireDType,
    WireTensor,
};
use rookery_torch::{TorchWorker, tensor_to_wire};
use tch::{Device, Tensor};
use worker_common::*;

const MLP: &str = r#"
input_shape = [6]
[[layers]]
type = "Dense"
units = 8
activation = "relu"
[[layers]]
type = "Dense"
units = 3
"#;

fn job() -> JobConfig {
    JobConfig {
        batch_size: 8,
        micro_batches: 2,
        ..JobConfig::new(OptimizerConfig::sgd(0.1), Loss::cross_entropy())
    }
}

/// Stage `k` of the MLP cut [0, 2) | [2, 3) (Dense+Relu, then Dense).
fn assign(k: usize) -> Assignment {
    let g = from_toml(MLP).unwrap();
    assignment(&g, &[0..2, 2..3], k, 0, &init_params(&g, 3), &job())
}

fn ready(k: usize) -> TorchWorker {
    let mut w = TorchWorker::new(Device::Cpu);
    assert_eq!(
        w.handle(ToProvider::Assign(Box::new(assign(k)))),
        [ToServer::Ready { job_id: 7 }]
    );
    w
}

fn forward(job_id: u64, step: u64, micro: u32, rows: i64) -> ToProvider {
    let x = t(&pseudo(rows as usize * 6, 1), &[rows, 6]);
    let mut f = first_forward(tensor_to_wire("input", &x, WireDType::F32).unwrap());
    if let ToProvider::Forward(f) = &mut f {
        (f.job_id, f.phase, f.micro) = (job_id, Phase::Train { step }, micro);
    }
    f
}

/// Micro-batch 0 of step 0 of job 7 (8 samples a step), with `input`.
fn first_forward(input: WireTensor) -> ToProvider {
    ToProvider::Forward(Forward {
        job_id: 7,
        phase: Phase::Train { step: 0 },
        micro: 0,
        step_samples: 8,
        step_targets: 8,
        inputs: vec![input],
        labels: None,
    })
}

/// The single `JobFailed` of `replies`, for job `job_id`.
/// `t` as int8, which carries only activations and gradients.
fn quantized(t: &WireTensor) -> WireTensor {
    let values = t.to_f32().unwrap();
    WireTensor::from_f32(
        t.name.clone(),
        &t.shape_usize(),
        &values,
        WireDType::I8Block,
    )
}

fn failure(replies: Vec<ToServer>, job_id: u64) -> String {
    match &replies[..] {
        [
            ToServer::JobFailed {
                job_id: id,
                message,
            },
        ] => {
            assert_eq!(*id, job_id, "{message}");
            println!("JobFailed: {message}");
            message.clone()
        }
        other => panic!("expected one JobFailed, got {other:?}"),
    }
}

fn assert_mentions(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(message.contains(part), "`{part}` missing from: {message}");
    }
}

#[test]
fn forward_before_any_assign_fails_the_job_it_names() {
    let mut w = TorchWorker::new(Device::Cpu);
    let message = failure(w.handle(forward(7, 0, 0, 4)), 7);
    assert_mentions(&message, &["job 7", "no stage is assigned"]);
    for m in [
        ToProvider::UploadParams { job_id: 7, step: 0 },
        ToProvider::Backward(Backward {
            job_id: 7,
            step: 0,
            micro: 0,
            grads: vec![],
        }),
    ] {
        failure(w.handle(m), 7);
    }
    assert!(w.handle(ToProvider::Release { job_id: 7 }).is_empty());
    assert!(w.handle(ToProvider::Heartbeat { seq: 1 }).is_empty());
}

#[test]
fn a_message_for_another_job_fails_naming_both_ids_and_the_stage_carries_on() {
    let mut w = ready(0);
    let message = failure(w.handle(forward(99, 0, 0, 4)), 99);
    assert_mentions(&message, &["job 99", "job 7"]);
    assert!(w.handle(ToProvider::Release { job_id: 99 }).is_empty());
    assert_eq!(w.job_id(), Some(7));
    assert!(matches!(
        &w.handle(forward(7, 0, 0, 4))[..],
        [ToServer::Activations(_)]
    ));
}

#[test]
fn backward_for_a_micro_batch_never_run_forward_fails() {
    let mut w = ready(0);
    assert!(matches!(
        &w.handle(forward(7, 0, 0, 4))[..],
        [ToServer::Activations(_)]
    ));
    let grads = vec![
        tensor_to_wire(
            "1",
            &Tensor::ones([4, 8], tch::kind::FLOAT_CPU),
            WireDType::F32,
        )
        .unwrap(),
    ];
    let message = failure(
        w.handle(ToProvider::Backward(Backward {
            job_id: 7,
            step: 0,
            micro: 1,
            grads,
        })),
        7,
    );
    assert_mentions(
        &message,
        &["micro-batch 1 of step 0", "not awaiting backward", "[0]"],
    );
    // The stage is gone after a failure, and says so.
    let again = failure(w.handle(forward(7, 0, 1, 4)), 7);
    assert_mentions(
        &again,
        &["dropped after an earlier failure", "not awaiting backward"],
    );
    // A new assignment starts afresh.
    assert_eq!(
        w.handle(ToProvider::Assign(Box::new(assign(0)))),
        [ToServer::Ready { job_id: 7 }]
    );
}

#[test]
fn bad_graph_json_fails_the_assignment_saying_so() {
    let mut w = TorchWorker::new(Device::Cpu);
    let a = Assignment {
        graph_json: "{\"inputs\": [oops".into(),
        ..assign(0)
    };
    let message = failure(w.handle(ToProvider::Assign(Box::new(a))), 7);
    assert_mentions(&message, &["stage 0 of 2", "graph JSON does not parse"]);
    assert_eq!(w.job_id(), None);
}

#[test]
fn parameters_of_the_wrong_shape_or_size_fail_the_assignment_naming_the_parameter() {
    let mut w = TorchWorker::new(Device::Cpu);
    let mut a = assign(0);
    let p = a.params.iter_mut().find(|p| p.name == "0.weight").unwrap();
    p.shape = vec![6, 8];
    let message = failure(w.handle(ToProvider::Assign(Box::new(a))), 7);
    assert_mentions(&message, &["0.weight", "[6, 8]", "[8, 6]"]);

    let mut a = assign(0);
    let p = a.params.iter_mut().find(|p| p.name == "0.bias").unwrap();
    p.data.truncate(5);
    let message = failure(w.handle(ToProvider::Assign(Box::new(a))), 7);
    assert_mentions(&message, &["0.bias", "5 bytes"]);

    let mut a = assign(0);
    a.params.retain(|p| p.name != "0.bias");
    let message = failure(w.handle(ToProvider::Assign(Box::new(a))), 7);
    assert_mentions(&message, &["0.bias", "missing"]);
}

#[test]
fn impossible_assignments_fail_with_the_reason() {
    let mut w = TorchWorker::new(Device::Cpu);
    for (a, says) in [
        (
            Assignment {
                stage: 2,
                ..assign(0)
            },
            "not in a chain of 2",
        ),
        (
            Assignment {
                wire_dtype: WireDType::I64,
                ..assign(0)
            },
            "wire dtype i64",
        ),
        (
            Assignment {
                end: 9,
                ..assign(0)
            },
            "0..9",
        ),
        (
            Assignment {
                outputs: vec!["0".into(), "1".into()],
                ..assign(1)
            },
            "exactly one output",
        ),
        (
            Assignment {
                optimizer: OptimizerConfig::sgd(-1.0),
                ..assign(0)
            },
            "learning rate",
        ),
        (
            Assignment {
                lr_schedule: LrSchedule::Linear {
                    warmup_steps: 0,
                    total_steps: None,
                },
                ..assign(0)
            },
            "total_steps",
        ),
        (
            Assignment {
                clip_grad_norm: Some(f64::NAN),
                ..assign(0)
            },
            "clip_grad_norm",
        ),
        (
            Assignment {
                params: assign(0).params.iter().map(quantized).collect(),
                ..assign(0)
            },
            "only activations and gradients",
        ),
    ] {
        let message = failure(w.handle(ToProvider::Assign(Box::new(a))), 7);
        assert_mentions(&message, &[says]);
    }
}

#[test]
fn forward_inputs_of_the_wrong_shape_or_with_nan_fail() {
    let mut w = ready(0);
    let bad = first_forward(WireTensor::from_f32(
        "input",
        &[4, 5],
        &[0.5; 20],
        WireDType::F32,
    ));
    let message = failure(w.handle(bad), 7);
    assert_mentions(
        &message,
        &["Forward of micro-batch 0 of step 0", "stage 0 of 2"],
    );

    let mut w = ready(0);
    let mut values = vec![0.5; 24];
    values[3] = f32::NAN;
    let bad = first_forward(WireTensor::from_f32(
        "input",
        &[4, 6],
        &values,
        WireDType::F32,
    ));
    assert_mentions(&failure(w.handle(bad), 7), &["not finite"]);

    // An int8 input whose block scale is negative, and one with a -128.
    let good = WireTensor::from_f32("input", &[4, 6], &[0.5; 24], WireDType::I8Block);
    for (at, bytes, says) in [
        (0, (-1.0f32).to_le_bytes().to_vec(), "int8 block 0"),
        (4 + 7, vec![0x80], "int8 element 7 is -128"),
    ] {
        let mut w = ready(0);
        let mut data = good.data.to_vec();
        data[at..at + bytes.len()].copy_from_slice(&bytes);
        let bad = first_forward(WireTensor {
            data: data.into(),
            ..good.clone()
        });
        assert_mentions(&failure(w.handle(bad), 7), &[says]);
    }

    // 8 samples in 2 micro-batches are chunks of 4: 3 rows is another split.
    let mut w = ready(0);
    assert_mentions(
        &failure(w.handle(forward(7, 0, 0, 3)), 7),
        &["holds 3 samples", "holds 4"],
    );
    let mut w = ready(0);
    assert_mentions(
        &failure(w.handle(forward(7, 0, 2, 4)), 7),
        &["2 micro-batches", "no micro-batch 2"],
    );
}

#[test]
fn the_leaf_needs_labels_and_takes_no_backward() {
    let mut w = ready(1);
    let h = tensor_to_wire(
        "1",
        &Tensor::ones([4, 8], tch::kind::FLOAT_CPU),
        WireDType::F32,
    )
    .unwrap();
    let message = failure(w.handle(first_forward(h.clone())), 7);
    assert_mentions(&message, &["without labels"]);

    let mut w = ready(1);
    let message = failure(
        w.handle(ToProvider::Forward(Forward {
            job_id: 7,
            phase: Phase::Train { step: 0 },
            micro: 0,
            step_samples: 8,
            step_targets: 8,
            inputs: vec![h.clone()],
            labels: Some(WireTensor::from_i64("labels", &[4], &[0, 1, 2, 3])),
        })),
        7,
    );
    assert_mentions(&message, &["labels span [0, 3] but there are 3 classes"]);

    let mut w = ready(1);
    let message = failure(
        w.handle(ToProvider::Backward(Backward {
            job_id: 7,
            step: 0,
            micro: 0,
            grads: vec![],
        })),
        7,
    );
    assert_mentions(&message, &["Leaf", "no Backward"]);
}

#[test]
fn a_new_step_cannot_start_before_the_last_one_finished_nor_a_done_step_rerun() {
    let mut w = ready(0);
    assert!(matches!(
        &w.handle(forward(7, 0, 0, 4))[..],
        [ToServer::Activations(_)]
    ));
    let message = failure(w.handle(forward(7, 1, 0, 4)), 7);
    assert_mentions(
        &message,
        &["step 1 cannot start", "step 0 is unfinished", "0 of 2"],
    );

    // Root and Leaf in one: each forward completes its micro-batch at once.
    let g = from_toml(MLP).unwrap();
    let mut w = TorchWorker::new(Device::Cpu);
    let a = assignment(&g, &[0..3], 0, 0, &init_params(&g, 3), &job());
    assert_eq!(
        w.handle(ToProvider::Assign(Box::new(a))),
        [ToServer::Ready { job_id: 7 }]
    );
    let with_labels = |step, micro| match forward(7, step, micro, 4) {
        ToProvider::Forward(f) => ToProvider::Forward(Forward {
            labels: Some(WireTensor::from_i64("labels", &[4], &[0, 1, 2, 0])),
            ..f
        }),
        _ => unreachable!(),
    };
    assert!(matches!(
        &w.handle(with_labels(0, 0))[..],
        [ToServer::LeafLoss(_)]
    ));
    assert!(matches!(
        &w.handle(with_labels(0, 1))[..],
        [ToServer::LeafLoss(_), ToServer::StepDone(d)] if d.step == 0
    ));
    let message = failure(w.handle(with_labels(0, 0)), 7);
    assert_mentions(&message, &["step 0 is already done", "next step is 1"]);
}

#[test]
fn set_params_with_an_unknown_name_or_a_wrong_shape_fails_and_a_valid_one_replaces_just_its_values()
{
    let mut w = ready(0);
    let before = match &w.handle(ToProvider::UploadParams { job_id: 7, step: 0 })[..] {
        [ToServer::OptimizerState(_), ToServer::Params(p)] => p.params.clone(),
        other => panic!("{other:?}"),
    };
    let mut params = before.clone();
    for p in &mut params {
        p.data = vec![0; p.data.len()].into();
    }
    params.push(WireTensor::from_f32(
        "2.weight",
        &[1],
        &[1.0],
        WireDType::F32,
    ));
    let message = failure(
        w.handle(ToProvider::SetParams(ParamSet {
            job_id: 7,
            step: 0,
            params,
        })),
        7,
    );
    assert_mentions(
        &message,
        &["2.weight", "not parameters of this stage", "0.weight"],
    );

    let mut w = ready(0);
    let message = failure(
        w.handle(ToProvider::SetParams(ParamSet {
            job_id: 7,
            step: 0,
            params: vec![WireTensor::from_f32(
                "0.bias",
                &[4],
                &[0.0; 4],
                WireDType::F32,
            )],
        })),
        7,
    );
    assert_mentions(&message, &["0.bias", "[4]", "[8]"]);

    // Parameters never travel as int8.
    let mut w = ready(0);
    let message = failure(
        w.handle(ToProvider::SetParams(ParamSet {
            job_id: 7,
            step: 0,
            params: vec![quantized(&WireTensor::from_f32(
                "0.bias",
                &[8],
                &[0.5; 8],
                WireDType::F32,
            ))],
        })),
        7,
    );
    assert_mentions(&message, &["0.bias", "int8"]);

    // A valid set replaces exactly the values given.
    let mut w = ready(0);
    let zeros = WireTensor::from_f32("0.bias", &[8], &[0.0; 8], WireDType::F32);
    assert!(
        w.handle(ToProvider::SetParams(ParamSet {
            job_id: 7,
            step: 0,
            params: vec![zeros.clone()],
        }))
        .is_empty()
    );
    let after = match &w.handle(ToProvider::UploadParams { job_id: 7, step: 0 })[..] {
        [ToServer::OptimizerState(_), ToServer::Params(p)] => p.params.clone(),
        other => panic!("{other:?}"),
    };
    for (a, b) in after.iter().zip(&before) {
        if a.name == "0.bias" {
            assert_eq!(a, &zeros);
        } else {
            assert_eq!(a, b);
        }
    }
}

#[test]
fn release_drops_the_stage() {
    let mut w = ready(0);
    assert!(w.handle(ToProvider::Release { job_id: 7 }).is_empty());
    assert_eq!(w.job_id(), None);
    assert_mentions(
        &failure(w.handle(forward(7, 0, 0, 4)), 7),
        &["no stage is assigned"],
    );
}

/// A Root that clips: after its last backward it reports its gradients'
/// sum of squares and steps only on a `GradScale` for that step, which
/// must lie in (0, 1].
#[test]
fn a_clipping_stage_waits_for_its_scale_and_refuses_a_bad_one() {
    let scale = |step: u64, scale: f64| {
        ToProvider::GradScale(GradScale {
            job_id: 7,
            step,
            scale,
        })
    };
    let mut w = ready(0);
    let message = failure(w.handle(scale(0, 0.5)), 7);
    assert_mentions(&message, &["GradScale of step 0", "no training step"]);

    let clipping = || {
        let mut w = TorchWorker::new(Device::Cpu);
        let a = Assignment {
            clip_grad_norm: Some(1.0),
            ..assign(0)
        };
        assert_eq!(
            w.handle(ToProvider::Assign(Box::new(a))),
            [ToServer::Ready { job_id: 7 }]
        );
        let mut replies = Vec::new();
        for micro in 0..2 {
            let [ToServer::Activations(a)] = &w.handle(forward(7, 0, micro, 4))[..] else {
                panic!("no activations")
            };
            let grads = a
                .outputs
                .iter()
                .map(|o| {
                    let shape = o.shape_usize();
                    let n = shape.iter().product::<usize>();
                    WireTensor::from_f32(&o.name, &shape, &vec![0.25; n], WireDType::F32)
                })
                .collect();
            replies = w.handle(ToProvider::Backward(Backward {
                job_id: 7,
                step: 0,
                micro,
                grads,
            }));
        }
        let [ToServer::GradNorm(n)] = &replies[..] else {
            panic!("expected GradNorm, got {replies:?}")
        };
        assert_eq!((n.job_id, n.step), (7, 0));
        assert!(n.sum_of_squares > 0.0 && n.sum_of_squares.is_finite());
        w
    };
    let mut w = clipping();
    // Nothing else of the step may start while the scale is awaited.
    failure(w.handle(forward(7, 1, 0, 4)), 7);
    let mut w = clipping();
    let message = failure(w.handle(scale(0, 2.0)), 7);
    assert_mentions(&message, &["scale of 2"]);
    let mut w = clipping();
    assert!(matches!(
        &w.handle(scale(0, 0.5))[..],
        [ToServer::StepDone(d)] if d.step == 0
    ));
}
