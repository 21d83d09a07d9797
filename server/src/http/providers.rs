//! `GET /api/providers`: every provider the server has seen, as the
//! dashboard lists them; names and work only for a Requester.

use std::collections::{HashMap, HashSet};

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::get;
use axum::{Json, Router};
use rookery_proto::api::{ApiError, ProviderInfo, ProviderWork};

use super::auth::requester_of;
use super::error::AppError;
use crate::dto;
use crate::state::AppState;
use crate::store::{jobs, providers};

pub fn routes() -> Router<AppState> {
    Router::new().route("/providers", get(list_providers))
}

/// Every provider the server has seen, connected ones with the stage they
/// run. Names are often derived from a host's name and work tells who runs
/// which job, so only a Requester sees them, and only the work of its own
/// jobs; anyone else gets the rows without names, reasons or work (the
/// public Providers page and the Donate page show what the server has).
#[utoipa::path(get, path = "/api/providers", tag = "providers",
    security((), ("api_token" = [])),
    responses((status = 200, description = "Every provider, connected or gone; names, reasons and work only for a Requester, and work only on its own jobs", body = Vec<ProviderInfo>),
        (status = 401, description = "A token was given and is wrong", body = ApiError)))]
pub async fn list_providers(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<Vec<ProviderInfo>>, AppError> {
    let requester = requester_of(&state, &headers).await?;
    let own_jobs: HashSet<u64> = match &requester {
        Some(r) => jobs::list_owned(&state.db, r.id)
            .await?
            .into_iter()
            .map(|j| j.id)
            .collect(),
        None => HashSet::new(),
    };
    let records = providers::list(&state.db).await?;
    let mut work: HashMap<u64, ProviderWork> = state
        .coordinator
        .snapshot()
        .await
        .into_iter()
        .filter_map(|live| Some((live.id, live.work?)))
        .filter(|(_, w)| own_jobs.contains(&w.job_id))
        .collect();
    Ok(Json(
        records
            .into_iter()
            .map(|record| {
                let work = work.remove(&record.id);
                let info = ProviderInfo {
                    work,
                    ..dto::provider_info(record)
                };
                if requester.is_some() {
                    info
                } else {
                    ProviderInfo {
                        name: format!("provider {}", info.id),
                        gone_reason: None,
                        ..info
                    }
                }
            })
            .collect(),
    ))
}
