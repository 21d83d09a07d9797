//! Rookery's wire types: every byte that crosses a socket or an HTTP body is
//! defined here and nowhere else.
//!
//! Two families live side by side:
//! - the provider protocol ([`ToServer`], [`ToProvider`]): postcard-encoded
//!   binary WebSocket frames, versioned by [`PROTOCOL_VERSION`] and bounded by
//!   a frame size limit that every decoder enforces ([`decode`]);
//! - the REST/JSON DTOs ([`api`]) shared by the server and the dashboard.
//!
//! This crate compiles to `wasm32-unknown-unknown` and knows nothing of tokio,
//! axum, tch or wgpu.

pub mod api;
pub mod stream;
pub mod tensor;
pub mod train;

pub use bytes::Bytes;
use serde::{Deserialize, Serialize, de::DeserializeOwned};

pub use tensor::{INT8_BLOCK, TensorError, WireDType, WireTensor};
pub use train::{
    Activations, Assignment, Backward, Forward, GradNorm, GradScale, Gradients, LeafLoss,
    OptimizerState, ParamOptimState, ParamSet, Phase, PipelineSchedule, StepDone,
};

/// Bumped on every incompatible change to [`ToServer`] or [`ToProvider`].
///
/// Invariant that keeps version negotiation possible across versions:
/// [`ToServer::Hello`] stays variant 0 and [`Hello::protocol_version`] stays its
/// first field, so any server can read the version of any client's first frame.
pub const PROTOCOL_VERSION: u32 = 13;

/// Default largest frame either side of a provider connection sends or
/// accepts. The server announces its own limit in [`ToProvider::Welcome`];
/// every message with tensors streams in frames within it
/// ([`stream::encode_streamed`]), so no limit bounds a stage's size.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;
/// The least frame limit a server may set: the link probe's 1 MiB frame and
/// a streamed message's header must fit.
pub const MIN_MAX_FRAME_BYTES: usize = 2 * 1024 * 1024;
/// The greatest frame limit a server may set; a native provider's transport
/// accepts frames this large, so it reads whatever a server may send.
pub const MAX_MAX_FRAME_BYTES: usize = 256 * 1024 * 1024;

/// Checks a frame limit (a server's setting, or what a `Welcome` announced)
/// against [`MIN_MAX_FRAME_BYTES`] and [`MAX_MAX_FRAME_BYTES`].
pub fn check_frame_limit(bytes: u64) -> Result<usize, String> {
    let range = MIN_MAX_FRAME_BYTES as u64..=MAX_MAX_FRAME_BYTES as u64;
    if range.contains(&bytes) {
        Ok(bytes as usize)
    } else {
        Err(format!(
            "a frame limit of {bytes} bytes is outside {MIN_MAX_FRAME_BYTES}..={MAX_MAX_FRAME_BYTES}"
        ))
    }
}

/// The WebSocket path providers connect to.
pub const PROVIDER_WS_PATH: &str = "/ws/provider";

/// What kind of machine a provider is (the planner weighs browsers' usually
/// smaller memory and speed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    /// A `rookery-provider` process (libtorch on CPU or CUDA).
    // Plans stored before the planner shared this type spelled it capitalised.
    #[serde(alias = "Native")]
    Native,
    /// A browser tab donating its GPU through WebGPU.
    #[serde(alias = "Browser")]
    Browser,
}

impl ProviderKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Native => "native",
            ProviderKind::Browser => "browser",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "native" => Some(ProviderKind::Native),
            "browser" => Some(ProviderKind::Browser),
            _ => None,
        }
    }
}

