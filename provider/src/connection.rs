//! The provider's side of the WebSocket protocol: the I/O around
//! `rookery_stage::session::ProviderSession` (which decides what every frame
//! and timer means): one session, generic over `Sink`/`Stream` so tests drive
//! it with channels, and a supervisor that reconnects with backoff until
//! shutdown.
//!
//! Training messages go to a [`Trainer`] on a thread of its own: a libtorch
//! call can take longer than the heartbeat timeout, and the session must keep
//! answering the server meanwhile. The thread takes messages in arrival order
//! and its replies are sent as each message's work finishes.

use std::fmt::Display;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc as std_mpsc;

use futures_util::{Sink, SinkExt, Stream, StreamExt};
use rookery_proto::{Bytes, Hello, MAX_MAX_FRAME_BYTES, ToProvider, ToServer};
use rookery_stage::session::{Action, Disconnect, ProviderSession, SessionPolicy};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::{self, Message, client::IntoClientRequest};

use crate::identity::CredentialFile;
use crate::trainer::{Trainer, job_of};

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

impl From<Disconnect> for SessionEnd {
    fn from(disconnect: Disconnect) -> Self {
        match disconnect {
            Disconnect::Lost(reason) => SessionEnd::Lost(reason),
            Disconnect::VersionMismatch(reason) | Disconnect::Refused(reason) => {
                SessionEnd::Fatal(reason)
            }
        }
    }
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
    drive_session(
        sink,
        stream,
        hello,
        shutdown,
        trainer,
        &CredentialFile::ephemeral(),
    )
    .await
    .1
}

