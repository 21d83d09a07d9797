//! The REST API through `tower::ServiceExt::oneshot`, no sockets involved.

#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use rookery_proto::api::{ApiError, ProviderInfo, ProviderStatus};
use rookery_proto::{Hello, PROTOCOL_VERSION, ProviderKind};
use rookery_server::store::Db;
use rookery_server::store::providers;
use rookery_server::store::tokens::Token;
use rookery_server::{AppState, Limits, app};
use tower::ServiceExt;

async fn get(state: &AppState, path: &str) -> (StatusCode, Vec<u8>) {
    get_as(state, path, None).await
}

async fn get_as(state: &AppState, path: &str, token: Option<&str>) -> (StatusCode, Vec<u8>) {
    let mut request = Request::get(path);
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let response = app(state.clone())
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
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

fn state() -> AppState {
    AppState::new(
        Db::open_in_memory().unwrap(),
        Limits::default(),
        None,
        std::env::temp_dir(),
        Token::new("test-token"),
    )
}

#[tokio::test]
async fn providers_endpoint_lists_registered_and_departed_providers() {
    let state = state();
    let (status, body) = get(&state, "/api/providers").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_slice::<Vec<ProviderInfo>>(&body).unwrap(),
        vec![]
    );

    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        kind: ProviderKind::Native,
        device: "libtorch 2.13.0 cpu".into(),
        memory_bytes: 8 << 30,
        gflops: 55.0,
        display_name: "box".into(),
        max_buffer_bytes: None,
        credential: None,
    };
    let kept = providers::register(&state.db, hello.clone(), 1, 10)
        .await
        .unwrap();
    let left = providers::register(&state.db, hello, 2, 20).await.unwrap();
    providers::mark_gone(&state.db, left, 30, "closed".into())
        .await
        .unwrap();

    // Anyone sees the rows, without names or reasons: names are often a
    // host's, and reasons can carry a provider's words.
    let (status, body) = get(&state, "/api/providers").await;
    assert_eq!(status, StatusCode::OK);
    let public: Vec<ProviderInfo> = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        public.iter().map(|p| p.name.clone()).collect::<Vec<_>>(),
        vec![format!("provider {kept}"), format!("provider {left}")]
    );
    assert!(
        public
            .iter()
            .all(|p| p.gone_reason.is_none() && p.work.is_none())
    );
    let (status, _) = get_as(&state, "/api/providers", Some("wrong")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    let (status, body) = get_as(&state, "/api/providers", Some("test-token")).await;
    assert_eq!(status, StatusCode::OK);
    let listed: Vec<ProviderInfo> = serde_json::from_slice(&body).unwrap();
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[0].name, "box");
    assert_eq!(
        (listed[0].id, listed[0].status),
        (kept, ProviderStatus::Connected)
    );
    assert_eq!(listed[0].device, "libtorch 2.13.0 cpu");
    assert_eq!(listed[0].gflops, 55.0);
    assert_eq!(
        (listed[1].id, listed[1].status),
        (left, ProviderStatus::Gone)
    );
    assert_eq!(listed[1].gone_since_ms, Some(30));
    assert_eq!(listed[1].gone_reason.as_deref(), Some("closed"));
}

