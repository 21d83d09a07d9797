//! The job store: every job's lifecycle, progress and metrics in SQLite, so
//! the dashboard and the CLI read one place and finished jobs survive restarts.
//! The coordinator writes; HTTP handlers read.

use rusqlite::{OptionalExtension, params};
use serde::{Deserialize, Serialize};

use crate::run::{EpochRecord, StepRecord};
use crate::store::db::{Db, DbError};

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// Accepted; waiting for providers.
    Queued,
    /// Stages are being handed to providers.
    Planning,
    Running,
    Completed,
    Failed,
    Cancelled,
}

impl JobStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Queued => "queued",
            JobStatus::Planning => "planning",
            JobStatus::Running => "running",
            JobStatus::Completed => "completed",
            JobStatus::Failed => "failed",
            JobStatus::Cancelled => "cancelled",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        [
            JobStatus::Queued,
            JobStatus::Planning,
            JobStatus::Running,
            JobStatus::Completed,
            JobStatus::Failed,
            JobStatus::Cancelled,
        ]
        .into_iter()
        .find(|s| s.as_str() == text)
    }

    pub fn is_finished(self) -> bool {
        matches!(
            self,
            JobStatus::Completed | JobStatus::Failed | JobStatus::Cancelled
        )
    }
}

/// A job as stored. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct JobRecord {
    pub id: u64,
    pub name: String,
    pub status: JobStatus,
    /// Why it waits, or why it failed, in words.
    pub detail: Option<String>,
    pub spec_json: String,
    /// The job's folder in the data dir (uploaded files, checkpoint, weights).
    pub dir: String,
    pub created_ms: u64,
    pub started_ms: Option<u64>,
    pub finished_ms: Option<u64>,
    pub step: u64,
    pub total_steps: u64,
    pub epoch: u64,
    pub last_loss: Option<f64>,
    pub samples_per_s: Option<f64>,
    pub plan_json: Option<String>,
    /// The Requester who submitted it.
    pub owner: Option<u64>,
}

const JOB_COLUMNS: &str = "id, name, status, detail, spec_json, dir, created_ms, started_ms, finished_ms, step, total_steps, epoch, last_loss, samples_per_s, plan_json, owner";

fn opt_u64(v: Option<i64>) -> Option<u64> {
    v.map(|v| v as u64)
}

fn row_to_job(row: &rusqlite::Row<'_>) -> rusqlite::Result<JobRecord> {
    let status: String = row.get(2)?;
    Ok(JobRecord {
        id: row.get::<_, i64>(0)? as u64,
        name: row.get(1)?,
        // Only this module writes the column, from a JobStatus.
        status: JobStatus::parse(&status).unwrap_or(JobStatus::Failed),
        detail: row.get(3)?,
        spec_json: row.get(4)?,
        dir: row.get(5)?,
        created_ms: row.get::<_, i64>(6)? as u64,
        started_ms: opt_u64(row.get(7)?),
        finished_ms: opt_u64(row.get(8)?),
        step: row.get::<_, i64>(9)? as u64,
        total_steps: row.get::<_, i64>(10)? as u64,
        epoch: row.get::<_, i64>(11)? as u64,
        last_loss: row.get(12)?,
        samples_per_s: row.get(13)?,
        plan_json: row.get(14)?,
        owner: opt_u64(row.get(15)?),
    })
}

/// Reserves an id for `owner`'s job whose files are still being written.
pub async fn insert(
    db: &Db,
    owner: u64,
    name: String,
    spec_json: String,
    dir: String,
    now_ms: u64,
) -> Result<u64, DbError> {
    db.call_durable(move |conn| {
        conn.execute(
            "INSERT INTO jobs (name, status, spec_json, dir, created_ms, owner) VALUES (?1, 'queued', ?2, ?3, ?4, ?5)",
            params![name, spec_json, dir, now_ms as i64, owner as i64],
        )?;
        Ok(conn.last_insert_rowid() as u64)
    })
    .await
}

