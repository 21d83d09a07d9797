//! `GET /api/providers`: the providers in numbers for anyone; every
//! provider, with names and its own jobs' work, for a Requester; and a
//! donor's own providers for whoever presents their credential.

use std::collections::{BTreeMap, HashMap, HashSet};

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::get;
use axum::{Json, Router};
use rookery_proto::ProviderKind;
use rookery_proto::api::{
    ApiError, CREDENTIAL_HEADER, LeaderboardEntry, ProviderList, ProviderSummary, ProviderWork,
};

use super::auth::requester_of;
use super::error::AppError;
use crate::dto;
use crate::state::AppState;
use crate::store::{credit, identities, jobs, providers};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/providers", get(list_providers))
        .route("/leaderboard", get(leaderboard))
}

/// Donors shown on the leaderboard at most.
pub const LEADERBOARD_SIZE: usize = 100;

/// The donors with the most credit, most first: public, as each donor chose
/// to appear (a name and team from its provider's `Hello`, else
/// `anonymous`); no identity, address or host name.
#[utoipa::path(get, path = "/api/leaderboard", tag = "providers",
    responses((status = 200, description = "The 100 donors with the most accepted work, most first", body = Vec<LeaderboardEntry>)))]
pub async fn leaderboard(
    State(state): State<AppState>,
) -> Result<Json<Vec<LeaderboardEntry>>, AppError> {
    let standings = credit::leaderboard(&state.db, LEADERBOARD_SIZE).await?;
    Ok(Json(
        standings
            .into_iter()
            .map(|s| LeaderboardEntry {
                name: s.name.unwrap_or_else(|| "anonymous".into()),
                team: s.team,
                credit: s.gflop,
            })
            .collect(),
    ))
}

/// The providers as the caller may see them. Anyone gets the counts. Rows
/// say who donates (names are often a host's, gone reasons carry a
/// provider's words, work says who runs which job), so a Requester gets
/// every row with the work of its own jobs only, and anyone else only the
/// rows of the identity whose credential it presents in
/// `X-Rookery-Credential` (a donating tab's, from its local storage): what
/// that provider was told itself.
#[utoipa::path(get, path = "/api/providers", tag = "providers",
    security((), ("api_token" = [])),
    params(("X-Rookery-Credential" = Option<String>, Header,
        description = "A provider credential this server issued: its providers are listed for a caller without a token")),
    responses((status = 200, description = "The connected providers in numbers; every provider for a Requester (work only on its own jobs), else only the credential's own", body = ProviderList),
        (status = 401, description = "A token was given and is wrong", body = ApiError)))]
pub async fn list_providers(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<ProviderList>, AppError> {
    let requester = requester_of(&state, &headers).await?;
    let summary = summary(&state).await?;
    let (records, shown_jobs) = match &requester {
        Some(r) => {
            let own_jobs: HashSet<u64> = jobs::list_owned(&state.db, r.id)
                .await?
                .into_iter()
                .map(|j| j.id)
                .collect();
            (providers::list(&state.db).await?, Some(own_jobs))
        }
        None => match credential(&headers) {
            Some(credential) => match identities::find(&state.db, credential).await? {
                // Its own stages' work is what the provider was sent itself.
                Some(identity) => (
                    providers::list_of_identity(&state.db, identity).await?,
                    None,
                ),
                None => (Vec::new(), None),
            },
            None => (Vec::new(), None),
        },
    };
    let live = if records.is_empty() {
        Vec::new()
    } else {
        state.coordinator.snapshot().await
    };
    // Each connected provider's GPU cap, as its donor set it last.
    let duty_cycles: HashMap<u64, f64> = live
        .iter()
        .map(|live| (live.id, live.hello.duty_cycle))
        .collect();
    let mut work: HashMap<u64, ProviderWork> = live
        .into_iter()
        .filter_map(|live| Some((live.id, live.work?)))
        .filter(|(_, w)| shown_jobs.as_ref().is_none_or(|j| j.contains(&w.job_id)))
        .collect();
    let providers = records
        .into_iter()
        .map(|record| {
            let work = work.remove(&record.id);
            let duty_cycle = duty_cycles.get(&record.id).copied();
            rookery_proto::api::ProviderInfo {
                work,
                duty_cycle,
                ..dto::provider_info(record)
            }
        })
        .collect();
    Ok(Json(ProviderList { summary, providers }))
}

fn credential(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(CREDENTIAL_HEADER)?.to_str().ok()?.trim();
    (!value.is_empty()).then(|| value.to_owned())
}

async fn summary(state: &AppState) -> Result<ProviderSummary, AppError> {
    let counts = providers::connected(&state.db).await?;
    let mut connected: BTreeMap<String, u64> = [ProviderKind::Native, ProviderKind::Browser]
        .into_iter()
        .map(|kind| (kind.as_str().to_owned(), 0))
        .collect();
    for (kind, n) in counts.by_kind {
        connected.insert(kind.as_str().to_owned(), n);
    }
    Ok(ProviderSummary {
        connected,
        connected_gflops: counts.gflops,
        ever_seen: identities::count(&state.db).await?,
    })
}
