//! One provider connection over in-memory channels: handshake, heartbeats,
//! link probes, payload accounting and every way a peer is dropped.

use super::link::LinkProbe;
use super::*;
use crate::state::Limits;
use crate::store::Db;
use futures_channel::mpsc;
use rookery_proto::stream::Lane;
use rookery_proto::{ProviderKind, WireDType};
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
        crate::store::tokens::Token::new("test-token"),
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
        credential: None,
        requester_token: None,
        donor: None,
        duty_cycle: 1.0,
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
    serve_provider(out_tx, incoming, state.clone(), None).await;
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
            // A repeated answer is ignored too.
            binary(&ToServer::ProbeAck { seq: 0 }),
        ]
        .into_iter()
        // Each frame of a full probe is answered.
        .chain((0..LinkProbe::CHUNKS).map(|_| binary(&ToServer::ProbeAck { seq: 1 })))
        .chain([binary(&ToServer::ProbeAck { seq: 2 })])
        .chain((0..LinkProbe::CHUNKS).map(|_| binary(&ToServer::ProbeAck { seq: 3 })))
        .chain([binary(&ToServer::ProbeAck { seq: 4 })])
        .chain((0..LinkProbe::CHUNKS).map(|_| binary(&ToServer::ProbeAck { seq: 5 })))
        // Three rounds are all there is.
        .chain([
            binary(&ToServer::ProbeAck { seq: 6 }),
            Ok(Message::Close(None)),
        ])
        .collect(),
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
    let rounds: Vec<(u32, usize)> = (0..LinkProbe::ROUNDS)
        .flat_map(|r| {
            std::iter::once((2 * r, 0)).chain(std::iter::repeat_n(
                (2 * r + 1, LinkProbe::CHUNK),
                LinkProbe::CHUNKS,
            ))
        })
        .collect();
    assert_eq!(LinkProbe::CHUNK * LinkProbe::CHUNKS, LinkProbe::BYTES);
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
    assert!(matches!(&replies[1], Message::Close(Some(frame)) if frame.code == close_code::POLICY));
    assert!(providers::list(&state.db).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_large_first_frame_is_refused_before_it_is_decoded() {
    // Frames of up to 1 MiB are fine later on, not first.
    let state = AppState::new(
        Db::open_in_memory().unwrap(),
        Limits {
            max_frame_bytes: 1 << 20,
            heartbeat_timeout: Duration::from_millis(300),
            ..Limits::default()
        },
        None,
        std::env::temp_dir(),
        crate::store::tokens::Token::new("test-token"),
    );
    let replies = run(&state, vec![Ok(Message::Binary(vec![0u8; 100_000].into()))]).await;
    let ToProvider::Error(error) = decode_reply(replies[0].clone()) else {
        panic!("expected an error, got {replies:?}");
    };
    assert!(
        error
            .message
            .contains("first frame must be a Hello of at most 4096 bytes"),
        "{}",
        error.message
    );
    // A real Hello is far below the limit.
    assert!(
        rookery_proto::encode(&ToServer::Hello(hello()))
            .unwrap()
            .len()
            < 512
    );
}

/// The `Welcome` a connection from `ip` with `hello` gets: (identity,
/// issued credential), or the refusal's text.
async fn welcome_of(
    state: &AppState,
    hello: Hello,
    ip: [u8; 4],
) -> Result<(u64, Option<String>), String> {
    let (out_tx, out_rx) = mpsc::unbounded();
    let frames = vec![binary(&ToServer::Hello(hello)), Ok(Message::Close(None))];
    let incoming = futures_util::stream::iter(frames);
    serve_provider(out_tx, incoming, state.clone(), Some(IpAddr::from(ip))).await;
    let replies: Vec<Message> = out_rx.collect().await;
    match decode_reply(replies[0].clone()) {
        ToProvider::Welcome {
            identity,
            credential,
            ..
        } => Ok((identity, credential)),
        ToProvider::Error(error) => Err(error.message),
        other => panic!("expected Welcome or Error, got {other:?}"),
    }
}

#[tokio::test]
async fn a_provider_keeps_its_identity_by_its_credential_whatever_its_name() {
    let state = state();
    let (identity, credential) = welcome_of(&state, hello(), [10, 0, 0, 1]).await.unwrap();
    let credential = credential.expect("a first visit is issued a credential");
    // Back under another name, from another address: the same identity,
    // and nothing new to keep.
    let renamed = Hello {
        display_name: "someone else".into(),
        credential: Some(credential),
        ..hello()
    };
    assert_eq!(
        welcome_of(&state, renamed, [10, 0, 0, 2]).await,
        Ok((identity, None))
    );
    // Taking its name makes nobody that identity.
    let (other, issued) = welcome_of(&state, hello(), [10, 0, 0, 3]).await.unwrap();
    assert!(other != identity && issued.is_some());
    let records = providers::list(&state.db).await.unwrap();
    let mut identities: Vec<Option<u64>> = records.iter().map(|r| r.identity).collect();
    identities.sort();
    assert_eq!(identities, [Some(identity), Some(identity), Some(other)]);
}

#[tokio::test]
async fn an_address_that_makes_too_many_identities_is_told_to_come_back_later() {
    let state = AppState {
        limits: Limits {
            identities: identities::IssueLimit { per_window: 2 },
            ..state().limits
        },
        ..state()
    };
    let (_, first) = welcome_of(&state, hello(), [10, 0, 0, 1]).await.unwrap();
    welcome_of(&state, hello(), [10, 0, 0, 1]).await.unwrap();
    let refused = welcome_of(&state, hello(), [10, 0, 0, 1])
        .await
        .unwrap_err();
    assert!(refused.contains("2 new provider identities"), "{refused}");
    // Known identities still come in, and other addresses are not affected.
    let known = Hello {
        credential: first,
        ..hello()
    };
    assert!(welcome_of(&state, known, [10, 0, 0, 1]).await.is_ok());
    assert!(welcome_of(&state, hello(), [10, 0, 0, 2]).await.is_ok());
}

#[tokio::test]
async fn a_requester_token_vouches_for_a_native_provider_and_a_wrong_or_revoked_one_is_refused() {
    let state = state();
    let (_, alice) = requesters::create(&state.db, "alice", 0).await.unwrap();
    let (_, bob) = requesters::create(&state.db, "bob", 0).await.unwrap();
    requesters::revoke(&state.db, "bob", 1).await.unwrap();
    let vouched = |token: &str, kind| Hello {
        requester_token: Some(token.into()),
        kind,
        max_buffer_bytes: (kind == ProviderKind::Browser).then_some(1 << 27),
        ..hello()
    };
    // (hello, refused with)
    let cases = [
        (vouched(alice.secret(), ProviderKind::Native), None),
        (
            vouched("not-a-token", ProviderKind::Native),
            Some("not one this server accepts"),
        ),
        (
            vouched(bob.secret(), ProviderKind::Native),
            Some("not one this server accepts"),
        ),
        (
            vouched(alice.secret(), ProviderKind::Browser),
            Some("only native providers"),
        ),
    ];
    for (hello, refused) in cases {
        let got = welcome_of(&state, hello, [10, 0, 0, 1]).await;
        match refused {
            None => assert!(got.is_ok(), "{got:?}"),
            Some(reason) => assert!(got.as_ref().is_err_and(|e| e.contains(reason)), "{got:?}"),
        }
    }
    // A refused vouch ends the provider for good (it would only be refused
    // again), and the token is kept nowhere.
    let (out_tx, out_rx) = mpsc::unbounded();
    let frames = vec![binary(&ToServer::Hello(vouched(
        "nope",
        ProviderKind::Native,
    )))];
    serve_provider(
        out_tx,
        futures_util::stream::iter(frames),
        state.clone(),
        None,
    )
    .await;
    let replies: Vec<Message> = out_rx.collect().await;
    let ToProvider::Error(error) = decode_reply(replies[0].clone()) else {
        panic!("{replies:?}")
    };
    assert_eq!(error.code, ErrorCode::Unauthorized);
    let records = format!("{:?}", providers::list(&state.db).await.unwrap());
    assert!(!records.contains(alice.secret()), "{records}");
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
        (
            Hello {
                credential: Some("c".repeat(129)),
                ..hello()
            },
            "credential",
        ),
        (
            Hello {
                duty_cycle: 0.05,
                ..hello()
            },
            "duty cycle",
        ),
        (
            Hello {
                duty_cycle: f64::NAN,
                ..hello()
            },
            "duty cycle",
        ),
        (
            Hello {
                donor: Some(DonorCard {
                    name: " ".into(),
                    team: None,
                }),
                ..hello()
            },
            "donor name",
        ),
        (
            Hello {
                donor: Some(DonorCard {
                    name: "n".repeat(41),
                    team: None,
                }),
                ..hello()
            },
            "donor name",
        ),
        (
            Hello {
                donor: Some(DonorCard {
                    name: "alice".into(),
                    team: Some("a\u{7}b".into()),
                }),
                ..hello()
            },
            "team",
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
    let mut tensor = rookery_proto::WireTensor::from_f32("h", &[2, 4], &[0.0; 8], WireDType::F32);
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
            Some("where 32 were left of tensor `h`"),
        ),
        (vec![announced(), Ok(torn)], Some("not whole f32 elements")),
        (
            vec![
                announced(),
                payload(Lane::Forward, &[1.0, 1.0, f32::NAN, 1.0]),
            ],
            Some("element 2 is not finite"),
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
async fn a_new_duty_cycle_reaches_the_planner_and_one_out_of_range_drops_the_provider() {
    let state = state();
    let (out_tx, mut out_rx) = mpsc::unbounded();
    let (in_tx, in_rx) = mpsc::unbounded();
    for message in [
        ToServer::Hello(hello()),
        ToServer::DutyCycle { duty_cycle: 0.5 },
        ToServer::Heartbeat { seq: 1 },
    ] {
        in_tx.unbounded_send(binary(&message)).unwrap();
    }
    let served = tokio::spawn({
        let state = state.clone();
        async move { serve_provider(out_tx, in_rx, state, None).await }
    });
    // The heartbeat is answered after the cap went to the coordinator,
    // whose queue answers the snapshot after it.
    while decode_reply(out_rx.next().await.unwrap()) != (ToProvider::Heartbeat { seq: 1 }) {}
    let live = state.coordinator.snapshot().await;
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].hello.duty_cycle, 0.5);
    in_tx
        .unbounded_send(binary(&ToServer::DutyCycle { duty_cycle: 0.01 }))
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), served)
        .await
        .expect("the connection ends")
        .unwrap();
    let replies: Vec<ToProvider> = out_rx
        .collect::<Vec<Message>>()
        .await
        .into_iter()
        .filter(|m| matches!(m, Message::Binary(_)))
        .map(decode_reply)
        .collect();
    let Some(ToProvider::Error(error)) = replies.last() else {
        panic!("expected an error, got {replies:?}");
    };
    assert_eq!(error.code, ErrorCode::BadFrame);
    assert!(error.message.contains("duty cycle"), "{}", error.message);
    let record = providers::get(&state.db, 1).await.unwrap().unwrap();
    assert!(record.gone.unwrap().reason.contains("duty cycle"));
    drop(in_tx);
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
    serve_provider(out_tx, in_rx, state.clone(), None).await;
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

