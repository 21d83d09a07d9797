//! The job endpoints once a job exists: list, inspect, metrics (JSON and
//! CSV), the event log and the live event stream, cancel, and download the
//! weights (uploads are in the `upload` module). Each Requester sees and
//! touches only their own jobs; another's job answers 404, as a missing one
//! does.

use std::convert::Infallible;
use std::path::Path;

use axum::body::Body;
use axum::extract::{Extension, Path as UrlPath, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, routing};
use futures_util::Stream;
use rookery_proto::api::{ApiError, JobEvent, JobEventBody, JobInfo, JobMetrics, LogEntry};
use serde::Deserialize;
use tokio::sync::broadcast::error::RecvError;

use super::error::AppError;
use crate::coordinator::Event;
use crate::state::AppState;
use crate::store::checkpoints::{checkpoint_path, cluster_weights_path, weights_path};
use crate::store::jobs::{self, JobRecord, LogRecord};
use crate::store::requesters::{self, Requester};
use crate::store::tokens::digest_hex;
use crate::{admission, dto, now_ms};

/// Log lines `GET /api/jobs/{id}/log` returns at most (the latest).
const LOG_LINES: usize = 1000;

/// How often an open event stream checks that the token it was opened with
/// still works, so a revoked Requester stops hearing of its jobs.
const STREAM_RECHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// The job endpoints (behind the Requester's token).
pub fn routes() -> Router<AppState> {
    // `routing::get` in full: `get` is also the handler of one job.
    Router::new()
        .route("/jobs", routing::get(list))
        .route("/jobs/{id}", routing::get(get))
        .route("/jobs/{id}/metrics", routing::get(metrics))
        .route("/jobs/{id}/metrics.csv", routing::get(metrics_as_csv))
        .route("/jobs/{id}/log", routing::get(log))
        .route("/events", routing::get(events))
        .route("/jobs/{id}/cancel", routing::post(cancel))
        .route("/jobs/{id}/weights", routing::get(weights))
}

/// Every job, newest first.
#[utoipa::path(get, path = "/api/jobs", tag = "jobs", security(("api_token" = [])),
    responses((status = 200, description = "Every job", body = Vec<JobInfo>),
        (status = 401, description = "No or wrong API token", body = ApiError)))]
pub async fn list(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
) -> Result<Json<Vec<JobInfo>>, AppError> {
    let records = jobs::list_owned(&state.db, requester.id).await?;
    Ok(Json(records.into_iter().map(dto::job_info).collect()))
}

async fn find(state: &AppState, requester: &Requester, id: u64) -> Result<JobRecord, AppError> {
    jobs::get_owned(&state.db, id, requester.id)
        .await?
        .ok_or_else(|| AppError::NotFound(format!("job {id}")))
}

/// One job.
#[utoipa::path(get, path = "/api/jobs/{id}", tag = "jobs", params(("id" = u64, Path, description = "The job's id")),
    security(("api_token" = [])),
    responses((status = 200, description = "The job", body = JobInfo),
        (status = 404, description = "No such job", body = ApiError)))]
pub async fn get(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    UrlPath(id): UrlPath<u64>,
) -> Result<Json<JobInfo>, AppError> {
    Ok(Json(dto::job_info(find(&state, &requester, id).await?)))
}

/// Per-step and per-epoch metrics so far.
#[utoipa::path(get, path = "/api/jobs/{id}/metrics", tag = "jobs", params(("id" = u64, Path, description = "The job's id")),
    security(("api_token" = [])),
    responses((status = 200, description = "Every step and evaluated epoch", body = JobMetrics),
        (status = 404, description = "No such job", body = ApiError)))]
pub async fn metrics(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    UrlPath(id): UrlPath<u64>,
) -> Result<Json<JobMetrics>, AppError> {
    find(&state, &requester, id).await?;
    let steps = jobs::steps(&state.db, id).await?;
    let epochs = jobs::epochs(&state.db, id).await?;
    Ok(Json(JobMetrics {
        steps: steps.into_iter().map(dto::step_metric).collect(),
        epochs: epochs.iter().map(dto::epoch_metric).collect(),
    }))
}

/// The metrics as CSV: one row per step, then one per epoch (see
/// [`dto::METRICS_CSV_HEADER`]).
#[utoipa::path(get, path = "/api/jobs/{id}/metrics.csv", tag = "jobs", params(("id" = u64, Path, description = "The job's id")),
    security(("api_token" = [])),
    responses((status = 200, description = "kind,step,epoch,loss,samples_per_s,elapsed_ms,bytes_relayed,bytes_synced,test_loss,test_accuracy,test_samples", body = String, content_type = "text/csv"),
        (status = 404, description = "No such job", body = ApiError)))]
