//! The provider WebSocket: handshake, heartbeats, and dropping a peer that
//! breaks the protocol without disturbing anyone else.
//!
//! The loop is generic over `Sink`/`Stream` so tests drive it with in-memory
//! channels as well as real sockets.

use std::collections::VecDeque;
use std::fmt::Display;
use std::net::SocketAddr;

use axum::extract::ws::{CloseFrame, Message, WebSocketUpgrade};
use axum::extract::{ConnectInfo, State};
use axum::http::{Extensions, HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use futures_util::{Sink, SinkExt, Stream, StreamExt};
use rookery_proto::stream::{Incoming, Lane, Payload, Streamed};
use rookery_proto::{
    DecodeError, ErrorCode, ErrorMessage, Hello, PROTOCOL_VERSION, ToProvider, ToServer, WireDType,
};

use crate::coordinator::{Event, Outgoing};
use crate::{AppState, admission, now_ms, providers};

/// WebSocket close codes (RFC 6455, section 7.4.1).
mod close_code {
    pub const NORMAL: u16 = 1000;
    pub const PROTOCOL: u16 = 1002;
    pub const UNSUPPORTED: u16 = 1003;
    pub const INVALID_PAYLOAD: u16 = 1007;
    pub const POLICY: u16 = 1008;
    pub const TOO_BIG: u16 = 1009;
    pub const INTERNAL: u16 = 1011;
}

/// Longest close reason a control frame can carry (125 bytes less the code).
const MAX_CLOSE_REASON: usize = 123;

pub async fn provider_socket(
    ws: WebSocketUpgrade,
    State(state): State<AppState>,
    extensions: Extensions,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    let ip = extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|info| info.0.ip());
    let slot = match admission::admit(&state, ip, &headers, uri.query()) {
        Ok(slot) => slot,
        Err(refusal) => {
            tracing::info!(?ip, reason = %refusal, "provider connection refused");
            return refusal.into_response();
        }
    };
    // Let frames of up to twice our limit through the transport so that this
    // module, not tungstenite, rejects an oversized frame and says why.
    let transport_limit = state.limits.max_frame_bytes.saturating_mul(2);
    ws.max_message_size(transport_limit)
        .max_frame_size(transport_limit)
        .on_upgrade(move |socket| {
            let (sink, stream) = socket.split();
            async move {
                serve_provider(sink, stream, state).await;
                drop(slot);
            }
        })
}

/// How a connection ended.
#[derive(Debug)]
enum Ending {
    /// The peer closed or vanished; nothing to tell it.
    Left(String),
    /// The server drops the peer and tells it why.
    Rejected {
        code: ErrorCode,
        close_code: u16,
        message: String,
    },
    /// The coordinator dropped the peer for wrong data (or banned it from its
    /// job); it is told why like a rejected peer.
    Expelled(String),
}

impl Ending {
    fn rejected(code: ErrorCode, close_code: u16, message: impl Into<String>) -> Self {
        Ending::Rejected {
            code,
            close_code,
            message: message.into(),
        }
    }

    fn bad_frame(error: DecodeError) -> Self {
        let close_code = match error {
            DecodeError::TooLarge { .. } => close_code::TOO_BIG,
            _ => close_code::INVALID_PAYLOAD,
        };
        Ending::rejected(error.code(), close_code, error.to_string())
    }

    /// What the registry records as the reason the provider is gone.
    fn reason(&self) -> String {
        match self {
            Ending::Left(reason) => reason.clone(),
            Ending::Rejected { message, .. } | Ending::Expelled(message) => {
                format!("dropped: {message}")
            }
        }
    }

    /// Whether the peer broke the protocol (a malformed, oversized or
    /// unexpected frame, or a bad payload), which counts as a fault against it.
    /// A transport error (a reset connection) is no fault: networks do that.
    fn is_fault(&self) -> bool {
        matches!(
            self,
            Ending::Rejected {
                code: ErrorCode::BadFrame | ErrorCode::FrameTooLarge | ErrorCode::UnexpectedMessage,
                close_code,
                ..
            } if *close_code != close_code::PROTOCOL
        )
    }
}