/// Fills in a reserved job's stored spec and folder. The folder's files
/// must be on disk (synced) first: from this commit on the job may be
/// planned, after a restart too, and reads them.
pub async fn set_files(db: &Db, id: u64, spec_json: String, dir: String) -> Result<(), DbError> {
    db.call_durable(move |conn| {
        conn.execute(
            "UPDATE jobs SET spec_json = ?2, dir = ?3 WHERE id = ?1",
            params![id as i64, spec_json, dir],
        )
        .map(drop)
    })
    .await
}

pub async fn get(db: &Db, id: u64) -> Result<Option<JobRecord>, DbError> {
    db.call(move |conn| {
        conn.query_row(
            &format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?1"),
            [id as i64],
            row_to_job,
        )
        .optional()
    })
    .await
}

/// `owner`'s job `id`; another Requester's job is as absent as a missing one.
pub async fn get_owned(db: &Db, id: u64, owner: u64) -> Result<Option<JobRecord>, DbError> {
    db.call(move |conn| {
        conn.query_row(
            &format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?1 AND owner = ?2"),
            [id as i64, owner as i64],
            row_to_job,
        )
        .optional()
    })
    .await
}

/// `owner`'s jobs, newest first.
pub async fn list_owned(db: &Db, owner: u64) -> Result<Vec<JobRecord>, DbError> {
    db.call(move |conn| {
        let mut statement = conn.prepare(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE owner = ?1 ORDER BY id DESC"
        ))?;
        let rows = statement.query_map([owner as i64], row_to_job)?;
        rows.collect()
    })
    .await
}

/// Every job, newest first.
pub async fn list(db: &Db) -> Result<Vec<JobRecord>, DbError> {
    db.call(|conn| {
        let mut statement =
            conn.prepare(&format!("SELECT {JOB_COLUMNS} FROM jobs ORDER BY id DESC"))?;
        let rows = statement.query_map([], row_to_job)?;
        rows.collect()
    })
    .await
}

/// Moves a job to `status`. Finished jobs never move again, so a late
/// cancel cannot rewrite a completion. Returns whether the row changed.
pub async fn set_status(
    db: &Db,
    id: u64,
    status: JobStatus,
    detail: Option<String>,
    now_ms: u64,
) -> Result<bool, DbError> {
    db.call_durable(move |conn| {
        let changed = conn.execute(
            "UPDATE jobs SET status = ?2, detail = ?3,
                 started_ms = CASE WHEN ?2 = 'running' AND started_ms IS NULL THEN ?4 ELSE started_ms END,
                 finished_ms = CASE WHEN ?2 IN ('completed', 'failed', 'cancelled') THEN ?4 ELSE finished_ms END
             WHERE id = ?1 AND status NOT IN ('completed', 'failed', 'cancelled')",
            params![id as i64, status.as_str(), detail, now_ms as i64],
        )?;
        Ok(changed > 0)
    })
    .await
}

pub async fn set_plan(
    db: &Db,
    id: u64,
    plan_json: String,
    total_steps: u64,
) -> Result<(), DbError> {
    db.call(move |conn| {
        conn.execute(
            "UPDATE jobs SET plan_json = ?2, total_steps = ?3 WHERE id = ?1",
            params![id as i64, plan_json, total_steps as i64],
        )
        .map(drop)
    })
    .await
}

pub async fn record_step(db: &Db, id: u64, record: StepRecord) -> Result<(), DbError> {
    let stages = serde_json::to_string(&record.stages).unwrap_or_else(|_| "[]".into());
    db.call(move |conn| {
        let tx = conn.transaction()?;
        tx.execute(
            "INSERT OR REPLACE INTO job_steps (job_id, step, epoch, loss, samples_per_s, elapsed_ms, bytes_relayed, stages_json, bytes_synced)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            params![
                id as i64,
                record.step as i64,
                record.epoch as i64,
                record.loss,
                record.samples_per_s,
                record.elapsed_ms,
                record.bytes_relayed as i64,
                stages,
                record.bytes_synced as i64
            ],
        )?;
        tx.execute(
            "UPDATE jobs SET step = ?2, epoch = ?3, last_loss = ?4, samples_per_s = ?5 WHERE id = ?1",
            params![
                id as i64,
                record.step as i64 + 1,
                record.epoch as i64,
                record.loss,
                record.samples_per_s
            ],
        )?;
        tx.commit()
    })
    .await
}