pub async fn metrics_as_csv(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    UrlPath(id): UrlPath<u64>,
) -> Result<Response, AppError> {
    find(&state, &requester, id).await?;
    let steps = jobs::steps(&state.db, id).await?;
    let epochs = jobs::epochs(&state.db, id).await?;
    Ok((
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/csv; charset=utf-8".to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"job-{id}-metrics.csv\""),
            ),
        ],
        dto::metrics_csv(&steps, &epochs),
    )
        .into_response())
}

/// The job's event log, oldest first (the latest lines only).
#[utoipa::path(get, path = "/api/jobs/{id}/log", tag = "jobs", params(("id" = u64, Path, description = "The job's id")),
    security(("api_token" = [])),
    responses((status = 200, description = "The latest 1000 lines", body = Vec<LogEntry>),
        (status = 404, description = "No such job", body = ApiError)))]
pub async fn log(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    UrlPath(id): UrlPath<u64>,
) -> Result<Json<Vec<LogEntry>>, AppError> {
    find(&state, &requester, id).await?;
    let lines = jobs::log(&state.db, id, LOG_LINES).await?;
    Ok(Json(lines.into_iter().map(dto::log_entry).collect()))
}

#[derive(Debug, Deserialize)]
pub struct EventFilter {
    /// Only this job's events.
    pub job: Option<u64>,
}

/// `GET /api/events`: server-sent events, each a JSON [`JobEvent`] under
/// the event name `job`. A subscriber that falls too far behind gets one
/// `lagged` event (with how many it missed) and should reload what it shows.
/// The stream ends before the first job event after its token is revoked
/// (checked at most once a second); the client's reconnection then gets a 401.
#[utoipa::path(get, path = "/api/events", tag = "jobs",
    params(("job" = Option<u64>, Query, description = "Only this job's events")), security(("api_token" = [])),
    responses((status = 200, description = "Server-sent events: `event: job` with a JobEvent as JSON data, or `event: lagged` with the number of events missed", body = JobEvent, content_type = "text/event-stream")))]