/// Serves one provider connection from its first frame to its last.
pub async fn serve_provider<Si, St, E>(mut sink: Si, mut stream: St, state: AppState)
where
    Si: Sink<Message> + Unpin,
    St: Stream<Item = Result<Message, E>> + Unpin,
    E: Display,
{
    let hello = match handshake(&mut stream, &state).await {
        Ok(hello) => hello,
        Err(ending) => {
            tracing::info!(reason = %ending.reason(), "provider refused at handshake");
            say_goodbye(&mut sink, ending).await;
            return;
        }
    };
    let name = hello.display_name.clone();
    let id = match providers::register(&state.db, hello.clone(), now_ms()).await {
        Ok(id) => id,
        Err(error) => {
            tracing::error!(%error, "cannot register provider");
            let ending = Ending::rejected(
                ErrorCode::Internal,
                close_code::INTERNAL,
                "the server cannot register providers right now; retry later",
            );
            say_goodbye(&mut sink, ending).await;
            return;
        }
    };
    tracing::info!(id, %name, "provider joined");

    let ending = session(id, hello, &mut sink, &mut stream, &state).await;
    let reason = ending.reason();
    tracing::info!(id, %name, %reason, "provider gone");
    if let Err(error) = providers::mark_gone(&state.db, id, now_ms(), reason).await {
        tracing::error!(id, %error, "cannot record that a provider left");
    }
    say_goodbye(&mut sink, ending).await;
}

async fn handshake<St, E>(stream: &mut St, state: &AppState) -> Result<Hello, Ending>
where
    St: Stream<Item = Result<Message, E>> + Unpin,
    E: Display,
{
    let deadline = tokio::time::Instant::now() + state.limits.heartbeat_timeout;
    let frame = next_frame(stream, state, deadline).await?;
    if let Some(version) = rookery_proto::peek_hello_version(&frame)
        && version != PROTOCOL_VERSION
    {
        return Err(Ending::rejected(
            ErrorCode::VersionMismatch,
            close_code::POLICY,
            format!(
                "this server speaks protocol version {PROTOCOL_VERSION}, the provider speaks {version}; upgrade the older side"
            ),
        ));
    }
    match rookery_proto::decode_frame::<ToServer>(&frame, state.limits.max_frame_bytes) {
        Ok(ToServer::Hello(hello)) => validate_hello(hello),
        Ok(other) => Err(Ending::rejected(
            ErrorCode::UnexpectedMessage,
            close_code::POLICY,
            format!(
                "the first frame must be Hello, got {}",
                message_name(&other)
            ),
        )),
        Err(error) => Err(Ending::bad_frame(error)),
    }
}

/// A provider describes itself; nothing it says is trusted blindly.
/// The smallest buffer limit a provider may report.
const MIN_BUFFER_LIMIT: u64 = 1 << 20;

fn validate_hello(hello: Hello) -> Result<Hello, Ending> {
    let problem = if hello.display_name.trim().is_empty() || hello.display_name.chars().count() > 64
    {
        Some("display name must have 1 to 64 characters")
    } else if hello.device.chars().count() > 256 {
        Some("device description must have at most 256 characters")
    } else if !hello.gflops.is_finite() || hello.gflops <= 0.0 {
        Some("measured GFLOP/s must be a positive finite number")
    } else if hello.memory_bytes == 0 {
        Some("memory must be more than 0 bytes")
    } else if hello.max_buffer_bytes.is_some_and(|b| b < MIN_BUFFER_LIMIT) {
        // WebGPU guarantees 128 MiB; a device claiming less than 1 MiB could
        // take no stage anyway.
        Some("the largest bindable buffer must be at least 1 MiB")
    } else {
        None
    };
    match problem {
        Some(problem) => Err(Ending::rejected(
            ErrorCode::BadFrame,
            close_code::POLICY,
            format!("invalid Hello: {problem}"),
        )),
        None => Ok(hello),
    }
}