pub async fn record_epoch(db: &Db, id: u64, record: EpochRecord) -> Result<(), DbError> {
    db.call(move |conn| {
        conn.execute(
            "INSERT OR REPLACE INTO job_evals (job_id, step, epoch, test_loss, test_accuracy, samples) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                id as i64,
                record.step as i64,
                record.epoch as i64,
                record.test_loss,
                record.test_accuracy,
                record.samples as i64
            ],
        )
        .map(drop)
    })
    .await
}

pub async fn steps(db: &Db, id: u64) -> Result<Vec<StepRecord>, DbError> {
    db.call(move |conn| {
        let mut statement = conn.prepare(
            "SELECT step, epoch, loss, samples_per_s, elapsed_ms, bytes_relayed, stages_json, bytes_synced
             FROM job_steps WHERE job_id = ?1 ORDER BY step",
        )?;
        let rows = statement.query_map([id as i64], |row| {
            let stages: String = row.get(6)?;
            Ok(StepRecord {
                step: row.get::<_, i64>(0)? as u64,
                epoch: row.get::<_, i64>(1)? as u64,
                loss: row.get(2)?,
                samples_per_s: row.get(3)?,
                elapsed_ms: row.get(4)?,
                bytes_relayed: row.get::<_, i64>(5)? as u64,
                bytes_synced: row.get::<_, i64>(7)? as u64,
                stages: serde_json::from_str(&stages).unwrap_or_default(),
            })
        })?;
        rows.collect()
    })
    .await
}

pub async fn epochs(db: &Db, id: u64) -> Result<Vec<EpochRecord>, DbError> {
    db.call(move |conn| {
        let mut statement = conn.prepare(
            "SELECT epoch, test_loss, test_accuracy, samples, step FROM job_evals WHERE job_id = ?1 ORDER BY step",
        )?;
        let rows = statement.query_map([id as i64], |row| {
            Ok(EpochRecord {
                epoch: row.get::<_, i64>(0)? as u64,
                test_loss: row.get(1)?,
                test_accuracy: row.get(2)?,
                samples: row.get::<_, i64>(3)? as u64,
                step: row.get::<_, i64>(4)? as u64,
            })
        })?;
        rows.collect()
    })
    .await
}

/// One line of a job's event log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    pub at_ms: u64,
    /// A short machine-readable word (`provider_left`, `checkpoint`, ...).
    pub kind: String,
    pub message: String,
}

pub async fn append_log(db: &Db, id: u64, record: LogRecord) -> Result<(), DbError> {
    db.call(move |conn| {
        conn.execute(
            "INSERT INTO job_log (job_id, at_ms, kind, message) VALUES (?1, ?2, ?3, ?4)",
            params![id as i64, record.at_ms as i64, record.kind, record.message],
        )
        .map(drop)
    })
    .await
}

/// A provider banned from a job after repeated faults.
#[derive(Debug, Clone, PartialEq)]
pub struct Ban {
    pub provider_id: u64,
    /// The banned identity; `None` for bans recorded before identities.
    pub identity: Option<u64>,
    /// For people only: names are chosen by providers.
    pub provider_name: String,
    pub at_ms: u64,
    pub reason: String,
}

pub async fn ban(db: &Db, job_id: u64, ban: Ban) -> Result<(), DbError> {
    db.call_durable(move |conn| {
        conn.execute(
            "INSERT OR REPLACE INTO job_bans (job_id, provider_id, provider_name, at_ms, reason, identity)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                job_id as i64,
                ban.provider_id as i64,
                ban.provider_name,
                ban.at_ms as i64,
                ban.reason,
                ban.identity.map(|i| i as i64),
            ],
        )
        .map(drop)
    })
    .await
}

