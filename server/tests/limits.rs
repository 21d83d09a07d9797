//! Bounds on connections, with real clients on a loopback port: the pages
//! that may open provider sockets, the join token, the per-IP caps on provider WebSockets and on HTTP connections,
//! the deadline for a peer that connects but never says Hello, and the
//! timeouts for clients that stall in their headers or uploads.

#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use rookery_proto::{Hello, PROTOCOL_VERSION, ProviderKind, ToProvider, ToServer};
use rookery_server::admission::AllowedOrigins;
use rookery_server::store::Db;
use rookery_server::store::tokens::Token;
use rookery_server::{AppState, Limits};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{self, Message};

type Client =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

const LOOPBACK: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

async fn start(limits: Limits, provider_token: Option<&str>) -> (SocketAddr, AppState) {
    start_with(limits, provider_token, AllowedOrigins::default()).await
}

async fn start_with(
    limits: Limits,
    provider_token: Option<&str>,
    origins: AllowedOrigins,
) -> (SocketAddr, AppState) {
    let mut state = AppState::new(
        Db::open_in_memory().unwrap(),
        limits,
        None,
        std::env::temp_dir(),
        Token::new("test-token"),
    )
    .with_allowed_origins(origins);
    if let Some(token) = provider_token {
        state = state.with_provider_token(token);
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(rookery_server::serve(
        listener,
        state.clone(),
        std::future::pending(),
    ));
    (addr, state)
}

fn url(addr: SocketAddr, query: &str) -> String {
    format!("ws://{addr}{}{query}", rookery_proto::PROVIDER_WS_PATH)
}

/// Opens a WebSocket; on refusal, the HTTP status and body.
async fn open(
    addr: SocketAddr,
    query: &str,
    bearer: Option<&str>,
) -> Result<Client, (u16, String)> {
    let mut request = url(addr, query).into_client_request().unwrap();
    if let Some(token) = bearer {
        request
            .headers_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    upgrade(request).await
}

/// Opens a WebSocket as a page at `origin` would (browsers send `Origin`).
async fn open_from(addr: SocketAddr, origin: Option<&str>) -> Result<Client, (u16, String)> {
    let mut request = url(addr, "").into_client_request().unwrap();
    if let Some(origin) = origin {
        request
            .headers_mut()
            .insert("origin", origin.parse().unwrap());
    }
    upgrade(request).await
}

async fn upgrade(
    request: tungstenite::handshake::client::Request,
) -> Result<Client, (u16, String)> {
    match tokio_tungstenite::connect_async(request).await {
        Ok((client, _)) => Ok(client),
        Err(tungstenite::Error::Http(response)) => {
            let body = response.body().clone().unwrap_or_default();
            Err((
                response.status().as_u16(),
                String::from_utf8_lossy(&body).into_owned(),
            ))
        }
        Err(other) => panic!("connecting failed below HTTP: {other}"),
    }
}

/// Says Hello and returns the Welcome's provider id.
async fn join(client: &mut Client) -> u64 {
    let hello = ToServer::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        kind: ProviderKind::Native,
        device: "loopback test".into(),
        memory_bytes: 1 << 30,
        gflops: 1.0,
        display_name: "limits".into(),
        max_buffer_bytes: None,
        credential: None,
        requester_token: None,
        donor: None,
        duty_cycle: 1.0,
    });
    let frame = rookery_proto::encode(&hello).unwrap();
    client.send(Message::Binary(frame.into())).await.unwrap();
    loop {
        let message = tokio::time::timeout(Duration::from_secs(5), client.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let Message::Binary(bytes) = message {
            match rookery_proto::decode::<ToProvider>(&bytes, 1 << 20).unwrap() {
                ToProvider::Welcome { provider_id, .. } => return provider_id,
                other => panic!("expected Welcome, got {other:?}"),
            }
        }
    }
}

/// Waits until the server counts `expected` provider connections from loopback.
async fn wait_for_count(state: &AppState, expected: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while state.connections.count(LOOPBACK) != expected {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} connections counted, expected {expected}",
            state.connections.count(LOOPBACK)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn connections_beyond_the_per_ip_cap_get_429_until_one_closes() {
    let (addr, state) = start(
        Limits {
            max_connections_per_ip: 2,
            ..Limits::default()
        },
        None,
    )
    .await;
    let mut first = open(addr, "", None).await.unwrap();
    let mut second = open(addr, "", None).await.unwrap();
    join(&mut first).await;
    join(&mut second).await;
    let (status, body) = open(addr, "", None).await.err().unwrap();
    assert_eq!(status, 429);
    assert!(
        body.contains("too many provider connections from 127.0.0.1 (at most 2)"),
        "{body}"
    );
    // The refused attempt took no slot; closing one frees one.
    assert_eq!(state.connections.count(LOOPBACK), 2);
    first.close(None).await.unwrap();
    wait_for_count(&state, 1).await;
    let mut third = open(addr, "", None).await.unwrap();
    join(&mut third).await;
    assert_eq!(state.connections.count(LOOPBACK), 2);
}

#[tokio::test]
async fn a_peer_that_never_says_hello_is_dropped_at_the_deadline() {
    let timeout = Duration::from_millis(400);
    let (addr, state) = start(
        Limits {
            heartbeat_timeout: timeout,
            ..Limits::default()
        },
        None,
    )
    .await;
    let started = tokio::time::Instant::now();
    let mut silent = open(addr, "", None).await.unwrap();
    wait_for_count(&state, 1).await;
    let close = loop {
        match tokio::time::timeout(Duration::from_secs(5), silent.next()).await {
            Ok(Some(Ok(Message::Close(Some(frame))))) => break frame,
            Ok(Some(Ok(_))) => continue,
            other => panic!("expected a close frame, got {other:?}"),
        }
    };
    let waited = started.elapsed();
    assert_eq!(close.code, CloseCode::Policy);
    assert!(
        close.reason.contains("heartbeat timeout"),
        "{}",
        close.reason
    );
    assert!(
        waited >= timeout && waited < timeout * 5,
        "dropped after {waited:?}"
    );
    wait_for_count(&state, 0).await;
}

#[tokio::test]
async fn providers_need_the_join_token_when_the_server_requires_one() {
    let (addr, state) = start(Limits::default(), Some("open sesame")).await;
    let refused: [(&str, Option<&str>); 4] = [
        ("", None),
        ("", Some("open sesam")),
        ("?token=open", None),
        ("?token=", Some("")),
    ];
    for (query, bearer) in refused {
        let (status, body) = open(addr, query, bearer).await.err().unwrap();
        assert_eq!(status, 401, "{query} {bearer:?}");
        assert!(body.contains("join token"), "{body}");
    }
    // Refused peers never reached the registry or took a slot.
    assert_eq!(state.connections.count(LOOPBACK), 0);
    let admitted: [(&str, Option<&str>); 2] =
        [("", Some("open sesame")), ("?token=open%20sesame", None)];
    for (query, bearer) in admitted {
        let mut client = open(addr, query, bearer).await.unwrap();
        assert!(join(&mut client).await > 0, "{query} {bearer:?}");
    }
}

/// Writes `head` on a raw socket, then goes silent; returns what the server
/// said before it closed, and how long that took.
#[tokio::test]
async fn pages_outside_the_allowed_origins_get_403_before_the_upgrade() {
    let allowed = AllowedOrigins::new(vec!["https://donate.example.org".parse().unwrap()]);
    let (addr, _state) = start_with(Limits::default(), None, allowed).await;
    let (status, body) = open_from(addr, Some("https://evil.example"))
        .await
        .err()
        .unwrap();
    assert_eq!(status, 403);
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    let message = error["error"].as_str().unwrap();
    assert!(message.contains("`https://evil.example`"), "{message}");
    assert!(message.contains("--allowed-origin"), "{message}");
    // A listed page, the server's own pages (its Host) and a native
    // provider, which sends no Origin, are upgraded and join.
    let own = format!("http://{addr}");
    for origin in [Some("https://donate.example.org"), Some(own.as_str()), None] {
        let mut client = open_from(addr, origin)
            .await
            .unwrap_or_else(|refused| panic!("{origin:?} refused: {refused:?}"));
        join(&mut client).await;
    }
}

async fn stall_after(addr: SocketAddr, head: &[u8]) -> (String, Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let started = tokio::time::Instant::now();
    tcp.write_all(head).await.unwrap();
    let mut said = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        // A reset counts as closed too.
        while let Ok(n @ 1..) = tcp.read(&mut buf).await {
            said.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    assert!(closed.is_ok(), "the connection was still open after 10 s");
    (
        String::from_utf8_lossy(&said).into_owned(),
        started.elapsed(),
    )
}

#[tokio::test]
async fn clients_that_stall_in_headers_or_uploads_are_dropped() {
    let timeout = Duration::from_millis(400);
    let (addr, _) = start(
        Limits {
            slow_client_timeout: timeout,
            ..Limits::default()
        },
        None,
    )
    .await;
    let upload = "POST /api/jobs HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer test-token\r\n\
                  Content-Type: multipart/form-data; boundary=B\r\nContent-Length: 100000\r\n\r\n\
                  --B\r\nContent-Disposition: form-data; name=\"x.npy\"; filename=\"x.npy\"\r\n\r\n\
                  first bytes of a file that never ends";
    let cases: [(&str, &str, &[&str]); 2] = [
        ("headers", "GET /api/health HTTP/1.1\r\nHost: t\r\n", &[]),
        ("upload", upload, &["HTTP/1.1 408", "the upload stalled"]),
    ];
    for (what, head, answer) in cases {
        let (said, waited) = stall_after(addr, head.as_bytes()).await;
        assert!(
            waited >= timeout && waited < timeout * 5,
            "{what}: dropped after {waited:?}"
        );
        for expected in answer {
            assert!(said.contains(expected), "{what}: {said}");
        }
    }
    // A client that sends its request promptly is answered on the same server.
    let (said, _) = stall_after(
        addr,
        b"GET /api/health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(said.starts_with("HTTP/1.1 200"), "{said}");
}

#[tokio::test]
async fn http_connections_beyond_the_per_ip_cap_get_429_until_one_closes() {
    use tokio::io::AsyncWriteExt;
    let (addr, _) = start(
        Limits {
            max_http_connections_per_ip: 2,
            ..Limits::default()
        },
        None,
    )
    .await;
    // Two idle connections hold both slots.
    let first = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut second = tokio::net::TcpStream::connect(addr).await.unwrap();
    let health = b"GET /api/health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";
    let (said, _) = stall_after(addr, health).await;
    assert!(said.starts_with("HTTP/1.1 429"), "{said}");
    assert!(
        said.contains("too many connections from 127.0.0.1 (at most 2)"),
        "{said}"
    );
    // The held connections still work, and closing one frees its slot.
    second.write_all(health).await.unwrap();
    let mut answer = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut second, &mut answer)
        .await
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    drop(first);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (said, _) = stall_after(addr, health).await;
        if said.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still refused: {said}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
