//! The job endpoints: submit (multipart upload of the job file and the files
//! it names), preview the plan of such an upload, list, inspect, metrics
//! (JSON and CSV), the event log and the live event stream, cancel, and
//! download the weights. Every check that can fail runs before the job is
//! accepted, so a queued job has a readable model and data that match it.
//! Each Requester sees and touches only their own jobs; another's job
//! answers 404, as a missing one does.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::path::{Component, Path, PathBuf};

use axum::Json;
use axum::body::Body;
use axum::extract::{Extension, Multipart, Path as UrlPath, Query, State};
use axum::http::{StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use rookery_job::JobSpec;
use rookery_proto::api::{
    ApiError, EpochMetric, JobCreated, JobEvent, JobEventBody, JobInfo, JobMetrics, LogEntry,
    PlanPreview, StageMetric, StepMetric,
};
use serde::Deserialize;
use tokio::sync::broadcast::error::RecvError;

use crate::coordinator::{self, Event, PrepareError, Prepared};
use crate::error::AppError;
use crate::jobs::{self, JobRecord, LogRecord};
use crate::requesters::Requester;
use crate::{AppState, now_ms};

/// How a job upload is laid out, for the OpenAPI description.
const UPLOAD_DESCRIPTION: &str = "Part `job`: the job file (TOML, or JSON when it starts with `{`; the job is named after the part's file name). Optional part `dataset`: the name of a dataset on the server (GET /api/datasets) whose files join the upload. Every other part is a file the job file names, stored under its part name (a relative path), e.g. the ONNX model, its `.data` side file and the data files.";

/// Log lines `GET /api/jobs/{id}/log` returns at most (the latest).
const LOG_LINES: usize = 1000;

/// The multipart part that carries the job file (TOML or JSON); every other
/// part is a file, stored under its part name (a relative path).
pub const JOB_PART: &str = "job";

/// The edge where the stored record becomes the API's DTO.
pub fn job_info(record: JobRecord) -> JobInfo {
    JobInfo {
        id: record.id,
        name: record.name,
        status: record.status.as_str().to_string(),
        detail: record.detail,
        created_ms: record.created_ms,
        started_ms: record.started_ms,
        finished_ms: record.finished_ms,
        step: record.step,
        total_steps: record.total_steps,
        epoch: record.epoch,
        last_loss: record.last_loss,
        samples_per_s: record.samples_per_s,
        // Rows planned before plans were stored as views have none.
        plan: record
            .plan_json
            .as_deref()
            .and_then(|p| serde_json::from_str(p).ok()),
    }
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
    Ok(Json(records.into_iter().map(job_info).collect()))
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
    Ok(Json(job_info(find(&state, &requester, id).await?)))
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
        steps: steps.into_iter().map(step_metric).collect(),
        epochs: epochs
            .into_iter()
            .map(|e| EpochMetric {
                epoch: e.epoch,
                test_loss: e.test_loss,
                test_accuracy: e.test_accuracy,
                samples: e.samples,
            })
            .collect(),
    }))
}

/// The edge where a stored step becomes the API's DTO.
pub fn step_metric(s: jobs::StepRecord) -> StepMetric {
    StepMetric {
        step: s.step,
        epoch: s.epoch,
        loss: s.loss,
        samples_per_s: s.samples_per_s,
        elapsed_ms: s.elapsed_ms,
        bytes_relayed: s.bytes_relayed,
        stages: s
            .stages
            .into_iter()
            .map(|t| StageMetric {
                cluster: t.cluster,
                stage: t.stage,
                provider: t.provider,
                compute_ms: t.compute_ms,
                idle_ms: t.idle_ms,
            })
            .collect(),
    }
}

/// The header of `GET /api/jobs/{id}/metrics.csv`: one row per step
/// (`kind` = `step`) then one per evaluated epoch (`kind` = `epoch`); the
/// columns a row's kind does not have are empty.
pub const METRICS_CSV_HEADER: &str = "kind,step,epoch,loss,samples_per_s,elapsed_ms,bytes_relayed,test_loss,test_accuracy,test_samples";

