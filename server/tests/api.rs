//! The REST API through `tower::ServiceExt::oneshot`, no sockets involved.

#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use rookery_proto::api::{ApiError, CREDENTIAL_HEADER, ProviderList, ProviderStatus};
use rookery_proto::{Hello, PROTOCOL_VERSION, ProviderKind};
use rookery_server::store::Db;
use rookery_server::store::identities::{self, IssueLimit, Resolved};
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

async fn get_with(state: &AppState, headers: &[(&str, &str)]) -> ProviderList {
    let mut request = Request::get("/api/providers");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = app(state.clone())
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&body).unwrap()
}

fn hello(kind: ProviderKind, name: &str, gflops: f64) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        kind,
        device: "libtorch 2.13.0 cpu".into(),
        memory_bytes: 8 << 30,
        gflops,
        display_name: name.into(),
        max_buffer_bytes: None,
        credential: None,
        requester_token: None,
        donor: None,
        duty_cycle: 1.0,
    }
}

/// Two donors, each with an identity: a native box (one connection gone,
/// one here) and a browser tab. Returns the tab's credential and the ids.
async fn two_donors(state: &AppState) -> (String, [u64; 3]) {
    let mut credentials = Vec::new();
    for _ in 0..2 {
        match identities::resolve(&state.db, None, None, 1, IssueLimit::default())
            .await
            .unwrap()
        {
            Resolved::Issued { credential, .. } => credentials.push(credential),
            other => panic!("expected an identity, got {other:?}"),
        }
    }
    let (box_id, tab_id) = (1, 2);
    let left = providers::register(
        &state.db,
        hello(ProviderKind::Native, "box", 55.0),
        box_id,
        10,
    )
    .await
    .unwrap();
    providers::mark_gone(&state.db, left, 30, "closed".into())
        .await
        .unwrap();
    let kept = providers::register(
        &state.db,
        hello(ProviderKind::Native, "box", 55.0),
        box_id,
        40,
    )
    .await
    .unwrap();
    let tab = providers::register(
        &state.db,
        hello(ProviderKind::Browser, "my tab", 2.5),
        tab_id,
        50,
    )
    .await
    .unwrap();
    (credentials.pop().unwrap(), [left, kept, tab])
}

#[tokio::test]
async fn anyone_gets_only_counts_of_the_providers() {
    let state = state();
    assert_eq!(get_with(&state, &[]).await.providers, vec![]);
    let _ = two_donors(&state).await;

    let public = get_with(&state, &[]).await;
    assert_eq!(
        public.providers,
        vec![],
        "no rows: names are often a host's"
    );
    assert_eq!(
        public.summary.connected,
        [("browser".to_string(), 1), ("native".to_string(), 1)].into()
    );
    assert_eq!(public.summary.connected_gflops, 57.5);
    assert_eq!(public.summary.ever_seen, 2);
    // A credential this server never issued shows nothing either.
    let stranger = get_with(&state, &[(CREDENTIAL_HEADER, "not-a-credential")]).await;
    assert_eq!(stranger.providers, vec![]);
    let (status, _) = get_as(&state, "/api/providers", Some("wrong")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn a_donor_sees_its_own_providers_by_its_credential_and_nobody_elses() {
    let state = state();
    let (tab_credential, [_, _, tab]) = two_donors(&state).await;
    let own = get_with(&state, &[(CREDENTIAL_HEADER, &tab_credential)]).await;
    assert_eq!(own.providers.len(), 1);
    assert_eq!(
        (own.providers[0].id, own.providers[0].name.as_str()),
        (tab, "my tab")
    );
    assert_eq!(own.summary.ever_seen, 2);
}

#[tokio::test]
async fn a_requester_gets_every_provider_with_names_and_reasons() {
    let state = state();
    let (tab_credential, [left, kept, tab]) = two_donors(&state).await;
    let listed = get_with(
        &state,
        &[
            ("authorization", "Bearer test-token"),
            (CREDENTIAL_HEADER, &tab_credential),
        ],
    )
    .await
    .providers;
    assert_eq!(
        listed.iter().map(|p| p.id).collect::<Vec<_>>(),
        vec![tab, kept, left]
    );
    assert_eq!(listed[1].name, "box");
    assert_eq!(listed[1].status, ProviderStatus::Connected);
    assert_eq!(listed[1].device, "libtorch 2.13.0 cpu");
    assert_eq!(listed[1].gflops, 55.0);
    assert_eq!(
        (listed[2].status, listed[2].gone_since_ms),
        (ProviderStatus::Gone, Some(30))
    );
    assert_eq!(listed[2].gone_reason.as_deref(), Some("closed"));
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
        ("get", "/api/leaderboard"),
    ];
    let paths = doc["paths"].as_object().unwrap();
    assert_eq!(paths.len(), 14, "{:?}", paths.keys().collect::<Vec<_>>());
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
        "LeaderboardEntry",
        "JobMetrics",
        "StepMetric",
        "PlanPreview",
        "PlanView",
        "StageView",
        "LogEntry",
        "JobEvent",
        "ProviderList",
        "ProviderSummary",
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