/// A connection whose provider said Hello and reads only the `Welcome`
/// (the writer stalls on the next frame): its frames in, what is left of
/// its replies, and the served connection.
async fn stalled_connection(
    state: &AppState,
) -> (
    mpsc::UnboundedSender<Result<Message, std::convert::Infallible>>,
    mpsc::Receiver<Message>,
    tokio::task::JoinHandle<()>,
) {
    let (out_tx, mut out_rx) = mpsc::channel(0);
    let (in_tx, in_rx) = mpsc::unbounded();
    in_tx
        .unbounded_send(binary(&ToServer::Hello(hello())))
        .unwrap();
    let served = tokio::spawn({
        let state = state.clone();
        async move { serve_provider(out_tx, in_rx, state, None).await }
    });
    assert!(matches!(
        decode_reply(out_rx.next().await.unwrap()),
        ToProvider::Welcome { .. }
    ));
    (in_tx, out_rx, served)
}

#[tokio::test(start_paused = true)]
async fn a_provider_that_reads_nothing_is_still_heard_and_timed_out() {
    // Its replies back up (nothing takes them off the wire), as when a
    // provider uploads for a long time while the server streams to it: the
    // server must keep reading, and notice when the provider falls silent.
    let state = state();
    let (in_tx, mut out_rx, served) = stalled_connection(&state).await;
    assert!(matches!(
        decode_reply(out_rx.next().await.unwrap()),
        ToProvider::Probe { .. }
    ));
    // From here on nothing is read.
    for seq in 0..20 {
        in_tx
            .unbounded_send(binary(&ToServer::Heartbeat { seq }))
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::timeout(Duration::from_secs(60), served)
        .await
        .expect("the connection ended though its writes were stuck")
        .unwrap();
    let record = providers::get(&state.db, 1).await.unwrap().unwrap();
    assert!(record.gone.unwrap().reason.contains("heartbeat timeout"));
    drop((in_tx, out_rx));
}

#[tokio::test]
async fn a_provider_that_talks_but_stops_reading_is_dropped_after_the_send_timeout() {
    // It heartbeats on time, so only the stalled send can tell.
    let state = AppState {
        limits: Limits {
            send_timeout: Duration::from_millis(200),
            ..state().limits
        },
        ..state()
    };
    let (in_tx, out_rx, served) = stalled_connection(&state).await;
    let started = std::time::Instant::now();
    let mut seq = 0;
    while !served.is_finished() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "a provider that reads nothing kept its connection"
        );
        in_tx
            .unbounded_send(binary(&ToServer::Heartbeat { seq }))
            .unwrap();
        seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let record = providers::get(&state.db, 1).await.unwrap().unwrap();
    let reason = record.gone.unwrap().reason;
    assert!(reason.contains("reads too slowly"), "{reason}");
    drop((in_tx, out_rx));
}

