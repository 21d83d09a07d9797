//! The parsers that take bytes from strangers, each with valid seeds and the
//! work the server (or a provider) does with what parses: the protocol
//! decoder both ways (plus the tensor checks and, for `Assign`, the graph),
//! streamed messages reassembled from their payload frames as a provider does,
//! the ONNX importer (plus shape analysis), layer specs and job files in
//! TOML and JSON (as the upload endpoint reads them), and dataset files in
//! every format.

use std::io;
use std::path::{Path, PathBuf};

use rookery_job::{DataFormat, DataRef, JobSpec, TokenWindows};
use rookery_model::{Graph, ModelSpec};
use rookery_proto::Bytes;
use rookery_proto::stream::{Assembler, Incoming, Streamed, encode_streamed, read_frame};
use rookery_proto::tensor::{WireDType, WireTensor};
use rookery_proto::{
    Activations, Assignment, Backward, DEFAULT_MAX_FRAME_BYTES, ErrorCode, ErrorMessage, Forward,
    GradNorm, GradScale, Gradients, Hello, LeafLoss, OptimizerState, PROTOCOL_VERSION,
    ParamOptimState, ParamSet, Phase, ProviderKind, StepDone, ToProvider, ToServer,
};

/// What a target does with one input: whether it parsed (a panic is neither).
pub type TargetFn = Box<dyn Fn(usize, &[u8]) -> bool + Send + Sync>;

pub struct Target {
    pub name: &'static str,
    pub seeds: Vec<Vec<u8>>,
    /// Text formats also get token and line mutations.
    pub text: bool,
    /// Runs one input; the `usize` is the seed it came from (for per-seed context).
    pub check: TargetFn,
}

/// Every target, with the folder the job-file targets resolve names in.
pub struct Targets {
    pub list: Vec<Target>,
    _upload: tempfile::TempDir,
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn read(path: &str) -> io::Result<Vec<u8>> {
    std::fs::read(repo(path))
}

pub fn all() -> io::Result<Targets> {
    // Dataset inputs go through files: a memory-backed folder, where there is
    // one, keeps that from being a disk benchmark.
    let shm = Path::new("/dev/shm");
    let upload = if shm.is_dir() {
        tempfile::tempdir_in(shm).or_else(|_| tempfile::tempdir())?
    } else {
        tempfile::tempdir()?
    };
    let list = vec![
        protocol_to_server(),
        protocol_to_provider()?,
        protocol_stream(),
        onnx()?,
        layer_spec()?,
        job_file("job file (TOML)", JOB_TOML, upload.path())?,
        job_file("job file (JSON)", JOB_JSON, upload.path())?,
        datasets(upload.path())?,
        upgrade_headers(),
    ];
    Ok(Targets {
        list,
        _upload: upload,
    })
}

fn tensor(name: &str, shape: &[usize], dtype: WireDType) -> WireTensor {
    let values: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|i| i as f32 * 0.25 - 1.0)
        .collect();
    WireTensor::from_f32(name, shape, &values, dtype)
}

/// What a receiver does with every tensor it accepts.
fn use_tensors<'a>(tensors: impl IntoIterator<Item = &'a WireTensor>) {
    for t in tensors {
        let _ = t.check();
        let _ = t.to_f32();
        let _ = t.to_i64();
        let _ = t.numel();
        let _ = t.shape_usize();
    }
}

fn encode<T: serde::Serialize>(message: &T) -> Vec<u8> {
    // Messages built here from valid values always encode.
    rookery_proto::encode(message).unwrap_or_default()
}

