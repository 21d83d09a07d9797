//! The coordinator stays responsive while a large job starts: a real server
//! on a loopback port, a provider over a real WebSocket, a job of about
//! 19 million parameters submitted and watched over real HTTP. Building its
//! run (reading its data, initialising every parameter, making the
//! `Assign` frames) takes a while; the coordinator must answer meanwhile.

#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use rookery_proto::api::{JobCreated, JobInfo, ProviderList};
use rookery_proto::{Hello, PROTOCOL_VERSION, ProviderKind, ToProvider, ToServer};
use rookery_server::store::Db;
use rookery_server::store::tokens::Token;
use rookery_server::{AppState, Limits};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

const TOKEN: &str = "responsive-token";

/// Input 1024, four hidden layers of 2048, 10 classes: 1024*2048 + 3 *
/// 2048*2048 + 2048*10 weights and their biases, about 14.7 million
/// parameters.
const MODEL: &str = r#"
input_shape = [1024]
[[layers]]
type = "Dense"
units = 2048
activation = "relu"
[[layers]]
type = "Dense"
units = 2048
activation = "relu"
[[layers]]
type = "Dense"
units = 2048
activation = "relu"
[[layers]]
type = "Dense"
units = 2048
activation = "relu"
[[layers]]
type = "Dense"
units = 10
"#;

const JOB: &str = r#"
[model]
spec = "model.toml"
input_shape = [1024]
[data]
format = "csv"
train_inputs = "x.csv"
train_labels = "y.csv"
[training]
epochs = 1
batch_size = 4
optimizer = { name = "sgd", lr = 0.01 }
"#;

fn multipart(files: &[(&str, Vec<u8>)]) -> (String, Vec<u8>) {
    let boundary = "rookery-responsive-boundary";
    let mut body = Vec::new();
    for (name, bytes) in files {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// A provider that answers link probes and heartbeats and reports when the
/// first frame of a job reaches it (it never trains).
async fn provider(addr: std::net::SocketAddr) -> tokio::sync::oneshot::Receiver<Instant> {
    let url = format!("ws://{addr}{}", rookery_proto::PROVIDER_WS_PATH);
    // A stage's `Assign` carries its parameters: tens of megabytes.
    let config = WebSocketConfig::default()
        .max_message_size(None)
        .max_frame_size(None);
    let (mut ws, _) = tokio_tungstenite::connect_async_with_config(url, Some(config), false)
        .await
        .unwrap();
    let hello = ToServer::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        kind: ProviderKind::Native,
        device: "loopback test".into(),
        memory_bytes: 1 << 36,
        gflops: 100.0,
        display_name: "worker".into(),
        max_buffer_bytes: None,
        credential: None,
        requester_token: None,
        donor: None,
        duty_cycle: 1.0,
    });
    let send = |m: &ToServer| Message::Binary(rookery_proto::encode(m).unwrap().into());
    ws.send(send(&hello)).await.unwrap();
    let (assigned, first_job_frame) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let mut assigned = Some(assigned);
        let mut beat = tokio::time::interval(Duration::from_millis(200));
        let mut seq = 0;
        loop {
            tokio::select! {
                _ = beat.tick() => {
                    seq += 1;
                    if ws.send(send(&ToServer::Heartbeat { seq })).await.is_err() {
                        return;
                    }
                }
                frame = ws.next() => {
                    let Some(Ok(frame)) = frame else { return };
                    let Message::Binary(bytes) = frame else { continue };
                    match rookery_proto::decode::<ToProvider>(&bytes, usize::MAX) {
                        Ok(ToProvider::Probe { seq, .. }) => {
                            let _ = ws.send(send(&ToServer::ProbeAck { seq })).await;
                        }
                        Ok(ToProvider::Welcome { .. } | ToProvider::Heartbeat { .. }) => {}
                        // Anything else is the job's (however it is framed).
                        _ => {
                            if let Some(assigned) = assigned.take() {
                                let _ = assigned.send(Instant::now());
                            }
                        }
                    }
                }
            }
        }
    });
    first_job_frame
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_answers_while_a_job_of_millions_of_parameters_starts() {
    let dir = tempfile::tempdir().unwrap();
    let state = AppState::new(
        Db::open_in_memory().unwrap(),
        Limits::default(),
        None,
        dir.path().to_path_buf(),
        Token::new(TOKEN),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(rookery_server::serve(
        listener,
        state.clone(),
        std::future::pending(),
    ));
    let http = reqwest::Client::new();
    let base = format!("http://{addr}/api");

    let first_job_frame = provider(addr).await;
    // Planned onto only once its link is measured.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let listed = http
            .get(format!("{base}/providers"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json::<ProviderList>()
            .await
            .unwrap()
            .providers;
        if listed.iter().any(|p| p.bandwidth_mbps.is_some()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the provider's link was never measured"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let row = |i: usize| -> String {
        (0..1024)
            .map(|j| format!("{}", ((i * 31 + j * 7) % 13) as f32 / 13.0))
            .collect::<Vec<_>>()
            .join(",")
    };
    let x: String = (0..8).map(|i| row(i) + "\n").collect();
    let y: String = (0..8).map(|i| format!("{}\n", i % 10)).collect();
    let (content_type, body) = multipart(&[
        ("job", JOB.as_bytes().to_vec()),
        ("model.toml", MODEL.as_bytes().to_vec()),
        ("x.csv", x.into_bytes()),
        ("y.csv", y.into_bytes()),
    ]);
    let created: JobCreated = http
        .post(format!("{base}/jobs"))
        .bearer_auth(TOKEN)
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let job_id = created.id;

    // Until the provider gets its stage, ask the coordinator (through the
    // providers endpoint, which it answers) what the provider does, and
    // count the answers given while the job was starting: its provider
    // already taken, the job not yet past the queue.
    let mut first_job_frame = first_job_frame;
    let mut answered_while_starting = 0;
    let mut slowest = Duration::ZERO;
    let mut taken_at = None;
    let assigned_at = loop {
        if let Ok(at) = first_job_frame.try_recv() {
            break at;
        }
        assert!(
            Instant::now() < deadline + Duration::from_secs(100),
            "the job never started"
        );
        let asked = Instant::now();
        let listed = http
            .get(format!("{base}/providers"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json::<ProviderList>()
            .await
            .unwrap()
            .providers;
        let took = asked.elapsed();
        let taken = listed
            .iter()
            .any(|p| p.work.as_ref().is_some_and(|w| w.job_id == job_id));
        let job: JobInfo = http
            .get(format!("{base}/jobs/{job_id}"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_ne!(job.status, "failed", "{:?}", job.detail);
        if taken && job.status == "queued" {
            taken_at.get_or_insert(asked);
            answered_while_starting += 1;
            slowest = slowest.max(took);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let starting = taken_at.map_or(Duration::ZERO, |at| assigned_at - at);
    println!(
        "the run took at least {starting:?} to build; the coordinator answered {answered_while_starting} calls meanwhile, the slowest in {slowest:?}"
    );
    // Before, the run was built inside the coordinator's turn that took the
    // providers, so no answer could see them taken by a job still queued.
    assert!(
        answered_while_starting >= 3,
        "only {answered_while_starting} answers while the job started"
    );
    assert!(
        slowest < starting / 2,
        "an answer took {slowest:?} of the {starting:?} start"
    );
}