#[test]
fn close_reasons_are_cut_on_character_boundaries() {
    let text = "é".repeat(100);
    let cut = truncate_utf8(&text, MAX_CLOSE_REASON);
    assert!(cut.len() <= MAX_CLOSE_REASON);
    assert_eq!(cut.chars().count(), 61);
}

#[test]
fn heartbeats_are_written_once_a_second_and_a_flood_is_refused() {
    let asked = Duration::from_millis(100);
    let mut pacer = HeartbeatPacer::new(asked);
    assert_eq!(pacer.most_per_second, 40);
    let t0 = std::time::Instant::now();
    // At the asked rate: one write a second, never a flood.
    let beats: Vec<Beat> = (0..30).map(|i| pacer.beat(t0 + asked * i)).collect();
    assert_eq!(beats.iter().filter(|b| **b == Beat::Record).count(), 3);
    assert!(!beats.contains(&Beat::Flood));
    // A hundred in a tenth of a second is a flood.
    let later = t0 + Duration::from_secs(10);
    let flood = (0..100).map(|i| pacer.beat(later + Duration::from_millis(i)));
    assert!(flood.into_iter().any(|b| b == Beat::Flood));
    // A provider asked for 10 ms heartbeats may send 400 a second.
    assert_eq!(
        HeartbeatPacer::new(Duration::from_millis(10)).most_per_second,
        400
    );
}

