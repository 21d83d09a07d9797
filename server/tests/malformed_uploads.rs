//! Malformed models, datasets and job files get a 400 naming the problem,
//! through the upload endpoint, and leave nothing behind.

#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

mod common;

use axum::http::StatusCode;
use rookery_proto::api::ApiError;

use common::*;

/// The PyTorch MLP fixture: an ONNX export with external data and npy data.
const ONNX_JOB: &str = r#"
[model]
onnx = "model.onnx"
input_shape = [12]
[data]
format = "npy"
train_inputs = "x.npy"
train_labels = "y.npy"
[training]
batch_size = 16
"#;

fn onnx_files() -> Files {
    ["model.onnx", "model.onnx.data", "x.npy", "y.npy"]
        .into_iter()
        .map(|name| {
            (
                name,
                std::fs::read(repo(&format!("tests/fixtures/pytorch-mlp/{name}"))).unwrap(),
            )
        })
        .collect()
}

/// `files` with `name`'s bytes replaced by `bytes` (or the part removed).
fn with(files: &Files, name: &'static str, bytes: Option<Vec<u8>>) -> Files {
    let mut out: Files = files.iter().filter(|(n, _)| *n != name).cloned().collect();
    if let Some(bytes) = bytes {
        out.push((name, bytes));
    }
    out
}

fn original(files: &Files, name: &str) -> Vec<u8> {
    files.iter().find(|(n, _)| *n == name).unwrap().1.clone()
}

/// Deterministic noise.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

#[tokio::test]
async fn malformed_models_datasets_and_job_files_get_a_400_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let state = state(dir.path());
    let onnx = onnx_files();
    let mnist = mnist_files();
    let model = original(&onnx, "model.onnx");
    let x = original(&onnx, "x.npy");
    let images = original(&mnist, "train-images-idx3-ubyte.gz");
    let mut flipped_header = x.clone();
    flipped_header[8] ^= 0xff;
    let cases: Vec<(&str, Vec<u8>, Files, &str)> = vec![
        // ONNX models.
        (
            "onnx: random bytes",
            ONNX_JOB.into(),
            with(&onnx, "model.onnx", Some(noise(4096, 1))),
            "model.onnx",
        ),
        (
            "onnx: empty",
            ONNX_JOB.into(),
            with(&onnx, "model.onnx", Some(Vec::new())),
            "model.onnx",
        ),
        (
            "onnx: truncated",
            ONNX_JOB.into(),
            with(&onnx, "model.onnx", Some(model[..model.len() / 2].to_vec())),
            "model.onnx",
        ),
        (
            "onnx: text",
            ONNX_JOB.into(),
            with(
                &onnx,
                "model.onnx",
                Some(b"def forward(x): return x".to_vec()),
            ),
            "model.onnx",
        ),
        (
            "onnx: external data missing",
            ONNX_JOB.into(),
            with(&onnx, "model.onnx.data", None),
            "model.onnx.data",
        ),
        (
            "onnx: external data short",
            ONNX_JOB.into(),
            with(&onnx, "model.onnx.data", Some(vec![0; 100])),
            "model.onnx.data",
        ),
        // Datasets.
        (
            "npy: random bytes",
            ONNX_JOB.into(),
            with(&onnx, "x.npy", Some(noise(2048, 2))),
            "x.npy",
        ),
        (
            "npy: truncated data",
            ONNX_JOB.into(),
            with(&onnx, "x.npy", Some(x[..x.len() - 7].to_vec())),
            "x.npy",
        ),
        (
            "npy: damaged header",
            ONNX_JOB.into(),
            with(&onnx, "x.npy", Some(flipped_header)),
            "x.npy",
        ),
        (
            "npy: labels missing",
            ONNX_JOB.into(),
            with(&onnx, "y.npy", None),
            "y.npy",
        ),
        (
            "idx: not gzip",
            JOB.into(),
            with(&mnist, "train-images-idx3-ubyte.gz", Some(noise(1000, 3))),
            "train-images-idx3-ubyte.gz",
        ),
        (
            "idx: truncated gzip",
            JOB.into(),
            with(
                &mnist,
                "train-images-idx3-ubyte.gz",
                Some(images[..images.len() / 3].to_vec()),
            ),
            "train-images-idx3-ubyte.gz",
        ),
        (
            "idx: labels for images",
            JOB.into(),
            with(&mnist, "train-labels-idx1-ubyte.gz", Some(images.clone())),
            "train-labels-idx1-ubyte.gz",
        ),
        // Job files.
        (
            "job: not UTF-8",
            vec![0xff, 0xfe, 0x00, 0x80],
            onnx.clone(),
            "not UTF-8",
        ),
        ("job: empty", Vec::new(), onnx.clone(), "model"),
        (
            "job: broken JSON",
            b"{\"model\": ".to_vec(),
            onnx.clone(),
            "JSON",
        ),
        (
            "job: JSON of the wrong type",
            br#"{"model": {"onnx": 5}}"#.to_vec(),
            onnx.clone(),
            "model.onnx",
        ),
        (
            "job: unknown field",
            ONNX_JOB.replace("batch_size", "batch_sise").into(),
            onnx.clone(),
            "batch_sise",
        ),
        (
            "job: zero batch",
            ONNX_JOB.replace("= 16", "= 0").into(),
            onnx.clone(),
            "training.batch_size",
        ),
        (
            "job: both model kinds",
            ONNX_JOB
                .replace("[model]", "[model]\nspec = \"cnn.toml\"")
                .into(),
            onnx.clone(),
            "model",
        ),
        (
            "job: absolute path",
            ONNX_JOB.replace("\"x.npy\"", "\"/etc/passwd\"").into(),
            onnx.clone(),
            "data.train_inputs",
        ),
        (
            "job: escaping path",
            ONNX_JOB.replace("\"x.npy\"", "\"../../x.npy\"").into(),
            onnx.clone(),
            "data.train_inputs",
        ),
    ];
    let mut failures = Vec::new();
    for (what, job, files, expected) in cases {
        let (status, body) = submit_bytes(&state, TOKEN, &job, &files).await;
        let error = serde_json::from_slice::<ApiError>(&body)
            .map(|e| e.error)
            .unwrap_or_else(|_| String::from_utf8_lossy(&body).into_owned());
        if status != StatusCode::BAD_REQUEST || !error.contains(expected) {
            failures.push(format!(
                "{what}: {status} `{error}` (expected 400 naming `{expected}`)"
            ));
        }
        // Internal paths stay in the server's log.
        if error.contains(dir.path().to_str().unwrap()) || error.contains(".upload-") {
            failures.push(format!("{what}: the error shows a server path: {error}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(listed(&state, TOKEN).await.is_empty());
    // The fixture itself is accepted, so each case failed for its own flaw.
    let (status, body) = submit(&state, ONNX_JOB, &onnx).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&body)
    );
}