async fn session<Si, St, E>(
    id: u64,
    hello: Hello,
    sink: &mut Si,
    stream: &mut St,
    state: &AppState,
) -> Ending
where
    Si: Sink<Message> + Unpin,
    St: Stream<Item = Result<Message, E>> + Unpin,
    E: Display,
{
    let welcome = ToProvider::Welcome {
        provider_id: id,
        heartbeat_interval_ms: millis(state.limits.heartbeat_interval),
        heartbeat_timeout_ms: millis(state.limits.heartbeat_timeout),
    };
    if let Err(ending) = send(sink, &welcome).await {
        return ending;
    }
    let (tx, mut outbox) = tokio::sync::mpsc::unbounded_channel();
    state.coordinator.send(Event::Connected { id, hello, tx });
    let mut probe = LinkProbe::default();
    if let Err(ending) = send(sink, &probe.start()).await {
        return ending;
    }
    let mut deadline = tokio::time::Instant::now() + state.limits.heartbeat_timeout;
    let mut owed = Owed::default();
    let ending = loop {
        // Frames the coordinator wants sent go out between incoming frames;
        // the heartbeat deadline only moves when the provider speaks.
        let frame = tokio::select! {
            biased;
            frame = next_frame(stream, state, deadline) => frame,
            Some(outgoing) = outbox.recv() => {
                let sent = match outgoing {
                    Outgoing::Message(message) => send(sink, &message).await,
                    Outgoing::Payload(frame) => send_frame(sink, frame).await,
                    // The coordinator already counted the fault this answers.
                    Outgoing::Close { reason } => Err(Ending::Expelled(reason)),
                };
                if let Err(ending) = sent {
                    break ending;
                }
                continue;
            }
        };
        let frame = match frame {
            Ok(frame) => frame,
            Err(ending) => break ending,
        };
        deadline = tokio::time::Instant::now() + state.limits.heartbeat_timeout;
        let message = match rookery_proto::stream::read_frame(&frame, state.limits.max_frame_bytes)
        {
            Ok(Incoming::Message(message)) => Ok(message),
            Ok(Incoming::Payload(payload)) => {
                match owed.take(&payload) {
                    Ok(()) => state.coordinator.send(Event::Payload { id, payload }),
                    Err(problem) => {
                        break Ending::rejected(ErrorCode::BadFrame, close_code::POLICY, problem);
                    }
                }
                continue;
            }
            Err(error) => Err(error),
        };
        match message {
            Ok(ToServer::Heartbeat { seq }) => {
                if let Err(error) = providers::record_heartbeat(&state.db, id, now_ms()).await {
                    tracing::error!(id, %error, "cannot record a heartbeat");
                }
                if let Err(ending) = send(sink, &ToProvider::Heartbeat { seq }).await {
                    break ending;
                }
            }
            Ok(ToServer::Hello(_)) => {
                break Ending::rejected(
                    ErrorCode::UnexpectedMessage,
                    close_code::POLICY,
                    "Hello was already accepted on this connection",
                );
            }
            Ok(ToServer::ProbeAck { seq }) => match probe.acknowledged(seq) {
                ProbeNext::Send(next) => {
                    if let Err(ending) = send(sink, &next).await {
                        break ending;
                    }
                }
                ProbeNext::Measured(mbps) => {
                    tracing::info!(id, mbps = format!("{mbps:.0}"), "measured the link");
                    if let Err(error) = providers::record_bandwidth(&state.db, id, mbps).await {
                        tracing::error!(id, %error, "cannot record a bandwidth");
                    }
                    state.coordinator.send(Event::Measured {
                        id,
                        bandwidth_mbps: mbps,
                    });
                }
                ProbeNext::Ignore => {
                    tracing::debug!(id, seq, "ignored a ProbeAck nobody asked for");
                }
            },
            Ok(ToServer::Error(ErrorMessage { code, message })) => {
                break Ending::Left(format!("provider gave up ({code:?}): {message}"));
            }
            Ok(message) => {
                if let Err(problem) = owed.announce(&message) {
                    break Ending::rejected(ErrorCode::BadFrame, close_code::POLICY, problem);
                }
                state.coordinator.send(Event::Message { id, message });
            }
            Err(error) => break Ending::bad_frame(error),
        }
    };
    if ending.is_fault() {
        // Before `Disconnected`: the fault counts against the job it leaves.
        state.coordinator.send(Event::Fault {
            id,
            reason: ending.reason(),
        });
    }
    state.coordinator.send(Event::Disconnected {
        id,
        reason: ending.reason(),
    });
    ending
}

