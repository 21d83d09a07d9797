//! `cargo xtask bench relay`: throughput of 4 MiB activations from one
//! provider through the server to the next, against one direct loopback
//! WebSocket between two peers carrying the same frames, measured in one run
//! (target: ratio >= 0.6).
//!
//! The relay path is the real one: a server (in this process, on a loopback
//! port) runs a two-stage job whose boundary tensor is 1024 x 1024 f32 per
//! micro-batch; two protocol clients play Root and Leaf over real
//! WebSockets, and every relay goes through decoding, the job's checks
//! (names, shapes, dtype, finite values), and encoding again. Throughput is
//! a step's activation bytes over the time from the Root's first send to the
//! Leaf's last receipt. Providers stream large tensors (`rookery_proto::stream`):
//! the message, then payload frames that the server checks and passes on as
//! they arrive, so its two hops overlap. The direct baselines send the same
//! `Activations` to a listener that receives and checks them as a provider
//! and the server would: once as one frame per tensor (the target's
//! baseline: the least work a link can do) and once as the same streamed
//! frames (what the relay itself costs, the protocol held fixed).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::{SinkExt, StreamExt};
use rookery_proto::stream::{self, Assembler, Streamed};
use rookery_proto::{
    Activations, Gradients, Hello, LeafLoss, PROTOCOL_VERSION, ParamSet, Phase, ProviderKind,
    StepDone, ToProvider, ToServer, WireDType, WireTensor,
};
use rookery_server::{AppState, Limits};
use rookery_test_support::{Classes, dense_mlp, write_job};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

const WIDTH: usize = 1024;
const ROWS: usize = 1024;
const STEPS: usize = 30;
/// Activations per step. One keeps the measurement to the relay itself: with
/// more, each step also carries the Root's inputs and the gradients back, and
/// the fake providers' own tensor building, through the same two cores.
const MICRO: usize = 1;
const MIB: f64 = (1 << 20) as f64;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let bytes = (MICRO * ROWS * WIDTH * 4) as f64;
    let relay = median(relay_latencies().await?);
    let whole = median(direct_latencies(Framing::Whole).await?);
    let streamed = median(direct_latencies(Framing::Streamed).await?);
    let rate = |ms: f64| bytes / MIB / (ms / 1e3);
    println!(
        "{MICRO} x 4 MiB activations ({ROWS} x {WIDTH} f32) per step, median of {STEPS} steps:"
    );
    for (name, ms) in [
        ("provider -> server -> provider (streamed)", relay),
        ("direct WebSocket, one frame per tensor", whole),
        ("direct WebSocket, streamed frames", streamed),
    ] {
        println!("  {name:<42} {ms:>7.2} ms  {:>8.1} MiB/s", rate(ms));
    }
    println!(
        "ratio relay / direct, against one frame per tensor: {:.3} (target >= 0.6)",
        whole / relay
    );
    println!(
        "ratio relay / direct, same frames on both:          {:.3}",
        streamed / relay
    );
    Ok(())
}

/// How the direct baseline puts a tensor on the wire.
#[derive(Clone, Copy)]
enum Framing {
    /// One frame holding the message and its tensor: the least work a
    /// direct link can do, so the stricter baseline.
    Whole,
    /// The frames providers send: the message, then payload frames.
    Streamed,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// What a bench stage accepts in one streamed message (its memory).
const RECEIVE_CAP: usize = 8 << 30;

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Sends a message as providers do: streamed tensors in payload frames.
async fn send(socket: &mut Socket, message: &ToServer) -> anyhow::Result<()> {
    for frame in stream::encode_streamed(message, rookery_proto::DEFAULT_MAX_FRAME_BYTES)? {
        socket.send(Message::Binary(frame)).await?;
    }
    Ok(())
}

/// Receives the next whole message as providers do.
async fn receive<T: Streamed + serde::de::DeserializeOwned>(
    socket: &mut tokio_tungstenite::WebSocketStream<impl AsyncRead + AsyncWrite + Unpin>,
    assembler: &mut Assembler<T>,
) -> anyhow::Result<T> {
    loop {
        match socket.next().await.context("the peer closed")?? {
            Message::Binary(bytes) => {
                let incoming = stream::read_frame(&bytes, usize::MAX)?;
                if let Some(message) = assembler.push(incoming)? {
                    return Ok(message);
                }
            }
            Message::Close(frame) => bail!("closed: {frame:?}"),
            _ => continue,
        }
    }
}

/// Joins as a provider and returns the socket after `Welcome`.
async fn join(url: &str, name: &str) -> anyhow::Result<Socket> {
    let (mut socket, _) = tokio_tungstenite::connect_async(url).await?;
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        kind: ProviderKind::Native,
        device: "bench".into(),
        memory_bytes: 8 << 30,
        gflops: 100.0,
        display_name: name.into(),
        max_buffer_bytes: None,
        credential: None,
        requester_token: None,
        donor: None,
        duty_cycle: 1.0,
    };
    send(&mut socket, &ToServer::Hello(hello)).await?;
    match receive(&mut socket, &mut Assembler::<ToProvider>::new(RECEIVE_CAP)).await? {
        ToProvider::Welcome { .. } => Ok(socket),
        other => bail!("expected Welcome, got {other:?}"),
    }
}

