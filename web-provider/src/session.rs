//! The platform-free half of a browser donation: the provider URL, the Hello
//! frame, how each server frame is answered, the reconnect backoff, and the
//! GPU self-check and benchmark. Kept apart from the browser glue so the host
//! can test it natively.
// Natively only the tests call most of this; the browser glue is wasm-only.
#![cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]

use rookery_kernels::{GpuContext, GpuError, MATMUL_REL_TOLERANCE, check_matmul, sample_matrix};
use rookery_proto::stream::{self, Assembler};
use rookery_proto::{
    DEFAULT_MAX_FRAME_BYTES, EncodeError, ErrorCode, ErrorMessage, Hello, PROTOCOL_VERSION,
    PROVIDER_WS_PATH, ProviderKind, ToProvider, ToServer,
};

/// Side of the benchmark matmul: big enough to keep a GPU busy, small enough
/// that one dispatch takes milliseconds, not seconds, on a slow one.
const BENCHMARK_N: u32 = 256;
/// Time the timed benchmark run aims for, in seconds.
const BENCHMARK_BUDGET_S: f64 = 0.2;
/// Most dispatches in the timed run, whatever the GPU's speed.
const BENCHMARK_MAX_ITERATIONS: u32 = 64;
/// First and largest pause before reconnecting, in milliseconds.
pub(crate) const BACKOFF_FIRST_MS: u32 = 1_000;
pub(crate) const BACKOFF_MAX_MS: u32 = 15_000;
/// Heartbeats are never sent faster than this, whatever the server asks, so
/// a bad Welcome cannot make the tab spin.
const MIN_HEARTBEAT_MS: u32 = 100;

/// `ws(s)://host/ws/provider` for a page served as `protocol` (`http:` or
/// `https:`, as `window.location.protocol` spells it) from `host`.
///
/// A server started with `--provider-token` admits only providers that
/// present its join token; its operator shares the Donate link with
/// `?token=...`, which the tab passes on (still percent-encoded) to the
/// socket's address, where the server reads it.
pub(crate) fn provider_url(protocol: &str, host: &str, page_query: &str) -> Option<String> {
    if host.is_empty() {
        // `file:` pages and the like have no server to talk to.
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

/// The first frame of every connection.
pub(crate) fn hello_frame(
    adapter: &str,
    memory_bytes: u64,
    gflops: f64,
    max_buffer_bytes: Option<u64>,
) -> Result<Vec<u8>, EncodeError> {
    rookery_proto::encode(&ToServer::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        kind: ProviderKind::Browser,
        device: adapter.to_owned(),
        memory_bytes,
        gflops,
        display_name: "browser tab".to_owned(),
        max_buffer_bytes,
    }))
}

pub(crate) fn heartbeat_frame(seq: u64) -> Result<Vec<u8>, EncodeError> {
    rookery_proto::encode(&ToServer::Heartbeat { seq })
}

/// What the tab does about one frame from the server.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Reaction {
    /// Nothing to do (the server's heartbeats need no answer).
    Ignore,
    /// The server accepted this tab; heartbeat every `heartbeat_interval_ms`.
    Welcomed {
        provider_id: u64,
        heartbeat_interval_ms: u32,
    },
    /// Drop this connection and try again later; the text is for a person.
    Reconnect(String),
    /// Stop donating: reconnecting cannot help. The text is for a person.
    GiveUp(String),
    /// Send this frame back.
    Answer(Vec<u8>),
    /// A training message for the stage worker.
    Train(ToProvider),
}

/// Puts frames together into whole messages: a streamed message's tensors
/// arrive in payload frames after it.
#[derive(Default)]
pub(crate) struct Inbox {
    assembler: Assembler<ToProvider>,
}

