//! The provider's side of the WebSocket protocol: one session (generic over
//! `Sink`/`Stream` so tests drive it with channels) and a supervisor that
//! reconnects with backoff until shutdown.
//!
//! Training messages go to a [`Trainer`] on a thread of its own: a libtorch
//! call can take longer than the heartbeat timeout, and the session must keep
//! answering the server meanwhile. The thread takes messages in arrival order
//! and its replies are sent as each message's work finishes.

use std::fmt::Display;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use futures_util::{Sink, SinkExt, Stream, StreamExt};
use rookery_proto::stream::{self, Assembler};
use rookery_proto::{DEFAULT_MAX_FRAME_BYTES, ErrorCode, Hello, ToProvider, ToServer};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::{self, Message, client::IntoClientRequest};

use crate::trainer::{Trainer, is_training_message, job_of};

/// How long to wait for `Welcome` after sending `Hello`.
const WELCOME_TIMEOUT: Duration = Duration::from_secs(10);

/// How a session ended.
#[derive(Debug, PartialEq)]
pub enum SessionEnd {
    /// Shutdown was requested; the connection was closed politely.
    Shutdown,
    /// The connection dropped; reconnecting may help.
    Lost(String),
    /// The server refused us for a reason reconnecting will not fix.
    Fatal(String),
}

/// Runs one connection: `Hello`, wait for `Welcome`, then heartbeat until the
/// connection ends or `shutdown` turns true, handing training messages to
/// `trainer` (on its own thread) and sending its replies.
pub async fn run_session<Si, St, E>(
    sink: &mut Si,
    stream: &mut St,
    hello: &Hello,
    shutdown: &mut watch::Receiver<bool>,
    trainer: Box<dyn Trainer>,
) -> SessionEnd
where
    Si: Sink<Message> + Unpin,
    Si::Error: Display,
    St: Stream<Item = Result<Message, E>> + Unpin,
    E: Display,
{
    if let Err(end) = send(sink, &ToServer::Hello(hello.clone())).await {
        return end;
    }
    let mut assembler = Assembler::default();
    let (id, interval, timeout) =
        match tokio::time::timeout(WELCOME_TIMEOUT, next_message(stream, &mut assembler)).await {
            Err(_) => return SessionEnd::Lost("the server did not answer Hello".into()),
            Ok(Err(end)) => return end,
            Ok(Ok(ToProvider::Welcome {
                provider_id,
                heartbeat_interval_ms,
                heartbeat_timeout_ms,
            })) => (
                provider_id,
                Duration::from_millis(u64::from(heartbeat_interval_ms.max(10))),
                Duration::from_millis(u64::from(heartbeat_timeout_ms.max(100))),
            ),
            Ok(Ok(other)) => return refused(other),
        };
    tracing::info!(provider_id = id, "joined the server");

    let mut worker = match TrainerThread::spawn(trainer) {
        Ok(worker) => worker,
        Err(error) => {
            return SessionEnd::Lost(format!("cannot start the training thread: {error}"));
        }
    };
    let mut ticker = tokio::time::interval(interval);
    let mut seq = 0u64;
    let mut last_heard = Instant::now();
    loop {
        tokio::select! {
            _ = ticker.tick() => {
                // The server answers every heartbeat, so silence means it is gone
                // even when TCP has not noticed yet.
                if last_heard.elapsed() > timeout {
                    return SessionEnd::Lost(format!("no answer from the server for {} ms", timeout.as_millis()));
                }
                if let Err(end) = send(sink, &ToServer::Heartbeat { seq }).await {
                    return end;
                }
                seq += 1;
            }
            message = next_message(stream, &mut assembler) => match message {
                Ok(message) => {
                    last_heard = Instant::now();
                    match message {
                        ToProvider::Heartbeat { .. } => {}
                        // Answered here, not by the trainer, so the server
                        // times the link and not the training thread.
                        ToProvider::Probe { seq, .. } => {
                            if let Err(end) = send(sink, &ToServer::ProbeAck { seq }).await {
                                return end;
                            }
                        }
                        message if is_training_message(&message) => {
                            if worker.inbox.send(message).is_err() {
                                return SessionEnd::Lost("the training thread stopped".into());
                            }
                        }
                        other => return refused(other),
                    }
                }
                Err(end) => return end,
            },
            replies = worker.replies.recv() => match replies {
                Some(replies) => {
                    for reply in &replies {
                        if let Err(end) = send(sink, reply).await {
                            return end;
                        }
                    }
                }
                // Only a crash ends the thread while the session holds its inbox;
                // a fresh session gets a fresh trainer.
                None => return SessionEnd::Lost("the training thread crashed".into()),
            },
            changed = shutdown.changed() => {
                if changed.is_err() || *shutdown.borrow() {
                    let _ = sink.send(Message::Close(None)).await;
                    let _ = sink.close().await;
                    return SessionEnd::Shutdown;
                }
            }
        }
    }
}

