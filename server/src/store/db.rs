//! The embedded SQLite database: opening, migrations, and an async door to a
//! blocking connection.
//!
//! One connection behind a mutex is plenty for the control plane (rows are
//! small and writes are rare next to the tensor traffic); every call runs on
//! tokio's blocking pool so a slow disk never stalls the socket loops.

use std::path::Path;
use std::sync::{Arc, Mutex};

use rusqlite::Connection;

/// Schema changes, applied in order; `PRAGMA user_version` records how many
/// have run. Append only: never edit a migration that has shipped.
pub(crate) const MIGRATIONS: &[&str] = &[
    "CREATE TABLE providers (
        id              INTEGER PRIMARY KEY AUTOINCREMENT,
        name            TEXT    NOT NULL,
        kind            TEXT    NOT NULL,
        device          TEXT    NOT NULL,
        memory_bytes    INTEGER NOT NULL,
        gflops          REAL    NOT NULL,
        connected_ms    INTEGER NOT NULL,
        last_heartbeat_ms INTEGER NOT NULL,
        gone_ms         INTEGER,
        gone_reason     TEXT
    );",
    "CREATE TABLE jobs (
        id              INTEGER PRIMARY KEY AUTOINCREMENT,
        name            TEXT    NOT NULL,
        status          TEXT    NOT NULL,
        detail          TEXT,
        spec_json       TEXT    NOT NULL,
        dir             TEXT    NOT NULL,
        created_ms      INTEGER NOT NULL,
        started_ms      INTEGER,
        finished_ms     INTEGER,
        step            INTEGER NOT NULL DEFAULT 0,
        total_steps     INTEGER NOT NULL DEFAULT 0,
        epoch           INTEGER NOT NULL DEFAULT 0,
        last_loss       REAL,
        samples_per_s   REAL,
        plan_json       TEXT
    );
    CREATE TABLE job_steps (
        job_id          INTEGER NOT NULL REFERENCES jobs(id),
        step            INTEGER NOT NULL,
        epoch           INTEGER NOT NULL,
        loss            REAL    NOT NULL,
        samples_per_s   REAL    NOT NULL,
        elapsed_ms      REAL    NOT NULL,
        bytes_relayed   INTEGER NOT NULL,
        stages_json     TEXT    NOT NULL,
        PRIMARY KEY (job_id, step)
    );
    CREATE TABLE job_epochs (
        job_id          INTEGER NOT NULL REFERENCES jobs(id),
        epoch           INTEGER NOT NULL,
        test_loss       REAL    NOT NULL,
        test_accuracy   REAL    NOT NULL,
        samples         INTEGER NOT NULL,
        PRIMARY KEY (job_id, epoch)
    );",
    "CREATE TABLE job_log (
        job_id          INTEGER NOT NULL REFERENCES jobs(id),
        seq             INTEGER PRIMARY KEY AUTOINCREMENT,
        at_ms           INTEGER NOT NULL,
        kind            TEXT    NOT NULL,
        message         TEXT    NOT NULL
    );
    CREATE INDEX job_log_by_job ON job_log (job_id, seq);",
    // Measured by the server's link probe after Welcome; NULL until then.
    "ALTER TABLE providers ADD COLUMN bandwidth_mbps REAL;",
    // Requesters hold SHA-256 digests of their tokens; jobs from before
    // this migration get their owner when the first Requester is made.
    "CREATE TABLE requesters (
        id              INTEGER PRIMARY KEY AUTOINCREMENT,
        name            TEXT    NOT NULL UNIQUE,
        token_sha256    TEXT    NOT NULL UNIQUE,
        created_ms      INTEGER NOT NULL
    );
    ALTER TABLE jobs ADD COLUMN owner INTEGER REFERENCES requesters(id);
    CREATE INDEX jobs_by_owner ON jobs (owner, id);",
    // Providers a job will not be planned onto again, by connection id and
    // by the name they gave (a reconnection gets a new id).
    "CREATE TABLE job_bans (
        job_id          INTEGER NOT NULL REFERENCES jobs(id),
        provider_id     INTEGER NOT NULL,
        provider_name   TEXT    NOT NULL,
        at_ms           INTEGER NOT NULL,
        reason          TEXT    NOT NULL,
        PRIMARY KEY (job_id, provider_id)
    );",
    // Server-issued provider identities (credential digests), which faults,
    // bans and credit follow; a connection records its identity, and bans
    // name the identity (bans from before this have none).
    "CREATE TABLE identities (
        id              INTEGER PRIMARY KEY AUTOINCREMENT,
        secret_sha256   TEXT    NOT NULL UNIQUE,
        created_ms      INTEGER NOT NULL,
        created_ip      TEXT    NOT NULL,
        last_seen_ms    INTEGER NOT NULL,
        faults          INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX identities_by_address ON identities (created_ip, created_ms);
    ALTER TABLE providers ADD COLUMN identity INTEGER;
    ALTER TABLE job_bans ADD COLUMN identity INTEGER;",
    // A revoked Requester keeps its row (its jobs still name it) but no
    // token of its works; `rookery token create` may issue it a new one.
    "ALTER TABLE requesters ADD COLUMN revoked_ms INTEGER;",
    // A donor's dashboard lists its identity's providers; pruning finds
    // long-gone ones.
    "CREATE INDEX providers_by_identity ON providers (identity);
    CREATE INDEX providers_by_gone ON providers (gone_ms);",
    // Credit: accepted training work per identity and job (a ban withdraws
    // a job's), and the name and team a donor shows on the leaderboard.
    "CREATE TABLE credit (
        identity        INTEGER NOT NULL,
        job_id          INTEGER NOT NULL,
        gflop           REAL    NOT NULL,
        PRIMARY KEY (identity, job_id)
    );
    ALTER TABLE identities ADD COLUMN donor_name TEXT;
    ALTER TABLE identities ADD COLUMN team TEXT;",
    // Evaluations keyed by the steps done when taken (`val_every` evaluates
    // within an epoch too); an earlier one was taken at its epoch's end.
    "CREATE TABLE job_evals (
        job_id          INTEGER NOT NULL REFERENCES jobs(id),
        step            INTEGER NOT NULL,
        epoch           INTEGER NOT NULL,
        test_loss       REAL    NOT NULL,
        test_accuracy   REAL    NOT NULL,
        samples         INTEGER NOT NULL,
        PRIMARY KEY (job_id, step)
    );
    INSERT INTO job_evals (job_id, step, epoch, test_loss, test_accuracy, samples)
        SELECT e.job_id,
               (e.epoch + 1) * (j.total_steps
                   / MAX(1, COALESCE(json_extract(j.spec_json, '$.training.epochs'), 1))),
               e.epoch, e.test_loss, e.test_accuracy, e.samples
        FROM job_epochs e JOIN jobs j ON j.id = e.job_id;
    DROP TABLE job_epochs;
    ALTER TABLE job_steps ADD COLUMN bytes_synced INTEGER NOT NULL DEFAULT 0;",
];

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("cannot create the data directory {path}: {source}")]
    DataDir {
        path: String,
        source: std::io::Error,
    },
    #[error("the database worker stopped unexpectedly")]
    WorkerGone,
}

