//! The session hands training messages to the trainer's own thread: heartbeats
//! go on while it computes, and its replies reach the socket in order.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use futures_channel::mpsc;
use futures_util::StreamExt;
use rookery_proto::{
    Assignment, Forward, LeafLoss, PROTOCOL_VERSION, Phase, ProviderKind, StepDone, ToProvider,
    ToServer, WireDType, WireTensor,
};
use rookery_provider::connection::{SessionEnd, run_session};
use rookery_provider::trainer::{NoTorch, Trainer};
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::Message;

fn hello() -> rookery_proto::Hello {
    rookery_proto::Hello {
        protocol_version: PROTOCOL_VERSION,
        kind: ProviderKind::Native,
        device: "test".into(),
        memory_bytes: 1,
        gflops: 1.0,
        display_name: "worker-connection".into(),
        max_buffer_bytes: None,
        credential: None,
        requester_token: None,
        donor: None,
        duty_cycle: 1.0,
    }
}

fn frame(message: &ToProvider) -> Result<Message, std::convert::Infallible> {
    Ok(Message::Binary(
        rookery_proto::encode(message).unwrap().into(),
    ))
}

fn decoded(message: Message) -> ToServer {
    match message {
        Message::Binary(bytes) => rookery_proto::decode(&bytes, 1 << 26).unwrap(),
        other => panic!("expected binary, got {other:?}"),
    }
}

fn assignment(graph_json: String) -> Assignment {
    Assignment {
        job_id: 5,
        cluster: 0,
        stage: 0,
        stages: 1,
        graph_json,
        first: 0,
        end: 2,
        outputs: vec!["1".into()],
        params: vec![],
        optimizer: rookery_model::OptimizerConfig::Sgd {
            lr: 0.1,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        },
        loss: rookery_model::Loss::cross_entropy(),
        batch_size: 4,
        micro_batches: 1,
        wire_dtype: WireDType::F32,
        seed: 1,
        start_step: 0,
        optimizer_state: Vec::new(),
        lr_schedule: rookery_model::LrSchedule::default(),
        clip_grad_norm: None,
        public_name: None,
        schedule: rookery_proto::PipelineSchedule::Gpipe,
        sync_int8: false,
        precision: Default::default(),
    }
}

fn forward() -> ToProvider {
    ToProvider::Forward(Forward {
        job_id: 5,
        phase: Phase::Train { step: 0 },
        micro: 0,
        step_samples: 4,
        step_targets: 4,
        inputs: vec![WireTensor::from_f32(
            "input",
            &[4, 3],
            &[0.25; 12],
            WireDType::F32,
        )],
        labels: Some(WireTensor::from_i64("labels", &[4], &[0, 1, 0, 1])),
    })
}

/// Stands in for libtorch work that takes far longer than a heartbeat period.
struct SlowTrainer(Duration);

impl Trainer for SlowTrainer {
    fn handle(&mut self, message: ToProvider) -> Vec<ToServer> {
        std::thread::sleep(self.0);
        match message {
            ToProvider::Assign(a) => vec![ToServer::Ready { job_id: a.job_id }],
            ToProvider::Forward(f) => vec![
                ToServer::LeafLoss(LeafLoss {
                    job_id: f.job_id,
                    phase: f.phase,
                    micro: f.micro,
                    loss_sum: 1.0,
                    correct: 0,
                    samples: 4,
                }),
                ToServer::StepDone(StepDone {
                    job_id: f.job_id,
                    step: 0,
                    compute_ms: 1.0,
                    peak_held: 1,
                }),
            ],
            _ => vec![],
        }
    }
}

/// Plays the server: Welcome, then `messages`, answering every heartbeat, until
/// `replies` training replies came. Returns them and the heartbeats counted
/// before the first one.
async fn drive(
    trainer: Box<dyn Trainer>,
    messages: Vec<ToProvider>,
    replies: usize,
) -> (Vec<ToServer>, u64, SessionEnd) {
    let (mut out_tx, mut out_rx) = mpsc::unbounded();
    let (in_tx, mut in_rx) = mpsc::unbounded();
    in_tx
        .unbounded_send(frame(&ToProvider::Welcome {
            provider_id: 1,
            heartbeat_interval_ms: 20,
            heartbeat_timeout_ms: 5_000,
            max_frame_bytes: rookery_proto::DEFAULT_MAX_FRAME_BYTES as u64,
            identity: 1,
            credential: None,
        }))
        .unwrap();
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let session = tokio::spawn(async move {
        run_session(&mut out_tx, &mut in_rx, &hello(), &mut stop_rx, trainer).await
    });
    assert_eq!(
        decoded(out_rx.next().await.unwrap()),
        ToServer::Hello(hello())
    );
    for m in &messages {
        in_tx.unbounded_send(frame(m)).unwrap();
    }
    let mut got = Vec::new();
    let mut heartbeats_before_reply = 0;
    let end = loop {
        let Some(message) = out_rx.next().await else {
            break session.await.unwrap();
        };
        match decoded(message) {
            ToServer::Heartbeat { seq } => {
                if got.is_empty() {
                    heartbeats_before_reply += 1;
                }
                // The session may have ended since it sent this heartbeat
                // (a crashed trainer ends it): then nobody needs the answer.
                let _ = in_tx.unbounded_send(frame(&ToProvider::Heartbeat { seq }));
            }
            reply => {
                got.push(reply);
                if got.len() == replies {
                    stop_tx.send(true).unwrap();
                    break session.await.unwrap();
                }
            }
        }
    };
    (got, heartbeats_before_reply, end)
}

