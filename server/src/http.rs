//! REST handlers and the static hosting of the dashboard.

use std::path::Path;

use axum::Json;
use axum::extract::{OriginalUri, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse};
use rookery_proto::api::{ProviderInfo, ProviderStatus, ProviderWork};

use crate::AppState;
use crate::error::AppError;
use crate::providers::{self, ProviderRecord};

/// Every provider the server has seen, connected ones with the stage they run.
#[utoipa::path(get, path = "/api/providers", tag = "providers",
    responses((status = 200, description = "Every provider, connected or gone", body = Vec<ProviderInfo>)))]
pub async fn list_providers(
    State(state): State<AppState>,
) -> Result<Json<Vec<ProviderInfo>>, AppError> {
    let records = providers::list(&state.db).await?;
    let mut work: std::collections::HashMap<u64, ProviderWork> = state
        .coordinator
        .snapshot()
        .await
        .into_iter()
        .filter_map(|live| Some((live.id, live.work?)))
        .collect();
    Ok(Json(
        records
            .into_iter()
            .map(|record| {
                let work = work.remove(&record.id);
                ProviderInfo {
                    work,
                    ..provider_info(record)
                }
            })
            .collect(),
    ))
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

/// The edge where the server's record becomes the dashboard's DTO.
fn provider_info(record: ProviderRecord) -> ProviderInfo {
    ProviderInfo {
        id: record.id,
        name: record.name,
        kind: record.kind,
        device: record.device,
        memory_bytes: record.memory_bytes,
        gflops: record.gflops,
        bandwidth_mbps: record.bandwidth_mbps,
        status: if record.gone.is_some() {
            ProviderStatus::Gone
        } else {
            ProviderStatus::Connected
        },
        connected_since_ms: record.connected_ms,
        last_heartbeat_ms: record.last_heartbeat_ms,
        gone_since_ms: record.gone.as_ref().map(|gone| gone.at_ms),
        gone_reason: record.gone.map(|gone| gone.reason),
        work: None,
    }
}

/// Whether `dir` holds a built dashboard.
pub fn is_dashboard(dir: &Path) -> bool {
    dir.join("index.html").is_file()
}