#[derive(Clone, Debug)]
pub struct Db {
    conn: Arc<Mutex<Connection>>,
}

impl Db {
    /// Opens (creating on first start) `rookery.sqlite3` in `data_dir` and
    /// brings its schema up to date.
    pub fn open_in_dir(data_dir: &Path) -> Result<Self, DbError> {
        std::fs::create_dir_all(data_dir).map_err(|source| DbError::DataDir {
            path: data_dir.display().to_string(),
            source,
        })?;
        let conn = Connection::open(data_dir.join("rookery.sqlite3"))?;
        // WAL keeps readers (the dashboard) from blocking the writer (heartbeats).
        conn.pragma_update(None, "journal_mode", "WAL")?;
        // NORMAL: in WAL mode a commit is synced only at checkpoints, so a
        // power cut may undo the last heartbeats and step records, which
        // cost nothing to lose and come by the hundred a second with many
        // providers (syncing each cut a loaded server's training speed by
        // half in `bench load`). What must not go back (a job the Requester
        // was told is queued, a state change the coordinator acted on, a
        // ban, a token) is written with `call_durable`.
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        // `rookery token create` writes while a server may hold the file.
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        Self::migrated(conn)
    }

    pub fn open_in_memory() -> Result<Self, DbError> {
        Self::migrated(Connection::open_in_memory()?)
    }

