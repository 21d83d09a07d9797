//! The provider WebSocket: handshake, heartbeats, and dropping a peer that
//! breaks the protocol without disturbing anyone else.
//!
//! The loop is generic over `Sink`/`Stream` so tests drive it with in-memory
//! channels as well as real sockets.

mod link;

use std::fmt::Display;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use axum::Router;
use axum::extract::ws::{CloseFrame, Message, WebSocketUpgrade};
use axum::extract::{ConnectInfo, State};
use axum::http::{Extensions, HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures_util::{Sink, SinkExt, Stream, StreamExt};
use rookery_proto::stream::{Assembler, Incoming, Lane, Streamed};
use rookery_proto::{
    DecodeError, DonorCard, ErrorCode, ErrorMessage, Hello, MAX_DONOR_CHARS, PROTOCOL_VERSION,
    ProviderKind, ToProvider, ToServer,
};

use self::link::{LinkProbe, Owed, ProbeNext};
use super::error::AppError;
use crate::admission::Slot;
use crate::coordinator::{Event, Outgoing, outbox};
use crate::now_ms;
use crate::state::AppState;
use crate::store::identities::{self, Resolved};
use crate::store::requesters::{self, Requester};
use crate::store::{credit, providers};

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
/// The WebSocket's read step and write-buffer threshold: small, since what
/// every connection keeps is what an idle browser costs the server
/// (`server/examples/idle_browsers.rs`); a 512 KiB payload frame takes 16
/// reads.
const IO_BUFFER_BYTES: usize = 32 << 10;

/// The provider WebSocket's route ([`rookery_proto::PROVIDER_WS_PATH`]).
pub fn routes() -> Router<AppState> {
    Router::new().route(rookery_proto::PROVIDER_WS_PATH, get(provider_socket))
}

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
    let slot = match admit(&state, ip, &headers, uri.query()) {
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
        // tungstenite fills its whole read buffer on every read (128 KiB by
        // default), so an idle browser's heartbeats would keep that much
        // resident; larger frames still arrive whole, read in these steps.
        .read_buffer_size(IO_BUFFER_BYTES)
        .write_buffer_size(IO_BUFFER_BYTES)
        .on_upgrade(move |socket| {
            let (sink, stream) = socket.split();
            async move {
                serve_provider(sink, stream, state, ip).await;
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

    /// A peer that does not take what is sent to it fast enough: dropped
    /// (its stage is reassigned), but no fault: links are slow at times.
    fn too_slow(message: String) -> Self {
        Ending::rejected(ErrorCode::HeartbeatTimeout, close_code::POLICY, message)
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

/// Serves one provider connection from its first frame to its last; `ip`
/// is the peer's address (new identities are counted per address).
pub async fn serve_provider<Si, St, E>(
    mut sink: Si,
    mut stream: St,
    state: AppState,
    ip: Option<IpAddr>,
) where
    Si: Sink<Message> + Unpin,
    St: Stream<Item = Result<Message, E>> + Unpin,
    E: Display,
{
    let mut hello = match handshake(&mut stream, &state).await {
        Ok(hello) => hello,
        Err(ending) => {
            tracing::info!(reason = %ending.reason(), "provider refused at handshake");
            say_goodbye(&mut sink, ending).await;
            return;
        }
    };
    let name = hello.display_name.clone();
    let (identity, issued) = match identify(&state, &hello, ip).await {
        Ok(identified) => identified,
        Err(ending) => {
            tracing::info!(?ip, %name, reason = %ending.reason(), "provider refused an identity");
            say_goodbye(&mut sink, ending).await;
            return;
        }
    };
    let vouched_by = match vouch(&state, &mut hello).await {
        Ok(vouched_by) => vouched_by,
        Err(ending) => {
            tracing::info!(?ip, %name, reason = %ending.reason(), "provider refused a vouch");
            say_goodbye(&mut sink, ending).await;
            return;
        }
    };
    if let Some(card) = hello.donor.clone()
        && let Err(error) = credit::set_donor(&state.db, identity, card).await
    {
        // The leaderboard keeps the old card; the work goes on.
        tracing::error!(identity, %error, "cannot record a donor's card");
    }
    let id = match providers::register(&state.db, hello.clone(), identity, now_ms()).await {
        Ok(id) => id,
        Err(error) => {
            tracing::error!(%error, "cannot register provider");
            say_goodbye(&mut sink, unavailable()).await;
            return;
        }
    };
    tracing::info!(id, identity, new = issued.is_some(), vouched_by = ?vouched_by.as_ref().map(|r| &r.name), %name, "provider joined");

    let joined = Joined {
        id,
        identity,
        vouched_by,
        issued,
    };
    let ending = session(joined, hello, &mut sink, &mut stream, &state).await;
    let reason = ending.reason();
    tracing::info!(id, %name, %reason, "provider gone");
    if let Err(error) = providers::mark_gone(&state.db, id, now_ms(), reason).await {
        tracing::error!(id, %error, "cannot record that a provider left");
    }
    say_goodbye(&mut sink, ending).await;
}

/// The server cannot go on with a provider for reasons of its own.
fn unavailable() -> Ending {
    Ending::rejected(
        ErrorCode::Internal,
        close_code::INTERNAL,
        "the server cannot register providers right now; retry later",
    )
}

/// What is wrong with a donor's leaderboard card, if anything: its name
/// and team are shown to everyone, so they are short, printable and the
/// name is not blank.
fn donor_card_problem(card: &DonorCard) -> Option<&'static str> {
    let fits =
        |text: &str| text.chars().count() <= MAX_DONOR_CHARS && !text.chars().any(char::is_control);
    if card.name.trim().is_empty() || !fits(&card.name) {
        Some("a donor name must have 1 to 40 printable characters")
    } else if card
        .team
        .as_deref()
        .is_some_and(|team| team.trim().is_empty() || !fits(team))
    {
        Some("a team must have 1 to 40 printable characters")
    } else {
        None
    }
}

/// The Requester whose token `hello` vouches with, if any; the token is
/// taken out of the `Hello`, which is kept and shown elsewhere.
async fn vouch(state: &AppState, hello: &mut Hello) -> Result<Option<Requester>, Ending> {
    let Some(token) = hello.requester_token.take() else {
        return Ok(None);
    };
    match requesters::authenticate(&state.db, &token).await {
        Ok(Some(requester)) => Ok(Some(requester)),
        Ok(None) => Err(Ending::rejected(
            ErrorCode::Unauthorized,
            close_code::POLICY,
            "the Requester token this provider vouches with is not one this server accepts \
             (mistyped, or revoked with `rookery token revoke`); fix --requester-token or leave it out",
        )),
        Err(error) => {
            tracing::error!(%error, "cannot check a provider's Requester token");
            Err(unavailable())
        }
    }
}

/// Who a welcomed connection is.
struct Joined {
    /// The connection.
    id: u64,
    identity: u64,
    /// The Requester who vouched for it.
    vouched_by: Option<Requester>,
    /// A credential issued to it now, for its `Welcome`.
    issued: Option<String>,
}

/// The identity `hello`'s credential names, or a new one if the address
/// may still make one.
async fn identify(
    state: &AppState,
    hello: &Hello,
    ip: Option<IpAddr>,
) -> Result<(u64, Option<String>), Ending> {
    let resolved = identities::resolve(
        &state.db,
        hello.credential.clone(),
        ip,
        now_ms(),
        state.limits.identities,
    )
    .await
    .map_err(|error| {
        tracing::error!(%error, "cannot resolve a provider's identity");
        unavailable()
    })?;
    match resolved {
        Resolved::Known(identity) => Ok((identity, None)),
        Resolved::Issued {
            identity,
            credential,
        } => Ok((identity, Some(credential))),
        Resolved::Refused { issued, faults } => Err(Ending::rejected(
            ErrorCode::RateLimited,
            close_code::POLICY,
            format!(
                "this address made {issued} new provider identities in the last hour, and they \
                 committed {faults} faults; reconnect with a credential this server issued, or \
                 retry later"
            ),
        )),
    }
}

async fn handshake<St, E>(stream: &mut St, state: &AppState) -> Result<Hello, Ending>
where
    St: Stream<Item = Result<Message, E>> + Unpin,
    E: Display,
{
    let deadline = tokio::time::Instant::now() + state.limits.heartbeat_timeout;
    let frame = next_frame(stream, state, deadline).await?;
    // Nothing about a stranger is decoded at length before it has said who
    // it is: a Hello is a few hundred bytes.
    if frame.len() > MAX_HELLO_BYTES {
        return Err(Ending::rejected(
            ErrorCode::UnexpectedMessage,
            close_code::POLICY,
            format!(
                "the first frame must be a Hello of at most {MAX_HELLO_BYTES} bytes, got {} bytes",
                frame.len()
            ),
        ));
    }
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
            format!("the first frame must be Hello, got {}", other.kind()),
        )),
        Err(error) => Err(Ending::bad_frame(error)),
    }
}

/// The largest first frame a connection may send: a `Hello`, whose strings
/// are bounded by [`validate_hello`], fits many times over.
pub const MAX_HELLO_BYTES: usize = 4096;

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
    } else if !rookery_proto::valid_duty_cycle(hello.duty_cycle) {
        Some("the duty cycle must be from 0.1 to 1")
    } else if hello.memory_bytes == 0 {
        Some("memory must be more than 0 bytes")
    } else if hello.max_buffer_bytes.is_some_and(|b| b < MIN_BUFFER_LIMIT) {
        // WebGPU guarantees 128 MiB; a device claiming less than 1 MiB could
        // take no stage anyway.
        Some("the largest bindable buffer must be at least 1 MiB")
    } else if hello
        .credential
        .as_ref()
        .is_some_and(|c| c.len() > rookery_proto::MAX_CREDENTIAL_CHARS)
    {
        Some("a credential has at most 128 characters")
    } else if hello
        .requester_token
        .as_ref()
        .is_some_and(|t| t.len() > rookery_proto::MAX_CREDENTIAL_CHARS)
    {
        Some("a Requester token has at most 128 characters")
    } else if hello.requester_token.is_some() && hello.kind != ProviderKind::Native {
        Some("only native providers are vouched for with a Requester token")
    } else if let Some(card) = &hello.donor
        && let Some(problem) = donor_card_problem(card)
    {
        Some(problem)
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
    joined: Joined,
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
    let limit = state.limits.max_frame_bytes;
    let Joined {
        id,
        identity,
        vouched_by,
        issued,
    } = joined;
    let welcome = ToProvider::Welcome {
        provider_id: id,
        heartbeat_interval_ms: millis(state.limits.heartbeat_interval),
        heartbeat_timeout_ms: millis(state.limits.heartbeat_timeout),
        max_frame_bytes: limit as u64,
        identity,
        credential: issued,
    };
    // Parameters and optimizer state end here, so they are assembled here;
    // a stage fits its provider's memory, and so does what it uploads.
    let mut params =
        Assembler::<ToServer>::new(usize::try_from(hello.memory_bytes).unwrap_or(usize::MAX));
    let patience = state.limits.send_timeout;
    if let Err(ending) = send(sink, &welcome, patience).await {
        return ending;
    }
    let (tx, outbox) = outbox(state.limits.max_outbox_bytes);
    let mut outbox = outbox.delayed(state.limits.relay_delay);
    state
        .coordinator
        .send(Event::Connected {
            id,
            identity,
            vouched_by,
            hello,
            tx,
        })
        .await;
    let mut probe = LinkProbe::default();
    for message in probe.start() {
        if let Err(ending) = send(sink, &message, patience).await {
            return ending;
        }
    }
    // Writing runs beside reading, never instead of it: a provider may be
    // uploading hundreds of megabytes while the server streams a message to
    // it, and if either side stopped reading to write, both socket buffers
    // would fill and the pair would wait for each other forever.
    let (replies, mut reply_rx) = tokio::sync::mpsc::unbounded_channel::<ToProvider>();
    // `None` once the session's replies are all sent and it has ended.
    let writer = async {
        loop {
            let sent = tokio::select! {
                Some(outgoing) = outbox.recv() => match outgoing {
                    Ok(Outgoing::Message(message)) => send_streamed(sink, &message, limit, patience).await,
                    Ok(Outgoing::Payload(frame)) => send_frame(sink, frame, patience).await,
                    // The coordinator already counted the fault this answers.
                    Ok(Outgoing::Close { reason }) => Err(Ending::Expelled(reason)),
                    Err(overflow) => Err(Ending::too_slow(overflow.to_string())),
                },
                reply = reply_rx.recv() => match reply {
                    Some(reply) => send(sink, &reply, patience).await,
                    None => return None,
                },
            };
            if let Err(ending) = sent {
                return Some(ending);
            }
        }
    };
    tokio::pin!(writer);
    let mut writer_ended = false;
    let mut deadline = tokio::time::Instant::now() + state.limits.heartbeat_timeout;
    let mut owed = Owed::default();
    let mut pacer = HeartbeatPacer::new(state.limits.heartbeat_interval);
    let ending = loop {
        let frame = tokio::select! {
            ended = &mut writer => {
                writer_ended = true;
                break ended.unwrap_or_else(|| Ending::Left("the connection's writer stopped".into()));
            }
            frame = next_frame(stream, state, deadline) => frame,
        };
        let frame = match frame {
            Ok(frame) => frame,
            Err(ending) => break ending,
        };
        deadline = tokio::time::Instant::now() + state.limits.heartbeat_timeout;
        let message = match rookery_proto::stream::read_frame::<ToServer>(&frame, limit) {
            Ok(Incoming::Payload(payload)) if payload.lane.is_relayed() => {
                match owed.take(&payload) {
                    Ok(()) => state.coordinator.send(Event::Payload { id, payload }).await,
                    Err(problem) => {
                        break Ending::rejected(ErrorCode::BadFrame, close_code::POLICY, problem);
                    }
                }
                continue;
            }
            Ok(Incoming::Message(message)) if message.lane() != Some(Lane::Params) => Ok(message),
            Ok(incoming) => match params.push(incoming) {
                Ok(Some(message)) => {
                    tracing::debug!(id, message = message.kind(), "assembled a message");
                    Ok(message)
                }
                Ok(None) => continue,
                Err(error) => {
                    break Ending::rejected(
                        ErrorCode::BadFrame,
                        close_code::POLICY,
                        error.to_string(),
                    );
                }
            },
            Err(error) => Err(error),
        };
        match message {
            Ok(ToServer::Heartbeat { seq }) => {
                match pacer.beat(std::time::Instant::now()) {
                    Beat::Flood => {
                        break Ending::rejected(
                            ErrorCode::BadFrame,
                            close_code::POLICY,
                            format!(
                                "heartbeats come faster than {} a second; this server asks for one every {} ms",
                                pacer.most_per_second,
                                millis(state.limits.heartbeat_interval)
                            ),
                        );
                    }
                    Beat::Record => {
                        if let Err(error) =
                            providers::record_heartbeat(&state.db, id, now_ms()).await
                        {
                            tracing::error!(id, %error, "cannot record a heartbeat");
                        }
                    }
                    Beat::Skip => {}
                }
                let _ = replies.send(ToProvider::Heartbeat { seq });
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
                    for message in next {
                        let _ = replies.send(message);
                    }
                }
                ProbeNext::Measured(mbps) => {
                    tracing::info!(id, mbps = format!("{mbps:.0}"), "measured the link");
                    if let Err(error) = providers::record_bandwidth(&state.db, id, mbps).await {
                        tracing::error!(id, %error, "cannot record a bandwidth");
                    }
                    state
                        .coordinator
                        .send(Event::Measured {
                            id,
                            bandwidth_mbps: mbps,
                        })
                        .await;
                }
                ProbeNext::Awaiting => {}
                ProbeNext::Ignore => {
                    tracing::debug!(id, seq, "ignored a ProbeAck nobody asked for");
                }
            },
            Ok(ToServer::Error(ErrorMessage { code, message })) => {
                let message = bounded_text(&message);
                break Ending::Left(format!("provider gave up ({code:?}): {message}"));
            }
            Ok(ToServer::DutyCycle { duty_cycle }) => {
                if !rookery_proto::valid_duty_cycle(duty_cycle) {
                    break Ending::rejected(
                        ErrorCode::BadFrame,
                        close_code::POLICY,
                        format!("a duty cycle must be from 0.1 to 1, not {duty_cycle}"),
                    );
                }
                state
                    .coordinator
                    .send(Event::DutyCycle { id, duty_cycle })
                    .await;
            }
            Ok(message) => {
                let message = with_bounded_text(message);
                if let Err(problem) = owed.announce(&message) {
                    break Ending::rejected(ErrorCode::BadFrame, close_code::POLICY, problem);
                }
                state.coordinator.send(Event::Message { id, message }).await;
            }
            Err(error) => break Ending::bad_frame(error),
        }
    };
    // Replies queued before the end (a heartbeat's answer) still go out,
    // unless the writer is what failed; a peer that reads nothing is given
    // up on.
    drop(replies);
    if !writer_ended {
        let _ = tokio::time::timeout(GOODBYE_TIMEOUT, &mut writer).await;
    }
    if ending.is_fault() {
        // Before `Disconnected`: the fault counts against the job it leaves.
        state
            .coordinator
            .send(Event::Fault {
                id,
                reason: ending.reason(),
            })
            .await;
    }
    state
        .coordinator
        .send(Event::Disconnected {
            id,
            reason: ending.reason(),
        })
        .await;
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
            // A close frame's reason (at most 123 bytes) says why, as a
            // donor's pause does.
            Some(Ok(Message::Close(frame))) => {
                let reason = frame
                    .map(|f| f.reason.as_str().trim().to_string())
                    .filter(|r| !r.is_empty());
                return Err(Ending::Left(
                    reason.map_or("closed".into(), |r| format!("closed: {r}")),
                ));
            }
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

/// Sends a message with tensors as its frames, none over `limit`.
async fn send_streamed<Si: Sink<Message> + Unpin>(
    sink: &mut Si,
    message: &ToProvider,
    limit: usize,
    patience: Duration,
) -> Result<(), Ending> {
    let started = std::time::Instant::now();
    let frames = rookery_proto::stream::encode_streamed(message, limit)
        .map_err(|error| Ending::Left(format!("cannot encode a message: {error}")))?;
    let (count, bytes) = (frames.len(), frames.iter().map(|f| f.len()).sum::<usize>());
    for frame in frames {
        send_frame(sink, frame, patience).await?;
    }
    if count > 1 {
        tracing::debug!(
            message = message_kind(message),
            frames = count,
            bytes,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "streamed a message"
        );
    }
    Ok(())
}

fn message_kind(message: &ToProvider) -> &'static str {
    match message {
        ToProvider::Assign(_) => "Assign",
        ToProvider::Forward(_) => "Forward",
        ToProvider::Backward(_) => "Backward",
        ToProvider::SetParams(_) => "SetParams",
        ToProvider::SetOptimizerState(_) => "SetOptimizerState",
        _ => "other",
    }
}