#[test]
fn a_providers_failure_text_is_kept_to_a_kilobyte() {
    let long = ToServer::JobFailed {
        job_id: 7,
        message: "é".repeat(40_000),
    };
    let ToServer::JobFailed { job_id, message } = with_bounded_text(long) else {
        panic!("still a failure");
    };
    assert_eq!(job_id, 7);
    assert!(message.len() < MAX_PROVIDER_TEXT + 64, "{}", message.len());
    assert!(
        message.ends_with("(78976 more bytes not kept)"),
        "{message}"
    );
    let short = ToServer::JobFailed {
        job_id: 7,
        message: "out of memory".into(),
    };
    assert_eq!(with_bounded_text(short.clone()), short);
}

/// A stage's parameters of `n` f32, streamed within the tests' 1 KiB frames.
fn streamed_params(values: &[f32]) -> Vec<Result<Message, std::convert::Infallible>> {
    let message = ToServer::Params(rookery_proto::ParamSet {
        job_id: 1,
        step: 0,
        params: vec![rookery_proto::WireTensor::from_f32(
            "w",
            &[values.len()],
            values,
            WireDType::F32,
        )],
    });
    rookery_proto::stream::encode_streamed(&message, 1024)
        .unwrap()
        .into_iter()
        .map(|frame| Ok(Message::Binary(frame)))
        .collect()
}

