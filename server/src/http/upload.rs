//! Job uploads: `POST /api/jobs` (submit) and `POST /api/plan` (preview
//! the plan of the same upload), multipart with the job file and the files
//! it names, or a dataset kept on the server (`GET /api/datasets`). Every
//! check that can fail runs before the job is accepted, so a queued job has
//! a readable model and data that match it.

use std::path::{Component, Path, PathBuf};

use axum::extract::{Extension, Multipart, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use rookery_job::{JobSpec, PrepareError, Prepared};
use rookery_proto::api::{ApiError, DatasetInfo, JobCreated, JobEvent, JobEventBody, PlanPreview};
use tokio::io::AsyncWriteExt;

use super::error::AppError;
use super::jobs::log_line;
use crate::coordinator::{self, Event, QueuedModel};
use crate::state::AppState;
use crate::store::datasets::{self, DatasetError};
use crate::store::requesters::Requester;
use crate::store::{self, jobs};
use crate::{dto, now_ms};

/// How a job upload is laid out, for the OpenAPI description.
const UPLOAD_DESCRIPTION: &str = "Part `job`: the job file (TOML, or JSON when it starts with `{`; the job is named after the part's file name). Optional part `dataset`: the name of a dataset on the server (GET /api/datasets) whose files join the upload. Every other part is a file the job file names, stored under its part name (a relative path), e.g. the ONNX model, its `.data` side file and the data files.";

/// The multipart part that carries the job file (TOML or JSON); every other
/// part is a file, stored under its part name (a relative path).
pub const JOB_PART: &str = "job";

/// The multipart part that names a server dataset.
pub const DATASET_PART: &str = "dataset";

/// A dataset that cannot join an upload is about the upload's dataset part.
impl From<DatasetError> for AppError {
    fn from(error: DatasetError) -> Self {
        match error {
            DatasetError::BadName(_) | DatasetError::Missing(_) => AppError::Field {
                field: DATASET_PART.into(),
                message: error.to_string(),
            },
            DatasetError::Copy { .. } => AppError::Internal(error.to_string()),
        }
    }
}

/// The upload endpoints (behind the Requester's token).
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/jobs", post(create))
        .route("/plan", post(plan))
        .route("/datasets", get(list_datasets))
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
    budget: Option<Budget>,
) -> Result<(PathBuf, String, String, Prepared), AppError> {
    let jobs_dir = state.data_dir.join("jobs");
    let upload = jobs_dir.join(format!(".upload-{:016x}", rand::random::<u64>()));
    let result = async {
        let (name, text, dataset) =
            receive(multipart, &upload, state.limits.max_upload_bytes, budget).await?;
        if let Some(dataset) = dataset {
            let (data_dir, dest) = (state.data_dir.clone(), upload.clone());
            tokio::task::spawn_blocking(move || datasets::link_into(&data_dir, &dataset, &dest))
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
        let prepared = rookery_job::prepare(spec)?;
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
    let (upload, _, _, prepared) = receive_checked(&state, &mut multipart, None).await?;
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
        plan: dto::plan_view(&plan, &prepared.graph, &who),
        warnings: prepared.warnings,
        train_samples: prepared.train.len() as u64,
        test_samples: prepared.test.as_ref().map_or(0, |t| t.len() as u64),
    }))
}

/// Submits a job: checked in full, then queued until providers take it.
#[utoipa::path(post, path = "/api/jobs", tag = "jobs", security(("api_token" = [])),
    request_body(content = String, content_type = "multipart/form-data", description = UPLOAD_DESCRIPTION),
    responses((status = 201, description = "Accepted and queued", body = JobCreated),
        (status = 400, description = "The upload is invalid; `field` names the job-file field or file", body = ApiError),
        (status = 429, description = "The Requester has as many jobs queued as the server keeps waiting", body = ApiError)))]