/// A provider's self-description, measured by the provider itself when it
/// starts, so nobody writes a node configuration file by hand.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// Must stay the first field: see [`PROTOCOL_VERSION`].
    pub protocol_version: u32,
    pub kind: ProviderKind,
    /// Human-readable device, as reported by the backend that measured it
    /// (libtorch for native providers, the WebGPU adapter for browsers).
    pub device: String,
    /// Memory the provider can devote to stages, in bytes.
    pub memory_bytes: u64,
    /// Measured single-precision matmul throughput.
    pub gflops: f64,
    /// A name the provider chose for itself; shown on the dashboard only.
    pub display_name: String,
    /// The largest single buffer the provider's GPU can bind (WebGPU's
    /// `maxStorageBufferBindingSize`, capped by `maxBufferSize`), for
    /// providers that run our own kernels; the planner keeps every tensor of
    /// their stages within it. `None` for libtorch providers.
    pub max_buffer_bytes: Option<u64>,
    /// The secret the server issued this provider in an earlier
    /// [`ToProvider::Welcome`]: faults, bans and credit follow it, not the
    /// name. `None` on a provider's first visit.
    pub credential: Option<String>,
    /// A Requester's API token, vouching for this provider: the server then
    /// trusts it to verify that Requester's jobs (spot checks), and the
    /// operator's (the first Requester's) vouches for every job. Native
    /// providers only; `None` for a stranger.
    pub requester_token: Option<String>,
    /// How the donor behind this provider wants to appear on the public
    /// leaderboard; `None` keeps it anonymous (and keeps an earlier card).
    pub donor: Option<DonorCard>,
    /// The share of the time its donor lets the GPU compute (a cap the
    /// provider keeps by idling after each piece of work), from
    /// [`MIN_DUTY_CYCLE`] to 1 (no cap): the planner counts the provider at
    /// `gflops * duty_cycle`. [`ToServer::DutyCycle`] changes it later.
    pub duty_cycle: f64,
}

/// The least [`Hello::duty_cycle`] a provider may keep: a tenth of the time.
pub const MIN_DUTY_CYCLE: f64 = 0.1;

/// Whether `duty_cycle` is one a provider may announce: finite, from
/// [`MIN_DUTY_CYCLE`] to 1.
pub fn valid_duty_cycle(duty_cycle: f64) -> bool {
    (MIN_DUTY_CYCLE..=1.0).contains(&duty_cycle)
}

/// A donor's public name and team, as the leaderboard shows them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DonorCard {
    /// 1 to [`MAX_DONOR_CHARS`] characters.
    pub name: String,
    /// At most [`MAX_DONOR_CHARS`] characters.
    pub team: Option<String>,
}

/// The longest donor name or team a `Hello` may carry, in characters.
pub const MAX_DONOR_CHARS: usize = 40;

/// The longest credential a `Hello` may carry (the server issues 64 hex
/// digits).
pub const MAX_CREDENTIAL_CHARS: usize = 128;

/// Why a peer is being told off. The code is for programs, the text for people.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorMessage {
    pub code: ErrorCode,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// The peer speaks another protocol version; reconnecting will not help.
    VersionMismatch,
    /// The frame could not be decoded or broke a rule of the protocol.
    BadFrame,
    /// The frame was larger than the receiver's limit.
    FrameTooLarge,
    /// A message arrived out of order (for example anything before `Hello`).
    UnexpectedMessage,
    /// The peer went quiet for longer than the heartbeat timeout.
    HeartbeatTimeout,
    /// The receiver failed for its own reasons; the peer may retry later.
    Internal,
    /// The peer asked for more than the receiver allows it now (new
    /// identities from one address); it may retry later.
    RateLimited,
    /// The Requester token the provider vouched with is not one the server
    /// accepts (mistyped or revoked); reconnecting with it will not help.
    Unauthorized,
}

/// Frames a provider sends to the server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ToServer {
    /// First frame of every connection. Must stay variant 0.
    Hello(Hello),
    /// Liveness; the server answers with [`ToProvider::Heartbeat`] of the same `seq`.
    Heartbeat {
        seq: u64,
    },
    /// The provider reports a problem it will not recover from on this connection.
    Error(ErrorMessage),
    /// The stage of [`Assignment`] is built and waits for data.
    Ready {
        job_id: u64,
    },
    Activations(Activations),
    Gradients(Gradients),
    LeafLoss(LeafLoss),
    StepDone(StepDone),
    /// Answer to [`ToProvider::UploadParams`].
    Params(ParamSet),
    /// The provider cannot go on with the job (bad assignment, out of memory,
    /// a libtorch error); the server reassigns or fails the job.
    JobFailed {
        job_id: u64,
        message: String,
    },
    /// Answer to [`ToProvider::Probe`], sent as soon as the probe is read.
    ProbeAck {
        seq: u32,
    },
    /// Sent just before [`ToServer::Params`] in answer to
    /// [`ToProvider::UploadParams`].
    OptimizerState(OptimizerState),
    /// A stage's share of the global gradient norm (jobs that clip).
    GradNorm(GradNorm),
    /// The donor changed the share of the time the GPU may compute (see
    /// [`Hello::duty_cycle`]); the planner counts it from now on.
    DutyCycle {
        duty_cycle: f64,
    },
}