fn protocol_to_server() -> Target {
    let messages = [
        ToServer::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            kind: ProviderKind::Native,
            device: "libtorch 2.13.0 cpu".into(),
            memory_bytes: 8 << 30,
            gflops: 55.5,
            display_name: "fuzz".into(),
            max_buffer_bytes: None,
            credential: Some("0123456789abcdef".into()),
            requester_token: Some("fedcba9876543210".into()),
            donor: Some(rookery_proto::DonorCard {
                name: "fuzz".into(),
                team: None,
            }),
            duty_cycle: 0.5,
        }),
        ToServer::Heartbeat { seq: 300 },
        ToServer::Error(ErrorMessage {
            code: ErrorCode::BadFrame,
            message: "bad".into(),
        }),
        ToServer::Ready { job_id: 1 },
        ToServer::Activations(Activations {
            job_id: 1,
            phase: Phase::Train { step: 3 },
            micro: 1,
            outputs: vec![
                tensor("x", &[2, 3], WireDType::F32),
                tensor("x8", &[2, 70], WireDType::I8Block),
            ],
            compute_ms: 1.5,
        }),
        ToServer::Gradients(Gradients {
            job_id: 1,
            step: 3,
            micro: 0,
            grads: vec![tensor("g", &[4], WireDType::Bf16)],
            compute_ms: 0.5,
        }),
        ToServer::LeafLoss(LeafLoss {
            job_id: 1,
            phase: Phase::Eval { epoch: 0 },
            micro: 2,
            loss_sum: 2.3,
            correct: 7,
            samples: 16,
        }),
        ToServer::StepDone(StepDone {
            job_id: 1,
            step: 9,
            compute_ms: 12.0,
            peak_held: 1,
        }),
        ToServer::Params(ParamSet {
            job_id: 1,
            step: 10,
            params: vec![
                tensor("0.weight", &[3, 2], WireDType::F16),
                tensor("0.bias", &[3], WireDType::F32),
            ],
        }),
        ToServer::JobFailed {
            job_id: 1,
            message: "out of memory".into(),
        },
        ToServer::GradNorm(GradNorm {
            job_id: 1,
            step: 9,
            sum_of_squares: 4.5,
        }),
        ToServer::DutyCycle { duty_cycle: 0.5 },
    ];
    Target {
        name: "protocol ToServer",
        seeds: messages.iter().map(encode).collect(),
        text: false,
        check: Box::new(|_, bytes| {
            let _ = rookery_proto::peek_hello_version(bytes);
            let frame = Bytes::copy_from_slice(bytes);
            match read_frame::<ToServer>(&frame, DEFAULT_MAX_FRAME_BYTES) {
                Ok(Incoming::Payload(_)) => true,
                Ok(Incoming::Message(message)) => {
                    match &message {
                        ToServer::Activations(a) => use_tensors(&a.outputs),
                        ToServer::Gradients(g) => use_tensors(&g.grads),
                        ToServer::Params(p) => use_tensors(&p.params),
                        ToServer::OptimizerState(o) => {
                            o.params.iter().for_each(|p| use_tensors(&p.slots))
                        }
                        _ => {}
                    }
                    true
                }
                Err(_) => false,
            }
        }),
    }
}