pub async fn create(
    State(state): State<AppState>,
    Extension(requester): Extension<Requester>,
    mut multipart: Multipart,
) -> Result<(StatusCode, Json<JobCreated>), AppError> {
    // Before the upload's bytes are read: a Requester cannot fill the disk
    // or the queue with jobs waiting for providers.
    let owned = jobs::list_owned(&state.db, requester.id).await?;
    let queued = owned
        .iter()
        .filter(|j| j.status == jobs::JobStatus::Queued)
        .count();
    if queued >= state.limits.max_queued_jobs {
        return Err(AppError::TooManyRequests(format!(
            "{queued} of your jobs are queued already, the most this server keeps waiting (`rookery serve --max-queued-jobs`); cancel one or wait for one to start"
        )));
    }
    // Nor can it fill the disk with the uploads of jobs it keeps waiting.
    let dirs: Vec<PathBuf> = owned
        .iter()
        .filter(|j| j.status == jobs::JobStatus::Queued && !j.dir.is_empty())
        .map(|j| PathBuf::from(&j.dir))
        .collect();
    let held = tokio::task::spawn_blocking(move || {
        dirs.iter()
            .map(|d| store::tree_bytes(d))
            .try_fold(0u64, |sum, bytes| bytes.map(|b| sum.saturating_add(b)))
    })
    .await
    .map_err(|e| AppError::Internal(format!("measuring queued uploads crashed: {e}")))?
    .map_err(|e| AppError::Internal(format!("measuring queued uploads: {e}")))?;
    let allowed = state.limits.max_queued_upload_bytes;
    if held >= allowed {
        return Err(AppError::TooManyRequests(format!(
            "your queued jobs' uploads hold {held} bytes, the most this server keeps per Requester ({allowed}; `rookery serve --max-queued-upload-bytes`); cancel one or wait for one to start"
        )));
    }
    let budget = Budget {
        bytes: allowed - held,
        held,
        allowed,
    };
    let (upload, name, text, mut prepared) =
        receive_checked(&state, &mut multipart, Some(budget)).await?;
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
    // The upload's files go in a folder of their own, so no part name can
    // stand in for a file the server keeps in the job's folder (its resume
    // point, checkpoint and weights).
    let dir = store::upload_dir(&store::job_dir(&state.data_dir, id));
    let stored = async {
        let parent = dir.parent().unwrap_or(&dir);
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(|e| format!("creating the job's folder: {e}"))?;
        tokio::fs::rename(&upload, &dir)
            .await
            .map_err(|e| format!("moving the upload: {e}"))?;
        // On disk before the row below names them: a job the Requester was
        // told is queued must still have its files after a power cut. The
        // files and their folders, then the folders the rename changed.
        let (synced, jobs_dir) = (dir.clone(), state.data_dir.join("jobs"));
        tokio::task::spawn_blocking(move || {
            store::sync_tree(&synced)?;
            let job_dir = synced.parent().unwrap_or(&synced);
            store::sync_dir(job_dir)?;
            store::sync_dir(&jobs_dir)
        })
        .await
        .map_err(|e| format!("syncing the upload crashed: {e}"))?
        .map_err(|e| format!("syncing the upload to disk: {e}"))?;
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
    // Only now does the job name its folder, and only a job with a folder
    // is ever planned (`jobs::queued`): a crash before here leaves a row
    // that nothing runs, never a queued job without its files.
    jobs::set_files(&state.db, id, spec_json, dir.display().to_string()).await?;
    tracing::info!(job = id, requester = %requester.name, "job queued");
    log_line(&state, id, "submitted", "accepted and queued".into()).await?;
    if let Some(record) = jobs::get(&state.db, id).await? {
        state.coordinator.publish(JobEvent {
            job_id: id,
            body: JobEventBody::Job {
                job: dto::job_info(record),
            },
        });
    }
    let warnings = prepared.warnings.clone();
    // The data is read and checked already; the scheduler starts from it.
    // Planning needs only the model: the data is read again when the job
    // starts, so a queued job holds none.
    state
        .coordinator
        .send(Event::Prepared {
            job_id: id,
            model: Box::new(QueuedModel::new(prepared)),
        })
        .await;
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
/// What a Requester's upload may still add to its queued jobs' files.
#[derive(Debug, Clone, Copy)]
struct Budget {
    bytes: u64,
    held: u64,
    allowed: u64,
}

async fn receive(
    multipart: &mut Multipart,
    dir: &Path,
    limit: usize,
    mut budget: Option<Budget>,
) -> Result<(String, String, Option<String>), AppError> {
    tokio::fs::create_dir_all(dir)
        .await
        .map_err(|e| AppError::Internal(format!("creating {}: {e}", dir.display())))?;
    let mut job = None;
    let mut dataset = None;
    while let Some(mut field) = multipart
        .next_field()
        .await
        .map_err(|e| multipart_error(&e, "unreadable upload", limit))?
    {
        let part = field.name().unwrap_or_default().to_string();
        let file_name = field.file_name().map(str::to_string);
        if part == JOB_PART || part == DATASET_PART {
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
            } else {
                let name = String::from_utf8(bytes.to_vec()).map_err(|_| AppError::Field {
                    field: part.clone(),
                    message: "the dataset name is not UTF-8 text".into(),
                })?;
                let name = name.trim().to_string();
                datasets::check_name(&name)?;
                dataset = Some(name);
            }
            continue;
        }
        let relative = safe_relative(&part)?;
        let path = dir.join(relative);
        if let Some(parent) = path.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| AppError::Internal(format!("creating {}: {e}", parent.display())))?;
        }
        // Straight to disk as it arrives: a model's weights are hundreds of
        // megabytes, and the server keeps no copy of them in memory.
        let writing =
            |e: std::io::Error| AppError::Internal(format!("writing {}: {e}", path.display()));
        let mut file = tokio::fs::File::create(&path).await.map_err(writing)?;
        while let Some(chunk) = field
            .chunk()
            .await
            .map_err(|e| multipart_error(&e, &format!("part `{part}`"), limit))?
        {
            if let Some(budget) = &mut budget {
                budget.bytes = budget
                    .bytes
                    .checked_sub(chunk.len() as u64)
                    .ok_or_else(|| {
                        AppError::PayloadTooLarge(format!(
                            "your queued jobs' uploads hold {} bytes and this one would pass the {} this server keeps per Requester (`rookery serve --max-queued-upload-bytes`)",
                            budget.held, budget.allowed
                        ))
                    })?;
            }
            file.write_all(&chunk).await.map_err(writing)?;
        }
        file.flush().await.map_err(writing)?;
    }
    let (name, text) = job.ok_or_else(|| {
        AppError::BadRequest(format!(
            "the upload has no `{JOB_PART}` part with the job file (TOML or JSON)"
        ))
    })?;
    Ok((name, text, dataset))
}

/// Datasets on the server, with their files.
#[utoipa::path(get, path = "/api/datasets", tag = "jobs", security(("api_token" = [])),
    responses((status = 200, description = "Every dataset under the data dir's datasets/ folder", body = Vec<DatasetInfo>),
        (status = 401, description = "No or wrong API token", body = ApiError)))]
pub async fn list_datasets(
    State(state): State<AppState>,
) -> Result<Json<Vec<DatasetInfo>>, AppError> {
    let data_dir = state.data_dir.clone();
    tokio::task::spawn_blocking(move || datasets::list(&data_dir))
        .await
        .map_err(|e| AppError::Internal(format!("listing datasets crashed: {e}")))?
        .map(Json)
        .map_err(|e| AppError::Internal(format!("listing datasets: {e}")))
}