#[tokio::test]
async fn parameters_are_assembled_from_frames_and_checked_as_they_arrive() {
    let good: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let mut poisoned = good.clone();
    poisoned[700] = f32::INFINITY;
    let cases: Vec<(Hello, Vec<_>, Option<&str>)> = vec![
        (hello(), streamed_params(&good), None),
        (
            hello(),
            streamed_params(&poisoned),
            Some("tensor `w`: element 700 is not finite"),
        ),
        // The header without its payloads, then an unrelated message: the
        // parameters are still owed, so nothing is passed on, and the
        // connection stays up until the peer sends something wrong.
        (hello(), streamed_params(&good)[..1].to_vec(), None),
        (
            hello(),
            {
                let mut frames = streamed_params(&good);
                frames.push(payload(Lane::Params, &[1.0]));
                frames
            },
            Some("no message waiting"),
        ),
        // More than the provider's own memory.
        (
            Hello {
                memory_bytes: 3999,
                ..hello()
            },
            streamed_params(&good),
            Some("announcing 4000 bytes"),
        ),
    ];
    for (hello, frames, problem) in cases {
        let state = state();
        let mut all = vec![binary(&ToServer::Hello(hello))];
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
async fn the_servers_own_tensors_go_out_in_frames_within_its_limit() {
    let values: Vec<f32> = (0..5000).map(|i| i as f32 * 0.25).collect();
    let message = ToProvider::SetParams(rookery_proto::ParamSet {
        job_id: 1,
        step: 3,
        params: vec![rookery_proto::WireTensor::from_f32(
            "w",
            &[values.len()],
            &values,
            WireDType::F32,
        )],
    });
    let (mut out_tx, out_rx) = mpsc::unbounded();
    send_streamed(&mut out_tx, &message, 1024, Duration::from_secs(5))
        .await
        .unwrap();
    drop(out_tx);
    let frames: Vec<Message> = out_rx.collect().await;
    assert!(frames.len() > 20);
    let mut assembler = Assembler::<ToProvider>::new(1 << 20);
    let mut whole = None;
    for frame in frames {
        let Message::Binary(bytes) = frame else {
            panic!("expected binary frames")
        };
        assert!(bytes.len() <= 1024);
        let incoming = rookery_proto::stream::read_frame(&bytes, 1024).unwrap();
        whole = assembler.push(incoming).unwrap();
    }
    assert_eq!(whole, Some(message));
}