fn protocol_to_provider() -> io::Result<Target> {
    let spec = String::from_utf8_lossy(&read("examples/mnist-cnn.toml")?).into_owned();
    let graph_json = rookery_model::from_toml(&spec)
        .ok()
        .and_then(|g| g.to_json().ok())
        .unwrap_or_default();
    let messages = [
        ToProvider::Welcome {
            provider_id: 4,
            heartbeat_interval_ms: 1000,
            heartbeat_timeout_ms: 4000,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES as u64,
            identity: 1,
            credential: Some("fedcba9876543210".into()),
        },
        ToProvider::Heartbeat { seq: 1 },
        ToProvider::Error(ErrorMessage {
            code: ErrorCode::VersionMismatch,
            message: "upgrade".into(),
        }),
        ToProvider::Assign(Box::new(Assignment {
            job_id: 1,
            cluster: 0,
            stage: 1,
            stages: 3,
            graph_json,
            first: 2,
            end: 5,
            outputs: vec!["relu_1".into()],
            params: vec![tensor("conv.weight", &[2, 1, 3, 3], WireDType::F32)],
            optimizer: rookery_model::OptimizerConfig::Sgd {
                lr: 0.1,
                momentum: 0.9,
                dampening: 0.0,
                nesterov: false,
                weight_decay: 0.0,
            },
            loss: rookery_model::Loss::cross_entropy(),
            batch_size: 32,
            micro_batches: 2,
            wire_dtype: WireDType::F32,
            seed: 42,
            start_step: 0,
            optimizer_state: Vec::new(),
            lr_schedule: rookery_model::LrSchedule::default(),
            clip_grad_norm: None,
            public_name: Some("fuzz".into()),
            schedule: rookery_proto::PipelineSchedule::OneForwardOneBackward,
            sync_int8: true,
            precision: Default::default(),
        })),
        ToProvider::Forward(Forward {
            job_id: 1,
            phase: Phase::Train { step: 0 },
            micro: 0,
            step_samples: 32,
            step_targets: 32,
            inputs: vec![tensor("input", &[2, 1, 2, 2], WireDType::F32)],
            labels: Some(WireTensor::from_i64("labels", &[2], &[3, 9])),
        }),
        ToProvider::Backward(Backward {
            job_id: 1,
            step: 0,
            micro: 1,
            grads: vec![
                tensor("relu_1", &[2, 2], WireDType::F16),
                tensor("relu_8", &[2, 40], WireDType::I8Block),
            ],
        }),
        ToProvider::UploadParams { job_id: 1, step: 5 },
        ToProvider::SetParams(ParamSet {
            job_id: 1,
            step: 5,
            params: vec![tensor("fc.bias", &[10], WireDType::F32)],
        }),
        ToProvider::Release { job_id: 1 },
        ToProvider::GradScale(GradScale {
            job_id: 1,
            step: 9,
            scale: 0.25,
        }),
    ];
    Ok(Target {
        name: "protocol ToProvider",
        seeds: messages.iter().map(encode).collect(),
        text: false,
        check: Box::new(|_, bytes| {
            let frame = Bytes::copy_from_slice(bytes);
            match read_frame::<ToProvider>(&frame, DEFAULT_MAX_FRAME_BYTES) {
                Ok(Incoming::Payload(_)) => true,
                Ok(Incoming::Message(message)) => {
                    match &message {
                        ToProvider::Assign(a) => {
                            use_tensors(&a.params);
                            if let Ok(graph) = Graph::from_json(&a.graph_json) {
                                let _ = graph.analyze();
                            }
                        }
                        ToProvider::Forward(f) => {
                            use_tensors(&f.inputs);
                            use_tensors(&f.labels);
                        }
                        ToProvider::Backward(b) => use_tensors(&b.grads),
                        ToProvider::SetParams(p) => use_tensors(&p.params),
                        _ => {}
                    }
                    true
                }
                Err(_) => false,
            }
        }),
    })
}

/// One ONNX seed: its bytes' context.
struct OnnxSeed {
    input_shape: Vec<usize>,
    external: Option<(String, Vec<u8>)>,
}

fn onnx() -> io::Result<Target> {
    let files: [(&str, &[usize], bool); 7] = [
        ("tests/fixtures/pytorch-mlp/model.onnx", &[16, 12], true),
        ("shared/model/fixtures/mlp.dynamo.onnx", &[2, 16], true),
        ("shared/model/fixtures/mlp.legacy.onnx", &[2, 16], false),
        (
            "shared/model/fixtures/cnn.dynamo.onnx",
            &[2, 3, 16, 16],
            true,
        ),
        (
            "shared/model/fixtures/cnn.legacy.onnx",
            &[2, 3, 16, 16],
            false,
        ),
        (
            "shared/model/fixtures/cnn.folded.onnx",
            &[2, 3, 16, 16],
            false,
        ),
        (
            "shared/model/fixtures/transformer.legacy.onnx",
            &[2, 8],
            false,
        ),
    ];
    let mut seeds = Vec::new();
    let mut context = Vec::new();
    for (path, shape, external) in files {
        seeds.push(read(path)?);
        let external = if external {
            let data = format!("{path}.data");
            let name = Path::new(&data)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            Some((name, read(&data)?))
        } else {
            None
        };
        context.push(OnnxSeed {
            input_shape: shape.to_vec(),
            external,
        });
    }
    Ok(Target {
        name: "ONNX import",
        seeds,
        text: false,
        check: Box::new(move |seed, bytes| {
            let seed = &context[seed % context.len()];
            let external = |location: &str| match &seed.external {
                Some((name, data)) if name == location => Ok(data.clone()),
                _ => Err(io::Error::from(io::ErrorKind::NotFound)),
            };
            match rookery_model::onnx::import(bytes, &external, &seed.input_shape) {
                Ok(imported) => {
                    let _ = imported.graph.analyze();
                    true
                }
                Err(_) => false,
            }
        }),
    })
}