    fn migrated(mut conn: Connection) -> Result<Self, DbError> {
        conn.pragma_update(None, "foreign_keys", "ON")?;
        let applied: usize = conn.pragma_query_value(None, "user_version", |row| row.get(0))?;
        for (index, migration) in MIGRATIONS.iter().enumerate().skip(applied) {
            let tx = conn.transaction()?;
            tx.execute_batch(migration)?;
            tx.pragma_update(None, "user_version", index + 1)?;
            tx.commit()?;
        }
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    /// Runs `work` on the calling thread; for start-up, before any request.
    pub(crate) fn call_now<R>(
        &self,
        work: impl FnOnce(&mut Connection) -> rusqlite::Result<R>,
    ) -> Result<R, DbError> {
        let mut guard = self
            .conn
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        work(&mut guard).map_err(DbError::from)
    }

    /// [`Db::call`] whose commit is synced to disk before it returns (with
    /// every commit before it): for what a power cut must not undo.
    pub async fn call_durable<R, F>(&self, work: F) -> Result<R, DbError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Connection) -> rusqlite::Result<R> + Send + 'static,
    {
        self.call(move |conn| {
            conn.pragma_update(None, "synchronous", "FULL")?;
            let result = work(conn);
            let restored = conn.pragma_update(None, "synchronous", "NORMAL");
            let value = result?;
            restored?;
            Ok(value)
        })
        .await
    }

    /// Runs `work` with the connection on the blocking pool.
    pub async fn call<R, F>(&self, work: F) -> Result<R, DbError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Connection) -> rusqlite::Result<R> + Send + 'static,
    {
        let conn = Arc::clone(&self.conn);
        tokio::task::spawn_blocking(move || {
            // A panic while holding the lock cannot leave SQLite half-written
            // (transactions roll back), so a poisoned lock is still usable.
            let mut guard = conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            work(&mut guard)
        })
        .await
        .map_err(|_| DbError::WorkerGone)?
        .map_err(DbError::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_run_once_and_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        drop(Db::open_in_dir(dir.path()).unwrap());
        let db = Db::open_in_dir(dir.path()).unwrap();
        let conn = db.conn.lock().unwrap();
        let version: usize = conn
            .pragma_query_value(None, "user_version", |row| row.get(0))
            .unwrap();
        assert_eq!(version, MIGRATIONS.len());
    }

    #[test]
    fn epoch_end_evaluations_move_to_the_steps_they_were_taken_at_and_steps_gain_sync_bytes() {
        let conn = Connection::open_in_memory().unwrap();
        let before = MIGRATIONS.len() - 1;
        for migration in &MIGRATIONS[..before] {
            conn.execute_batch(migration).unwrap();
        }
        conn.execute_batch(
            "INSERT INTO jobs (id, name, status, spec_json, dir, created_ms, total_steps)
                 VALUES (7, 'j', 'completed', '{\"training\":{\"epochs\":3}}', '', 0, 30);
             INSERT INTO job_epochs VALUES (7, 0, 0.5, 0.8, 100), (7, 2, 0.25, 0.9, 100);",
        )
        .unwrap();
        conn.execute_batch(MIGRATIONS[before]).unwrap();
        let rows: Vec<(i64, i64, f64)> = conn
            .prepare("SELECT step, epoch, test_loss FROM job_evals ORDER BY step")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(rows, [(10, 0, 0.5), (30, 2, 0.25)]);
        let columns: Vec<String> = conn
            .prepare("SELECT name FROM pragma_table_info('job_steps')")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(columns.iter().any(|c| c == "bytes_synced"), "{columns:?}");
    }

    #[tokio::test]
    async fn a_data_dirs_database_is_in_wal_mode_and_durable_calls_sync_their_commit() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open_in_dir(dir.path()).unwrap();
        let mode = db
            .call(|conn| {
                conn.pragma_query_value(None, "journal_mode", |row| row.get::<_, String>(0))
            })
            .await;
        assert_eq!(mode.unwrap(), "wal");
        let synchronous = |conn: &mut Connection| {
            conn.pragma_query_value(None, "synchronous", |row| row.get::<_, i64>(0))
        };
        // (plain, durable, plain again) where 1 is NORMAL and 2 is FULL.
        let plain = db.call(synchronous).await.unwrap();
        let durable = db.call_durable(synchronous).await.unwrap();
        let after = db.call(synchronous).await.unwrap();
        assert_eq!((plain, durable, after), (1, 2, 1));
    }

    #[test]
    fn data_dir_is_created_on_first_start() {
        let dir = tempfile::tempdir().unwrap();
        let nested = dir.path().join("a/b");
        Db::open_in_dir(&nested).unwrap();
        assert!(nested.join("rookery.sqlite3").exists());
    }
}
