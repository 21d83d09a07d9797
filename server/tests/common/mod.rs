//! What the HTTP tests of the job endpoints share: a server state, requests
//! through `oneshot`, multipart uploads of the MNIST job.

#![allow(dead_code)] // Each test file uses its own share of these.
#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::path::{Path, PathBuf};

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use rookery_proto::api::{ApiError, JobCreated, JobInfo};
use rookery_server::store::Db;
use rookery_server::store::tokens::Token;
use rookery_server::{AppState, Limits, app};
use tower::ServiceExt;

pub const TOKEN: &str = "secret-token";
pub const BOUNDARY: &str = "rookery-test-boundary";

pub fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

pub fn state(data_dir: &Path) -> AppState {
    AppState::new(
        Db::open_in_memory().unwrap(),
        Limits::default(),
        None,
        data_dir.to_path_buf(),
        Token::new(TOKEN),
    )
}

pub async fn call(state: &AppState, request: Request<Body>) -> (StatusCode, Vec<u8>) {
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    (
        status,
        response
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
}

pub fn authed(method: &str, path: &str, token: Option<&str>) -> axum::http::request::Builder {
    let builder = Request::builder().method(method).uri(path);
    match token {
        Some(token) => builder.header(header::AUTHORIZATION, format!("Bearer {token}")),
        None => builder,
    }
}

/// A multipart body: the job part, then files as (part name, bytes).
pub fn multipart(job: &[u8], files: &[(&str, Vec<u8>)]) -> Body {
    let mut body = Vec::new();
    let mut part = |name: &str, bytes: &[u8]| {
        body.extend_from_slice(
            format!(
                "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    };
    part("job", job);
    for (name, bytes) in files {
        part(name, bytes);
    }
    body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    Body::from(body)
}

/// Upload parts: (part name, bytes).
pub type Files = Vec<(&'static str, Vec<u8>)>;

pub fn mnist_files() -> Files {
    let mut files = vec![(
        "cnn.toml",
        std::fs::read(repo("examples/mnist-cnn.toml")).unwrap(),
    )];
    for name in [
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ] {
        files.push((
            name,
            std::fs::read(repo(&format!("datasets/mnist-10k/{name}"))).unwrap(),
        ));
    }
    files
}

pub const JOB: &str = r#"
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
[training]
epochs = 1
batch_size = 64
optimizer = { name = "adam", lr = 0.001 }
"#;

pub async fn submit(
    state: &AppState,
    job: &str,
    files: &[(&str, Vec<u8>)],
) -> (StatusCode, Vec<u8>) {
    submit_as(state, TOKEN, job, files).await
}

pub async fn submit_as(
    state: &AppState,
    token: &str,
    job: &str,
    files: &[(&str, Vec<u8>)],
) -> (StatusCode, Vec<u8>) {
    submit_bytes(state, token, job.as_bytes(), files).await
}

pub async fn submit_bytes(
    state: &AppState,
    token: &str,
    job: &[u8],
    files: &[(&str, Vec<u8>)],
) -> (StatusCode, Vec<u8>) {
    let request = authed("POST", "/api/jobs", Some(token))
        .header(
            header::CONTENT_TYPE,
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .body(multipart(job, files))
        .unwrap();
    call(state, request).await
}

pub fn error_of(body: &[u8]) -> String {
    serde_json::from_slice::<ApiError>(body).unwrap().error
}

/// Submits the MNIST job as `token`; returns its id.
pub async fn submit_mnist(state: &AppState, token: &str) -> u64 {
    accepted(state, token, &mnist_files()).await
}

/// Submits `JOB` with `files` as `token`, which must be accepted; returns
/// the job's id.
pub async fn accepted(state: &AppState, token: &str, files: &[(&str, Vec<u8>)]) -> u64 {
    let (status, body) = submit_as(state, token, JOB, files).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&body)
    );
    serde_json::from_slice::<JobCreated>(&body).unwrap().id
}

pub async fn listed(state: &AppState, token: &str) -> Vec<u64> {
    let (status, body) = call(
        state,
        authed("GET", "/api/jobs", Some(token))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    serde_json::from_slice::<Vec<JobInfo>>(&body)
        .unwrap()
        .into_iter()
        .map(|job| job.id)
        .collect()
}

/// Cancels job `id` as `token`, which must succeed.
pub async fn cancel(state: &AppState, token: &str, id: u64) {
    let (status, _) = call(
        state,
        authed("POST", &format!("/api/jobs/{id}/cancel"), Some(token))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}