impl ToServer {
    /// The message's kind, for logs and errors (its `Debug` form can hold
    /// whole tensors).
    pub fn kind(&self) -> &'static str {
        match self {
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
            ToServer::GradNorm(_) => "GradNorm",
            ToServer::DutyCycle { .. } => "DutyCycle",
        }
    }
}

/// Frames the server sends to a provider.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ToProvider {
    /// Answer to an accepted [`Hello`].
    Welcome {
        provider_id: u64,
        /// How often the provider must send a heartbeat.
        heartbeat_interval_ms: u32,
        /// After this long without any frame the server drops the provider.
        heartbeat_timeout_ms: u32,
        /// The largest frame the server accepts and sends: the provider
        /// streams within it (checked by [`check_frame_limit`]).
        max_frame_bytes: u64,
        /// The provider's identity on this server: what its faults, bans
        /// and credit attach to (the connection's `provider_id` changes on
        /// every reconnection, the identity does not).
        identity: u64,
        /// A credential the server issued for `identity` now (the `Hello`
        /// had none, or one the server does not know): the provider keeps
        /// it and sends it in every later `Hello`. `None` when the `Hello`'s
        /// credential was accepted.
        credential: Option<String>,
    },
    Heartbeat {
        seq: u64,
    },
    /// The server rejects something; it closes the connection right after.
    Error(ErrorMessage),
    /// Build a stage; the provider answers [`ToServer::Ready`].
    Assign(Box<Assignment>),
    Forward(Forward),
    Backward(Backward),
    /// Send the stage's current parameters as [`ToServer::Params`].
    UploadParams {
        job_id: u64,
        step: u64,
    },
    /// Replace the stage's parameters (the cross-cluster average); optimizer
    /// state stays.
    SetParams(ParamSet),
    /// The job is over for this provider (finished, cancelled or reassigned):
    /// drop the stage.
    Release {
        job_id: u64,
    },
    /// Measures the link: the provider answers [`ToServer::ProbeAck`] at
    /// once, and the server times an empty probe and a large one to estimate
    /// the bandwidth the planner uses.
    Probe {
        seq: u32,
        #[serde(with = "crate::tensor::frame_bytes")]
        padding: Bytes,
    },
    /// Scale the step's gradients and step (answer to every stage's
    /// [`ToServer::GradNorm`]).
    GradScale(GradScale),
    /// The work this provider's identity is credited with so far: GFLOP of
    /// accepted training work, less any a spot check or ban withdrew. Sent
    /// as it grows.
    Credit {
        gflop: f64,
    },
    /// Replace the stage's optimizer state (the clusters' average, for jobs
    /// with `average_optimizer`); sent just before the sync's
    /// [`ToProvider::SetParams`].
    SetOptimizerState(OptimizerState),
}

/// Everything that can go wrong turning bytes into a message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("frame of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge { len: usize, limit: usize },
    #[error("frame is empty")]
    Empty,
    #[error("frame is not a valid message: {0}")]
    Malformed(String),
    #[error("frame has {0} unexpected trailing bytes after the message")]
    TrailingBytes(usize),
}

impl DecodeError {
    /// The protocol error code a receiver reports for this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            DecodeError::TooLarge { .. } => ErrorCode::FrameTooLarge,
            _ => ErrorCode::BadFrame,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("message does not serialize: {0}")]
pub struct EncodeError(pub(crate) String);