/// Plays one stage; the Root reports when it sent each activation, the Leaf
/// when it received it.
/// Stamps are (is the Leaf, step, when).
async fn stage(
    mut socket: Socket,
    stamps: mpsc::UnboundedSender<(bool, u64, Instant)>,
) -> anyhow::Result<()> {
    let mut assigned = None;
    let mut assembler = Assembler::new(RECEIVE_CAP);
    loop {
        let message = tokio::time::timeout(
            Duration::from_secs(60),
            receive(&mut socket, &mut assembler),
        )
        .await??;
        match message {
            ToProvider::Assign(a) => {
                send(&mut socket, &ToServer::Ready { job_id: a.job_id }).await?;
                assigned = Some(a);
            }
            ToProvider::Forward(f) => {
                let a = assigned.as_ref().context("Forward before Assign")?;
                let Phase::Train { step } = f.phase else {
                    continue;
                };
                let rows = f.inputs[0].shape[0] as usize;
                let leaf = a.stage + 1 == a.stages;
                let boundary = |name: &str| {
                    WireTensor::from_f32(
                        name,
                        &[rows, WIDTH],
                        &vec![0.25; rows * WIDTH],
                        WireDType::F32,
                    )
                };
                if leaf {
                    let _ = stamps.send((true, step, Instant::now()));
                    let job_id = a.job_id;
                    let loss = LeafLoss {
                        job_id,
                        phase: f.phase,
                        micro: f.micro,
                        loss_sum: rows as f64,
                        correct: 0,
                        samples: rows as u32,
                    };
                    send(&mut socket, &ToServer::LeafLoss(loss)).await?;
                    let grads = f.inputs.iter().map(|t| boundary(&t.name)).collect();
                    let grads = Gradients {
                        job_id,
                        step,
                        micro: f.micro,
                        grads,
                        compute_ms: 0.0,
                    };
                    send(&mut socket, &ToServer::Gradients(grads)).await?;
                    send(
                        &mut socket,
                        &ToServer::StepDone(StepDone {
                            job_id,
                            step,
                            compute_ms: 0.0,
                            peak_held: 1,
                        }),
                    )
                    .await?;
                } else {
                    let outputs = a.outputs.iter().map(|n| boundary(n)).collect();
                    let _ = stamps.send((false, step, Instant::now()));
                    let activations = Activations {
                        job_id: a.job_id,
                        phase: f.phase,
                        micro: f.micro,
                        outputs,
                        compute_ms: 0.0,
                    };
                    send(&mut socket, &ToServer::Activations(activations)).await?;
                }
            }
            ToProvider::Backward(b) => {
                send(
                    &mut socket,
                    &ToServer::StepDone(StepDone {
                        job_id: b.job_id,
                        step: b.step,
                        compute_ms: 0.0,
                        peak_held: 1,
                    }),
                )
                .await?;
            }
            ToProvider::UploadParams { job_id, step } => {
                let a = assigned.as_ref().context("UploadParams before Assign")?;
                let params = ParamSet {
                    job_id,
                    step,
                    params: a.params.clone(),
                };
                send(&mut socket, &ToServer::Params(params)).await?;
            }
            ToProvider::Probe { seq, .. } => {
                send(&mut socket, &ToServer::ProbeAck { seq }).await?;
            }
            ToProvider::Release { .. } => return Ok(()),
            _ => {}
        }
    }
}