/// [`run_session`], also returning the session for what it learned (whether
/// the server welcomed this provider, and when).
async fn drive_session<Si, St, E>(
    sink: &mut Si,
    stream: &mut St,
    hello: &Hello,
    shutdown: &mut watch::Receiver<bool>,
    trainer: Box<dyn Trainer>,
    credentials: &CredentialFile,
) -> (ProviderSession, SessionEnd)
where
    Si: Sink<Message> + Unpin,
    Si::Error: Display,
    St: Stream<Item = Result<Message, E>> + Unpin,
    E: Display,
{
    let clock = Instant::now();
    let now = || clock.elapsed();
    let mut session = ProviderSession::new(SessionPolicy::NATIVE, hello.clone());
    let hello = session.opened(now());
    if let Err(end) = send(sink, &session, &hello).await {
        return (session, end);
    }
    let welcome_deadline = session
        .policy()
        .welcome_timeout
        .map(|timeout| clock + timeout);
    let (id, identity, interval) = loop {
        let frame = match welcome_deadline {
            Some(deadline) => tokio::select! {
                frame = next_frame(stream) => frame,
                () = tokio::time::sleep_until(deadline) => {
                    let end = session.welcome_timed_out().into();
                    return (session, end);
                }
            },
            None => next_frame(stream).await,
        };
        let frame = match frame {
            Ok(frame) => frame,
            Err(end) => return (session, end),
        };
        match session.frame(&frame, now()) {
            None => continue,
            Some(Action::Joined {
                provider_id,
                identity,
                heartbeat_interval,
                issued_credential,
            }) => {
                if let Some(credential) = issued_credential {
                    // Kept before any work is done under it; a provider that
                    // cannot keep it still works, as a new identity next time.
                    match credentials.save(&credential) {
                        Ok(()) => tracing::info!(
                            identity,
                            file = ?credentials.path(),
                            "the server issued this provider an identity"
                        ),
                        Err(error) => {
                            tracing::warn!(identity, %error, "cannot keep the credential")
                        }
                    }
                }
                break (provider_id, identity, heartbeat_interval);
            }
            Some(Action::End(disconnect)) => return (session, disconnect.into()),
            // Before `Welcome` the session ends rather than asking for these.
            Some(Action::Send(_) | Action::Train(_) | Action::Credit(_)) => {
                return (
                    session,
                    SessionEnd::Lost("the session broke its own rules".into()),
                );
            }
        }
    };
    tracing::info!(provider_id = id, identity, "joined the server");

    let mut worker = match TrainerThread::spawn(trainer) {
        Ok(worker) => worker,
        Err(error) => {
            let end = SessionEnd::Lost(format!("cannot start the training thread: {error}"));
            return (session, end);
        }
    };
    // Writing runs beside reading, never instead of it: while this provider
    // uploads its parameters the server may be streaming to it, and if
    // either side stopped reading to write, both socket buffers would fill
    // and the pair would wait for each other forever.
    let (out, mut outbound) = mpsc::unbounded_channel::<Outbound>();
    let writer = async {
        while let Some(item) = outbound.recv().await {
            match item {
                Outbound::Frames(frames) => {
                    if let Err(end) = write_frames(sink, frames).await {
                        return end;
                    }
                }
                Outbound::Close => {
                    let _ = sink.send(Message::Close(None)).await;
                    let _ = sink.close().await;
                    return SessionEnd::Shutdown;
                }
            }
        }
        SessionEnd::Shutdown
    };
    tokio::pin!(writer);
    let mut writer_ended = false;
    let mut ticker = tokio::time::interval(interval);
    let end = loop {
        let done = tokio::select! {
            end = &mut writer => {
                writer_ended = true;
                Err(end)
            }
            _ = ticker.tick() => match session.heartbeat_due(now()) {
                Action::Send(message) => queue(&out, &session, &message),
                Action::End(disconnect) => Err(disconnect.into()),
                Action::Joined { .. } | Action::Train(_) | Action::Credit(_) => Ok(()),
            },
            frame = next_frame(stream) => match frame.map(|frame| session.frame(&frame, now())) {
                Err(end) => Err(end),
                Ok(None | Some(Action::Joined { .. })) => Ok(()),
                Ok(Some(Action::Send(message))) => queue(&out, &session, &message),
                Ok(Some(Action::Train(message))) => worker
                    .inbox
                    .send(message)
                    .map_err(|_| SessionEnd::Lost("the training thread stopped".into())),
                Ok(Some(Action::End(disconnect))) => Err(disconnect.into()),
                Ok(Some(Action::Credit(gflop))) => {
                    println!(
                        "credit: {} of accepted training work",
                        rookery_proto::api::flop_text(gflop)
                    );
                    Ok(())
                }
            },
            replies = worker.replies.recv() => match replies {
                Some(replies) => replies.iter().try_for_each(|m| queue(&out, &session, m)),
                // Only a crash ends the thread while the session holds its inbox;
                // a fresh session gets a fresh trainer.
                None => Err(SessionEnd::Lost("the training thread crashed".into())),
            },
            changed = shutdown.changed() => {
                if changed.is_err() || *shutdown.borrow() {
                    let _ = out.send(Outbound::Close);
                    Err(SessionEnd::Shutdown)
                } else {
                    Ok(())
                }
            }
        };
        if let Err(end) = done {
            break end;
        }
    };
    // What was queued before the end still goes out (a crashed trainer's
    // `JobFailed`, the goodbye), unless the writer is what failed; a server
    // that reads nothing is given up on.
    drop(out);
    if !writer_ended {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), &mut writer).await;
    }
    (session, end)
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
                            let rest = trainer.rest_after();
                            if !rest.is_zero() {
                                std::thread::sleep(rest);
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

/// What the session's writer sends next.
enum Outbound {
    Frames(Vec<Bytes>),
    Close,
}

/// `message` as the session frames it: tensors stream in frames within the
/// frame limit the server announced.
fn frames_of(session: &ProviderSession, message: &ToServer) -> Result<Vec<Bytes>, SessionEnd> {
    #[cfg(feature = "fault-injection")]
    let tampered = crate::fault::tamper(message);
    #[cfg(feature = "fault-injection")]
    let message = tampered.as_ref().unwrap_or(message);
    let frames = session
        .encode(message)
        .map_err(|error| SessionEnd::Fatal(format!("cannot encode {}: {error}", message.kind())))?;
    #[cfg(feature = "fault-injection")]
    let frames = crate::fault::tamper_frames(message, frames);
    Ok(frames)
}

/// Hands `message`'s frames to the session's writer.
fn queue(
    out: &mpsc::UnboundedSender<Outbound>,
    session: &ProviderSession,
    message: &ToServer,
) -> Result<(), SessionEnd> {
    out.send(Outbound::Frames(frames_of(session, message)?))
        .map_err(|_| SessionEnd::Lost("the connection's writer stopped".into()))
}

/// Sends `message` now (before the session's writer runs).
async fn send<Si>(
    sink: &mut Si,
    session: &ProviderSession,
    message: &ToServer,
) -> Result<(), SessionEnd>
where
    Si: Sink<Message> + Unpin,
    Si::Error: Display,
{
    write_frames(sink, frames_of(session, message)?).await
}

async fn write_frames<Si>(sink: &mut Si, frames: Vec<Bytes>) -> Result<(), SessionEnd>
where
    Si: Sink<Message> + Unpin,
    Si::Error: Display,
{
    // Each frame is flushed on its own so the server relays the first
    // payload while the next is still being written.
    for frame in frames {
        sink.send(Message::Binary(frame))
            .await
            .map_err(|error| SessionEnd::Lost(format!("cannot send: {error}")))?;
    }
    Ok(())
}

/// The transport's limits: any frame a server may send (its limit is at
/// most [`MAX_MAX_FRAME_BYTES`]) is read, and the session then holds it to
/// the limit the server announced.
fn transport_config() -> tungstenite::protocol::WebSocketConfig {
    tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(MAX_MAX_FRAME_BYTES))
        .max_frame_size(Some(MAX_MAX_FRAME_BYTES))
}