/// Encodes one frame. Messages built from valid Rust values always encode;
/// the error exists because postcard's API is fallible.
pub fn encode<T: Serialize>(message: &T) -> Result<Vec<u8>, EncodeError> {
    // Sized first (a walk that copies nothing), so a frame of megabytes of
    // tensors is written once into its final buffer instead of regrown.
    let len =
        postcard::experimental::serialized_size(message).map_err(|e| EncodeError(e.to_string()))?;
    postcard::to_extend(message, Vec::with_capacity(len)).map_err(|e| EncodeError(e.to_string()))
}

/// Decodes one frame, refusing frames over `limit` bytes before looking at
/// them and frames with bytes left over after the message.
pub fn decode<T: DeserializeOwned>(frame: &[u8], limit: usize) -> Result<T, DecodeError> {
    if frame.len() > limit {
        return Err(DecodeError::TooLarge {
            len: frame.len(),
            limit,
        });
    }
    if frame.is_empty() {
        return Err(DecodeError::Empty);
    }
    let (message, rest) =
        postcard::take_from_bytes(frame).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes(rest.len()));
    }
    Ok(message)
}

/// [`decode`] for a received frame: tensors decoded from it are views into
/// `frame` rather than copies, so relaying them costs no copy.
pub fn decode_frame<T: DeserializeOwned>(frame: &Bytes, limit: usize) -> Result<T, DecodeError> {
    tensor::sharing(frame, || decode(frame, limit))
}