/// Waits for the next binary frame until `deadline` (one heartbeat timeout
/// after the peer last spoke).
async fn next_frame<St, E>(
    stream: &mut St,
    state: &AppState,
    deadline: tokio::time::Instant,
) -> Result<axum::body::Bytes, Ending>
where
    St: Stream<Item = Result<Message, E>> + Unpin,
    E: Display,
{
    let timeout = state.limits.heartbeat_timeout;
    loop {
        let next = match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(next) => next,
            Err(_) => {
                return Err(Ending::rejected(
                    ErrorCode::HeartbeatTimeout,
                    close_code::POLICY,
                    format!("heartbeat timeout: no frame for {} ms", timeout.as_millis()),
                ));
            }
        };
        match next {
            Some(Ok(Message::Binary(bytes))) => {
                let limit = state.limits.max_frame_bytes;
                if bytes.len() > limit {
                    return Err(Ending::bad_frame(DecodeError::TooLarge {
                        len: bytes.len(),
                        limit,
                    }));
                }
                return Ok(bytes);
            }
            Some(Ok(Message::Text(_))) => {
                return Err(Ending::rejected(
                    ErrorCode::BadFrame,
                    close_code::UNSUPPORTED,
                    "text frames are not part of the protocol; send binary frames",
                ));
            }
            Some(Ok(Message::Close(_))) => return Err(Ending::Left("closed".into())),
            // Pings are answered by the transport; they still prove liveness.
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Err(error)) => {
                return Err(Ending::rejected(
                    ErrorCode::BadFrame,
                    close_code::PROTOCOL,
                    format!("transport error: {error}"),
                ));
            }
            None => return Err(Ending::Left("connection lost".into())),
        }
    }
}

async fn send<Si: Sink<Message> + Unpin>(
    sink: &mut Si,
    message: &ToProvider,
) -> Result<(), Ending> {
    let frame = rookery_proto::encode(message)
        .map_err(|error| Ending::Left(format!("cannot encode a reply: {error}")))?;
    send_frame(sink, frame.into()).await
}

async fn send_frame<Si: Sink<Message> + Unpin>(
    sink: &mut Si,
    frame: axum::body::Bytes,
) -> Result<(), Ending> {
    sink.send(Message::Binary(frame))
        .await
        .map_err(|_| Ending::Left("connection lost while sending".into()))
}

/// Measures a provider's link once, right after `Welcome`: an empty probe
/// times the round trip, then a [`LinkProbe::BYTES`] probe times the round
/// trip plus the transfer; the difference gives the bandwidth the planner
/// weighs boundary tensors with. Up to [`LinkProbe::ROUNDS`] such pairs are
/// timed, while they fit in [`LinkProbe::BUDGET`], and the quickest of each
/// kind counts: a provider connects while it (and its neighbours) are still
/// starting, and other work can only make a probe slower. (Differences of
/// single rounds are no good: one slow empty probe makes the link look
/// boundless.)
#[derive(Debug, Default)]
struct LinkProbe {
    began: Option<tokio::time::Instant>,
    awaiting: Option<AwaitedProbe>,
    quickest_empty: Option<std::time::Duration>,
    quickest_full: Option<std::time::Duration>,
}

#[derive(Debug)]
struct AwaitedProbe {
    /// Even: an empty probe; odd: the full one of the same round.
    seq: u32,
    sent: tokio::time::Instant,
}

enum ProbeNext {
    Send(ToProvider),
    Measured(f64),
    Ignore,
}

impl LinkProbe {
    /// Large enough to time a fast link, small enough for a slow one (8 s
    /// at 1 Mbit/s).
    const BYTES: usize = 1 << 20;
    /// What a measurement is clamped to, in Mbit/s: timer resolution makes
    /// loopback look unboundedly fast.
    const RANGE: (f64, f64) = (1.0, 100_000.0);
    const ROUNDS: u32 = 3;
    /// No round starts after probing has taken this long (a slow link is
    /// timed once).
    const BUDGET: std::time::Duration = std::time::Duration::from_millis(500);

    fn start(&mut self) -> ToProvider {
        let now = tokio::time::Instant::now();
        self.began = Some(now);
        self.send(0, now)
    }

    fn send(&mut self, seq: u32, now: tokio::time::Instant) -> ToProvider {
        self.awaiting = Some(AwaitedProbe { seq, sent: now });
        let padding = if !seq.is_multiple_of(2) {
            vec![0; Self::BYTES].into()
        } else {
            Default::default()
        };
        ToProvider::Probe { seq, padding }
    }