impl Inbox {
    /// The message `frame` completes, if any; an error ends the connection.
    pub(crate) fn push(&mut self, frame: Vec<u8>) -> Result<Option<ToProvider>, String> {
        let incoming = stream::read_frame(&bytes::Bytes::from(frame), DEFAULT_MAX_FRAME_BYTES)
            .map_err(|error| format!("the server sent a message this tab cannot read ({error})"))?;
        self.assembler
            .push(incoming)
            .map_err(|error| format!("the server's frames do not fit together ({error})"))
    }
}

/// What the tab does about one whole message from the server.
pub(crate) fn react(message: ToProvider) -> Reaction {
    match message {
        ToProvider::Welcome {
            provider_id,
            heartbeat_interval_ms,
            ..
        } => Reaction::Welcomed {
            provider_id,
            heartbeat_interval_ms: heartbeat_interval_ms.max(MIN_HEARTBEAT_MS),
        },
        ToProvider::Heartbeat { .. } => Reaction::Ignore,
        ToProvider::Error(ErrorMessage {
            code: ErrorCode::VersionMismatch,
            message,
        }) => Reaction::GiveUp(format!(
            "This page and the server speak different protocol versions ({message}). \
             Reload the page to get the server's current version."
        )),
        ToProvider::Error(ErrorMessage { message, .. }) => {
            Reaction::Reconnect(format!("the server refused this tab: {message}"))
        }
        ToProvider::Probe { seq, .. } => answer(&ToServer::ProbeAck { seq }),
        message @ (ToProvider::Assign(_)
        | ToProvider::Forward(_)
        | ToProvider::Backward(_)
        | ToProvider::UploadParams { .. }
        | ToProvider::SetParams(_)
        | ToProvider::Release { .. }) => Reaction::Train(message),
    }
}

/// The frames of a reply: large activations and gradients go as payload
/// frames after their message, as native providers send them.
pub(crate) fn reply_frames(message: &ToServer) -> Result<Vec<bytes::Bytes>, String> {
    stream::encode_streamed(message).map_err(|error| format!("cannot encode a reply: {error}"))
}

fn answer(message: &ToServer) -> Reaction {
    match rookery_proto::encode(message) {
        Ok(frame) => Reaction::Answer(frame),
        Err(error) => Reaction::Reconnect(format!("cannot encode a reply: {error}")),
    }
}

/// Pauses between reconnection attempts: 1 s, doubling up to 15 s, back to
/// 1 s once a server has welcomed the tab again.
#[derive(Debug)]
pub(crate) struct Backoff {
    next_ms: u32,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        Self {
            next_ms: BACKOFF_FIRST_MS,
        }
    }

    /// The pause before the next attempt.
    pub(crate) fn next_delay_ms(&mut self) -> u32 {
        let delay = self.next_ms;
        self.next_ms = (self.next_ms.saturating_mul(2)).min(BACKOFF_MAX_MS);
        delay
    }

    pub(crate) fn reset(&mut self) {
        self.next_ms = BACKOFF_FIRST_MS;
    }
}

/// Runs the kernel on a small shape that is no multiple of any tile and
/// compares it with the CPU reference: a GPU or driver that computes wrong
/// answers must not donate them.
pub(crate) async fn self_check(gpu: &GpuContext) -> Result<(), String> {
    let (m, k, n) = (37, 29, 19);
    let a = sample_matrix(m * k, 7);
    let b = sample_matrix(k * n, 8);
    let c = gpu
        .matmul(&a, &b, m, k, n)
        .await
        .map_err(|e| e.to_string())?;
    check_matmul(&a, &b, m, k, n, &c, MATMUL_REL_TOLERANCE).map_err(|e| e.to_string())
}

