//! The job endpoints through `tower::ServiceExt::oneshot`: a Requester's token
//! guards every one and reaches only that Requester's jobs, uploads are
//! checked before they are accepted (over-large ones get a 413; malformed
//! ones are `malformed_uploads.rs`), and a bad upload leaves nothing behind.
//! Uses the real MNIST files, the example CNN and the PyTorch ONNX fixture.

#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use rookery_proto::api::{
    ApiError, JobCreated, JobEvent, JobEventBody, JobInfo, JobMetrics, LogEntry, PlanPreview,
};
use rookery_proto::{Hello, ProviderKind};
use rookery_server::store::Db;
use rookery_server::store::requesters;
use rookery_server::store::tokens::Token;
use rookery_server::{AppState, Limits, app};
use tower::ServiceExt;

use common::*;

#[tokio::test]
async fn every_job_endpoint_needs_the_right_token() {
    let dir = tempfile::tempdir().unwrap();
    let state = state(dir.path());
    let endpoints = [
        ("GET", "/api/jobs"),
        ("POST", "/api/jobs"),
        ("GET", "/api/jobs/1"),
        ("GET", "/api/jobs/1/metrics"),
        ("POST", "/api/jobs/1/cancel"),
        ("GET", "/api/jobs/1/weights"),
        ("GET", "/api/jobs/1/metrics.csv"),
        ("GET", "/api/jobs/1/log"),
        ("POST", "/api/plan"),
        ("GET", "/api/events"),
        ("GET", "/api/datasets"),
    ];
    // A token that differs from a real one by its last character.
    let near = format!("{}x", &TOKEN[..TOKEN.len() - 1]);
    for (method, path) in endpoints {
        for token in [None, Some("wrong"), Some(""), Some(near.as_str())] {
            let (status, body) = call(
                &state,
                authed(method, path, token).body(Body::empty()).unwrap(),
            )
            .await;
            assert_eq!(
                status,
                StatusCode::UNAUTHORIZED,
                "{method} {path} with {token:?}"
            );
            assert!(error_of(&body).contains("token"), "{method} {path}");
        }
    }
    // The right token reaches the handler (an unknown job is a 404, not a 401).
    let (status, _) = call(
        &state,
        authed("GET", "/api/jobs/1", Some(TOKEN))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // Providers and health stay public.
    let (status, _) = call(
        &state,
        authed("GET", "/api/providers", None)
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn a_good_upload_is_queued_listed_and_cancellable_once() {
    let dir = tempfile::tempdir().unwrap();
    let state = state(dir.path());
    let (status, body) = submit(&state, JOB, &mnist_files()).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&body)
    );
    let created: JobCreated = serde_json::from_slice(&body).unwrap();

    let get = |path: String| {
        authed("GET", &path, Some(TOKEN))
            .body(Body::empty())
            .unwrap()
    };
    let (status, body) = call(&state, get("/api/jobs".into())).await;
    assert_eq!(status, StatusCode::OK);
    let jobs: Vec<JobInfo> = serde_json::from_slice(&body).unwrap();
    assert_eq!(jobs.len(), 1);
    assert_eq!(
        (jobs[0].id, jobs[0].status.as_str()),
        (created.id, "queued")
    );
    // The files live in the job's own upload folder now.
    assert!(
        dir.path()
            .join(format!("jobs/{}/upload/cnn.toml", created.id))
            .is_file()
    );

    let (status, body) = call(&state, get(format!("/api/jobs/{}/metrics", created.id))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_slice::<JobMetrics>(&body).unwrap(),
        JobMetrics::default()
    );
    let (status, body) = call(&state, get(format!("/api/jobs/{}/weights", created.id))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(error_of(&body).contains("none yet"));
    // One cluster's own weights exist only once a job of several completes;
    // a cluster that is not a number is a client error.
    let (status, body) = call(
        &state,
        get(format!("/api/jobs/{}/weights?cluster=1", created.id)),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(error_of(&body).contains("cluster 1"), "{}", error_of(&body));
    let (status, _) = call(
        &state,
        get(format!("/api/jobs/{}/weights?cluster=first", created.id)),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let cancel = || {
        authed(
            "POST",
            &format!("/api/jobs/{}/cancel", created.id),
            Some(TOKEN),
        )
        .body(Body::empty())
        .unwrap()
    };
    let (status, body) = call(&state, cancel()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_slice::<JobInfo>(&body).unwrap().status,
        "cancelled"
    );
    let (status, body) = call(&state, cancel()).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(error_of(&body).contains("already cancelled"));
}

#[tokio::test]
async fn an_upload_cannot_stand_in_for_the_servers_own_files() {
    // A resume point claiming 2^47 clusters once aborted the server when
    // the job was planned: uploaded files shared the job folder with it.
    let dir = tempfile::tempdir().unwrap();
    let state = state(dir.path());
    let mut files = mnist_files();
    let mut forged = Vec::new();
    let header = br#"{"meta/clusters":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}"#;
    forged.extend_from_slice(&(header.len() as u64).to_le_bytes());
    forged.extend_from_slice(header);
    forged.extend_from_slice(&(1i64 << 23).to_le_bytes());
    forged.extend_from_slice(&0i64.to_le_bytes());
    for name in [
        "resume.safetensors",
        "weights.safetensors",
        "checkpoint.safetensors",
    ] {
        files.push((name, forged.clone()));
    }
    let id = accepted(&state, TOKEN, &files).await;
    let job_dir = dir.path().join(format!("jobs/{id}"));
    for name in [
        "resume.safetensors",
        "weights.safetensors",
        "checkpoint.safetensors",
    ] {
        assert!(
            !job_dir.join(name).exists(),
            "{name} landed beside the server's files"
        );
        assert!(
            job_dir.join("upload").join(name).is_file(),
            "{name} kept as an upload"
        );
    }
    // No weights to download: the forged file is not the job's.
    let (status, _) = call(
        &state,
        authed("GET", &format!("/api/jobs/{id}/weights"), Some(TOKEN))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn bad_uploads_get_a_clear_400_and_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let state = state(dir.path());
    let files = mnist_files();
    let without = |name: &str| {
        files
            .iter()
            .filter(|(n, _)| *n != name)
            .cloned()
            .collect::<Vec<_>>()
    };
    let cases: Vec<(String, Files, &str)> = vec![
        (
            JOB.replace("adam", "adagrad"),
            files.clone(),
            "training.optimizer",
        ),
        (
            JOB.to_string(),
            without("train-labels-idx1-ubyte.gz"),
            "train-labels-idx1-ubyte.gz",
        ),
        (
            JOB.replace("[1, 28, 28]", "[3, 28, 28]"),
            files.clone(),
            "input_shape",
        ),
        ("this is not toml [".to_string(), files.clone(), "TOML"),
        (
            JOB.to_string(),
            {
                let mut bad = without("cnn.toml");
                bad.push(("cnn.toml", b"[[layers]]\ntype = \"Teleport\"\n".to_vec()));
                bad
            },
            "cnn.toml",
        ),
        (
            JOB.to_string(),
            vec![("../escape", vec![1])],
            "relative paths",
        ),
    ];
    for (job, files, expected) in cases {
        let (status, body) = submit(&state, &job, &files).await;
        assert_eq!(
            status,
            StatusCode::BAD_REQUEST,
            "{expected}: {}",
            String::from_utf8_lossy(&body)
        );
        let error = error_of(&body);
        assert!(
            error.contains(expected),
            "expected `{expected}` in: {error}"
        );
    }
    // No job, and no upload folder, survived.
    let (_, body) = call(
        &state,
        authed("GET", "/api/jobs", Some(TOKEN))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert!(
        serde_json::from_slice::<Vec<JobInfo>>(&body)
            .unwrap()
            .is_empty()
    );
    let left: Vec<_> = std::fs::read_dir(dir.path().join("jobs"))
        .map(|d| d.count())
        .into_iter()
        .collect();
    assert_eq!(left, vec![0]);
}

fn plan_request(job: &str, files: &[(&str, Vec<u8>)]) -> Request<Body> {
    authed("POST", "/api/plan", Some(TOKEN))
        .header(
            header::CONTENT_TYPE,
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .body(multipart(job.as_bytes(), files))
        .unwrap()
}

/// Registers a provider with the coordinator the way the socket loop does
/// after a handshake and a link probe; the receiver keeps its queue open.
async fn connect(
    state: &AppState,
    id: u64,
    memory_bytes: u64,
) -> rookery_server::coordinator::OutboxReceiver {
    let (tx, rx) = rookery_server::coordinator::outbox(usize::MAX);
    state
        .coordinator
        .send(rookery_server::coordinator::Event::Connected {
            id,
            identity: id,
            vouched_by: None,
            hello: Hello {
                protocol_version: rookery_proto::PROTOCOL_VERSION,
                kind: ProviderKind::Native,
                device: format!("libtorch cpu {id}"),
                memory_bytes,
                gflops: 10.0 * id as f64,
                display_name: format!("p{id}"),
                max_buffer_bytes: None,
                credential: None,
                requester_token: None,
                donor: None,
                duty_cycle: 1.0,
            },
            tx,
        })
        .await;
    state
        .coordinator
        .send(rookery_server::coordinator::Event::Measured {
            id,
            bandwidth_mbps: 1000.0,
        })
        .await;
    rx
}

#[tokio::test]
async fn the_plan_preview_splits_the_model_over_the_connected_providers_and_keeps_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let state = state(dir.path());
    let job = JOB.replace("optimizer =", "stages = 3\nclusters = 1\noptimizer =");

    let (status, body) = call(&state, plan_request(&job, &mnist_files())).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(error_of(&body).contains("no idle native provider"));

    let mut queues = Vec::new();
    for id in 1..=3 {
        queues.push(connect(&state, id, 4 << 30).await);
    }
    let (status, body) = call(&state, plan_request(&job, &mnist_files())).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let preview: PlanPreview = serde_json::from_slice(&body).unwrap();
    let plan = &preview.plan;
    assert_eq!(plan.clusters.len(), 1);
    let stages = &plan.clusters[0].stages;
    let roles: Vec<&str> = stages.iter().map(|s| s.role.as_str()).collect();
    assert_eq!(roles, ["root", "stem", "leaf"]);
    let mut providers: Vec<u64> = stages.iter().map(|s| s.provider).collect();
    providers.sort();
    assert_eq!(providers, [1, 2, 3]);
    for stage in stages {
        assert_eq!(stage.device, format!("libtorch cpu {}", stage.provider));
        assert_eq!(stage.provider_name, format!("p{}", stage.provider));
        assert!(stage.memory_bytes > 0 && stage.time_s > 0.0, "{stage:?}");
    }
    // The example CNN's trainable parameters (conv 160, batch norm 32, conv
    // 4640, dense 200832, dense 1290), each in exactly one stage.
    assert_eq!(plan.param_count, 206_954);
    assert_eq!(
        stages.iter().map(|s| s.param_count).sum::<u64>(),
        plan.param_count
    );
    // datasets/mnist-10k: 8,000 training and 2,000 test digits.
    assert_eq!(
        (preview.train_samples, preview.test_samples),
        (8_000, 2_000)
    );

    // A preview is not a submission.
    let (_, body) = call(
        &state,
        authed("GET", "/api/jobs", Some(TOKEN))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert!(
        serde_json::from_slice::<Vec<JobInfo>>(&body)
            .unwrap()
            .is_empty()
    );
    let left = std::fs::read_dir(dir.path().join("jobs")).unwrap().count();
    assert_eq!(left, 0);
}

#[tokio::test]
async fn validation_errors_name_the_field_or_file_they_concern() {
    let dir = tempfile::tempdir().unwrap();
    let state = state(dir.path());
    let files = mnist_files();
    let cases: Vec<(String, Files, &str)> = vec![
        (
            JOB.replace("batch_size = 64", "batch_size = 0"),
            files.clone(),
            "training.batch_size",
        ),
        (
            JOB.replace("lr = 0.001", "lr = -1.0"),
            files.clone(),
            "training.optimizer.lr",
        ),
        (
            JOB.to_string(),
            files
                .iter()
                .map(|(n, b)| {
                    let bytes = if *n == "train-labels-idx1-ubyte.gz" {
                        b"not gzip".to_vec()
                    } else {
                        b.clone()
                    };
                    (*n, bytes)
                })
                .collect(),
            "train-labels-idx1-ubyte.gz",
        ),
    ];
    for (job, files, field) in cases {
        for request in [plan_request(&job, &files), {
            authed("POST", "/api/jobs", Some(TOKEN))
                .header(
                    header::CONTENT_TYPE,
                    format!("multipart/form-data; boundary={BOUNDARY}"),
                )
                .body(multipart(job.as_bytes(), &files))
                .unwrap()
        }] {
            let (status, body) = call(&state, request).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{field}");
            let error: ApiError = serde_json::from_slice(&body).unwrap();
            assert_eq!(error.field.as_deref(), Some(field), "{error:?}");
            // Messages name files as uploaded, not where the server put them.
            assert!(!error.error.contains(".upload-"), "{error:?}");
        }
    }
}

/// Reads server-sent events until job `id`'s own row arrives.
async fn events_until_job_row(response: axum::response::Response, id: u64) -> Vec<JobEvent> {
    let mut body = response.into_body();
    let mut text = String::new();
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|e: &JobEvent| matches!(&e.body, JobEventBody::Job { job } if job.id == id))
    {
        let frame = tokio::time::timeout(std::time::Duration::from_secs(10), body.frame())
            .await
            .expect("an event within 10 s")
            .unwrap()
            .unwrap();
        text.push_str(std::str::from_utf8(frame.data_ref().unwrap()).unwrap());
        while let Some(end) = text.find("\n\n") {
            let block: String = text.drain(..end + 2).collect();
            if let Some(data) = block
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .filter(|_| block.starts_with("event: job"))
            {
                seen.push(serde_json::from_str(data).unwrap());
            }
        }
    }
    seen
}

#[tokio::test]
async fn the_event_stream_carries_submissions_and_the_log_keeps_them() {
    let dir = tempfile::tempdir().unwrap();
    let state = state(dir.path());
    let response = app(state.clone())
        .oneshot(
            authed("GET", "/api/events", Some(TOKEN))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "text/event-stream"
    );
    let id = submit_mnist(&state, TOKEN).await;

    let seen = events_until_job_row(response, id).await;
    assert!(seen.iter().any(|e| matches!(
        &e.body,
        JobEventBody::Log { entry } if entry.kind == "submitted"
    )));

    let (status, body) = call(
        &state,
        authed("GET", &format!("/api/jobs/{id}/log"), Some(TOKEN))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let log: Vec<LogEntry> = serde_json::from_slice(&body).unwrap();
    assert_eq!(log[0].kind, "submitted");

    let (status, body) = call(
        &state,
        authed("GET", &format!("/api/jobs/{id}/metrics.csv"), Some(TOKEN))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        String::from_utf8(body).unwrap().trim_end(),
        rookery_server::dto::METRICS_CSV_HEADER
    );
}

#[tokio::test]
async fn a_job_can_use_a_dataset_kept_on_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let state = state(dir.path());
    let mnist = dir.path().join("datasets/mnist");
    std::fs::create_dir_all(&mnist).unwrap();
    let files = mnist_files();
    for (name, bytes) in files.iter().filter(|(n, _)| n.ends_with(".gz")) {
        std::fs::write(mnist.join(name), bytes).unwrap();
    }
    std::fs::write(mnist.join(".hidden"), b"x").unwrap();

    let (status, body) = call(
        &state,
        authed("GET", "/api/datasets", Some(TOKEN))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let datasets: Vec<rookery_proto::api::DatasetInfo> = serde_json::from_slice(&body).unwrap();
    assert_eq!(datasets.len(), 1);
    assert_eq!(datasets[0].name, "mnist");
    let names: Vec<&str> = datasets[0].files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "t10k-images-idx3-ubyte.gz",
            "t10k-labels-idx1-ubyte.gz",
            "train-images-idx3-ubyte.gz",
            "train-labels-idx1-ubyte.gz"
        ]
    );

    // Only the model travels; the data comes from the server's folder.
    let model = vec![files[0].clone()];
    let with = |dataset: &str| {
        let mut parts = model.clone();
        parts.push(("dataset", dataset.as_bytes().to_vec()));
        parts
    };
    let id = accepted(&state, TOKEN, &with("mnist")).await;
    let job_dir = dir.path().join(format!("jobs/{id}/upload"));
    assert!(job_dir.join("train-images-idx3-ubyte.gz").is_file());
    assert!(!job_dir.join(".hidden").exists());
    assert!(!job_dir.join("dataset").exists(), "the part is no file");

    for (name, expected) in [
        ("../jobs", "folder name alone"),
        ("nope", "no dataset `nope`"),
    ] {
        let (status, body) = submit(&state, JOB, &with(name)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{name}");
        let error: ApiError = serde_json::from_slice(&body).unwrap();
        assert_eq!(error.field.as_deref(), Some("dataset"), "{error:?}");
        assert!(error.error.contains(expected), "{error:?}");
    }
}
#[tokio::test]
async fn a_requester_cannot_see_or_touch_another_requesters_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let state = state(dir.path());
    let (_, bob) = requesters::create(&state.db, "bob", 0).await.unwrap();
    let bob = bob.secret().to_string();
    let mine = submit_mnist(&state, TOKEN).await;
    let bobs = submit_mnist(&state, &bob).await;
    assert_eq!(listed(&state, TOKEN).await, vec![mine]);
    assert_eq!(listed(&state, &bob).await, vec![bobs]);

    // Another Requester's job answers exactly as a job that does not exist.
    let missing = bobs + 100;
    for (method, path) in [
        ("GET", ""),
        ("GET", "/metrics"),
        ("GET", "/metrics.csv"),
        ("GET", "/log"),
        ("POST", "/cancel"),
        ("GET", "/weights"),
    ] {
        for (token, id, owner) in [(bob.as_str(), mine, TOKEN), (TOKEN, bobs, bob.as_str())] {
            let request = |job: u64, token: &str| {
                authed(method, &format!("/api/jobs/{job}{path}"), Some(token))
                    .body(Body::empty())
                    .unwrap()
            };
            let (status, body) = call(&state, request(id, token)).await;
            let (absent_status, absent_body) = call(&state, request(missing, token)).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "{method} {path} of job {id}");
            assert_eq!(absent_status, StatusCode::NOT_FOUND);
            assert_eq!(
                error_of(&body).replace(&id.to_string(), "N"),
                error_of(&absent_body).replace(&missing.to_string(), "N"),
                "{method} {path}"
            );
            // The owner still reaches it.
            let (status, _) = call(&state, request(id, owner)).await;
            let expected = if path == "/weights" {
                StatusCode::NOT_FOUND // none yet, for the owner too
            } else {
                StatusCode::OK
            };
            assert_eq!(status, expected, "{method} {path} by the owner");
        }
    }
    // Each job was cancelled once, by its owner.
    for (token, id) in [(TOKEN, mine), (bob.as_str(), bobs)] {
        let (_, body) = call(
            &state,
            authed("GET", &format!("/api/jobs/{id}"), Some(token))
                .body(Body::empty())
                .unwrap(),
        )
        .await;
        let job: JobInfo = serde_json::from_slice(&body).unwrap();
        assert_eq!(job.status, "cancelled");
        assert_eq!(job.detail.as_deref(), Some("cancelled by the Requester"));
    }
}

#[tokio::test]
async fn the_event_stream_carries_only_the_callers_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let state = state(dir.path());
    let (_, bob) = requesters::create(&state.db, "bob", 0).await.unwrap();
    let bob = bob.secret().to_string();
    let response = app(state.clone())
        .oneshot(
            authed("GET", "/api/events", Some(TOKEN))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    // Bob's job goes first, so its events come before the caller's own.
    let bobs = submit_mnist(&state, &bob).await;
    let mine = submit_mnist(&state, TOKEN).await;
    let seen = events_until_job_row(response, mine).await;
    assert!(seen.iter().all(|e| e.job_id == mine), "{seen:?}");
    assert_ne!(bobs, mine);
}

/// An event stream outlives the middleware's check of its token: once the
/// Requester is revoked, it ends instead of carrying the next event.
#[tokio::test]
async fn an_open_event_stream_ends_once_its_token_is_revoked() {
    let dir = tempfile::tempdir().unwrap();
    let state = state(dir.path());
    let (bob, token) = requesters::create(&state.db, "bob", 0).await.unwrap();
    let job = rookery_server::store::jobs::insert(
        &state.db,
        bob.id,
        "j".into(),
        "{}".into(),
        "d".into(),
        1,
    )
    .await
    .unwrap();
    let response = app(state.clone())
        .oneshot(
            authed("GET", "/api/events", Some(token.secret()))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    requesters::revoke(&state.db, "bob", 2).await.unwrap();
    state.coordinator.publish(JobEvent {
        job_id: job,
        body: JobEventBody::Log {
            entry: LogEntry {
                at_ms: 3,
                kind: "running".into(),
                message: "after the revocation".into(),
            },
        },
    });
    let mut body = response.into_body();
    let mut text = String::new();
    loop {
        let frame = tokio::time::timeout(std::time::Duration::from_secs(10), body.frame())
            .await
            .expect("the stream ends within 10 s");
        match frame {
            None => break,
            Some(frame) => text.push_str(
                std::str::from_utf8(frame.unwrap().data_ref().unwrap_or(&Default::default()))
                    .unwrap(),
            ),
        }
    }
    assert!(!text.contains("after the revocation"), "{text}");
    let (status, _) = call(
        &state,
        authed("GET", "/api/events", Some(token.secret()))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn an_upload_over_the_limit_is_refused_with_413() {
    let dir = tempfile::tempdir().unwrap();
    let state = AppState::new(
        Db::open_in_memory().unwrap(),
        Limits {
            max_upload_bytes: 64 << 10,
            ..Limits::default()
        },
        None,
        dir.path().to_path_buf(),
        Token::new(TOKEN),
    );
    let (status, body) = submit(&state, JOB, &mnist_files()).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let error = error_of(&body);
    assert!(error.contains("65536 bytes"), "{error}");
    assert!(error.contains("--max-upload-bytes"), "{error}");
    assert!(listed(&state, TOKEN).await.is_empty());
}

#[tokio::test]
async fn a_requester_may_keep_only_so_many_jobs_queued() {
    let dir = tempfile::tempdir().unwrap();
    let state = AppState::new(
        Db::open_in_memory().unwrap(),
        Limits {
            max_queued_jobs: 2,
            ..Limits::default()
        },
        None,
        dir.path().to_path_buf(),
        Token::new(TOKEN),
    );
    let first = submit_mnist(&state, TOKEN).await;
    submit_mnist(&state, TOKEN).await;
    let (status, body) = submit(&state, JOB, &mnist_files()).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let error = error_of(&body);
    assert!(error.contains("2 of your jobs are queued"), "{error}");
    assert!(error.contains("--max-queued-jobs"), "{error}");
    assert_eq!(listed(&state, TOKEN).await.len(), 2);
    // A cancelled job frees its place.
    cancel(&state, TOKEN, first).await;
    submit_mnist(&state, TOKEN).await;
}

#[tokio::test]
async fn a_requesters_queued_uploads_may_hold_only_so_many_bytes() {
    let one: u64 = mnist_files().iter().map(|(_, b)| b.len() as u64).sum();
    // (allowance, the second upload's status, what its error names)
    let cases = [
        // Room for half of another: refused as it streams past the allowance.
        (one * 3 / 2, StatusCode::PAYLOAD_TOO_LARGE, "would pass"),
        // No room at all: refused before a byte of it is read.
        (one, StatusCode::TOO_MANY_REQUESTS, "hold"),
    ];
    for (allowed, want, names) in cases {
        let dir = tempfile::tempdir().unwrap();
        let state = AppState::new(
            Db::open_in_memory().unwrap(),
            Limits {
                max_queued_upload_bytes: allowed,
                ..Limits::default()
            },
            None,
            dir.path().to_path_buf(),
            Token::new(TOKEN),
        );
        let first = submit_mnist(&state, TOKEN).await;
        let (status, body) = submit(&state, JOB, &mnist_files()).await;
        assert_eq!(status, want, "{allowed}");
        let error = error_of(&body);
        assert!(
            error.contains(names) && error.contains("--max-queued-upload-bytes"),
            "{error}"
        );
        // Nothing of the refused upload stays.
        assert_eq!(listed(&state, TOKEN).await.len(), 1);
        let leftovers = std::fs::read_dir(dir.path().join("jobs"))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with(".upload")
            })
            .count();
        assert_eq!(leftovers, 0);
        // A cancelled job frees its bytes.
        cancel(&state, TOKEN, first).await;
        submit_mnist(&state, TOKEN).await;
    }
}
