//! The job endpoints: submit (multipart upload of the job file and the files
//! it names), list, inspect, metrics, cancel, and download the weights. Every
//! check that can fail runs before the job is accepted, so a queued job has a
//! readable model and data that match it. Each Requester sees and touches
//! only their own jobs; another's job answers 404, as a missing one does.

use std::path::{Component, Path, PathBuf};

use axum::Json;
use axum::body::Body;
use axum::extract::{Extension, Multipart, Path as UrlPath, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use rookery_job::JobSpec;
use rookery_proto::api::{EpochMetric, JobCreated, JobInfo, JobMetrics, StageMetric, StepMetric};

use crate::coordinator::{self, Event};
use crate::error::AppError;
use crate::jobs::{self, JobRecord};
use crate::requesters::Requester;
use crate::{AppState, now_ms};

/// The multipart part that carries the job file (TOML or JSON); every other
/// part is a file, stored under its part name (a relative path).
pub const JOB_PART: &str = "job";

/// The edge where the stored record becomes the API's DTO.
fn job_info(record: JobRecord) -> JobInfo {
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
        plan: record
            .plan_json
            .as_deref()
            .and_then(|p| serde_json::from_str(p).ok()),
    }
}

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

pub async fn get(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    UrlPath(id): UrlPath<u64>,
) -> Result<Json<JobInfo>, AppError> {
    Ok(Json(job_info(find(&state, &requester, id).await?)))
}

pub async fn metrics(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    UrlPath(id): UrlPath<u64>,
) -> Result<Json<JobMetrics>, AppError> {
    find(&state, &requester, id).await?;
    let steps = jobs::steps(&state.db, id).await?;
    let epochs = jobs::epochs(&state.db, id).await?;
    Ok(Json(JobMetrics {
        steps: steps
            .into_iter()
            .map(|s| StepMetric {
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
            })
            .collect(),
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
    Ok(Json(job_info(find(&state, &requester, id).await?)))
}

/// The trained weights of a completed job; while it runs, the latest checkpoint.
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
pub fn parse_job(text: &str, base: &Path) -> Result<JobSpec, String> {
    JobSpec::from_upload(text, base).map_err(|e| relative_to(&e.to_string(), base))
}

/// `message` with the upload folder's path taken out of the names it shows.
fn relative_to(message: &str, base: &Path) -> String {
    let base = base.display().to_string();
    message
        .replace(&format!("{base}/"), "")
        .replace(&base, "the upload")
}

pub async fn create(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    mut multipart: Multipart,
) -> Result<(StatusCode, Json<JobCreated>), AppError> {
    let jobs_dir = state.data_dir.join("jobs");
    let upload = jobs_dir.join(format!(".upload-{:016x}", rand::random::<u64>()));
    let result = receive(&mut multipart, &upload, state.limits.max_upload_bytes).await;
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
        let prepared = coordinator::prepare(spec).map_err(|e| relative_to(&e, &base))?;
        Ok::<_, String>((text, prepared))
    })
    .await
    .map_err(|e| AppError::Internal(format!("checking a job crashed: {e}")))?;
    let (text, mut prepared) = match checked {
        Ok(ok) => ok,
        Err(reason) => {
            let _ = tokio::fs::remove_dir_all(&upload).await;
            return Err(AppError::BadRequest(reason));
        }
    };
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
        let spec = parse_job(&text, &dir)?;
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
fn upload_error(
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

/// Stores every file part under `dir`; returns the job's name and text.
async fn receive(
    multipart: &mut Multipart,
    dir: &Path,
    limit: usize,
) -> Result<(String, String), AppError> {
    tokio::fs::create_dir_all(dir)
        .await
        .map_err(|e| AppError::Internal(format!("creating {}: {e}", dir.display())))?;
    let mut job = None;
    while let Some(field) = multipart
        .next_field()
        .await
        .map_err(|e| upload_error(&e, "unreadable upload", limit))?
    {
        let part = field.name().unwrap_or_default().to_string();
        let file_name = field.file_name().map(str::to_string);
        let bytes = field
            .bytes()
            .await
            .map_err(|e| upload_error(&e, &format!("part `{part}`"), limit))?;
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
    job.ok_or_else(|| {
        AppError::BadRequest(format!(
            "the upload has no `{JOB_PART}` part with the job file (TOML or JSON)"
        ))
    })
}