#[tokio::test]
async fn the_session_keeps_heartbeating_while_the_trainer_computes_and_relays_its_replies_in_order()
{
    let (replies, heartbeats, end) = drive(
        Box::new(SlowTrainer(Duration::from_millis(400))),
        vec![
            ToProvider::Assign(Box::new(assignment("{}".into()))),
            forward(),
        ],
        3,
    )
    .await;
    assert_eq!(end, SessionEnd::Shutdown);
    assert!(
        matches!(
            &replies[..],
            [
                ToServer::Ready { job_id: 5 },
                ToServer::LeafLoss(_),
                ToServer::StepDone(_)
            ]
        ),
        "{replies:?}"
    );
    // 400 ms of blocked trainer at one heartbeat per 20 ms: about 20.
    assert!(
        heartbeats >= 5,
        "only {heartbeats} heartbeats while the trainer worked"
    );
}

#[tokio::test]
async fn a_link_probe_is_answered_at_once_even_while_the_trainer_is_busy() {
    let (replies, _, end) = drive(
        Box::new(SlowTrainer(Duration::from_millis(400))),
        vec![
            ToProvider::Assign(Box::new(assignment("{}".into()))),
            ToProvider::Probe {
                seq: 4,
                padding: vec![0; 1 << 20].into(),
            },
        ],
        2,
    )
    .await;
    assert_eq!(end, SessionEnd::Shutdown);
    assert_eq!(
        replies,
        vec![ToServer::ProbeAck { seq: 4 }, ToServer::Ready { job_id: 5 }]
    );
}

#[tokio::test]
async fn a_build_without_libtorch_fails_the_assignment_through_the_session() {
    let (replies, _, end) = drive(
        Box::new(NoTorch),
        vec![ToProvider::Assign(Box::new(assignment("{}".into())))],
        1,
    )
    .await;
    assert_eq!(end, SessionEnd::Shutdown);
    assert!(
        matches!(&replies[..], [ToServer::JobFailed { job_id: 5, message }] if message.contains("without libtorch")),
        "{replies:?}"
    );
}

struct PanickingTrainer;

impl Trainer for PanickingTrainer {
    fn handle(&mut self, _: ToProvider) -> Vec<ToServer> {
        panic!("boom")
    }
}

#[tokio::test]
async fn a_trainer_that_panics_fails_the_job_and_ends_the_session_for_a_fresh_start() {
    let (replies, _, end) = drive(Box::new(PanickingTrainer), vec![forward()], 2).await;
    assert!(
        matches!(&replies[..], [ToServer::JobFailed { job_id: 5, message }] if message.contains("boom")),
        "{replies:?}"
    );
    assert!(
        matches!(&end, SessionEnd::Lost(reason) if reason.contains("crashed")),
        "{end:?}"
    );
}

#[cfg(feature = "torch")]
#[tokio::test]
async fn the_libtorch_worker_answers_assign_and_forward_through_the_session() {
    let graph = rookery_model::from_toml(
        "input_shape = [3]\n[[layers]]\ntype = \"Dense\"\nunits = 4\nactivation = \"relu\"\n[[layers]]\ntype = \"Dense\"\nunits = 2\n",
    )
    .unwrap();
    assert_eq!(graph.nodes.len(), 3);
    let params = graph
        .initial_values(3)
        .into_iter()
        .map(|(name, values)| {
            let shape = graph.param(&name).unwrap().shape.clone();
            WireTensor::from_f32(name, &shape, &values, WireDType::F32)
        })
        .collect();
    let a = Assignment {
        end: 3,
        outputs: graph.outputs.clone(),
        params,
        ..assignment(graph.to_json().unwrap())
    };
    let worker = rookery_provider::trainer::StageTrainer::new(
        rookery_torch::TorchStageFactory::new(tch::Device::Cpu),
    );
    let (replies, _, end) = drive(
        Box::new(worker),
        vec![ToProvider::Assign(Box::new(a)), forward()],
        3,
    )
    .await;
    assert_eq!(end, SessionEnd::Shutdown);
    match &replies[..] {
        [
            ToServer::Ready { job_id: 5 },
            ToServer::LeafLoss(l),
            ToServer::StepDone(d),
        ] => {
            assert_eq!((l.samples, d.step), (4, 0));
            assert!(l.loss_sum.is_finite() && l.loss_sum > 0.0, "{l:?}");
        }
        other => panic!("{other:?}"),
    }
}