/// The session's end of the trainer's thread. Dropping it closes the inbox, and
/// the thread ends after the message it is working on.
struct TrainerThread {
    inbox: std_mpsc::Sender<ToProvider>,
    replies: mpsc::UnboundedReceiver<Vec<ToServer>>,
}

impl TrainerThread {
    fn spawn(mut trainer: Box<dyn Trainer>) -> std::io::Result<Self> {
        let (inbox, messages) = std_mpsc::channel::<ToProvider>();
        let (reply_tx, replies) = mpsc::unbounded_channel();
        std::thread::Builder::new()
            .name("rookery-trainer".into())
            .spawn(move || {
                while let Ok(message) = messages.recv() {
                    let job = job_of(&message);
                    match catch_unwind(AssertUnwindSafe(|| trainer.handle(message))) {
                        Ok(out) => {
                            if reply_tx.send(out).is_err() {
                                return;
                            }
                        }
                        Err(panic) => {
                            // The trainer's state is unknown after a panic: report
                            // the job failed and stop, which ends the session.
                            let reason = panic
                                .downcast_ref::<&str>()
                                .map(|s| (*s).to_string())
                                .or_else(|| panic.downcast_ref::<String>().cloned())
                                .unwrap_or_else(|| "unknown panic".into());
                            tracing::error!(%reason, "the trainer panicked");
                            if let Some(job_id) = job {
                                let _ = reply_tx.send(vec![ToServer::JobFailed {
                                    job_id,
                                    message: format!("the provider's trainer crashed: {reason}"),
                                }]);
                            }
                            return;
                        }
                    }
                }
            })?;
        Ok(Self { inbox, replies })
    }
}

fn refused(message: ToProvider) -> SessionEnd {
    match message {
        ToProvider::Error(error) if error.code == ErrorCode::VersionMismatch => {
            SessionEnd::Fatal(error.message)
        }
        ToProvider::Error(error) => SessionEnd::Lost(format!("the server said: {}", error.message)),
        other => SessionEnd::Lost(format!("unexpected message from the server: {other:?}")),
    }
}

async fn send<Si>(sink: &mut Si, message: &ToServer) -> Result<(), SessionEnd>
where
    Si: Sink<Message> + Unpin,
    Si::Error: Display,
{
    #[cfg(feature = "fault-injection")]
    let tampered = crate::fault::tamper(message);
    #[cfg(feature = "fault-injection")]
    let message = tampered.as_ref().unwrap_or(message);
    let frames = stream::encode_streamed(message)
        .map_err(|error| SessionEnd::Fatal(format!("cannot encode {message:?}: {error}")))?;
    #[cfg(feature = "fault-injection")]
    let frames = crate::fault::tamper_frames(message, frames);
    // Each frame is flushed on its own so the server relays the first
    // payload while the next is still being written.
    for frame in frames {
        sink.send(Message::Binary(frame))
            .await
            .map_err(|error| SessionEnd::Lost(format!("cannot send: {error}")))?;
    }
    Ok(())
}