fn layer_spec() -> io::Result<Target> {
    let seeds = vec![
        read("examples/mnist-cnn.toml")?,
        LAYER_SPEC_MLP.as_bytes().to_vec(),
    ];
    Ok(Target {
        name: "layer spec (TOML)",
        seeds,
        text: true,
        check: Box::new(|_, bytes| {
            let text = String::from_utf8_lossy(bytes);
            match ModelSpec::from_toml(&text).and_then(|spec| spec.to_graph()) {
                Ok(graph) => {
                    let _ = graph.analyze();
                    true
                }
                Err(_) => false,
            }
        }),
    })
}

/// A provider WebSocket upgrade's untrusted text: three lines, the
/// `Origin` and `Host` headers and the query (which may carry the join
/// token), as `--allowed-origin` and `--provider-token` read them.
fn upgrade_headers() -> Target {
    use axum::http::header::{HOST, ORIGIN};
    use axum::http::{HeaderMap, HeaderValue};
    use rookery_server::admission::{AllowedOrigins, ProviderToken, WebOrigin};

    let seeds = [
        "https://rookery.example\nrookery.example\ntoken=join%20me",
        "http://127.0.0.1:8080\n127.0.0.1:8080\nname=x&token=join+me",
        "https://[::1]:443/\n[::1]\ntoken=join%20me",
        "HTTPS://Rookery.Example:443\nelsewhere.example\nx=%zz&token=join%20me",
    ];
    let allowed: AllowedOrigins = AllowedOrigins::new(vec![
        "https://rookery.example"
            .parse::<WebOrigin>()
            .expect("a valid origin"),
    ]);
    let token = ProviderToken::new("join me");
    Target {
        name: "provider upgrade headers",
        seeds: seeds.iter().map(|s| s.as_bytes().to_vec()).collect(),
        text: true,
        check: Box::new(move |_, bytes| {
            let mut lines = bytes.split(|b| *b == b'\n');
            let mut headers = HeaderMap::new();
            for name in [ORIGIN, HOST] {
                if let Some(value) = lines.next().and_then(|v| HeaderValue::from_bytes(v).ok()) {
                    headers.insert(name, value);
                }
            }
            let query = lines.next().map(String::from_utf8_lossy);
            let _ = String::from_utf8_lossy(bytes).parse::<WebOrigin>();
            let origin_ok = allowed.admits(&headers).is_ok();
            token.admits(&headers, query.as_deref()) && origin_ok
        }),
    }
}

/// Names the job-file seeds mention; they exist (empty) in the upload folder.
const UPLOADED: [&str; 10] = [
    "cnn.onnx",
    "cnn.toml",
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
    "x.npy",
    "y.npy",
    "data.npz",
    "data.csv",
];