/// GFLOP/s of this GPU in at most a few hundred milliseconds: one dispatch
/// to gauge its speed, then as many as fit in [`BENCHMARK_BUDGET_S`].
pub(crate) async fn measure_gflops(gpu: &GpuContext) -> Result<f64, GpuError> {
    let first = match gpu.benchmark_matmul_gflops(BENCHMARK_N, 1).await {
        Ok(gflops) => gflops,
        // Too fast for the clock to see one dispatch: time the most we allow.
        Err(GpuError::ClockTooCoarse { .. }) => {
            return gpu
                .benchmark_matmul_gflops(BENCHMARK_N, BENCHMARK_MAX_ITERATIONS)
                .await;
        }
        Err(error) => return Err(error),
    };
    let flops = rookery_kernels::matmul_flops(
        BENCHMARK_N as usize,
        BENCHMARK_N as usize,
        BENCHMARK_N as usize,
    );
    let seconds_each = flops / (first * 1e9);
    if seconds_each * 2.0 > BENCHMARK_BUDGET_S {
        // A slow GPU: one dispatch already is a fair measurement.
        return Ok(first);
    }
    // Truncation is fine: the ratio is positive and clamped below.
    let iterations =
        ((BENCHMARK_BUDGET_S / seconds_each) as u32).clamp(2, BENCHMARK_MAX_ITERATIONS);
    gpu.benchmark_matmul_gflops(BENCHMARK_N, iterations).await
}