/// The next whole message; payload frames are put into their messages by
/// `assembler`, which keeps partial ones across calls (so this is cancel-safe).
async fn next_message<St, E>(
    stream: &mut St,
    assembler: &mut Assembler<ToProvider>,
) -> Result<ToProvider, SessionEnd>
where
    St: Stream<Item = Result<Message, E>> + Unpin,
    E: Display,
{
    loop {
        match stream.next().await {
            Some(Ok(Message::Binary(bytes))) => {
                let incoming =
                    stream::read_frame(&bytes, DEFAULT_MAX_FRAME_BYTES).map_err(|error| {
                        SessionEnd::Lost(format!("unreadable frame from the server: {error}"))
                    })?;
                match assembler.push(incoming) {
                    Ok(Some(message)) => return Ok(message),
                    Ok(None) => continue,
                    Err(error) => {
                        return Err(SessionEnd::Lost(format!(
                            "the server's frames do not fit together: {error}"
                        )));
                    }
                }
            }
            Some(Ok(Message::Close(frame))) => {
                let reason = frame
                    .map(|f| format!("{} ({})", f.reason, u16::from(f.code)))
                    .unwrap_or_else(|| "no reason given".into());
                return Err(SessionEnd::Lost(format!(
                    "the server closed the connection: {reason}"
                )));
            }
            Some(Ok(_)) => continue,
            Some(Err(error)) => return Err(SessionEnd::Lost(format!("connection error: {error}"))),
            None => return Err(SessionEnd::Lost("the connection closed".into())),
        }
    }
}

/// Exponential backoff with a cap: 0.5 s, 1 s, 2 s, ... up to `max`.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
    initial: Duration,
    max: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            next: initial,
            initial,
            max,
        }
    }

    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

/// Turns what a person types (`ws://host:port`, `http://host:port/`) into the
/// provider endpoint URL.
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
        Some((host, _)) => format!("{scheme}://{host}{}", rookery_proto::PROVIDER_WS_PATH),
        None => format!("{scheme}://{rest}{}", rookery_proto::PROVIDER_WS_PATH),
    }
}

/// The WebSocket upgrade request, carrying the join token as a `Bearer`
/// header (not in the URL, which ends up in logs).
fn upgrade_request(
    url: &str,
    token: Option<&str>,
) -> Result<tungstenite::handshake::client::Request, String> {
    let mut request = url
        .into_client_request()
        .map_err(|error| format!("bad server URL {url}: {error}"))?;
    if let Some(token) = token {
        let value = tungstenite::http::HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| "the join token must be printable ASCII".to_string())?;
        request
            .headers_mut()
            .insert(tungstenite::http::header::AUTHORIZATION, value);
    }
    Ok(request)
}

