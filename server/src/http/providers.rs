//! `GET /api/providers`: every provider the server has seen, as the
//! dashboard lists them.

use std::collections::HashMap;

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use rookery_proto::api::{ProviderInfo, ProviderWork};

use super::error::AppError;
use crate::dto;
use crate::state::AppState;
use crate::store::providers;

pub fn routes() -> Router<AppState> {
    Router::new().route("/providers", get(list_providers))
}

/// Every provider the server has seen, connected ones with the stage they run.
#[utoipa::path(get, path = "/api/providers", tag = "providers",
    responses((status = 200, description = "Every provider, connected or gone", body = Vec<ProviderInfo>)))]
pub async fn list_providers(
    State(state): State<AppState>,
) -> Result<Json<Vec<ProviderInfo>>, AppError> {
    let records = providers::list(&state.db).await?;
    let mut work: HashMap<u64, ProviderWork> = state
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
                    ..dto::provider_info(record)
                }
            })
            .collect(),
    ))
}