pub fn metrics_csv(steps: &[jobs::StepRecord], epochs: &[jobs::EpochRecord]) -> String {
    let mut csv = String::with_capacity(64 * (steps.len() + epochs.len() + 1));
    csv.push_str(METRICS_CSV_HEADER);
    csv.push('\n');
    for s in steps {
        let _ = writeln!(
            csv,
            "step,{},{},{},{},{},{},,,",
            s.step, s.epoch, s.loss, s.samples_per_s, s.elapsed_ms, s.bytes_relayed
        );
    }
    for e in epochs {
        let _ = writeln!(
            csv,
            "epoch,,{},,,,,{},{},{}",
            e.epoch, e.test_loss, e.test_accuracy, e.samples
        );
    }
    csv
}

/// The metrics as CSV: one row per step, then one per epoch (see
/// [`METRICS_CSV_HEADER`]).
#[utoipa::path(get, path = "/api/jobs/{id}/metrics.csv", tag = "jobs", params(("id" = u64, Path, description = "The job's id")),
    security(("api_token" = [])),
    responses((status = 200, description = "kind,step,epoch,loss,samples_per_s,elapsed_ms,bytes_relayed,test_loss,test_accuracy,test_samples", body = String, content_type = "text/csv"),
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
        metrics_csv(&steps, &epochs),
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
    Ok(Json(
        lines
            .into_iter()
            .map(|l| LogEntry {
                at_ms: l.at_ms,
                kind: l.kind,
                message: l.message,
            })
            .collect(),
    ))
}

#[derive(Debug, Deserialize)]
pub struct EventFilter {
    /// Only this job's events.
    pub job: Option<u64>,
}

/// `GET /api/events`: server-sent events, each a JSON [`JobEvent`] under
/// the event name `job`. A subscriber that falls too far behind gets one
/// `lagged` event (with how many it missed) and should reload what it shows.
#[utoipa::path(get, path = "/api/events", tag = "jobs",
    params(("job" = Option<u64>, Query, description = "Only this job's events")), security(("api_token" = [])),
    responses((status = 200, description = "Server-sent events: `event: job` with a JobEvent as JSON data, or `event: lagged` with the number of events missed", body = JobEvent, content_type = "text/event-stream")))]
pub async fn events(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    Query(filter): Query<EventFilter>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    /// The subscription, and whether each job seen so far is the caller's
    /// (looked up once per job, so another Requester's jobs stay unseen).
    struct Subscription {
        rx: tokio::sync::broadcast::Receiver<JobEvent>,
        owned: std::collections::HashMap<u64, bool>,
    }
    let db = state.db.clone();
    let start = Subscription {
        rx: state.coordinator.subscribe(),
        owned: Default::default(),
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
    state.coordinator.send(Event::Cancel { job_id: id });
    log_line(&state, id, "cancelled", "cancelled by the Requester".into()).await?;
    let job = job_info(find(&state, &requester, id).await?);
    state.coordinator.publish(JobEvent {
        job_id: id,
        body: JobEventBody::Job { job: job.clone() },
    });
    Ok(Json(job))
}

/// Writes a line to a job's log and sends it to live subscribers.
async fn log_line(state: &AppState, id: u64, kind: &str, message: String) -> Result<(), AppError> {
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

/// The trained weights of a completed job; while it runs, the latest checkpoint.
#[utoipa::path(get, path = "/api/jobs/{id}/weights", tag = "jobs", params(("id" = u64, Path, description = "The job's id")),
    security(("api_token" = [])),
    responses((status = 200, description = "A safetensors file named by the model's parameters", body = Vec<u8>, content_type = "application/octet-stream"),
        (status = 404, description = "No such job, or no weights yet", body = ApiError)))]