fn job_file(name: &'static str, seeds: &[&str], upload: &Path) -> io::Result<Target> {
    for file in UPLOADED {
        std::fs::write(upload.join(file), b"")?;
    }
    let upload = upload.to_path_buf();
    Ok(Target {
        name,
        seeds: seeds.iter().map(|s| s.as_bytes().to_vec()).collect(),
        text: true,
        check: Box::new(move |_, bytes| {
            // The endpoint refuses non-UTF-8 job files before parsing.
            let Ok(text) = std::str::from_utf8(bytes) else {
                return false;
            };
            match JobSpec::from_upload(text, &upload) {
                Ok(spec) => {
                    let _ = spec.to_json();
                    let _ = spec.micro_batch_size();
                    true
                }
                Err(_) => false,
            }
        }),
    })
}

const LAYER_SPEC_MLP: &str = r#"
input_shape = [12]
[[layers]]
type = "Flatten"
[[layers]]
type = "Dense"
units = 32
activation = "relu"
[[layers]]
type = "Dropout"
rate = 0.1
[[layers]]
type = "Dense"
units = 3
"#;

const JOB_TOML: &[&str] = &[
    r#"
[model]
spec = "cnn.toml"
input_shape = [1, 28, 28]
[data]
format = "idx"
train_inputs = "train-images-idx3-ubyte.gz"
train_labels = "train-labels-idx1-ubyte.gz"
test_inputs = "t10k-images-idx3-ubyte.gz"
test_labels = "t10k-labels-idx1-ubyte.gz"
scale = 0.00392156862745098
mean = 0.1307
std = 0.3081
[training]
epochs = 5
batch_size = 32
micro_batches = 2
loss = "cross_entropy"
optimizer = { name = "adam", lr = 0.002, betas = [0.9, 0.999] }
clusters = 2
stages = 3
sync_every = 1
shuffle = true
seed = 42
wire_dtype = "f16"
[training.verify]
rate = 0.02
"#,
    r#"
[model]
onnx = "cnn.onnx"
input_shape = [12]
[data]
format = "npz"
train_inputs = "data.npz:x_train"
train_labels = "data.npz:y_train"
[training]
batch_size = 16
loss = "mse"
optimizer = { name = "sgd", lr = 0.1, momentum = 0.9, nesterov = true }
clusters = "auto"
"#,
    r#"
[model]
spec = "cnn.toml"
input_shape = [4]
[data]
format = "csv"
train_inputs = "data.csv"
train_labels = "data.csv"
[training]
batch_size = 8
optimizer = { name = "rmsprop", lr = 0.01, alpha = 0.99, centered = true }
"#,
];

const JOB_JSON: &[&str] = &[
    r#"{
  "model": { "onnx": "cnn.onnx", "input_shape": [1, 28, 28] },
  "data": {
    "format": "idx",
    "train_inputs": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_inputs": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
    "scale": 0.00392156862745098, "mean": 0.1307, "std": 0.3081
  },
  "training": {
    "epochs": 2, "batch_size": 64, "micro_batches": 4, "loss": "cross_entropy",
    "optimizer": { "name": "adamw", "lr": 0.001, "weight_decay": 0.01 },
    "clusters": 3, "sync_every": 2, "shuffle": false, "seed": 7, "wire_dtype": "bf16"
  }
}"#,
    r#"{"model": {"spec": "cnn.toml", "input_shape": [12]},
 "data": {"format": "npy", "train_inputs": "x.npy", "train_labels": "y.npy"},
 "training": {"batch_size": 16, "stages": 2}}"#,
];

/// A tiny npz (a zip of `.npy` members, stored uncompressed so mutations
/// reach the arrays) holding `members`.
fn npz(members: &[(&str, &[u8])]) -> io::Result<Vec<u8>> {
    let mut zip = zip::ZipWriter::new(io::Cursor::new(Vec::new()));
    let options =
        zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, bytes) in members {
        zip.start_file(*name, options).map_err(io::Error::other)?;
        io::Write::write_all(&mut zip, bytes)?;
    }
    Ok(zip.finish().map_err(io::Error::other)?.into_inner())
}