/// The providers banned from a job, oldest first.
pub async fn bans(db: &Db, job_id: u64) -> Result<Vec<Ban>, DbError> {
    db.call(move |conn| {
        let mut statement = conn.prepare(
            "SELECT provider_id, provider_name, at_ms, reason, identity FROM job_bans
             WHERE job_id = ?1 ORDER BY at_ms, provider_id",
        )?;
        let rows = statement.query_map(params![job_id as i64], |row| {
            Ok(Ban {
                provider_id: row.get::<_, i64>(0)? as u64,
                identity: row.get::<_, Option<i64>>(4)?.map(|i| i as u64),
                provider_name: row.get(1)?,
                at_ms: row.get::<_, i64>(2)? as u64,
                reason: row.get(3)?,
            })
        })?;
        rows.collect()
    })
    .await
}

/// The last `limit` lines of a job's log, oldest first.
pub async fn log(db: &Db, id: u64, limit: usize) -> Result<Vec<LogRecord>, DbError> {
    db.call(move |conn| {
        let mut statement = conn.prepare(
            "SELECT at_ms, kind, message FROM
                 (SELECT seq, at_ms, kind, message FROM job_log WHERE job_id = ?1 ORDER BY seq DESC LIMIT ?2)
             ORDER BY seq",
        )?;
        let rows = statement.query_map(params![id as i64, limit as i64], |row| {
            Ok(LogRecord {
                at_ms: row.get::<_, i64>(0)? as u64,
                kind: row.get(1)?,
                message: row.get(2)?,
            })
        })?;
        rows.collect()
    })
    .await
}

/// A restarted server has lost every running job's providers: such jobs go
/// back to the queue and resume from their last checkpoint (the resume file
/// in their folder) when providers are there.
pub async fn requeue_interrupted(db: &Db) -> Result<usize, DbError> {
    db.call(|conn| {
        conn.execute(
            "UPDATE jobs SET status = 'queued', detail = 'the server restarted; the job resumes from its last checkpoint when providers connect'
             WHERE status IN ('planning', 'running')",
            [],
        )
    })
    .await
}