pub async fn weights(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    UrlPath(id): UrlPath<u64>,
) -> Result<Response, AppError> {
    find(&state, &requester, id).await?;
    let candidates = [
        coordinator::weights_path(&state.data_dir, id),
        coordinator::checkpoint_path(&state.data_dir, id),
    ];
    for path in candidates {
        match tokio::fs::read(&path).await {
            Ok(bytes) => {
                let name = format!("job-{id}-{}", file_name(&path));
                return Ok((
                    StatusCode::OK,
                    [
                        (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                        (
                            header::CONTENT_DISPOSITION,
                            format!("attachment; filename=\"{name}\""),
                        ),
                    ],
                    Body::from(bytes),
                )
                    .into_response());
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => return Err(AppError::Internal(format!("{}: {error}", path.display()))),
        }
    }
    Err(AppError::NotFound(format!(
        "weights of job {id}: none yet (they appear at the first sync)"
    )))
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// A part name as a path inside the job folder: relative, no `..`, no hidden
/// or empty components.
fn safe_relative(name: &str) -> Result<PathBuf, AppError> {
    let path = Path::new(name);
    let ok = !name.is_empty()
        && name.len() <= 255
        && path.components().all(|c| match c {
            Component::Normal(part) => !part.to_string_lossy().starts_with('.'),
            _ => false,
        });
    if ok {
        Ok(path.to_path_buf())
    } else {
        Err(AppError::BadRequest(format!(
            "file part `{name}`: names must be relative paths without `..` or hidden components"
        )))
    }
}

/// Parses an uploaded job file's text (JSON or TOML) whose files are in
/// `base`. Errors name files relative to the upload: the server's own
/// folders are no business of the client's.
pub fn parse_job(text: &str, base: &Path) -> Result<JobSpec, rookery_job::JobError> {
    JobSpec::from_upload(text, base)
}

/// `message` with the upload folder's path taken out of the names it shows.
fn relative_to(message: &str, base: &Path) -> String {
    let base = base.display().to_string();
    message
        .replace(&format!("{base}/"), "")
        .replace(&base, "the upload")
}

/// Receives an upload into a fresh folder and checks it in full. On error
/// the folder is gone; on success the caller owns it.
async fn receive_checked(
    state: &AppState,
    multipart: &mut Multipart,
) -> Result<(PathBuf, String, String, Prepared), AppError> {
    let jobs_dir = state.data_dir.join("jobs");
    let upload = jobs_dir.join(format!(".upload-{:016x}", rand::random::<u64>()));
    let result = async {
        let (name, text, dataset) =
            receive(multipart, &upload, state.limits.max_upload_bytes).await?;
        if let Some(dataset) = dataset {
            let (data_dir, dest) = (state.data_dir.clone(), upload.clone());
            tokio::task::spawn_blocking(move || {
                crate::datasets::link_into(&data_dir, &dataset, &dest)
            })
            .await
            .map_err(|e| AppError::Internal(format!("linking a dataset crashed: {e}")))??;
        }
        Ok::<_, AppError>((name, text))
    }
    .await;
    let (name, text) = match result {
        Ok(job) => job,
        Err(error) => {
            let _ = tokio::fs::remove_dir_all(&upload).await;
            return Err(error);
        }
    };
    let base = upload.clone();
    let checked = tokio::task::spawn_blocking(move || {
        let spec = parse_job(&text, &base)?;
        let prepared = coordinator::prepare(spec)?;
        Ok::<_, PrepareError>((text, prepared))
    })
    .await
    .map_err(|e| AppError::Internal(format!("checking a job crashed: {e}")));
    match checked {
        Ok(Ok((text, prepared))) => Ok((upload, name, text, prepared)),
        Ok(Err(error)) => {
            let _ = tokio::fs::remove_dir_all(&upload).await;
            Err(upload_error(error, &upload))
        }
        Err(error) => {
            let _ = tokio::fs::remove_dir_all(&upload).await;
            Err(error)
        }
    }
}

/// A failed check as the Requester should read it: paths relative to the
/// upload (as the parts were named), and the field or file it concerns.
fn upload_error(error: PrepareError, upload: &Path) -> AppError {
    let message = relative_to(&error.message, upload);
    match error.field {
        Some(field) => AppError::Field {
            field: relative_to(&field, upload),
            message,
        },
        None => AppError::BadRequest(message),
    }
}

/// `POST /api/plan`: the same upload as `POST /api/jobs`, checked the same
/// way, answered with the plan the scheduler would make with the idle native
/// providers connected now. Nothing is kept.
#[utoipa::path(post, path = "/api/plan", tag = "jobs", security(("api_token" = [])),
    request_body(content = String, content_type = "multipart/form-data", description = UPLOAD_DESCRIPTION),
    responses((status = 200, description = "The plan, per cluster and stage", body = PlanPreview),
        (status = 400, description = "The upload is invalid; `field` names the job-file field or file", body = ApiError),
        (status = 409, description = "The upload is fine but the providers connected now cannot take it", body = ApiError)))]
pub async fn plan(
    State(state): State<AppState>,
    mut multipart: Multipart,
) -> Result<Json<PlanPreview>, AppError> {
    let (upload, _, _, prepared) = receive_checked(&state, &mut multipart).await?;
    let _ = tokio::fs::remove_dir_all(&upload).await;
    // The providers the scheduler would plan onto now.
    let live = state.coordinator.snapshot().await;
    let specs: Vec<_> = live
        .iter()
        .filter_map(coordinator::LiveProvider::candidate)
        .collect();
    if specs.is_empty() {
        return Err(AppError::Conflict(
            "no idle native provider is connected: start `rookery-provider --server ws://HOST:PORT` on a machine (the job can still be submitted; it waits for providers)".into(),
        ));
    }
    let options = coordinator::plan_options(&prepared.spec);
    let plan = rookery_plan::clusterize(&prepared.graph, &specs, &options).map_err(|e| {
        AppError::Conflict(format!(
            "the {} idle providers cannot take this job now: {e}",
            specs.len()
        ))
    })?;
    let who = coordinator::by_plan_id(live);
    Ok(Json(PlanPreview {
        plan: crate::plan_view::plan_view(&plan, &prepared.graph, &who),
        warnings: prepared.warnings,
        train_samples: prepared.train.len() as u64,
        test_samples: prepared.test.as_ref().map_or(0, |t| t.len() as u64),
    }))
}

/// Submits a job: checked in full, then queued until providers take it.
#[utoipa::path(post, path = "/api/jobs", tag = "jobs", security(("api_token" = [])),
    request_body(content = String, content_type = "multipart/form-data", description = UPLOAD_DESCRIPTION),
    responses((status = 201, description = "Accepted and queued", body = JobCreated),
        (status = 400, description = "The upload is invalid; `field` names the job-file field or file", body = ApiError)))]