    fn acknowledged(&mut self, seq: u32) -> ProbeNext {
        let now = tokio::time::Instant::now();
        let Some(awaited) = self.awaiting.take_if(|a| a.seq == seq) else {
            return ProbeNext::Ignore;
        };
        let took = now - awaited.sent;
        let quickest = if seq.is_multiple_of(2) {
            &mut self.quickest_empty
        } else {
            &mut self.quickest_full
        };
        *quickest = Some(quickest.map_or(took, |q| q.min(took)));
        if seq.is_multiple_of(2) {
            return ProbeNext::Send(self.send(seq + 1, now));
        }
        let rounds = seq / 2 + 1;
        let within_budget = self.began.is_some_and(|b| now - b < Self::BUDGET);
        if rounds < Self::ROUNDS && within_budget {
            return ProbeNext::Send(self.send(seq + 1, now));
        }
        let (Some(empty), Some(full)) = (self.quickest_empty, self.quickest_full) else {
            return ProbeNext::Ignore;
        };
        let transfer = full.saturating_sub(empty).as_secs_f64();
        let mbps = (Self::BYTES * 8) as f64 / transfer.max(1e-9) / 1e6;
        ProbeNext::Measured(mbps.clamp(Self::RANGE.0, Self::RANGE.1))
    }
}

/// The tensor bytes a provider announced and has not sent yet, tensor by
/// tensor in order. Each payload frame is checked here, in the provider's own
/// task, before it is relayed: it must belong to the lane and fit the tensor
/// it continues, and hold whole, finite elements of the tensor's type.
#[derive(Debug, Default)]
struct Owed(VecDeque<(Lane, WireDType, usize)>);

impl Owed {
    /// Bound on announced-but-unsent tensors: a provider owes at most a few.
    const MAX_PENDING: usize = 1024;

    fn announce(&mut self, message: &ToServer) -> Result<(), String> {
        let Some(lane) = message.lane() else {
            return Ok(());
        };
        for tensor in message.streamed_tensors().iter().filter(|t| t.follows()) {
            if self.0.len() >= Self::MAX_PENDING {
                return Err("too many announced tensors outstanding".into());
            }
            let len = tensor.expected_len().unwrap_or(0);
            self.0.push_back((lane, tensor.dtype, len));
        }
        Ok(())
    }

    fn take(&mut self, payload: &Payload) -> Result<(), String> {
        let Some((lane, dtype, left)) = self.0.front_mut() else {
            return Err("a payload frame that no message announced".into());
        };
        let data = payload.data();
        if payload.lane != *lane {
            return Err(format!(
                "a {:?} payload while {:?} bytes are owed",
                payload.lane, lane
            ));
        }
        if data.is_empty() || data.len() > *left || !data.len().is_multiple_of(dtype.size()) {
            return Err(format!(
                "a payload of {} bytes does not fit the {left} bytes of {} owed",
                data.len(),
                dtype.as_str()
            ));
        }
        if let Some(index) = dtype.first_non_finite(data) {
            return Err(format!(
                "a payload with a non-finite value at element {index}"
            ));
        }
        *left -= data.len();
        if *left == 0 {
            self.0.pop_front();
        }
        Ok(())
    }
}

/// Tells a rejected peer why, then closes. Best effort: the peer may be gone.
async fn say_goodbye<Si: Sink<Message> + Unpin>(sink: &mut Si, ending: Ending) {
    let ending = match ending {
        Ending::Expelled(message) => Ending::Rejected {
            code: ErrorCode::BadFrame,
            close_code: close_code::POLICY,
            message,
        },
        other => other,
    };
    let (close_code, reason) = match ending {
        Ending::Left(_) | Ending::Expelled(_) => (close_code::NORMAL, String::new()),
        Ending::Rejected {
            code,
            close_code,
            message,
        } => {
            let error = ToProvider::Error(ErrorMessage {
                code,
                message: message.clone(),
            });
            let _ = send(sink, &error).await;
            (close_code, message)
        }
    };
    let frame = CloseFrame {
        code: close_code,
        reason: truncate_utf8(&reason, MAX_CLOSE_REASON).into(),
    };
    let _ = sink.send(Message::Close(Some(frame))).await;
    let _ = sink.close().await;
}