/// GFLOP/s of the CPU reference matmul, timed with `now_ms` (the browser's
/// clock): what a tab without WebGPU offers.
pub(crate) fn measure_cpu_gflops(now_ms: impl Fn() -> f64) -> f64 {
    const N: usize = 96;
    let a = sample_matrix(N * N, 1);
    let b = sample_matrix(N * N, 2);
    let flops = rookery_kernels::matmul_flops(N, N, N);
    let started = now_ms();
    let mut runs = 0u32;
    // At least 50 ms, so a coarse clock still measures something.
    while runs < 2 || now_ms() - started < 50.0 {
        std::hint::black_box(rookery_kernels::matmul_reference(&a, &b, N, N, N));
        runs += 1;
    }
    let seconds = ((now_ms() - started) / 1e3).max(1e-6);
    (flops * f64::from(runs) / seconds / 1e9).max(1e-3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_url_follows_the_page_scheme() {
        assert_eq!(
            provider_url("http:", "localhost:8080", "").as_deref(),
            Some("ws://localhost:8080/ws/provider")
        );
        assert_eq!(
            provider_url("https:", "rookery.example", "").as_deref(),
            Some("wss://rookery.example/ws/provider")
        );
        assert_eq!(provider_url("file:", "", ""), None);
        assert_eq!(provider_url("ftp:", "example.org", ""), None);
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
                provider_url("http:", "h:1", query).as_deref(),
                Some(url),
                "{query}"
            );
        }
    }

    #[test]
    fn hello_is_a_browser_hello_of_the_current_version() {
        let frame = hello_frame("SwiftShader (webgpu)", 1 << 28, 12.5, Some(1 << 27)).unwrap();
        assert_eq!(
            rookery_proto::peek_hello_version(&frame),
            Some(PROTOCOL_VERSION)
        );
        let ToServer::Hello(hello) =
            rookery_proto::decode::<ToServer>(&frame, DEFAULT_MAX_FRAME_BYTES).unwrap()
        else {
            panic!("not a Hello");
        };
        assert_eq!(hello.kind, ProviderKind::Browser);
        assert_eq!(hello.device, "SwiftShader (webgpu)");
        assert_eq!(hello.memory_bytes, 1 << 28);
        assert_eq!(hello.gflops, 12.5);
        assert_eq!(hello.max_buffer_bytes, Some(1 << 27));
        assert_eq!(
            rookery_proto::decode::<ToServer>(&heartbeat_frame(9).unwrap(), 64).unwrap(),
            ToServer::Heartbeat { seq: 9 }
        );
    }

    fn frame(message: &ToProvider) -> Vec<u8> {
        rookery_proto::encode(message).unwrap()
    }

    #[test]
    fn reactions_to_server_messages() {
        assert_eq!(
            react(ToProvider::Welcome {
                provider_id: 4,
                heartbeat_interval_ms: 2_000,
                heartbeat_timeout_ms: 10_000,
            }),
            Reaction::Welcomed {
                provider_id: 4,
                heartbeat_interval_ms: 2_000
            }
        );
        // A zero interval would make the heartbeat loop spin.
        assert_eq!(
            react(ToProvider::Welcome {
                provider_id: 4,
                heartbeat_interval_ms: 0,
                heartbeat_timeout_ms: 0,
            }),
            Reaction::Welcomed {
                provider_id: 4,
                heartbeat_interval_ms: MIN_HEARTBEAT_MS
            }
        );
        assert_eq!(react(ToProvider::Heartbeat { seq: 1 }), Reaction::Ignore);
        // A link probe is answered at once, so the server can time the link.
        let probe = ToProvider::Probe {
            seq: 3,
            padding: vec![0; 64].into(),
        };
        assert_eq!(
            react(probe),
            Reaction::Answer(rookery_proto::encode(&ToServer::ProbeAck { seq: 3 }).unwrap())
        );
        assert!(matches!(
            react(ToProvider::Error(ErrorMessage {
                code: ErrorCode::VersionMismatch,
                message: "server speaks 2".into(),
            })),
            Reaction::GiveUp(text) if text.contains("server speaks 2")
        ));
        assert!(matches!(
            react(ToProvider::Error(ErrorMessage {
                code: ErrorCode::HeartbeatTimeout,
                message: "too quiet".into(),
            })),
            Reaction::Reconnect(text) if text.contains("too quiet")
        ));
        // Training goes to the stage worker.
        let upload = ToProvider::UploadParams { job_id: 4, step: 1 };
        assert_eq!(react(upload.clone()), Reaction::Train(upload));
    }

    #[test]
    fn the_inbox_puts_streamed_tensors_back_into_their_message_and_refuses_garbage() {
        use rookery_proto::{Backward, WireDType, WireTensor};
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
        let frames = stream::encode_streamed(&backward).unwrap();
        assert!(
            frames.len() > 1,
            "160 KB of gradients travel as payload frames"
        );
        let mut inbox = Inbox::default();
        let mut whole = None;
        for f in frames {
            whole = inbox.push(f.to_vec()).unwrap();
        }
        assert_eq!(whole, Some(backward));
        assert!(inbox.push(vec![0xff, 0xff]).is_err());
        assert!(Inbox::default().push(Vec::new()).is_err());
        assert_eq!(
            Inbox::default()
                .push(frame(&ToProvider::Heartbeat { seq: 2 }))
                .unwrap(),
            Some(ToProvider::Heartbeat { seq: 2 })
        );
        // Replies stream the same way.
        let reply = ToServer::Gradients(rookery_proto::Gradients {
            job_id: 1,
            step: 2,
            micro: 0,
            grads: vec![WireTensor::from_f32(
                "g",
                &[40_000],
                &values,
                WireDType::F32,
            )],
            compute_ms: 1.0,
        });
        assert!(reply_frames(&reply).unwrap().len() > 1);
    }

    #[test]
    fn the_cpu_fallback_measures_a_positive_speed() {
        let start = std::time::Instant::now();
        let gflops = measure_cpu_gflops(|| start.elapsed().as_secs_f64() * 1e3);
        assert!(gflops > 0.0 && gflops.is_finite(), "{gflops}");
    }

    #[test]
    fn backoff_doubles_to_fifteen_seconds_and_resets() {
        let mut backoff = Backoff::new();
        let delays: Vec<u32> = (0..7).map(|_| backoff.next_delay_ms()).collect();
        assert_eq!(delays, [1_000, 2_000, 4_000, 8_000, 15_000, 15_000, 15_000]);
        backoff.reset();
        assert_eq!(backoff.next_delay_ms(), 1_000);
    }
}