/// Jobs waiting for providers, oldest first.
pub async fn queued(db: &Db) -> Result<Vec<JobRecord>, DbError> {
    db.call(|conn| {
        let mut statement = conn.prepare(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE status = 'queued' AND dir != '' ORDER BY id"
        ))?;
        let rows = statement.query_map([], row_to_job)?;
        rows.collect()
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::StageTime;

    /// A database whose Requester 1 may own jobs.
    async fn db_with_requester() -> Db {
        let db = Db::open_in_memory().unwrap();
        let (requester, _) = crate::store::requesters::create(&db, "r", 0).await.unwrap();
        assert_eq!(requester.id, 1);
        db
    }

    #[tokio::test]
    async fn a_job_runs_records_metrics_and_finishes_once() {
        let db = db_with_requester().await;
        let id = insert(&db, 1, "mnist".into(), "{}".into(), "/tmp/j".into(), 10)
            .await
            .unwrap();
        assert_eq!(queued(&db).await.unwrap().len(), 1);
        assert!(
            set_status(&db, id, JobStatus::Running, None, 20)
                .await
                .unwrap()
        );
        record_step(
            &db,
            id,
            StepRecord {
                step: 0,
                epoch: 0,
                loss: 2.3,
                samples_per_s: 100.0,
                elapsed_ms: 50.0,
                bytes_relayed: 4096,
                bytes_synced: 0,
                stages: vec![StageTime {
                    cluster: 0,
                    stage: 0,
                    provider: 3,
                    compute_ms: 30.0,
                    idle_ms: 20.0,
                    planned_ms: 0.0,
                    peak_held: 3,
                }],
            },
        )
        .await
        .unwrap();
        record_epoch(
            &db,
            id,
            EpochRecord {
                epoch: 0,
                step: 10,
                test_loss: 0.5,
                test_accuracy: 0.9,
                samples: 2000,
            },
        )
        .await
        .unwrap();
        assert!(
            set_status(&db, id, JobStatus::Completed, None, 30)
                .await
                .unwrap()
        );
        // A late cancel does not rewrite history.
        assert!(
            !set_status(&db, id, JobStatus::Cancelled, None, 40)
                .await
                .unwrap()
        );
        let job = get(&db, id).await.unwrap().unwrap();
        assert_eq!(job.status, JobStatus::Completed);
        assert_eq!((job.started_ms, job.finished_ms), (Some(20), Some(30)));
        assert_eq!((job.step, job.last_loss), (1, Some(2.3)));
        let steps = steps(&db, id).await.unwrap();
        assert_eq!(steps[0].stages[0].provider, 3);
        assert_eq!(epochs(&db, id).await.unwrap()[0].samples, 2000);
    }

    #[tokio::test]
    async fn the_log_keeps_each_jobs_latest_lines_in_order() {
        let db = db_with_requester().await;
        let a = insert(&db, 1, "a".into(), "{}".into(), "a".into(), 1)
            .await
            .unwrap();
        let b = insert(&db, 1, "b".into(), "{}".into(), "b".into(), 1)
            .await
            .unwrap();
        for (job, at) in [(a, 1), (b, 2), (a, 3), (a, 4)] {
            let line = LogRecord {
                at_ms: at,
                kind: "sync".into(),
                message: format!("line {at}"),
            };
            append_log(&db, job, line).await.unwrap();
        }
        let times = |lines: Vec<LogRecord>| lines.iter().map(|l| l.at_ms).collect::<Vec<_>>();
        assert_eq!(times(log(&db, a, 10).await.unwrap()), [1, 3, 4]);
        assert_eq!(times(log(&db, a, 2).await.unwrap()), [3, 4]);
        assert_eq!(times(log(&db, b, 10).await.unwrap()), [2]);
    }

    #[tokio::test]
    async fn interrupted_jobs_go_back_to_the_queue() {
        let db = db_with_requester().await;
        let a = insert(&db, 1, "a".into(), "{}".into(), "a".into(), 1)
            .await
            .unwrap();
        let b = insert(&db, 1, "b".into(), "{}".into(), "b".into(), 1)
            .await
            .unwrap();
        set_status(&db, a, JobStatus::Running, None, 2)
            .await
            .unwrap();
        set_status(&db, b, JobStatus::Completed, None, 2)
            .await
            .unwrap();
        assert_eq!(requeue_interrupted(&db).await.unwrap(), 1);
        assert_eq!(
            get(&db, a).await.unwrap().unwrap().status,
            JobStatus::Queued
        );
        assert_eq!(
            get(&db, b).await.unwrap().unwrap().status,
            JobStatus::Completed
        );
    }

    #[tokio::test]
    async fn bans_are_kept_per_job_and_a_repeated_ban_replaces_the_first() {
        let db = db_with_requester().await;
        let a = insert(&db, 1, "a".into(), "{}".into(), "a".into(), 1)
            .await
            .unwrap();
        let b = insert(&db, 1, "b".into(), "{}".into(), "b".into(), 1)
            .await
            .unwrap();
        let banned = |id, at_ms, reason: &str| Ban {
            provider_id: id,
            identity: Some(id + 100),
            provider_name: format!("p{id}"),
            at_ms,
            reason: reason.into(),
        };
        ban(&db, a, banned(3, 10, "NaN")).await.unwrap();
        ban(&db, a, banned(5, 20, "shape")).await.unwrap();
        ban(&db, a, banned(3, 30, "NaN again")).await.unwrap();
        assert_eq!(
            bans(&db, a).await.unwrap(),
            [banned(5, 20, "shape"), banned(3, 30, "NaN again")]
        );
        assert!(bans(&db, b).await.unwrap().is_empty());
    }
}