pub async fn create(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    mut multipart: Multipart,
) -> Result<(StatusCode, Json<JobCreated>), AppError> {
    let (upload, name, text, mut prepared) = receive_checked(&state, &mut multipart).await?;
    // Reserve the id, then move the files to the job's own folder and store
    // the spec with paths resolved there.
    let id = jobs::insert(
        &state.db,
        requester.id,
        name,
        "{}".into(),
        String::new(),
        now_ms(),
    )
    .await?;
    let dir = coordinator::job_dir(&state.data_dir, id);
    let stored = async {
        tokio::fs::rename(&upload, &dir)
            .await
            .map_err(|e| format!("moving the upload: {e}"))?;
        let spec = parse_job(&text, &dir).map_err(|e| e.to_string())?;
        let json = spec.to_json().map_err(|e| e.to_string())?;
        Ok::<_, String>((spec, json))
    }
    .await;
    let spec_json = match stored {
        Ok((spec, json)) => {
            prepared.spec = spec;
            json
        }
        Err(reason) => {
            let _ = tokio::fs::remove_dir_all(&upload).await;
            jobs::set_status(
                &state.db,
                id,
                jobs::JobStatus::Failed,
                Some(reason.clone()),
                now_ms(),
            )
            .await?;
            return Err(AppError::Internal(reason));
        }
    };
    jobs::set_files(&state.db, id, spec_json, dir.display().to_string()).await?;
    tracing::info!(job = id, requester = %requester.name, "job queued");
    log_line(&state, id, "submitted", "accepted and queued".into()).await?;
    if let Some(record) = jobs::get(&state.db, id).await? {
        state.coordinator.publish(JobEvent {
            job_id: id,
            body: JobEventBody::Job {
                job: job_info(record),
            },
        });
    }
    let warnings = prepared.warnings.clone();
    // The data is read and checked already; the scheduler starts from it.
    state.coordinator.send(Event::Prepared {
        job_id: id,
        prepared: Box::new(prepared),
    });
    Ok((StatusCode::CREATED, Json(JobCreated { id, warnings })))
}

