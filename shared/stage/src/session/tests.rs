#![allow(clippy::unwrap_used)]

use super::*;
use rookery_proto::{Backward, WireDType, WireTensor};

fn offer() -> DeviceOffer {
    DeviceOffer {
        device: "SwiftShader (webgpu)".into(),
        memory_bytes: 1 << 28,
        gflops: 12.5,
        max_buffer_bytes: Some(1 << 27),
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn frame(message: &ToProvider) -> Bytes {
    Bytes::from(rookery_proto::encode(message).unwrap())
}

fn welcome(interval_ms: u32, timeout_ms: u32) -> ToProvider {
    welcome_limited(interval_ms, timeout_ms, DEFAULT_MAX_FRAME_BYTES as u64)
}

fn welcome_limited(interval_ms: u32, timeout_ms: u32, max_frame_bytes: u64) -> ToProvider {
    ToProvider::Welcome {
        provider_id: 4,
        heartbeat_interval_ms: interval_ms,
        heartbeat_timeout_ms: timeout_ms,
        max_frame_bytes,
        identity: 9,
        credential: None,
    }
}

/// A session of `policy` that has said Hello at 0 s and been welcomed.
fn joined(policy: SessionPolicy, interval_ms: u32, timeout_ms: u32) -> ProviderSession {
    let mut session = ProviderSession::new(policy, policy.hello("unit", offer()));
    session.opened(Duration::ZERO);
    assert!(matches!(
        session.message(welcome(interval_ms, timeout_ms), Duration::ZERO),
        Some(Action::Joined { .. })
    ));
    session
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
fn page_provider_url_follows_the_page_scheme() {
    assert_eq!(
        page_provider_url("http:", "localhost:8080", "").as_deref(),
        Some("ws://localhost:8080/ws/provider")
    );
    assert_eq!(
        page_provider_url("https:", "rookery.example", "").as_deref(),
        Some("wss://rookery.example/ws/provider")
    );
    assert_eq!(page_provider_url("file:", "", ""), None);
    assert_eq!(page_provider_url("ftp:", "example.org", ""), None);
}

#[test]
fn a_join_token_on_the_page_goes_to_the_socket_still_encoded() {
    for (query, url) in [
        ("?token=abc", "ws://h:1/ws/provider?token=abc"),
        (
            "?lang=en&token=join%20me",
            "ws://h:1/ws/provider?token=join%20me",
        ),
        ("?token=", "ws://h:1/ws/provider"),
        ("?tokens=abc", "ws://h:1/ws/provider"),
    ] {
        assert_eq!(
            page_provider_url("http:", "h:1", query).as_deref(),
            Some(url),
            "{query}"
        );
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

#[test]
fn a_browser_backs_off_from_one_to_fifteen_seconds() {
    let mut backoff = SessionPolicy::BROWSER.backoff();
    let delays: Vec<u128> = (0..7).map(|_| backoff.next_delay().as_millis()).collect();
    assert_eq!(delays, [1_000, 2_000, 4_000, 8_000, 15_000, 15_000, 15_000]);
    backoff.reset();
    assert_eq!(backoff.next_delay(), Duration::from_secs(1));
}

#[test]
fn hello_is_a_hello_of_the_current_version_and_the_policys_kind() {
    for policy in [SessionPolicy::NATIVE, SessionPolicy::BROWSER] {
        let mut session = ProviderSession::new(policy, policy.hello("tab", offer()));
        let ToServer::Hello(hello) = session.opened(Duration::ZERO) else {
            panic!("the first message is Hello");
        };
        let frame = rookery_proto::encode(&ToServer::Hello(hello.clone())).unwrap();
        assert_eq!(
            rookery_proto::peek_hello_version(&frame),
            Some(PROTOCOL_VERSION)
        );
        assert_eq!(hello.kind, policy.kind);
        assert_eq!(hello.device, "SwiftShader (webgpu)");
        assert_eq!(hello.display_name, "tab");
        assert_eq!(hello.memory_bytes, 1 << 28);
        assert_eq!(hello.gflops, 12.5);
        assert_eq!(hello.max_buffer_bytes, Some(1 << 27));
    }
}

#[test]
fn welcome_sets_the_heartbeat_pace_with_a_floor() {
    for (policy, asked, floor) in [
        (SessionPolicy::BROWSER, 2_000, 2_000),
        // A zero interval would make the heartbeat loop spin.
        (SessionPolicy::BROWSER, 0, 100),
        (SessionPolicy::NATIVE, 0, 10),
    ] {
        let mut session = ProviderSession::new(policy, policy.hello("unit", offer()));
        session.opened(Duration::ZERO);
        assert_eq!(
            session.frame(&frame(&welcome(asked, 10_000)), Duration::ZERO),
            Some(Action::Joined {
                provider_id: 4,
                identity: 9,
                heartbeat_interval: Duration::from_millis(floor),
                issued_credential: None,
            })
        );
        assert!(session.welcomed());
    }
}

#[test]
fn an_issued_credential_goes_into_every_later_hello() {
    let policy = SessionPolicy::NATIVE;
    let mut session = ProviderSession::new(policy, policy.hello("unit", offer()));
    let ToServer::Hello(first) = session.opened(Duration::ZERO) else {
        panic!("the first message is Hello");
    };
    assert_eq!(first.credential, None);
    let issued = ToProvider::Welcome {
        provider_id: 4,
        heartbeat_interval_ms: 1_000,
        heartbeat_timeout_ms: 5_000,
        max_frame_bytes: DEFAULT_MAX_FRAME_BYTES as u64,
        identity: 12,
        credential: Some("s3cret".into()),
    };
    let Some(Action::Joined {
        identity,
        issued_credential,
        ..
    }) = session.message(issued, Duration::ZERO)
    else {
        panic!("Welcome joins");
    };
    assert_eq!(
        (identity, issued_credential.as_deref()),
        (12, Some("s3cret"))
    );
    // The next session starts from this one's Hello.
    let mut next = ProviderSession::new(policy, session.hello().clone());
    let ToServer::Hello(again) = next.opened(Duration::ZERO) else {
        panic!("the first message is Hello");
    };
    assert_eq!(again.credential.as_deref(), Some("s3cret"));
}

#[test]
fn reactions_to_server_messages_once_welcomed() {
    let mut session = joined(SessionPolicy::BROWSER, 2_000, 10_000);
    let now = secs(1);
    assert_eq!(session.message(ToProvider::Heartbeat { seq: 1 }, now), None);
    // A link probe is answered at once, so the server can time the link.
    let probe = ToProvider::Probe {
        seq: 3,
        padding: vec![0; 64].into(),
    };
    assert_eq!(
        session.message(probe, now),
        Some(Action::Send(ToServer::ProbeAck { seq: 3 }))
    );
    // Training goes to the stage worker.
    let upload = ToProvider::UploadParams { job_id: 4, step: 1 };
    assert_eq!(
        session.message(upload.clone(), now),
        Some(Action::Train(upload))
    );
    assert!(matches!(
        session.message(welcome(1, 1), now),
        Some(Action::End(Disconnect::Lost(_)))
    ));
}

#[test]
fn a_version_mismatch_or_a_refused_vouch_ends_for_good_other_errors_are_lost_sessions() {
    // (code, how the session ends: 'v' version, 'r' refused, 'l' lost)
    for (code, end_kind) in [
        (ErrorCode::VersionMismatch, 'v'),
        (ErrorCode::Unauthorized, 'r'),
        (ErrorCode::HeartbeatTimeout, 'l'),
        (ErrorCode::Internal, 'l'),
        (ErrorCode::RateLimited, 'l'),
    ] {
        let mut session = ProviderSession::new(
            SessionPolicy::NATIVE,
            SessionPolicy::NATIVE.hello("unit", offer()),
        );
        session.opened(Duration::ZERO);
        let end = session.message(
            ToProvider::Error(ErrorMessage {
                code,
                message: "server speaks 2".into(),
            }),
            Duration::ZERO,
        );
        match (end, end_kind) {
            (Some(Action::End(Disconnect::VersionMismatch(text))), 'v')
            | (Some(Action::End(Disconnect::Refused(text))), 'r') => {
                assert_eq!(text, "server speaks 2");
            }
            (Some(Action::End(Disconnect::Lost(text))), 'l') => {
                assert!(text.contains("server speaks 2"), "{text}");
            }
            (other, _) => panic!("{code:?}: {other:?}"),
        }
    }
}

#[test]
fn training_before_welcome_ends_the_session() {
    let mut session = ProviderSession::new(
        SessionPolicy::BROWSER,
        SessionPolicy::BROWSER.hello("unit", offer()),
    );
    session.opened(Duration::ZERO);
    assert!(matches!(
        session.message(ToProvider::Release { job_id: 1 }, Duration::ZERO),
        Some(Action::End(Disconnect::Lost(text))) if text.contains("before welcoming")
    ));
}

#[test]
fn heartbeats_count_up_and_a_silent_server_is_noticed() {
    let mut session = joined(SessionPolicy::NATIVE, 100, 500);
    for (seq, at) in [(0, 0), (1, 100), (2, 200)] {
        assert_eq!(
            session.heartbeat_due(Duration::from_millis(at)),
            Action::Send(ToServer::Heartbeat { seq })
        );
    }
    // An answer at 300 ms keeps the session until 800 ms.
    assert_eq!(
        session.message(ToProvider::Heartbeat { seq: 2 }, Duration::from_millis(300)),
        None
    );
    assert!(matches!(
        session.heartbeat_due(Duration::from_millis(800)),
        Action::Send(_)
    ));
    assert!(matches!(
        session.heartbeat_due(Duration::from_millis(801)),
        Action::End(Disconnect::Lost(text)) if text.contains("no answer")
    ));
    // A tab leaves silence to the browser's socket events.
    let mut tab = joined(SessionPolicy::BROWSER, 100, 500);
    assert!(matches!(tab.heartbeat_due(secs(60)), Action::Send(_)));
}

#[test]
fn a_long_welcomed_session_earns_a_quick_reconnect() {
    let native = joined(SessionPolicy::NATIVE, 100, 500);
    assert!(!native.earned_quick_reconnect(secs(29)));
    assert!(native.earned_quick_reconnect(secs(31)));
    let tab = joined(SessionPolicy::BROWSER, 100, 500);
    assert!(tab.earned_quick_reconnect(Duration::ZERO));
    let mut refused = ProviderSession::new(
        SessionPolicy::BROWSER,
        SessionPolicy::BROWSER.hello("unit", offer()),
    );
    refused.opened(Duration::ZERO);
    assert!(!refused.earned_quick_reconnect(secs(60)));
}

#[test]
fn streamed_tensors_are_put_back_into_their_message_and_garbage_is_refused() {
    let values: Vec<f32> = (0..40_000).map(|i| i as f32).collect();
    let backward = ToProvider::Backward(Backward {
        job_id: 1,
        step: 2,
        micro: 0,
        grads: vec![WireTensor::from_f32(
            "g",
            &[40_000],
            &values,
            WireDType::F32,
        )],
    });
    let frames = stream::encode_streamed(&backward, DEFAULT_MAX_FRAME_BYTES).unwrap();
    assert!(
        frames.len() > 1,
        "160 KB of gradients travel as payload frames"
    );
    let mut session = joined(SessionPolicy::BROWSER, 100, 500);
    let mut whole = None;
    for f in &frames {
        whole = session.frame(f, secs(1));
    }
    assert_eq!(whole, Some(Action::Train(backward)));
    for garbage in [vec![0xff, 0xff], Vec::new()] {
        let mut session = joined(SessionPolicy::BROWSER, 100, 500);
        assert!(matches!(
            session.frame(&Bytes::from(garbage), secs(1)),
            Some(Action::End(Disconnect::Lost(_)))
        ));
    }
}

#[test]
fn the_session_streams_and_reads_within_the_frame_limit_the_server_announces() {
    let limit = rookery_proto::MIN_MAX_FRAME_BYTES;
    let mut session = ProviderSession::new(
        SessionPolicy::NATIVE,
        SessionPolicy::NATIVE.hello("unit", offer()),
    );
    session.opened(Duration::ZERO);
    assert_eq!(session.max_frame_bytes(), DEFAULT_MAX_FRAME_BYTES);
    assert!(matches!(
        session.message(welcome_limited(100, 500, limit as u64), Duration::ZERO),
        Some(Action::Joined { .. })
    ));
    assert_eq!(session.max_frame_bytes(), limit);
    // 12 MB of parameters go as frames within the limit.
    let values = vec![0.5f32; 3_000_000];
    let params = ToServer::Params(rookery_proto::ParamSet {
        job_id: 1,
        step: 0,
        params: vec![WireTensor::from_f32(
            "w",
            &[3_000_000],
            &values,
            WireDType::F32,
        )],
    });
    let frames = session.encode(&params).unwrap();
    assert!(frames.len() > 20);
    assert!(frames.iter().all(|f| f.len() <= limit));
    // A frame over the announced limit ends the session.
    let probe = ToProvider::Probe {
        seq: 1,
        padding: vec![0; limit].into(),
    };
    assert!(matches!(
        session.frame(&frame(&probe), secs(1)),
        Some(Action::End(Disconnect::Lost(reason))) if reason.contains("exceeds the limit")
    ));
}

#[test]
fn a_welcome_announcing_an_unusable_frame_limit_ends_the_session() {
    for limit in [0, 1024, u64::MAX] {
        let mut session = ProviderSession::new(
            SessionPolicy::NATIVE,
            SessionPolicy::NATIVE.hello("unit", offer()),
        );
        session.opened(Duration::ZERO);
        assert!(matches!(
            session.message(welcome_limited(100, 500, limit), Duration::ZERO),
            Some(Action::End(Disconnect::Lost(reason))) if reason.contains("frame limit")
        ));
    }
}

#[test]
fn the_server_cannot_make_a_provider_buffer_more_than_its_memory() {
    let mut session = joined(SessionPolicy::BROWSER, 100, 500);
    // The offer's memory is 256 MiB; an Assign announcing 1 GiB is refused
    // from its header, before any payload.
    let mut huge = WireTensor::from_f32("w", &[1], &[0.0], WireDType::F32);
    huge.shape = vec![1 << 28];
    huge.data = Bytes::new();
    let set = ToProvider::SetParams(rookery_proto::ParamSet {
        job_id: 1,
        step: 0,
        params: vec![huge],
    });
    assert!(matches!(
        session.frame(&frame(&set), secs(1)),
        Some(Action::End(Disconnect::Lost(reason))) if reason.contains("accepts")
    ));
}