/// Connects, runs sessions and reconnects with backoff until shutdown, each
/// session with a fresh trainer from `make_trainer` (the server forgets a lost
/// provider's stages, so none survive a reconnect).
/// Returns an error only for refusals that retrying cannot fix.
pub async fn run(
    url: &str,
    token: Option<&str>,
    hello: &Hello,
    mut shutdown: watch::Receiver<bool>,
    make_trainer: impl Fn() -> Box<dyn Trainer>,
) -> Result<(), String> {
    let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(10));
    loop {
        if *shutdown.borrow() {
            return Ok(());
        }
        // No Nagle: small frames (losses, step reports) must not wait for ACKs.
        let request = upgrade_request(url, token)?;
        let connected = tokio::select! {
            connected = tokio_tungstenite::connect_async_with_config(request, None, true) => connected,
            _ = shutdown.changed() => return Ok(()),
        };
        match connected {
            Ok((socket, _)) => {
                let started = std::time::Instant::now();
                let (mut sink, mut stream) = socket.split();
                match run_session(&mut sink, &mut stream, hello, &mut shutdown, make_trainer())
                    .await
                {
                    SessionEnd::Shutdown => return Ok(()),
                    SessionEnd::Fatal(reason) => return Err(reason),
                    SessionEnd::Lost(reason) => {
                        // A long healthy session earns a quick reconnect.
                        if started.elapsed() > Duration::from_secs(30) {
                            backoff.reset();
                        }
                        tracing::warn!(%reason, "lost the server");
                    }
                }
            }
            Err(tungstenite::Error::Http(response))
                if response.status() == tungstenite::http::StatusCode::UNAUTHORIZED =>
            {
                return Err(
                    "it requires a join token and this provider's is missing or wrong (pass --token)"
                        .into(),
                );
            }
            Err(error) => tracing::warn!(%error, url, "cannot reach the server"),
        }
        let delay = backoff.next_delay();
        tracing::info!(delay_ms = delay.as_millis() as u64, "reconnecting");
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            _ = shutdown.changed() => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::NoTorch;
    use futures_channel::mpsc;
    use rookery_proto::{ErrorMessage, PROTOCOL_VERSION, ProviderKind};

    fn hello() -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            kind: ProviderKind::Native,
            device: "test".into(),
            memory_bytes: 1,
            gflops: 1.0,
            display_name: "unit".into(),
            max_buffer_bytes: None,
        }
    }

    fn frame(message: &ToProvider) -> Result<Message, std::convert::Infallible> {
        Ok(Message::Binary(
            rookery_proto::encode(message).unwrap().into(),
        ))
    }

    fn sent(message: Message) -> ToServer {
        match message {
            Message::Binary(bytes) => rookery_proto::decode(&bytes, 1 << 20).unwrap(),
            other => panic!("expected binary, got {other:?}"),
        }
    }

    #[test]
    fn urls_a_person_types_become_the_provider_endpoint() {
        for (typed, expected) in [
            ("ws://127.0.0.1:8080", "ws://127.0.0.1:8080/ws/provider"),
            ("ws://127.0.0.1:8080/", "ws://127.0.0.1:8080/ws/provider"),
            ("http://host:1", "ws://host:1/ws/provider"),
            ("https://host", "wss://host/ws/provider"),
            ("localhost:9", "ws://localhost:9/ws/provider"),
            ("ws://host/custom/path", "ws://host/custom/path"),
        ] {
            assert_eq!(provider_url(typed), expected, "{typed}");
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(3));
        let delays: Vec<u128> = (0..5).map(|_| backoff.next_delay().as_millis()).collect();
        assert_eq!(delays, vec![500, 1000, 2000, 3000, 3000]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_millis(500));
    }

    #[tokio::test(start_paused = true)]
    async fn session_says_hello_then_heartbeats_at_the_servers_pace() {
        let (mut out_tx, mut out_rx) = mpsc::unbounded();
        let (in_tx, mut in_rx) = mpsc::unbounded();
        in_tx
            .unbounded_send(frame(&ToProvider::Welcome {
                provider_id: 4,
                heartbeat_interval_ms: 100,
                heartbeat_timeout_ms: 10_000,
            }))
            .unwrap();
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let session = tokio::spawn(async move {
            run_session(
                &mut out_tx,
                &mut in_rx,
                &hello(),
                &mut stop_rx,
                Box::new(NoTorch),
            )
            .await
        });
        assert_eq!(sent(out_rx.next().await.unwrap()), ToServer::Hello(hello()));
        for expected in 0..3 {
            assert_eq!(
                sent(out_rx.next().await.unwrap()),
                ToServer::Heartbeat { seq: expected }
            );
            in_tx
                .unbounded_send(frame(&ToProvider::Heartbeat { seq: expected }))
                .unwrap();
        }
        stop_tx.send(true).unwrap();
        assert_eq!(session.await.unwrap(), SessionEnd::Shutdown);
        let rest: Vec<Message> = out_rx.collect().await;
        assert!(rest.iter().any(|m| matches!(m, Message::Close(_))));
    }

    #[tokio::test]
    async fn a_version_mismatch_is_fatal_other_errors_are_retried() {
        for (code, fatal) in [
            (ErrorCode::VersionMismatch, true),
            (ErrorCode::Internal, false),
        ] {
            let (mut out_tx, _out_rx) = mpsc::unbounded();
            let mut incoming =
                futures_util::stream::iter(vec![frame(&ToProvider::Error(ErrorMessage {
                    code,
                    message: "nope".into(),
                }))]);
            let (_stop_tx, mut stop_rx) = watch::channel(false);
            let end = run_session(
                &mut out_tx,
                &mut incoming,
                &hello(),
                &mut stop_rx,
                Box::new(NoTorch),
            )
            .await;
            assert_eq!(
                matches!(end, SessionEnd::Fatal(_)),
                fatal,
                "{code:?}: {end:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_server_is_noticed() {
        let (mut out_tx, _out_rx) = mpsc::unbounded();
        let (in_tx, mut in_rx) = mpsc::unbounded();
        in_tx
            .unbounded_send(frame(&ToProvider::Welcome {
                provider_id: 1,
                heartbeat_interval_ms: 100,
                heartbeat_timeout_ms: 500,
            }))
            .unwrap();
        let (_stop_tx, mut stop_rx) = watch::channel(false);
        let end = run_session(
            &mut out_tx,
            &mut in_rx,
            &hello(),
            &mut stop_rx,
            Box::new(NoTorch),
        )
        .await;
        assert!(
            matches!(end, SessionEnd::Lost(ref r) if r.contains("no answer")),
            "{end:?}"
        );
        drop(in_tx);
    }
}
