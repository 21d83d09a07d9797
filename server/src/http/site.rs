//! What is not the API proper: the health check, the answer to unknown
//! API paths, and the static dashboard (a built one, or a page that says how
//! to build it).

use std::path::Path;

use axum::extract::OriginalUri;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse};
use axum::routing::get;
use axum::{Json, Router};
use tower_http::services::{ServeDir, ServeFile};

use super::error::AppError;
use crate::state::AppState;

pub fn routes() -> Router<AppState> {
    Router::new().route("/health", get(health))
}

/// `router` with the dashboard behind every path it does not route: the
/// built dashboard in `web_dir` when there is one, else a page saying how to
/// build it.
pub fn with_dashboard(router: Router<AppState>, web_dir: Option<&Path>) -> Router<AppState> {
    match web_dir.filter(|dir| is_dashboard(dir)) {
        // Unknown paths get index.html so the dashboard's own routes deep-link.
        Some(dir) => router
            .fallback_service(ServeDir::new(dir).fallback(ServeFile::new(dir.join("index.html")))),
        None => router.fallback(dashboard_missing),
    }
}

/// Liveness and the provider protocol version.
#[utoipa::path(get, path = "/api/health", tag = "server",
    responses((status = 200, description = "`{\"status\": \"ok\", \"protocol_version\": N}`", body = Object)))]
pub async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "status": "ok",
        "protocol_version": rookery_proto::PROTOCOL_VERSION,
    }))
}

pub async fn api_not_found(OriginalUri(uri): OriginalUri) -> AppError {
    AppError::NotFound(format!("no API endpoint at {}", uri.path()))
}

/// Served in place of the dashboard when the server was started without a
/// built one, so a person sees how to get it instead of a bare 404.
pub async fn dashboard_missing() -> impl IntoResponse {
    (
        StatusCode::NOT_FOUND,
        Html(
            "<!doctype html><title>Rookery</title><h1>Rookery</h1>\
             <p>The dashboard is not built. Run <code>cargo xtask web</code> and start the \
             server with <code>--web-dir target/web</code>. The API is at <a href=\"/api/providers\">/api/providers</a>.</p>",
        ),
    )
}

/// Whether `dir` holds a built dashboard.
pub fn is_dashboard(dir: &Path) -> bool {
    dir.join("index.html").is_file()
}