/// A safetensors file of one f32 array.
fn safetensors(name: &str, shape: &[usize], values: &[f32]) -> Vec<u8> {
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let header = format!(
        r#"{{"{name}":{{"dtype":"F32","shape":{shape:?},"data_offsets":[0,{}]}}}}"#,
        data.len()
    );
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&data);
    out
}

/// Dataset files as the server reads uploaded ones: each input is written to
/// a file (one per thread) and read back in its seed's format.
fn datasets(dir: &Path) -> io::Result<Target> {
    let x = read("tests/fixtures/pytorch-mlp/x.npy")?;
    let y = read("tests/fixtures/pytorch-mlp/y.npy")?;
    let idx3: Vec<u8> = [0u8, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 2]
        .into_iter()
        .chain(1..=8)
        .collect();
    let seeds: Vec<(DataFormat, Vec<u8>)> = vec![
        (DataFormat::Npy, x),
        (DataFormat::Npy, y.clone()),
        (DataFormat::Idx, idx3),
        (
            DataFormat::Idx,
            read("datasets/mnist-10k/t10k-labels-idx1-ubyte.gz")?,
        ),
        (
            DataFormat::Csv,
            b"a, b, label\n1, 2.5, 0\n-3, 4e2, 1\n\n\"5\", 6, 2\n".to_vec(),
        ),
        (DataFormat::Npz, npz(&[("y.npy", &y)])?),
        (
            DataFormat::Safetensors,
            safetensors("x", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        ),
        (
            DataFormat::Tokens,
            [7u16, 0, 4095, 12, 12, 3, 9, 1]
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect(),
        ),
        (
            DataFormat::Tokens,
            read("tests/fixtures/pytorch-mlp/y.npy")?,
        ),
    ];
    let formats: Vec<DataFormat> = seeds.iter().map(|(f, _)| *f).collect();
    let dir = dir.to_path_buf();
    Ok(Target {
        name: "dataset files",
        seeds: seeds.into_iter().map(|(_, bytes)| bytes).collect(),
        text: false,
        check: Box::new(move |seed, bytes| {
            let path = dir.join(format!("{:?}.data", std::thread::current().id()));
            if std::fs::write(&path, bytes).is_err() {
                return false;
            }
            let format = formats[seed % formats.len()];
            if format == DataFormat::Tokens {
                // Named `.u16` so a raw file has a width; `.npy` is found by its magic.
                let tokens = path.with_extension("u16");
                if std::fs::rename(&path, &tokens).is_err() {
                    return false;
                }
                return match TokenWindows::read(&DataRef::file(&tokens), None, 3) {
                    Ok(w) => {
                        let all: Vec<usize> = (0..w.len()).collect();
                        w.gather_inputs(&all).len() == w.gather_labels(&all).len()
                    }
                    Err(_) => false,
                };
            }
            match rookery_job::data::read_array(format, &DataRef::file(&path)) {
                Ok(array) => {
                    // What loading a split does with an array.
                    let _ = array.to_f32();
                    let _ = array.to_classes();
                    true
                }
                Err(_) => false,
            }
        }),
    })
}

/// Frames of one input for the stream target: each is a little-endian u32
/// length, then that many bytes (a short last frame takes what is left).
fn split_frames(mut bytes: &[u8]) -> Vec<&[u8]> {
    let mut frames = Vec::new();
    while bytes.len() >= 4 {
        let len = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
        let rest = &bytes[4..];
        let (frame, after) = rest.split_at(len.min(rest.len()));
        frames.push(frame);
        bytes = after;
    }
    frames
}

fn join_frames(frames: &[Bytes]) -> Vec<u8> {
    frames
        .iter()
        .flat_map(|f| {
            (f.len() as u32)
                .to_le_bytes()
                .into_iter()
                .chain(f.iter().copied())
        })
        .collect()
}

/// The frame limit the stream target's seeds are cut to: small, so that a
/// seed holds many payload frames.
const STREAM_SEED_LIMIT: usize = 64 * 1024;

/// Sequences of frames, streamed messages and their payloads, into an
/// [`Assembler`]: a provider's (activations, gradients, its assignment and
/// parameters) and the server's (parameters and optimizer state).
fn protocol_stream() -> Target {
    let big = |name: &str, n: usize| tensor(name, &[n], WireDType::F32);
    let to_provider = [
        ToProvider::Forward(Forward {
            job_id: 1,
            phase: Phase::Train { step: 2 },
            micro: 0,
            step_samples: 4,
            step_targets: 4,
            inputs: vec![
                big("x", 16 * 1024 + 5),
                tensor("small", &[3], WireDType::F16),
            ],
            labels: Some(WireTensor::from_i64("labels", &[4], &[0, 1, 2, 3])),
        }),
        ToProvider::Backward(Backward {
            job_id: 1,
            step: 2,
            micro: 1,
            grads: vec![
                big("g", 17 * 1024),
                big("h", 16 * 1024),
                tensor("q", &[70 * 1024 + 3], WireDType::I8Block),
            ],
        }),
        ToProvider::SetParams(ParamSet {
            job_id: 1,
            step: 2,
            params: vec![big("w", 20 * 1024), big("b", 8)],
        }),
    ];
    let to_server = [
        ToServer::Params(ParamSet {
            job_id: 1,
            step: 2,
            params: vec![big("w", 20 * 1024), big("b", 8)],
        }),
        ToServer::OptimizerState(OptimizerState {
            job_id: 1,
            step: 2,
            params: vec![ParamOptimState {
                name: "w".into(),
                steps: 2,
                slots: vec![big("exp_avg", 20 * 1024), big("exp_avg_sq", 20 * 1024)],
            }],
        }),
    ];
    let seed = |frames: Result<Vec<Bytes>, _>| {
        frames
            .map(|frames| join_frames(&frames))
            .unwrap_or_default()
    };
    // The first byte says who receives: 0 a provider, 1 the server.
    let mut seeds: Vec<Vec<u8>> = to_provider
        .iter()
        .map(|m| [vec![0], seed(encode_streamed(m, STREAM_SEED_LIMIT))].concat())
        .collect();
    seeds.extend(
        to_server
            .iter()
            .map(|m| [vec![1], seed(encode_streamed(m, STREAM_SEED_LIMIT))].concat()),
    );
    Target {
        name: "protocol stream",
        seeds,
        text: false,
        check: Box::new(|_, bytes| match bytes.split_first() {
            Some((0, frames)) => assemble::<ToProvider>(frames, |m| match m {
                ToProvider::Forward(f) => {
                    use_tensors(&f.inputs);
                    use_tensors(&f.labels);
                }
                ToProvider::Backward(b) => use_tensors(&b.grads),
                ToProvider::SetParams(p) => use_tensors(&p.params),
                ToProvider::Assign(a) => use_tensors(&a.params),
                _ => {}
            }),
            Some((_, frames)) => assemble::<ToServer>(frames, |m| match m {
                ToServer::Params(p) => use_tensors(&p.params),
                ToServer::OptimizerState(o) => use_tensors(o.params.iter().flat_map(|p| &p.slots)),
                _ => {}
            }),
            None => false,
        }),
    }
}

/// Feeds `bytes`' frames to an assembler capped as a receiver caps it;
/// whether a message came out whole and nothing was refused.
fn assemble<T: Streamed + serde::de::DeserializeOwned>(bytes: &[u8], receive: impl Fn(&T)) -> bool {
    let mut assembler = Assembler::<T>::new(1 << 24);
    let mut complete = false;
    for frame in split_frames(bytes) {
        let frame = Bytes::copy_from_slice(frame);
        let Ok(incoming) = read_frame::<T>(&frame, STREAM_SEED_LIMIT) else {
            return false;
        };
        match assembler.push(incoming) {
            Ok(Some(message)) => {
                receive(&message);
                complete = true;
            }
            Ok(None) => {}
            Err(_) => return false,
        }
    }
    complete
}
