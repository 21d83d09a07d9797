//! The provider's side of a session with the server, without the socket:
//! the provider URL, the `Hello`, what each frame from the server means, the
//! heartbeat and `Welcome` timing, and the pauses between reconnections.
//! The native provider (tokio-tungstenite) and the browser tab (a
//! `WebSocket`) both drive a [`ProviderSession`] and only move bytes and run
//! timers themselves.
//!
//! Time is whatever clock the driver has, as a [`Duration`] since an origin
//! of its choosing that stays fixed for the session: `std::time::Instant`
//! panics on wasm32-unknown-unknown, so this module never reads a clock.

use std::time::Duration;

use rookery_proto::stream::{self, Assembler};
use rookery_proto::{
    Bytes, DEFAULT_MAX_FRAME_BYTES, EncodeError, ErrorCode, ErrorMessage, Hello, PROTOCOL_VERSION,
    PROVIDER_WS_PATH, ProviderKind, ToProvider, ToServer, check_frame_limit,
};

/// What distinguishes one kind of provider's sessions from another's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SessionPolicy {
    pub kind: ProviderKind,
    /// The first pause before reconnecting; it doubles up to `backoff_max`.
    pub backoff_first: Duration,
    pub backoff_max: Duration,
    /// A session welcomed and this old when it ends earns a quick reconnect
    /// (the backoff starts over).
    pub healthy_after: Duration,
    /// Heartbeats are never sent faster than this, whatever `Welcome` asks,
    /// so a bad `Welcome` cannot make the provider spin.
    pub min_heartbeat_interval: Duration,
    /// How long to wait for `Welcome` after `Hello`; `None`: as long as the
    /// socket stays open.
    pub welcome_timeout: Option<Duration>,
    /// The least silence (no frame at all) after which the server counts as
    /// gone even when the socket has not noticed; `None`: silence is not
    /// watched. The server's `heartbeat_timeout_ms` applies above it.
    pub min_silence_timeout: Option<Duration>,
}

impl SessionPolicy {
    /// `rookery-provider`: reconnects quickly, and notices a silent server
    /// (the server answers every heartbeat) before TCP does.
    pub const NATIVE: Self = Self {
        kind: ProviderKind::Native,
        backoff_first: Duration::from_millis(500),
        backoff_max: Duration::from_secs(10),
        healthy_after: Duration::from_secs(30),
        min_heartbeat_interval: Duration::from_millis(10),
        welcome_timeout: Some(Duration::from_secs(10)),
        min_silence_timeout: Some(Duration::from_millis(100)),
    };

    /// A browser tab: gentler pauses (many tabs may reconnect at once), and
    /// the browser's own socket events end a dead session.
    pub const BROWSER: Self = Self {
        kind: ProviderKind::Browser,
        backoff_first: Duration::from_secs(1),
        backoff_max: Duration::from_secs(15),
        healthy_after: Duration::ZERO,
        min_heartbeat_interval: Duration::from_millis(100),
        welcome_timeout: None,
        min_silence_timeout: None,
    };

    /// The `Hello` of a provider of this kind offering `offer`.
    pub fn hello(&self, display_name: impl Into<String>, offer: DeviceOffer) -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            kind: self.kind,
            device: offer.device,
            memory_bytes: offer.memory_bytes,
            gflops: offer.gflops,
            display_name: display_name.into(),
            max_buffer_bytes: offer.max_buffer_bytes,
            credential: None,
            requester_token: None,
            donor: None,
            // Uncapped; a donating tab sets its donor's cap.
            duty_cycle: 1.0,
        }
    }

    pub fn backoff(&self) -> Backoff {
        Backoff::new(self.backoff_first, self.backoff_max)
    }
}

/// What a provider says about its device in `Hello`.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceOffer {
    /// The device in words, for the dashboard.
    pub device: String,
    pub memory_bytes: u64,
    /// Measured matmul throughput.
    pub gflops: f64,
    /// The largest tensor buffer the device allows, if it has such a limit.
    pub max_buffer_bytes: Option<u64>,
}

