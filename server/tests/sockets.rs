//! Real WebSocket clients against a real server on a loopback port.

#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use rookery_proto::api::{ProviderInfo, ProviderList, ProviderStatus};
use rookery_proto::{ErrorCode, Hello, PROTOCOL_VERSION, ProviderKind, ToProvider, ToServer};
use rookery_server::store::Db;
use rookery_server::store::tokens::Token;
use rookery_server::{AppState, Limits};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

type Client =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

const FRAME_LIMIT: usize = 4096;

async fn start_server() -> (std::net::SocketAddr, AppState) {
    let state = AppState::new(
        Db::open_in_memory().unwrap(),
        Limits {
            max_frame_bytes: FRAME_LIMIT,
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_millis(1500),
            ..Limits::default()
        },
        None,
        std::env::temp_dir(),
        Token::new("test-token"),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = state.clone();
    tokio::spawn(rookery_server::serve(
        listener,
        serving,
        std::future::pending(),
    ));
    (addr, state)
}

async fn connect(addr: std::net::SocketAddr) -> Client {
    let url = format!("ws://{addr}{}", rookery_proto::PROVIDER_WS_PATH);
    tokio_tungstenite::connect_async(url).await.unwrap().0
}

async fn send(client: &mut Client, message: &ToServer) {
    let frame = rookery_proto::encode(message).unwrap();
    client.send(Message::Binary(frame.into())).await.unwrap();
}

/// The next message, answering the server's link probes on the way as a
/// provider does.
async fn receive(client: &mut Client) -> ToProvider {
    loop {
        let message = tokio::time::timeout(Duration::from_secs(5), client.next())
            .await
            .expect("server answered in time")
            .expect("connection open")
            .expect("frame readable");
        if let Message::Binary(bytes) = message {
            match rookery_proto::decode(&bytes, 1 << 21).unwrap() {
                ToProvider::Probe { seq, .. } => send(client, &ToServer::ProbeAck { seq }).await,
                message => return message,
            }
        }
    }
}

/// Reads until the server closes; returns the close code and reason.
async fn closed_with(client: &mut Client) -> (CloseCode, String) {
    loop {
        match tokio::time::timeout(Duration::from_secs(5), client.next()).await {
            Ok(Some(Ok(Message::Close(Some(frame))))) => {
                return (frame.code, frame.reason.to_string());
            }
            Ok(Some(Ok(_))) => continue,
            other => panic!("expected a close frame, got {other:?}"),
        }
    }
}

fn hello(name: &str) -> ToServer {
    ToServer::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        kind: ProviderKind::Native,
        device: "loopback test".into(),
        memory_bytes: 1 << 30,
        gflops: 1.0,
        display_name: name.into(),
        max_buffer_bytes: None,
        credential: None,
        requester_token: None,
        donor: None,
        duty_cycle: 1.0,
    })
}

async fn join(addr: std::net::SocketAddr, name: &str) -> (Client, u64) {
    let mut client = connect(addr).await;
    send(&mut client, &hello(name)).await;
    match receive(&mut client).await {
        ToProvider::Welcome { provider_id, .. } => (client, provider_id),
        other => panic!("expected Welcome, got {other:?}"),
    }
}

async fn listed(state: &AppState) -> Vec<ProviderInfo> {
    let app = rookery_server::app(state.clone());
    let response = tower::ServiceExt::oneshot(
        app,
        axum::http::Request::get("/api/providers")
            .header("authorization", "Bearer test-token")
            .body(axum::body::Body::empty())
            .unwrap(),
    )
    .await
    .unwrap();
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap();
    serde_json::from_slice::<ProviderList>(&body.to_bytes())
        .unwrap()
        .providers
}

async fn status_of(state: &AppState, id: u64) -> ProviderStatus {
    listed(state)
        .await
        .iter()
        .find(|p| p.id == id)
        .unwrap()
        .status
}