pub async fn events(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    Query(filter): Query<EventFilter>,
    headers: HeaderMap,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    /// The subscription, whether each job seen so far is the caller's
    /// (looked up once per job, so another Requester's jobs stay unseen),
    /// and the caller's token (as its digest) with when it last worked.
    struct Subscription {
        rx: tokio::sync::broadcast::Receiver<JobEvent>,
        owned: std::collections::HashMap<u64, bool>,
        digest: String,
        checked: Option<tokio::time::Instant>,
    }
    let db = state.db.clone();
    let start = Subscription {
        rx: state.coordinator.subscribe(),
        owned: Default::default(),
        // The middleware let the request in with this token.
        digest: admission::bearer(&headers)
            .map(digest_hex)
            .unwrap_or_default(),
        checked: None,
    };
    let stream = futures_util::stream::unfold(start, move |mut sub| {
        let db = db.clone();
        async move {
            loop {
                match sub.rx.recv().await {
                    Ok(event) if filter.job.is_some_and(|job| job != event.job_id) => continue,
                    Ok(event) => {
                        let owned = match sub.owned.get(&event.job_id) {
                            Some(&owned) => owned,
                            None => {
                                let owned = jobs::get_owned(&db, event.job_id, requester.id)
                                    .await
                                    .is_ok_and(|job| job.is_some());
                                sub.owned.insert(event.job_id, owned);
                                owned
                            }
                        };
                        if !owned {
                            continue;
                        }
                        // The middleware checked the token once; a stream
                        // outlives that check, so it checks again.
                        if sub.checked.is_none_or(|at| at.elapsed() >= STREAM_RECHECK) {
                            let still = requesters::authenticate_digest(&db, sub.digest.clone())
                                .await
                                .is_ok_and(|r| r.is_some_and(|r| r.id == requester.id));
                            if !still {
                                return None;
                            }
                            sub.checked = Some(tokio::time::Instant::now());
                        }
                        let data = serde_json::to_string(&event).unwrap_or_default();
                        return Some((Ok(SseEvent::default().event("job").data(data)), sub));
                    }
                    Err(RecvError::Lagged(missed)) => {
                        let event = SseEvent::default().event("lagged").data(missed.to_string());
                        return Some((Ok(event), sub));
                    }
                    Err(RecvError::Closed) => return None,
                }
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// Stops a job; its providers are released.
#[utoipa::path(post, path = "/api/jobs/{id}/cancel", tag = "jobs", params(("id" = u64, Path, description = "The job's id")),
    security(("api_token" = [])),
    responses((status = 200, description = "The cancelled job", body = JobInfo),
        (status = 404, description = "No such job", body = ApiError),
        (status = 409, description = "The job had already finished", body = ApiError)))]
pub async fn cancel(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    UrlPath(id): UrlPath<u64>,
) -> Result<Json<JobInfo>, AppError> {
    let job = find(&state, &requester, id).await?;
    if job.status.is_finished() {
        return Err(AppError::Conflict(format!(
            "job {id} is already {}",
            job.status.as_str()
        )));
    }
    jobs::set_status(
        &state.db,
        id,
        jobs::JobStatus::Cancelled,
        Some("cancelled by the Requester".into()),
        now_ms(),
    )
    .await?;
    state.coordinator.send(Event::Cancel { job_id: id }).await;
    log_line(&state, id, "cancelled", "cancelled by the Requester".into()).await?;
    let job = dto::job_info(find(&state, &requester, id).await?);
    state.coordinator.publish(JobEvent {
        job_id: id,
        body: JobEventBody::Job { job: job.clone() },
    });
    Ok(Json(job))
}

/// Writes a line to a job's log and sends it to live subscribers.
pub(super) async fn log_line(
    state: &AppState,
    id: u64,
    kind: &str,
    message: String,
) -> Result<(), AppError> {
    let at_ms = now_ms();
    let record = LogRecord {
        at_ms,
        kind: kind.into(),
        message: message.clone(),
    };
    jobs::append_log(&state.db, id, record).await?;
    state.coordinator.publish(JobEvent {
        job_id: id,
        body: JobEventBody::Log {
            entry: LogEntry {
                at_ms,
                kind: kind.into(),
                message,
            },
        },
    });
    Ok(())
}

#[derive(Debug, Deserialize)]
pub struct WeightsQuery {
    /// One cluster's own weights instead of the combined ones.
    pub cluster: Option<usize>,
}

/// The trained weights of a completed job; while it runs, the latest
/// checkpoint. With `?cluster=N`, cluster N's own weights as it finished,
/// before the last sync combined them (Ravnest's `model_fusion(cluster_id)`),
/// kept once a job that trained several clusters completes.
#[utoipa::path(get, path = "/api/jobs/{id}/weights", tag = "jobs",
    params(("id" = u64, Path, description = "The job's id"),
        ("cluster" = Option<usize>, Query, description = "One cluster's own weights (0-based), once a job with several clusters completed")),
    security(("api_token" = [])),
    responses((status = 200, description = "A safetensors file named by the model's parameters", body = Vec<u8>, content_type = "application/octet-stream"),
        (status = 404, description = "No such job, or no weights yet", body = ApiError)))]
pub async fn weights(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    UrlPath(id): UrlPath<u64>,
    Query(query): Query<WeightsQuery>,
) -> Result<Response, AppError> {
    find(&state, &requester, id).await?;
    let candidates = match query.cluster {
        Some(c) => vec![cluster_weights_path(&state.data_dir, id, c)],
        None => vec![
            weights_path(&state.data_dir, id),
            checkpoint_path(&state.data_dir, id),
        ],
    };
    for path in candidates {
        // Streamed from disk: a GPT-2's weights are 650 MB, and a download
        // must not hold them in the server's memory.
        let opened = match tokio::fs::File::open(&path).await {
            Ok(file) => file.metadata().await.map(|meta| (file, meta.len())),
            Err(error) => Err(error),
        };
        match opened {
            Ok((file, len)) => {
                let name = format!("job-{id}-{}", file_name(&path));
                return Ok((
                    StatusCode::OK,
                    [
                        (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                        (header::CONTENT_LENGTH, len.to_string()),
                        (
                            header::CONTENT_DISPOSITION,
                            format!("attachment; filename=\"{name}\""),
                        ),
                    ],
                    Body::from_stream(tokio_util::io::ReaderStream::new(file)),
                )
                    .into_response());
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => return Err(AppError::Internal(format!("{}: {error}", path.display()))),
        }
    }
    Err(AppError::NotFound(match query.cluster {
        Some(c) => format!(
            "weights of cluster {c} of job {id}: none (each cluster's own weights are kept when a job that trained several clusters completes; clusters count from 0)"
        ),
        None => format!("weights of job {id}: none yet (they appear at the first sync)"),
    }))
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}