/// Exponential backoff with a cap: `first`, twice that, ... up to `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    first: Duration,
    max: Duration,
}

impl Backoff {
    pub fn new(first: Duration, max: Duration) -> Self {
        Self {
            next: first,
            first,
            max,
        }
    }

    /// The pause before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

/// Turns what a person types (`ws://host:port`, `http://host:port/`,
/// `host:port`) into the provider endpoint URL.
pub fn provider_url(server: &str) -> String {
    let server = server.trim();
    let (scheme, rest) = match server.split_once("://") {
        Some(("http", rest)) => ("ws", rest),
        Some(("https", rest)) => ("wss", rest),
        Some((scheme, rest)) => (scheme, rest),
        None => ("ws", server),
    };
    match rest.split_once('/') {
        Some((host, path)) if !path.is_empty() => format!("{scheme}://{host}/{path}"),
        Some((host, _)) => format!("{scheme}://{host}{PROVIDER_WS_PATH}"),
        None => format!("{scheme}://{rest}{PROVIDER_WS_PATH}"),
    }
}

/// `ws(s)://host/ws/provider` for a page served as `protocol` (`http:` or
/// `https:`, as `window.location.protocol` spells it) from `host`; `None`
/// for pages with no server to talk to (`file:` and the like).
///
/// A server started with `--provider-token` admits only providers that
/// present its join token; its operator shares the Donate link with
/// `?token=...`, which the tab passes on (still percent-encoded) to the
/// socket's address, where the server reads it.
pub fn page_provider_url(protocol: &str, host: &str, page_query: &str) -> Option<String> {
    if host.is_empty() {
        return None;
    }
    let scheme = match protocol {
        "https:" => "wss",
        "http:" => "ws",
        _ => return None,
    };
    let token = page_query
        .trim_start_matches('?')
        .split('&')
        .find_map(|pair| pair.strip_prefix("token="))
        .filter(|token| !token.is_empty());
    Some(match token {
        Some(token) => format!("{scheme}://{host}{PROVIDER_WS_PATH}?token={token}"),
        None => format!("{scheme}://{host}{PROVIDER_WS_PATH}"),
    })
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send this message (streamed: large tensors go as payload frames after
    /// it, see [`ProviderSession::encode`]).
    Send(ToServer),
    /// The server accepted this provider: heartbeat every
    /// `heartbeat_interval` from now on, and start a stage worker.
    Joined {
        provider_id: u64,
        /// The identity the server knows this provider by.
        identity: u64,
        heartbeat_interval: Duration,
        /// A credential the server issued now: keep it (a file, local
        /// storage) and give it to [`SessionPolicy::hello`]'s `Hello` next
        /// time. The session already uses it for its own reconnections
        /// ([`ProviderSession::hello`]).
        issued_credential: Option<String>,
    },
    /// A training message for the stage worker.
    Train(ToProvider),
    /// The identity's credit grew to this many GFLOP of accepted work.
    Credit(f64),
    /// The session is over.
    End(Disconnect),
}

/// Why a session ended, as far as the protocol can tell.
#[derive(Debug, Clone, PartialEq)]
pub enum Disconnect {
    /// Reconnecting may help; the text is for a person.
    Lost(String),
    /// The server speaks another protocol version (its words): reconnecting
    /// cannot help.
    VersionMismatch(String),
    /// The server will not take this provider as it is configured (its
    /// words): reconnecting cannot help either.
    Refused(String),
}

#[derive(Debug)]
enum State {
    /// Not opened yet, or `Hello` sent and no `Welcome` yet.
    Joining,
    Joined {
        silence_timeout: Option<Duration>,
    },
}

/// One connection's protocol state: feed it what happens, do what it says.
#[derive(Debug)]
pub struct ProviderSession {
    policy: SessionPolicy,
    hello: Hello,
    state: State,
    assembler: Assembler<ToProvider>,
    /// The server's frame limit once it is announced; the default before.
    max_frame_bytes: usize,
    opened_at: Duration,
    last_heard: Duration,
    welcomed: bool,
    seq: u64,
}

impl ProviderSession {
    pub fn new(policy: SessionPolicy, hello: Hello) -> Self {
        // A stage fits the provider's memory, so nothing the server streams
        // to it is larger.
        let memory = usize::try_from(hello.memory_bytes).unwrap_or(usize::MAX);
        Self {
            policy,
            hello,
            state: State::Joining,
            assembler: Assembler::new(memory),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            opened_at: Duration::ZERO,
            last_heard: Duration::ZERO,
            welcomed: false,
            seq: 0,
        }
    }

    pub fn policy(&self) -> &SessionPolicy {
        &self.policy
    }

    /// The `Hello` this session sends, with any credential the server
    /// issued it: the next session's `Hello`.
    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// The socket opened at `now`: the first message to send.
    pub fn opened(&mut self, now: Duration) -> ToServer {
        self.opened_at = now;
        self.last_heard = now;
        ToServer::Hello(self.hello.clone())
    }

    /// The largest frame to send or accept: what the server announced in
    /// `Welcome`, [`DEFAULT_MAX_FRAME_BYTES`] before.
    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    /// A message's frames within the session's frame limit: the stage
    /// worker's replies and the session's own messages go out this way.
    pub fn encode(&self, message: &ToServer) -> Result<Vec<Bytes>, EncodeError> {
        stream::encode_streamed(message, self.max_frame_bytes)
    }

    /// Whether the server has welcomed this provider.
    pub fn welcomed(&self) -> bool {
        self.welcomed
    }

    /// The policy's `welcome_timeout` passed without a `Welcome`.
    pub fn welcome_timed_out(&self) -> Disconnect {
        Disconnect::Lost("the server did not answer Hello".into())
    }

    /// Whether the session, ending at `now`, earns a quick reconnect.
    pub fn earned_quick_reconnect(&self, now: Duration) -> bool {
        self.welcomed && now.saturating_sub(self.opened_at) >= self.policy.healthy_after
    }

    /// A binary frame from the server at `now`. `None`: nothing to do (a
    /// heartbeat, or part of a message whose payload frames are still to
    /// come).
    pub fn frame(&mut self, frame: &Bytes, now: Duration) -> Option<Action> {
        let incoming = match stream::read_frame(frame, self.max_frame_bytes) {
            Ok(incoming) => incoming,
            Err(error) => {
                return Some(lost(format!(
                    "the server sent a frame this provider cannot read ({error})"
                )));
            }
        };
        match self.assembler.push(incoming) {
            Ok(Some(message)) => self.message(message, now),
            Ok(None) => {
                self.last_heard = now;
                None
            }
            Err(error) => Some(lost(format!(
                "the server's frames do not fit together ({error})"
            ))),
        }
    }

    /// A whole message from the server at `now`.
    pub fn message(&mut self, message: ToProvider, now: Duration) -> Option<Action> {
        self.last_heard = now;
        match (&self.state, message) {
            (
                _,
                ToProvider::Error(ErrorMessage {
                    code: ErrorCode::VersionMismatch,
                    message,
                }),
            ) => Some(Action::End(Disconnect::VersionMismatch(message))),
            (
                _,
                ToProvider::Error(ErrorMessage {
                    code: ErrorCode::Unauthorized,
                    message,
                }),
            ) => Some(Action::End(Disconnect::Refused(message))),
            (_, ToProvider::Error(ErrorMessage { message, .. })) => {
                Some(lost(format!("the server refused this provider: {message}")))
            }
            (
                State::Joining,
                ToProvider::Welcome {
                    provider_id,
                    heartbeat_interval_ms,
                    heartbeat_timeout_ms,
                    max_frame_bytes,
                    identity,
                    credential,
                },
            ) => {
                self.max_frame_bytes = match check_frame_limit(max_frame_bytes) {
                    Ok(limit) => limit,
                    Err(problem) => {
                        return Some(lost(format!("the server's Welcome is unusable: {problem}")));
                    }
                };
                let heartbeat_interval =
                    ms(heartbeat_interval_ms).max(self.policy.min_heartbeat_interval);
                self.state = State::Joined {
                    silence_timeout: self
                        .policy
                        .min_silence_timeout
                        .map(|floor| ms(heartbeat_timeout_ms).max(floor)),
                };
                self.welcomed = true;
                if let Some(credential) = &credential {
                    self.hello.credential = Some(credential.clone());
                }
                Some(Action::Joined {
                    provider_id,
                    identity,
                    heartbeat_interval,
                    issued_credential: credential,
                })
            }
            (State::Joining, other) => Some(lost(format!(
                "the server sent {} before welcoming this provider",
                kind(&other)
            ))),
            (State::Joined { .. }, ToProvider::Heartbeat { .. }) => None,
            // Answered here, not by the stage worker, so the server times the
            // link and not the computation.
            (State::Joined { .. }, ToProvider::Probe { seq, .. }) => {
                Some(Action::Send(ToServer::ProbeAck { seq }))
            }
            (State::Joined { .. }, ToProvider::Credit { gflop }) => Some(Action::Credit(gflop)),
            (State::Joined { .. }, ToProvider::Welcome { .. }) => Some(lost(
                "the server sent Welcome to a provider it had welcomed".into(),
            )),
            (
                State::Joined { .. },
                message @ (ToProvider::Assign(_)
                | ToProvider::Forward(_)
                | ToProvider::Backward(_)
                | ToProvider::UploadParams { .. }
                | ToProvider::SetParams(_)
                | ToProvider::SetOptimizerState(_)
                | ToProvider::Release { .. }
                | ToProvider::GradScale(_)),
            ) => Some(Action::Train(message)),
        }
    }

    /// The heartbeat timer fired at `now`: the heartbeat to send, or the end
    /// of a session whose server has been silent too long (it answers every
    /// heartbeat, so silence means it is gone even when TCP has not noticed).
    pub fn heartbeat_due(&mut self, now: Duration) -> Action {
        if let State::Joined {
            silence_timeout: Some(timeout),
        } = self.state
            && now.saturating_sub(self.last_heard) > timeout
        {
            return lost(format!(
                "no answer from the server for {} ms",
                timeout.as_millis()
            ));
        }
        let seq = self.seq;
        self.seq += 1;
        Action::Send(ToServer::Heartbeat { seq })
    }
}

fn ms(millis: u32) -> Duration {
    Duration::from_millis(u64::from(millis))
}

fn lost(reason: String) -> Action {
    Action::End(Disconnect::Lost(reason))
}

/// A message's kind, for errors (its `Debug` form can hold whole tensors).
fn kind(message: &ToProvider) -> &'static str {
    match message {
        ToProvider::Welcome { .. } => "Welcome",
        ToProvider::Heartbeat { .. } => "Heartbeat",
        ToProvider::Error(_) => "Error",
        ToProvider::Assign(_) => "Assign",
        ToProvider::Forward(_) => "Forward",
        ToProvider::Backward(_) => "Backward",
        ToProvider::UploadParams { .. } => "UploadParams",
        ToProvider::SetParams(_) => "SetParams",
        ToProvider::SetOptimizerState(_) => "SetOptimizerState",
        ToProvider::Release { .. } => "Release",
        ToProvider::Probe { .. } => "Probe",
        ToProvider::GradScale(_) => "GradScale",
        ToProvider::Credit { .. } => "Credit",
    }
}

#[cfg(test)]
mod tests;