#[tokio::test]
async fn a_garbage_client_is_dropped_while_a_good_one_keeps_its_heartbeats() {
    let (addr, state) = start_server().await;
    let (mut good, good_id) = join(addr, "good").await;
    let (mut bad, bad_id) = join(addr, "bad").await;

    bad.send(Message::Binary(vec![7, 0xff, 0xff, 0xff, 0x01].into()))
        .await
        .unwrap();
    match receive(&mut bad).await {
        ToProvider::Error(error) => assert_eq!(error.code, ErrorCode::BadFrame),
        other => panic!("expected an error, got {other:?}"),
    }
    let (code, reason) = closed_with(&mut bad).await;
    assert_eq!(code, CloseCode::Invalid);
    assert!(reason.contains("not a valid message"), "{reason}");

    for seq in 0..5 {
        send(&mut good, &ToServer::Heartbeat { seq }).await;
        assert_eq!(receive(&mut good).await, ToProvider::Heartbeat { seq });
    }
    assert_eq!(status_of(&state, good_id).await, ProviderStatus::Connected);
    assert_eq!(status_of(&state, bad_id).await, ProviderStatus::Gone);
}

#[tokio::test]
async fn an_oversized_frame_closes_only_that_connection_with_the_limit_named() {
    let (addr, state) = start_server().await;
    let (mut good, good_id) = join(addr, "good").await;
    let (mut big, big_id) = join(addr, "big").await;

    big.send(Message::Binary(vec![0; FRAME_LIMIT + 1].into()))
        .await
        .unwrap();
    match receive(&mut big).await {
        ToProvider::Error(error) => {
            assert_eq!(error.code, ErrorCode::FrameTooLarge);
            assert_eq!(
                error.message,
                format!(
                    "frame of {} bytes exceeds the limit of {FRAME_LIMIT} bytes",
                    FRAME_LIMIT + 1
                )
            );
        }
        other => panic!("expected an error, got {other:?}"),
    }
    assert_eq!(closed_with(&mut big).await.0, CloseCode::Size);

    send(&mut good, &ToServer::Heartbeat { seq: 1 }).await;
    assert_eq!(receive(&mut good).await, ToProvider::Heartbeat { seq: 1 });
    assert_eq!(status_of(&state, good_id).await, ProviderStatus::Connected);
    assert_eq!(status_of(&state, big_id).await, ProviderStatus::Gone);
}

#[tokio::test]
async fn text_frames_and_frames_before_hello_are_refused() {
    let (addr, _state) = start_server().await;
    let mut texter = connect(addr).await;
    texter.send(Message::Text("hello?".into())).await.unwrap();
    let _ = receive(&mut texter).await;
    assert_eq!(closed_with(&mut texter).await.0, CloseCode::Unsupported);

    let mut eager = connect(addr).await;
    send(&mut eager, &ToServer::Heartbeat { seq: 0 }).await;
    match receive(&mut eager).await {
        ToProvider::Error(error) => assert_eq!(error.code, ErrorCode::UnexpectedMessage),
        other => panic!("expected an error, got {other:?}"),
    }
}

#[tokio::test]
async fn a_provider_that_disconnects_or_goes_quiet_is_marked_gone_quickly() {
    let (addr, state) = start_server().await;
    let (dropped, dropped_id) = join(addr, "dropped").await;
    let (_quiet, quiet_id) = join(addr, "quiet").await;
    drop(dropped);

    let started = std::time::Instant::now();
    loop {
        let dropped_gone = status_of(&state, dropped_id).await == ProviderStatus::Gone;
        let quiet_gone = status_of(&state, quiet_id).await == ProviderStatus::Gone;
        if dropped_gone && quiet_gone {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "not marked gone: dropped={dropped_gone} quiet={quiet_gone}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let providers = listed(&state).await;
    let quiet = providers.iter().find(|p| p.id == quiet_id).unwrap();
    assert!(
        quiet
            .gone_reason
            .as_deref()
            .unwrap()
            .contains("heartbeat timeout")
    );
}