/// Sends a session message (no tensors: `Welcome`, `Heartbeat`, `Probe`,
/// `Error`) as one frame.
async fn send<Si: Sink<Message> + Unpin>(
    sink: &mut Si,
    message: &ToProvider,
    patience: Duration,
) -> Result<(), Ending> {
    let frame = rookery_proto::encode(message)
        .map_err(|error| Ending::Left(format!("cannot encode a reply: {error}")))?;
    send_frame(sink, frame.into(), patience).await
}

/// Sends one frame, giving up on a peer that takes longer than `patience`
/// to take it: one that stopped reading would otherwise hold its job for
/// good.
async fn send_frame<Si: Sink<Message> + Unpin>(
    sink: &mut Si,
    frame: axum::body::Bytes,
    patience: Duration,
) -> Result<(), Ending> {
    let len = frame.len();
    match tokio::time::timeout(patience, sink.send(Message::Binary(frame))).await {
        Ok(sent) => sent.map_err(|_| Ending::Left("connection lost while sending".into())),
        Err(_) => Err(Ending::too_slow(format!(
            "a frame of {len} bytes took more than {} ms to send; this provider reads too slowly",
            patience.as_millis()
        ))),
    }
}

/// How long a goodbye may take: a peer that reads nothing must not hold
/// its connection's task for ever.
const GOODBYE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Tells a rejected peer why, then closes. Best effort: the peer may be gone,
/// or may read nothing (then it gets [`GOODBYE_TIMEOUT`] and is let go).
async fn say_goodbye<Si: Sink<Message> + Unpin>(sink: &mut Si, ending: Ending) {
    let _ = tokio::time::timeout(GOODBYE_TIMEOUT, goodbye(sink, ending)).await;
}