fn truncate_utf8(text: &str, max_bytes: usize) -> &str {
    if text.len() <= max_bytes {
        return text;
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

fn message_name(message: &ToServer) -> &'static str {
    match message {
        ToServer::Hello(_) => "Hello",
        ToServer::Heartbeat { .. } => "Heartbeat",
        ToServer::Error(_) => "Error",
        ToServer::Ready { .. } => "Ready",
        ToServer::Activations(_) => "Activations",
        ToServer::Gradients(_) => "Gradients",
        ToServer::LeafLoss(_) => "LeafLoss",
        ToServer::StepDone(_) => "StepDone",
        ToServer::Params(_) => "Params",
        ToServer::JobFailed { .. } => "JobFailed",
        ToServer::ProbeAck { .. } => "ProbeAck",
        ToServer::OptimizerState(_) => "OptimizerState",
    }
}

fn millis(duration: std::time::Duration) -> u32 {
    u32::try_from(duration.as_millis()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Limits, db::Db};
    use futures_channel::mpsc;
    use rookery_proto::ProviderKind;
    use std::time::Duration;

    fn state() -> AppState {
        AppState::new(
            Db::open_in_memory().unwrap(),
            Limits {
                max_frame_bytes: 1024,
                heartbeat_interval: Duration::from_millis(50),
                heartbeat_timeout: Duration::from_millis(300),
                ..Limits::default()
            },
            None,
            std::env::temp_dir(),
            crate::auth::Token::new("test-token"),
        )
    }

    fn hello() -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            kind: ProviderKind::Native,
            device: "test device".into(),
            memory_bytes: 1 << 30,
            gflops: 10.0,
            display_name: "unit".into(),
            max_buffer_bytes: None,
        }
    }

    fn binary(message: &ToServer) -> Result<Message, std::convert::Infallible> {
        Ok(Message::Binary(
            rookery_proto::encode(message).unwrap().into(),
        ))
    }

    fn decode_reply(message: Message) -> ToProvider {
        match message {
            Message::Binary(bytes) => rookery_proto::decode(&bytes, 1 << 21).unwrap(),
            other => panic!("expected a binary frame, got {other:?}"),
        }
    }

    /// Runs a connection over channels: `frames` in, every reply out but
    /// the link probes.
    async fn run(
        state: &AppState,
        frames: Vec<Result<Message, std::convert::Infallible>>,
    ) -> Vec<Message> {
        let is_probe = |m: &Message| {
            matches!(m, Message::Binary(b) if matches!(
                rookery_proto::decode(b, 1 << 21),
                Ok(ToProvider::Probe { .. })
            ))
        };
        run_all(state, frames)
            .await
            .into_iter()
            .filter(|m| !is_probe(m))
            .collect()
    }

    async fn run_all(
        state: &AppState,
        frames: Vec<Result<Message, std::convert::Infallible>>,
    ) -> Vec<Message> {
        let (out_tx, out_rx) = mpsc::unbounded();
        let incoming = futures_util::stream::iter(frames);
        serve_provider(out_tx, incoming, state.clone()).await;
        out_rx.collect().await
    }

    #[tokio::test]
    async fn the_link_is_probed_in_rounds_and_its_best_bandwidth_recorded() {
        let state = state();
        let replies = run_all(
            &state,
            vec![
                binary(&ToServer::Hello(hello())),
                // An answer to a probe never sent is ignored.
                binary(&ToServer::ProbeAck { seq: 7 }),
                binary(&ToServer::ProbeAck { seq: 0 }),
                binary(&ToServer::ProbeAck { seq: 1 }),
                // A repeated answer is ignored too.
                binary(&ToServer::ProbeAck { seq: 1 }),
                binary(&ToServer::ProbeAck { seq: 2 }),
                binary(&ToServer::ProbeAck { seq: 3 }),
                binary(&ToServer::ProbeAck { seq: 4 }),
                binary(&ToServer::ProbeAck { seq: 5 }),
                // Three rounds are all there is.
                binary(&ToServer::ProbeAck { seq: 6 }),
                Ok(Message::Close(None)),
            ],
        )
        .await;
        let probes: Vec<(u32, usize)> = replies
            .into_iter()
            .filter_map(|m| match m {
                Message::Binary(_) => match decode_reply(m) {
                    ToProvider::Probe { seq, padding } => Some((seq, padding.len())),
                    _ => None,
                },
                _ => None,
            })
            .collect();
        let round = [(0, 0), (1, LinkProbe::BYTES)];
        let rounds: Vec<(u32, usize)> = (0..LinkProbe::ROUNDS)
            .flat_map(|r| round.map(|(seq, len)| (seq + 2 * r, len)))
            .collect();
        assert_eq!(probes, rounds);
        let record = providers::get(&state.db, 1).await.unwrap().unwrap();
        let mbps = record.bandwidth_mbps.expect("measured");
        assert!(
            (LinkProbe::RANGE.0..=LinkProbe::RANGE.1).contains(&mbps),
            "{mbps}"
        );
    }

    #[tokio::test]
    async fn hello_heartbeat_and_close_are_answered_and_recorded() {
        let state = state();
        let replies = run(
            &state,
            vec![
                binary(&ToServer::Hello(hello())),
                binary(&ToServer::Heartbeat { seq: 9 }),
                Ok(Message::Close(None)),
            ],
        )
        .await;
        assert!(matches!(
            decode_reply(replies[0].clone()),
            ToProvider::Welcome { provider_id: 1, .. }
        ));
        assert_eq!(
            decode_reply(replies[1].clone()),
            ToProvider::Heartbeat { seq: 9 }
        );
        let record = providers::get(&state.db, 1).await.unwrap().unwrap();
        assert_eq!(record.gone.unwrap().reason, "closed");
    }

    #[tokio::test]
    async fn wrong_version_is_named_and_nobody_is_registered() {
        let state = state();
        let replies = run(
            &state,
            vec![binary(&ToServer::Hello(Hello {
                protocol_version: PROTOCOL_VERSION + 1,
                ..hello()
            }))],
        )
        .await;
        match decode_reply(replies[0].clone()) {
            ToProvider::Error(error) => {
                assert_eq!(error.code, ErrorCode::VersionMismatch);
                assert!(
                    error.message.contains("protocol version"),
                    "{}",
                    error.message
                );
            }
            other => panic!("expected an error, got {other:?}"),
        }
        assert!(
            matches!(&replies[1], Message::Close(Some(frame)) if frame.code == close_code::POLICY)
        );
        assert!(providers::list(&state.db).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn invalid_hellos_are_refused_with_the_reason() {
        let cases = [
            (
                Hello {
                    display_name: " ".into(),
                    ..hello()
                },
                "display name",
            ),
            (
                Hello {
                    gflops: f64::NAN,
                    ..hello()
                },
                "GFLOP/s",
            ),
            (
                Hello {
                    gflops: -1.0,
                    ..hello()
                },
                "GFLOP/s",
            ),
            (
                Hello {
                    memory_bytes: 0,
                    ..hello()
                },
                "memory",
            ),
            (
                Hello {
                    max_buffer_bytes: Some(4096),
                    ..hello()
                },
                "largest bindable buffer",
            ),
            (
                Hello {
                    device: "x".repeat(300),
                    ..hello()
                },
                "device",
            ),
        ];
        for (bad, expected) in cases {
            let state = state();
            let replies = run(&state, vec![binary(&ToServer::Hello(bad))]).await;
            let ToProvider::Error(error) = decode_reply(replies[0].clone()) else {
                panic!("expected an error for {expected}");
            };
            assert!(
                error.message.contains(expected),
                "{} lacks {expected}",
                error.message
            );
        }
    }

    #[tokio::test]
    async fn garbage_after_hello_drops_the_provider_and_says_why() {
        let state = state();
        let replies = run(
            &state,
            vec![
                binary(&ToServer::Hello(hello())),
                Ok(Message::Binary(vec![0xff, 0xff, 0xff].into())),
            ],
        )
        .await;
        let ToProvider::Error(error) = decode_reply(replies[1].clone()) else {
            panic!("expected an error");
        };
        assert_eq!(error.code, ErrorCode::BadFrame);
        let record = providers::get(&state.db, 1).await.unwrap().unwrap();
        assert!(
            record
                .gone
                .unwrap()
                .reason
                .starts_with("dropped: frame is not a valid message")
        );
    }

    /// An `Activations` whose one tensor of 8 f32 follows in payload frames.
    fn announced() -> Result<Message, std::convert::Infallible> {
        let mut tensor =
            rookery_proto::WireTensor::from_f32("h", &[2, 4], &[0.0; 8], WireDType::F32);
        tensor.data = Default::default();
        binary(&ToServer::Activations(rookery_proto::Activations {
            job_id: 1,
            phase: rookery_proto::Phase::Train { step: 0 },
            micro: 0,
            outputs: vec![tensor],
            compute_ms: 0.0,
        }))
    }

    fn payload(lane: Lane, values: &[f32]) -> Result<Message, std::convert::Infallible> {
        let mut frame = vec![rookery_proto::stream::PAYLOAD_TAG, lane as u8];
        frame.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        Ok(Message::Binary(frame.into()))
    }

    #[tokio::test]
    async fn payload_frames_must_fit_what_their_message_announced() {
        let mut torn = payload(Lane::Forward, &[1.0; 2]).unwrap();
        if let Message::Binary(bytes) = &mut torn {
            *bytes = bytes.slice(..bytes.len() - 2);
        }
        let cases: Vec<(Vec<_>, Option<&str>)> = vec![
            (
                vec![
                    announced(),
                    payload(Lane::Forward, &[1.0; 4]),
                    payload(Lane::Forward, &[2.0; 4]),
                ],
                None,
            ),
            (
                vec![payload(Lane::Forward, &[1.0; 8])],
                Some("no message announced"),
            ),
            (
                vec![announced(), payload(Lane::Backward, &[1.0; 8])],
                Some("Backward payload while Forward"),
            ),
            (
                vec![announced(), payload(Lane::Forward, &[1.0; 9])],
                Some("does not fit"),
            ),
            (vec![announced(), Ok(torn)], Some("does not fit")),
            (
                vec![
                    announced(),
                    payload(Lane::Forward, &[1.0, 1.0, f32::NAN, 1.0]),
                ],
                Some("non-finite value at element 2"),
            ),
        ];
        for (frames, problem) in cases {
            let state = state();
            let mut all = vec![binary(&ToServer::Hello(hello()))];
            all.extend(frames);
            all.push(binary(&ToServer::Heartbeat { seq: 1 }));
            let replies = run(&state, all).await;
            let last = decode_reply(replies[1].clone());
            match problem {
                None => assert_eq!(last, ToProvider::Heartbeat { seq: 1 }),
                Some(problem) => {
                    let ToProvider::Error(error) = last else {
                        panic!("expected an error for {problem}, got {last:?}");
                    };
                    assert_eq!(error.code, ErrorCode::BadFrame);
                    assert!(error.message.contains(problem), "{}", error.message);
                }
            }
        }
    }

    #[tokio::test]
    async fn frames_over_the_limit_close_with_too_big() {
        let state = state();
        let replies = run(&state, vec![Ok(Message::Binary(vec![0; 1025].into()))]).await;
        let ToProvider::Error(error) = decode_reply(replies[0].clone()) else {
            panic!("expected an error");
        };
        assert_eq!(error.code, ErrorCode::FrameTooLarge);
        assert!(
            matches!(&replies[1], Message::Close(Some(frame)) if frame.code == close_code::TOO_BIG)
        );
    }

    #[tokio::test]
    async fn silence_after_hello_is_a_heartbeat_timeout() {
        let state = state();
        let (out_tx, out_rx) = mpsc::unbounded();
        let (in_tx, in_rx) = mpsc::unbounded();
        in_tx
            .unbounded_send(binary(&ToServer::Hello(hello())))
            .unwrap();
        // Keep `in_tx` alive: the stream stays open but silent.
        serve_provider(out_tx, in_rx, state.clone()).await;
        drop(in_tx);
        let replies: Vec<Message> = out_rx.collect().await;
        // Welcome, the unanswered link probe, then the error.
        let ToProvider::Error(error) = decode_reply(replies[2].clone()) else {
            panic!("expected an error");
        };
        assert_eq!(error.code, ErrorCode::HeartbeatTimeout);
        let record = providers::get(&state.db, 1).await.unwrap().unwrap();
        assert!(record.gone.unwrap().reason.contains("heartbeat timeout"));
    }

    #[test]
    fn close_reasons_are_cut_on_character_boundaries() {
        let text = "é".repeat(100);
        let cut = truncate_utf8(&text, MAX_CLOSE_REASON);
        assert!(cut.len() <= MAX_CLOSE_REASON);
        assert_eq!(cut.chars().count(), 61);
    }
}