/// An unreadable upload is the client's fault; one over the size limit or
/// stalled past the slow-client timeout says so.
fn multipart_error(
    error: &axum::extract::multipart::MultipartError,
    what: &str,
    limit: usize,
) -> AppError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = cause {
        if current.is::<tower_http::timeout::TimeoutError>() {
            return AppError::Timeout(
                "the upload stalled for longer than this server waits; send it again".into(),
            );
        }
        cause = current.source();
    }
    if error.status() == StatusCode::PAYLOAD_TOO_LARGE {
        AppError::PayloadTooLarge(format!(
            "the upload is larger than this server accepts ({limit} bytes; `rookery serve --max-upload-bytes` sets it)"
        ))
    } else {
        AppError::BadRequest(format!("{what}: {error}"))
    }
}

/// Stores every file part under `dir`; returns the job's name and text,
/// and the server dataset the upload names, if any.
async fn receive(
    multipart: &mut Multipart,
    dir: &Path,
    limit: usize,
) -> Result<(String, String, Option<String>), AppError> {
    tokio::fs::create_dir_all(dir)
        .await
        .map_err(|e| AppError::Internal(format!("creating {}: {e}", dir.display())))?;
    let mut job = None;
    let mut dataset = None;
    while let Some(field) = multipart
        .next_field()
        .await
        .map_err(|e| multipart_error(&e, "unreadable upload", limit))?
    {
        let part = field.name().unwrap_or_default().to_string();
        let file_name = field.file_name().map(str::to_string);
        let bytes = field
            .bytes()
            .await
            .map_err(|e| multipart_error(&e, &format!("part `{part}`"), limit))?;
        if part == JOB_PART {
            let text = String::from_utf8(bytes.to_vec())
                .map_err(|_| AppError::BadRequest("the job file is not UTF-8 text".into()))?;
            let name = file_name
                .as_deref()
                .and_then(|f| Path::new(f).file_stem())
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "job".into());
            job = Some((name, text));
            continue;
        }
        if part == crate::datasets::DATASET_PART {
            let name = String::from_utf8(bytes.to_vec()).map_err(|_| AppError::Field {
                field: part.clone(),
                message: "the dataset name is not UTF-8 text".into(),
            })?;
            let name = name.trim().to_string();
            crate::datasets::check_name(&name)?;
            dataset = Some(name);
            continue;
        }
        let relative = safe_relative(&part)?;
        let path = dir.join(relative);
        if let Some(parent) = path.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| AppError::Internal(format!("creating {}: {e}", parent.display())))?;
        }
        tokio::fs::write(&path, &bytes)
            .await
            .map_err(|e| AppError::Internal(format!("writing {}: {e}", path.display())))?;
    }
    let (name, text) = job.ok_or_else(|| {
        AppError::BadRequest(format!(
            "the upload has no `{JOB_PART}` part with the job file (TOML or JSON)"
        ))
    })?;
    Ok((name, text, dataset))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::{EpochRecord, StageTime, StepRecord};

    #[test]
    fn metrics_csv_has_one_row_per_step_then_per_epoch_with_empty_foreign_columns() {
        let step = |step, loss| StepRecord {
            step,
            epoch: 0,
            loss,
            samples_per_s: 100.0,
            elapsed_ms: 12.5,
            bytes_relayed: 4096,
            stages: vec![StageTime {
                cluster: 0,
                stage: 0,
                provider: 1,
                compute_ms: 1.0,
                idle_ms: 2.0,
            }],
        };
        let epochs = [EpochRecord {
            epoch: 0,
            test_loss: 0.25,
            test_accuracy: 0.9,
            samples: 2000,
        }];
        let csv = metrics_csv(&[step(0, 2.5), step(1, 1.5)], &epochs);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(
            lines,
            [
                METRICS_CSV_HEADER,
                "step,0,0,2.5,100,12.5,4096,,,",
                "step,1,0,1.5,100,12.5,4096,,,",
                "epoch,,0,,,,,0.25,0.9,2000",
            ]
        );
        let columns = METRICS_CSV_HEADER.split(',').count();
        assert!(lines.iter().all(|l| l.split(',').count() == columns));
    }
}