#[tokio::test]
async fn unknown_api_paths_are_json_404s() {
    let (status, body) = get(&state(), "/api/nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let error: ApiError = serde_json::from_slice(&body).unwrap();
    assert_eq!(error.error, "not found: no API endpoint at /api/nope");
}

#[tokio::test]
async fn without_a_dashboard_the_root_page_says_how_to_build_it() {
    let (status, body) = get(&state(), "/").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(String::from_utf8(body).unwrap().contains("cargo xtask web"));
}

#[tokio::test]
async fn the_dashboard_is_served_with_deep_links_falling_back_to_index() {
    let web = tempfile::tempdir().unwrap();
    std::fs::write(web.path().join("index.html"), "<html>dashboard</html>").unwrap();
    std::fs::create_dir(web.path().join("pkg")).unwrap();
    std::fs::write(web.path().join("pkg/app.js"), "export {}").unwrap();
    let state = AppState::new(
        Db::open_in_memory().unwrap(),
        Limits::default(),
        Some(web.path().to_path_buf()),
        std::env::temp_dir(),
        Token::new("test-token"),
    );
    assert_eq!(
        get(&state, "/pkg/app.js").await,
        (StatusCode::OK, b"export {}".to_vec())
    );
    for route in ["/", "/donate", "/providers"] {
        let (status, body) = get(&state, route).await;
        assert_eq!(status, StatusCode::OK, "{route}");
        assert_eq!(body, b"<html>dashboard</html>", "{route}");
    }
    // The API keeps its own 404s rather than falling back to the dashboard.
    assert_eq!(get(&state, "/api/nope").await.0, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn health_reports_the_protocol_version() {
    let (status, body) = get(&state(), "/api/health").await;
    assert_eq!(status, StatusCode::OK);
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["protocol_version"], PROTOCOL_VERSION);
}

#[tokio::test]
async fn the_openapi_description_documents_every_endpoint_and_dto_the_dashboard_uses() {
    let state = state();
    let (status, body) = get(&state, "/api/openapi.json").await;
    assert_eq!(status, StatusCode::OK);
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let endpoints = [
        ("get", "/api/health"),
        ("get", "/api/providers"),
        ("get", "/api/openapi.json"),
        ("get", "/api/jobs"),
        ("post", "/api/jobs"),
        ("get", "/api/jobs/{id}"),
        ("get", "/api/jobs/{id}/metrics"),
        ("get", "/api/jobs/{id}/metrics.csv"),
        ("get", "/api/jobs/{id}/log"),
        ("post", "/api/jobs/{id}/cancel"),
        ("get", "/api/jobs/{id}/weights"),
        ("post", "/api/plan"),
        ("get", "/api/events"),
        ("get", "/api/datasets"),
    ];
    let paths = doc["paths"].as_object().unwrap();
    assert_eq!(paths.len(), 13, "{:?}", paths.keys().collect::<Vec<_>>());
    for (method, path) in endpoints {
        let operation = &doc["paths"][path][method];
        assert!(operation.is_object(), "{method} {path} is not documented");
        // Job endpoints say they need the token; public ones do not.
        let guarded = path.starts_with("/api/jobs")
            || ["/api/plan", "/api/events", "/api/datasets"].contains(&path);
        assert_eq!(
            operation["security"][0].get("api_token").is_some(),
            guarded,
            "{method} {path}"
        );
        // Every documented endpoint answers (no 404 from the API fallback).
        let request = Request::builder()
            .method(method.to_uppercase().as_str())
            .uri(path.replace("{id}", "1"))
            .body(Body::empty())
            .unwrap();
        let response = app(state.clone()).oneshot(request).await.unwrap();
        let answered = response.status();
        let fallback = !guarded && answered == StatusCode::NOT_FOUND;
        assert!(!fallback, "{method} {path} answered {answered}");
        if guarded {
            assert_eq!(answered, StatusCode::UNAUTHORIZED, "{method} {path}");
        }
    }
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for dto in [
        "JobInfo",
        "JobCreated",
        "JobMetrics",
        "StepMetric",
        "PlanPreview",
        "PlanView",
        "StageView",
        "LogEntry",
        "JobEvent",
        "ProviderInfo",
        "ProviderWork",
        "ApiError",
        "DatasetInfo",
    ] {
        assert!(schemas.contains_key(dto), "no schema for {dto}");
    }
    // Field names are the JSON ones (serde's), e.g. the optional error field.
    assert!(schemas["ApiError"]["properties"]["field"].is_object());
    assert_eq!(
        doc["components"]["securitySchemes"]["api_token"]["scheme"],
        "bearer"
    );
}