/// The next binary frame.
async fn next_frame<St, E>(stream: &mut St) -> Result<Bytes, SessionEnd>
where
    St: Stream<Item = Result<Message, E>> + Unpin,
    E: Display,
{
    loop {
        match stream.next().await {
            Some(Ok(Message::Binary(bytes))) => return Ok(bytes),
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
    mut hello: Hello,
    credentials: &CredentialFile,
    mut shutdown: watch::Receiver<bool>,
    make_trainer: impl Fn() -> Box<dyn Trainer>,
) -> Result<(), String> {
    let mut backoff = SessionPolicy::NATIVE.backoff();
    loop {
        if *shutdown.borrow() {
            return Ok(());
        }
        // No Nagle: small frames (losses, step reports) must not wait for ACKs.
        let request = upgrade_request(url, token)?;
        let connected = tokio::select! {
            connected = tokio_tungstenite::connect_async_with_config(request, Some(transport_config()), true) => connected,
            _ = shutdown.changed() => return Ok(()),
        };
        match connected {
            Ok((socket, _)) => {
                let started = Instant::now();
                let (mut sink, mut stream) = socket.split();
                let (session, end) = drive_session(
                    &mut sink,
                    &mut stream,
                    &hello,
                    &mut shutdown,
                    make_trainer(),
                    credentials,
                )
                .await;
                // With the credential the server issued, if it issued one.
                hello = session.hello().clone();
                match end {
                    SessionEnd::Shutdown => return Ok(()),
                    SessionEnd::Fatal(reason) => return Err(reason),
                    SessionEnd::Lost(reason) => {
                        if session.earned_quick_reconnect(started.elapsed()) {
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
    use rookery_proto::{ErrorCode, ErrorMessage, PROTOCOL_VERSION, ProviderKind};

    fn hello() -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            kind: ProviderKind::Native,
            device: "test".into(),
            memory_bytes: 1,
            gflops: 1.0,
            display_name: "unit".into(),
            max_buffer_bytes: None,
            credential: None,
            requester_token: None,
            donor: None,
            duty_cycle: 1.0,
        }
    }

    /// Works `work` on each message and answers with one `Ready` of its job,
    /// noting when each message's work began.
    struct Slow {
        work: std::time::Duration,
        began: std::sync::Arc<std::sync::Mutex<Vec<Instant>>>,
    }

    impl Trainer for Slow {
        fn handle(&mut self, message: ToProvider) -> Vec<ToServer> {
            if let Ok(mut began) = self.began.lock() {
                began.push(Instant::now());
            }
            std::thread::sleep(self.work);
            job_of(&message)
                .map(|job_id| vec![ToServer::Ready { job_id }])
                .unwrap_or_default()
        }
    }

    /// `rookery-provider --gpu-cap`: a capped trainer's replies go out as
    /// soon as its work is done, and the next message waits out the rest,
    /// so the device works at most the cap's share of the time.
    #[tokio::test]
    async fn a_capped_trainer_answers_at_once_then_rests_before_the_next_message() {
        let work = std::time::Duration::from_millis(20);
        let began = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let slow = Slow {
            work,
            began: began.clone(),
        };
        let paced = crate::trainer::Paced::new(Box::new(slow), 0.25);
        let mut thread = TrainerThread::spawn(Box::new(paced)).unwrap();
        for job_id in [1, 2, 3] {
            thread.inbox.send(ToProvider::Release { job_id }).unwrap();
        }
        let mut answered = Vec::new();
        for _ in 0..3 {
            assert!(thread.replies.recv().await.is_some());
            answered.push(Instant::now());
        }
        let began = began.lock().unwrap().clone();
        // Each message works 20 ms and then rests 3 times as long (a 25%
        // cap): a message's work begins at least work + rest after the
        // one before's (both timed on the trainer's thread, where sleeping
        // never ends early), and each answer arrives before that rest ends.
        // Times taken where the answers arrive would also hold the
        // scheduler's delays.
        assert_eq!(began.len(), 3);
        // (Less a microsecond: the rest goes through f64 milliseconds.)
        let least = 4 * work - std::time::Duration::from_micros(1);
        for pair in began.windows(2) {
            assert!(pair[1] - pair[0] >= least, "{began:?}");
        }
        for (answer, next) in answered.iter().zip(&began[1..]) {
            assert!(answer < next, "answered {answered:?}, began {began:?}");
        }
        // Uncapped, nothing rests.
        let slow = Slow {
            work,
            began: Default::default(),
        };
        let paced = crate::trainer::Paced::new(Box::new(slow), 1.0);
        assert_eq!(paced.rest_after(), std::time::Duration::ZERO);
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

    /// A session on its own task, welcomed with a heartbeat every 100 ms
    /// and `timeout_ms` of patience: what the server sends goes into the
    /// returned sender, and the session writes into `out`.
    fn welcomed_session<Si>(
        mut out: Si,
        timeout_ms: u32,
    ) -> (
        mpsc::UnboundedSender<Result<Message, std::convert::Infallible>>,
        watch::Sender<bool>,
        tokio::task::JoinHandle<SessionEnd>,
    )
    where
        Si: Sink<Message> + Unpin + Send + 'static,
        Si::Error: Display,
    {
        let (in_tx, mut in_rx) = mpsc::unbounded();
        in_tx
            .unbounded_send(frame(&ToProvider::Welcome {
                provider_id: 4,
                heartbeat_interval_ms: 100,
                heartbeat_timeout_ms: timeout_ms,
                max_frame_bytes: rookery_proto::DEFAULT_MAX_FRAME_BYTES as u64,
                identity: 1,
                credential: None,
            }))
            .unwrap();
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let session = tokio::spawn(async move {
            run_session(
                &mut out,
                &mut in_rx,
                &hello(),
                &mut stop_rx,
                Box::new(NoTorch),
            )
            .await
        });
        (in_tx, stop_tx, session)
    }

    #[tokio::test(start_paused = true)]
    async fn session_says_hello_then_heartbeats_at_the_servers_pace() {
        let (out_tx, mut out_rx) = mpsc::unbounded();
        let (in_tx, stop_tx, session) = welcomed_session(out_tx, 10_000);
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
                max_frame_bytes: rookery_proto::DEFAULT_MAX_FRAME_BYTES as u64,
                identity: 1,
                credential: None,
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

    #[tokio::test(start_paused = true)]
    async fn the_session_keeps_reading_while_its_writes_are_stuck() {
        // A server busy streaming to this provider reads nothing for a
        // while: the provider's writes back up, and it must still read.
        let (out_tx, mut out_rx) = mpsc::channel(0);
        let (in_tx, _stop_tx, session) = welcomed_session(out_tx, 600_000);
        assert_eq!(sent(out_rx.next().await.unwrap()), ToServer::Hello(hello()));
        // Heartbeats fall due every 100 ms and none is taken off the wire.
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        in_tx
            .unbounded_send(frame(&ToProvider::Error(ErrorMessage {
                code: ErrorCode::Internal,
                message: "going away".into(),
            })))
            .unwrap();
        let end = tokio::time::timeout(std::time::Duration::from_secs(60), session)
            .await
            .expect("the session read the server's error while its writes were stuck")
            .unwrap();
        assert!(matches!(end, SessionEnd::Lost(_)), "{end:?}");
        drop(out_rx);
    }
}