async fn relay_latencies() -> anyhow::Result<Vec<f64>> {
    let dir = tempfile::tempdir()?;
    let model = dense_mlp(WIDTH, &[(WIDTH, None), (10, None)]);
    let samples = MICRO * ROWS;
    let data = Classes {
        sample: vec![WIDTH],
        x: vec![0.5; samples * WIDTH],
        y: (0..samples as i64).map(|i| i % 10).collect(),
    };
    write_job(
        dir.path(),
        &model,
        &data,
        &format!(
            "epochs = {STEPS}\nbatch_size = {samples}\nmicro_batches = {MICRO}\nclusters = 1\nstages = 2\nsync_every = 1000"
        ),
    )?;

    let data_dir = dir.path().join("server");
    let state = AppState::open(&data_dir, Limits::default(), None).await?;
    let token = state.api_token.secret().to_string();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(rookery_server::serve(
        listener,
        state,
        std::future::pending(),
    ));
    let url = format!("ws://{addr}{}", rookery_proto::PROVIDER_WS_PATH);
    let (stamps, mut stamped) = mpsc::unbounded_channel();
    let a = tokio::spawn(stage(join(&url, "a").await?, stamps.clone()));
    let b = tokio::spawn(stage(join(&url, "b").await?, stamps));
    let client = rookery_server::cli::client::Client::new(&addr.to_string(), &token);
    let created = client.submit(&dir.path().join("job.toml")).await?;
    let job = client.watch(created.id).await?;
    if job.status != "completed" {
        bail!("the bench job ended {}: {:?}", job.status, job.detail);
    }
    let _ = (a.await, b.await);
    let (mut sent, mut got) = (Vec::new(), Vec::new());
    while let Ok((leaf, step, at)) = stamped.try_recv() {
        if leaf { &mut got } else { &mut sent }.push((step, at));
    }
    let mut latencies = Vec::with_capacity(STEPS);
    for step in 0..STEPS as u64 {
        let first = sent
            .iter()
            .filter(|(s, _)| *s == step)
            .map(|(_, t)| *t)
            .min();
        let last = got
            .iter()
            .filter(|(s, _)| *s == step)
            .map(|(_, t)| *t)
            .max();
        let count = got.iter().filter(|(s, _)| *s == step).count();
        match (first, last) {
            (Some(t0), Some(t1)) if count == MICRO => {
                latencies.push(t1.duration_since(t0).as_secs_f64() * 1e3)
            }
            _ => bail!("step {step}: {count} of {MICRO} activations arrived"),
        }
    }
    Ok(latencies)
}

async fn direct_latencies(framing: Framing) -> anyhow::Result<Vec<f64>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await?;
        let mut socket = tokio_tungstenite::accept_async(stream).await?;
        let mut assembler = Assembler::new(RECEIVE_CAP);
        // Received as a provider receives (a whole frame decodes without a
        // copy) and checked as the server checks, until the sender hangs up.
        while let Ok(message) = receive::<ToServer>(&mut socket, &mut assembler).await {
            if let ToServer::Activations(a) = message {
                a.outputs[0].check()?;
            }
            let _ = tx.send(Instant::now());
        }
        anyhow::Ok(())
    });
    let (mut socket, _) = tokio_tungstenite::connect_async(format!("ws://{addr}")).await?;
    let mut latencies = Vec::with_capacity(STEPS);
    for step in 0..STEPS as u64 {
        // Built before the clock starts, as the Root's are in the relay run.
        let messages: Vec<_> = (0..MICRO as u32)
            .map(|micro| {
                ToServer::Activations(Activations {
                    job_id: 1,
                    phase: Phase::Train { step },
                    micro,
                    outputs: vec![WireTensor::from_f32(
                        "h",
                        &[ROWS, WIDTH],
                        &vec![0.25; ROWS * WIDTH],
                        WireDType::F32,
                    )],
                    compute_ms: 0.0,
                })
            })
            .collect();
        let t0 = Instant::now();
        for message in &messages {
            match framing {
                Framing::Whole => {
                    let frame = rookery_proto::encode(message)?;
                    socket.send(Message::Binary(frame.into())).await?;
                }
                Framing::Streamed => send(&mut socket, message).await?,
            }
        }
        let mut t1 = t0;
        for _ in 0..MICRO {
            t1 = rx.recv().await.context("the listener stopped")?;
        }
        latencies.push(t1.duration_since(t0).as_secs_f64() * 1e3);
    }
    Ok(latencies)
}