/// Reads only the protocol version of a `Hello` frame, whatever the rest of
/// it looks like, so a server can name the mismatch instead of failing to
/// decode a newer client's message.
pub fn peek_hello_version(frame: &[u8]) -> Option<u32> {
    #[derive(Deserialize)]
    enum VersionOnly {
        Hello(u32),
    }
    match postcard::take_from_bytes::<VersionOnly>(frame) {
        Ok((VersionOnly::Hello(version), _)) => Some(version),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hello() -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            kind: ProviderKind::Native,
            device: "libtorch 2.13.0 cpu (2 threads)".into(),
            memory_bytes: 24 << 30,
            gflops: 41.5,
            display_name: "alice-laptop".into(),
            max_buffer_bytes: None,
            credential: None,
            requester_token: Some("t0k3n".into()),
            donor: Some(DonorCard {
                name: "alice".into(),
                team: Some("ravens".into()),
            }),
            duty_cycle: 0.5,
        }
    }

    fn every_to_server() -> Vec<ToServer> {
        vec![
            ToServer::Hello(hello()),
            ToServer::Hello(Hello {
                kind: ProviderKind::Browser,
                ..hello()
            }),
            ToServer::Heartbeat { seq: u64::MAX },
            ToServer::Error(ErrorMessage {
                code: ErrorCode::Internal,
                message: "out of memory".into(),
            }),
            ToServer::Ready { job_id: 1 },
            ToServer::Activations(Activations {
                job_id: 1,
                phase: Phase::Eval { epoch: 2 },
                micro: 3,
                outputs: vec![tensor()],
                compute_ms: 1.5,
            }),
            ToServer::Gradients(Gradients {
                job_id: 1,
                step: 9,
                micro: 0,
                grads: vec![tensor(), tensor()],
                compute_ms: 0.0,
            }),
            ToServer::LeafLoss(LeafLoss {
                job_id: 1,
                phase: Phase::Train { step: 4 },
                micro: 1,
                loss_sum: 2.5,
                correct: 3,
                samples: 4,
            }),
            ToServer::StepDone(StepDone {
                job_id: 1,
                step: 4,
                compute_ms: 12.0,
                peak_held: 1,
            }),
            ToServer::Params(ParamSet {
                job_id: 1,
                step: 5,
                params: vec![tensor()],
            }),
            ToServer::JobFailed {
                job_id: 1,
                message: "no memory".into(),
            },
            ToServer::ProbeAck { seq: 1 },
            ToServer::OptimizerState(OptimizerState {
                job_id: 1,
                step: 5,
                params: vec![ParamOptimState {
                    name: "w".into(),
                    steps: 5,
                    slots: vec![tensor()],
                }],
            }),
            ToServer::GradNorm(GradNorm {
                job_id: 1,
                step: 5,
                sum_of_squares: 2.25,
            }),
            ToServer::DutyCycle { duty_cycle: 0.25 },
        ]
    }

    fn tensor() -> WireTensor {
        WireTensor::from_f32(
            "fc.weight",
            &[2, 3],
            &[1., 2., 3., 4., 5., 6.],
            WireDType::Bf16,
        )
    }

    fn every_to_provider() -> Vec<ToProvider> {
        let mut messages = vec![
            ToProvider::Welcome {
                provider_id: 7,
                heartbeat_interval_ms: 1000,
                heartbeat_timeout_ms: 5000,
                max_frame_bytes: DEFAULT_MAX_FRAME_BYTES as u64,
                identity: 1,
                credential: None,
            },
            ToProvider::Heartbeat { seq: 3 },
            ToProvider::Assign(Box::new(Assignment {
                job_id: 1,
                cluster: 1,
                stage: 2,
                stages: 3,
                graph_json: "{}".into(),
                first: 4,
                end: 7,
                outputs: vec!["fc2".into()],
                params: vec![tensor()],
                optimizer: rookery_model::OptimizerConfig::Adam {
                    lr: 1e-3,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.0,
                    amsgrad: false,
                },
                loss: rookery_model::Loss::cross_entropy(),
                batch_size: 64,
                micro_batches: 4,
                wire_dtype: WireDType::F16,
                seed: 42,
                start_step: 0,
                optimizer_state: vec![ParamOptimState {
                    name: "w".into(),
                    steps: 3,
                    slots: vec![tensor()],
                }],
                lr_schedule: rookery_model::LrSchedule::Cosine {
                    warmup_steps: 10,
                    total_steps: Some(100),
                    min_lr: 1e-5,
                },
                clip_grad_norm: Some(1.0),
                public_name: Some("Handwritten digits for the Lab".into()),
                schedule: crate::PipelineSchedule::Gpipe,
                sync_int8: false,
                precision: Default::default(),
            })),
            ToProvider::Forward(Forward {
                job_id: 1,
                phase: Phase::Train { step: 0 },
                micro: 2,
                step_samples: 64,
                step_targets: 64,
                inputs: vec![tensor()],
                labels: Some(WireTensor::from_i64("labels", &[2], &[1, 7])),
            }),
            ToProvider::Backward(Backward {
                job_id: 1,
                step: 0,
                micro: 2,
                grads: vec![tensor()],
            }),
            ToProvider::UploadParams { job_id: 1, step: 3 },
            ToProvider::SetParams(ParamSet {
                job_id: 1,
                step: 3,
                params: vec![],
            }),
            ToProvider::Release { job_id: 1 },
            ToProvider::Probe {
                seq: 1,
                padding: Bytes::from(vec![0; 100]),
            },
            ToProvider::GradScale(GradScale {
                job_id: 1,
                step: 5,
                scale: 0.5,
            }),
            ToProvider::Credit { gflop: 1234.5 },
        ];
        for code in [
            ErrorCode::VersionMismatch,
            ErrorCode::BadFrame,
            ErrorCode::FrameTooLarge,
            ErrorCode::UnexpectedMessage,
            ErrorCode::HeartbeatTimeout,
            ErrorCode::Internal,
            ErrorCode::RateLimited,
            ErrorCode::Unauthorized,
        ] {
            messages.push(ToProvider::Error(ErrorMessage {
                code,
                message: format!("{code:?}"),
            }));
        }
        messages
    }

    #[test]
    fn every_message_round_trips() {
        for message in every_to_server() {
            let frame = encode(&message).unwrap();
            assert_eq!(decode::<ToServer>(&frame, 1 << 16), Ok(message));
        }
        for message in every_to_provider() {
            let frame = encode(&message).unwrap();
            assert_eq!(decode::<ToProvider>(&frame, 1 << 16), Ok(message));
        }
    }

    #[test]
    fn decoded_tensors_share_the_frame_and_plain_decoding_copies() {
        let message = ToServer::Activations(Activations {
            job_id: 1,
            phase: Phase::Train { step: 0 },
            micro: 0,
            outputs: vec![WireTensor::from_f32(
                "h",
                &[2, 3],
                &[1.0; 6],
                WireDType::F32,
            )],
            compute_ms: 1.0,
        });
        let frame = Bytes::from(encode(&message).unwrap());
        let within = |data: &[u8]| {
            let range = frame.as_ptr_range();
            range.contains(&data.as_ptr())
        };
        let shared: ToServer = decode_frame(&frame, 1 << 16).unwrap();
        let copied: ToServer = decode(&frame, 1 << 16).unwrap();
        assert_eq!(shared, message);
        assert_eq!(copied, message);
        let (ToServer::Activations(shared), ToServer::Activations(copied)) = (shared, copied)
        else {
            unreachable!()
        };
        assert!(within(&shared.outputs[0].data));
        assert!(!within(&copied.outputs[0].data));
    }

    #[test]
    fn frame_over_the_limit_is_refused_before_decoding() {
        let frame = encode(&ToServer::Hello(hello())).unwrap();
        let limit = frame.len() - 1;
        assert_eq!(
            decode::<ToServer>(&frame, limit),
            Err(DecodeError::TooLarge {
                len: frame.len(),
                limit
            })
        );
    }

    #[test]
    fn every_truncation_of_every_message_is_an_error() {
        for message in every_to_server() {
            let frame = encode(&message).unwrap();
            for cut in 0..frame.len() {
                assert!(
                    decode::<ToServer>(&frame[..cut], 1 << 16).is_err(),
                    "{message:?} cut at {cut} decoded"
                );
            }
        }
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        let mut frame = encode(&ToServer::Heartbeat { seq: 1 }).unwrap();
        frame.push(0);
        assert_eq!(
            decode::<ToServer>(&frame, 1 << 16),
            Err(DecodeError::TrailingBytes(1))
        );
    }

    #[test]
    fn a_duty_cycle_is_a_tenth_to_all_of_the_time() {
        for ok in [MIN_DUTY_CYCLE, 0.5, 1.0] {
            assert!(valid_duty_cycle(ok), "{ok}");
        }
        for bad in [0.0, 0.09, 1.01, -0.5, f64::NAN, f64::INFINITY] {
            assert!(!valid_duty_cycle(bad), "{bad}");
        }
    }

    #[test]
    fn version_is_readable_from_a_hello_of_any_shape() {
        let frame = encode(&ToServer::Hello(Hello {
            protocol_version: 99,
            ..hello()
        }))
        .unwrap();
        assert_eq!(peek_hello_version(&frame), Some(99));
        // A future Hello with different fields after the version still peeks.
        assert_eq!(peek_hello_version(&[0, 42, 0xff, 0xff]), Some(42));
        assert_eq!(
            peek_hello_version(&encode(&ToServer::Heartbeat { seq: 1 }).unwrap()),
            None
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode::<ToServer>(&bytes, 256);
            let _ = decode::<ToProvider>(&bytes, 256);
            let _ = peek_hello_version(&bytes);
        }

        #[test]
        fn corrupted_frames_never_panic(index in 0usize..64, byte in any::<u8>()) {
            for message in every_to_server() {
                let mut frame = encode(&message).unwrap();
                let at = index % frame.len();
                frame[at] = byte;
                let _ = decode::<ToServer>(&frame, 1 << 16);
            }
        }

        #[test]
        fn hello_round_trips_for_any_values(
            version in any::<u32>(), memory in any::<u64>(), gflops in any::<f64>().prop_filter("nan", |g| !g.is_nan()),
            device in ".{0,40}", name in ".{0,40}", browser in any::<bool>()
        ) {
            let message = ToServer::Hello(Hello {
                protocol_version: version,
                kind: if browser { ProviderKind::Browser } else { ProviderKind::Native },
                device, memory_bytes: memory, gflops, display_name: name,
                max_buffer_bytes: None,
                credential: None,
                requester_token: None,
                donor: None,
                duty_cycle: 1.0,
            });
            let frame = encode(&message).unwrap();
            prop_assert_eq!(decode::<ToServer>(&frame, 1 << 16), Ok(message));
        }
    }
}