async fn goodbye<Si: Sink<Message> + Unpin>(sink: &mut Si, ending: Ending) {
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
            let _ = send(sink, &error, GOODBYE_TIMEOUT).await;
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

/// What one heartbeat costs the server: a database write at most once a
/// second (the dashboard shows seconds), and a provider that sends them far
/// faster than asked is dropped.
#[derive(Debug)]
struct HeartbeatPacer {
    /// Heartbeats allowed in any one second: four times the asked rate, and
    /// never fewer than 20.
    most_per_second: u32,
    window_start: Option<std::time::Instant>,
    in_window: u32,
    last_recorded: Option<std::time::Instant>,
}

/// What to do with one heartbeat.
#[derive(Debug, PartialEq, Eq)]
enum Beat {
    Record,
    Skip,
    Flood,
}

/// Heartbeats are written to the database at most this often.
const HEARTBEAT_RECORD_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl HeartbeatPacer {
    fn new(asked_interval: std::time::Duration) -> Self {
        let per_second = 1000 / asked_interval.as_millis().max(1);
        Self {
            most_per_second: (4 * per_second).max(20) as u32,
            window_start: None,
            in_window: 0,
            last_recorded: None,
        }
    }

    fn beat(&mut self, now: std::time::Instant) -> Beat {
        let second = std::time::Duration::from_secs(1);
        match self.window_start {
            Some(start) if now.duration_since(start) < second => self.in_window += 1,
            _ => {
                self.window_start = Some(now);
                self.in_window = 1;
            }
        }
        if self.in_window > self.most_per_second {
            return Beat::Flood;
        }
        match self.last_recorded {
            Some(at) if now.duration_since(at) < HEARTBEAT_RECORD_EVERY => Beat::Skip,
            _ => {
                self.last_recorded = Some(now);
                Beat::Record
            }
        }
    }
}

/// Most bytes of a provider's own words (an error, a failure's cause) the
/// server keeps: they reach the log, the job's record and its Requester,
/// and a frame could carry megabytes.
pub const MAX_PROVIDER_TEXT: usize = 1024;

/// `text` cut to [`MAX_PROVIDER_TEXT`] bytes, saying how much was cut.
fn bounded_text(text: &str) -> String {
    let kept = truncate_utf8(text, MAX_PROVIDER_TEXT);
    if kept.len() == text.len() {
        text.to_string()
    } else {
        format!("{kept}… ({} more bytes not kept)", text.len() - kept.len())
    }
}

/// A provider's message with its free text bounded.
fn with_bounded_text(message: ToServer) -> ToServer {
    match message {
        ToServer::JobFailed { job_id, message } => ToServer::JobFailed {
            job_id,
            message: bounded_text(&message),
        },
        other => other,
    }
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

fn millis(duration: std::time::Duration) -> u32 {
    u32::try_from(duration.as_millis()).unwrap_or(u32::MAX)
}

/// Checks a provider's upgrade request. `ip` is `None` when the server runs
/// without connection info (in-process tests); such requests are not counted.
fn admit(
    state: &AppState,
    ip: Option<IpAddr>,
    headers: &HeaderMap,
    query: Option<&str>,
) -> Result<Option<Slot>, AppError> {
    // First: a page the server does not trust learns nothing more, not even
    // whether a join token is needed.
    if let Err(origin) = state.allowed_origins.admits(headers) {
        return Err(AppError::Forbidden(format!(
            "pages at `{origin}` may not connect providers to this server (`rookery serve --allowed-origin` lists the pages that may)"
        )));
    }
    if let Some(token) = &state.provider_token
        && !token.admits(headers, query)
    {
        return Err(AppError::Unauthorized(
            "this server requires providers to present its join token (rookery-provider --token, or `?token=` on the WebSocket URL)",
        ));
    }
    let Some(ip) = ip else {
        return Ok(None);
    };
    let max = state.limits.max_connections_per_ip;
    match state.connections.take(ip, max) {
        Some(slot) => Ok(Some(slot)),
        None => Err(AppError::TooManyRequests(format!(
            "too many provider connections from {ip} (at most {max})"
        ))),
    }
}

#[cfg(test)]
mod tests;
