//! Credit: the training work each provider identity did that the server
//! accepted, in GFLOP (each stage's planned work for each step its cluster
//! finished), kept per job so that work later found wrong is withdrawn: a
//! ban on a job takes back that identity's credit for the job. A donor may
//! give its identity a public name and team ([`set_donor`]); the
//! leaderboard ranks identities by credit, the nameless as "anonymous".

use rookery_proto::DonorCard;
use rusqlite::params;

use crate::store::db::{Db, DbError};

/// One donor on the leaderboard.
#[derive(Debug, Clone, PartialEq)]
pub struct Standing {
    pub name: Option<String>,
    pub team: Option<String>,
    /// GFLOP of accepted work.
    pub gflop: f64,
}

/// Adds `(identity, gflop)` of work on `job_id` to each identity's credit.
pub async fn add(db: &Db, job_id: u64, work: Vec<(u64, f64)>) -> Result<(), DbError> {
    db.call(move |conn| {
        let tx = conn.transaction()?;
        {
            let mut upsert = tx.prepare_cached(
                "INSERT INTO credit (identity, job_id, gflop) VALUES (?1, ?2, ?3)
                 ON CONFLICT (identity, job_id) DO UPDATE SET gflop = gflop + excluded.gflop",
            )?;
            for (identity, gflop) in work {
                upsert.execute(params![identity as i64, job_id as i64, gflop])?;
            }
        }
        tx.commit()
    })
    .await
}

/// Takes back `identity`'s credit for `job_id`; the GFLOP withdrawn.
pub async fn withdraw(db: &Db, job_id: u64, identity: u64) -> Result<f64, DbError> {
    db.call_durable(move |conn| {
        let gflop: f64 = conn.query_row(
            "SELECT COALESCE(SUM(gflop), 0) FROM credit WHERE identity = ?1 AND job_id = ?2",
            params![identity as i64, job_id as i64],
            |row| row.get(0),
        )?;
        conn.execute(
            "DELETE FROM credit WHERE identity = ?1 AND job_id = ?2",
            params![identity as i64, job_id as i64],
        )?;
        Ok(gflop)
    })
    .await
}

/// `identity`'s credit over every job, GFLOP.
pub async fn total(db: &Db, identity: u64) -> Result<f64, DbError> {
    db.call(move |conn| {
        conn.query_row(
            "SELECT COALESCE(SUM(gflop), 0) FROM credit WHERE identity = ?1",
            [identity as i64],
            |row| row.get(0),
        )
    })
    .await
}

/// Records how `identity`'s donor wants to appear on the leaderboard.
pub async fn set_donor(db: &Db, identity: u64, card: DonorCard) -> Result<(), DbError> {
    db.call(move |conn| {
        conn.execute(
            "UPDATE identities SET donor_name = ?2, team = ?3 WHERE id = ?1",
            params![identity as i64, card.name, card.team],
        )
        .map(drop)
    })
    .await
}

/// The `limit` identities with the most credit, most first (ties by the
/// older identity), each with its donor's name and team if it gave them.
pub async fn leaderboard(db: &Db, limit: usize) -> Result<Vec<Standing>, DbError> {
    db.call(move |conn| {
        let mut query = conn.prepare(
            "SELECT i.donor_name, i.team, SUM(c.gflop) AS total
             FROM credit c JOIN identities i ON i.id = c.identity
             GROUP BY c.identity HAVING total > 0
             ORDER BY total DESC, c.identity ASC LIMIT ?1",
        )?;
        let rows = query.query_map([limit as i64], |row| {
            Ok(Standing {
                name: row.get(0)?,
                team: row.get(1)?,
                gflop: row.get(2)?,
            })
        })?;
        rows.collect()
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::identities::{self, IssueLimit, Resolved};

    async fn identity(db: &Db) -> u64 {
        match identities::resolve(db, None, None, 0, IssueLimit::default())
            .await
            .unwrap()
        {
            Resolved::Issued { identity, .. } => identity,
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn credit_adds_up_per_identity_a_ban_withdraws_one_jobs_and_it_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open_in_dir(dir.path()).unwrap();
        let (alice, bob, carol) = (
            identity(&db).await,
            identity(&db).await,
            identity(&db).await,
        );
        let card = |name: &str, team: Option<&str>| DonorCard {
            name: name.into(),
            team: team.map(Into::into),
        };
        set_donor(&db, alice, card("alice", Some("ravens")))
            .await
            .unwrap();
        set_donor(&db, bob, card("bob", None)).await.unwrap();
        add(&db, 1, vec![(alice, 10.0), (bob, 30.0), (carol, 5.0)])
            .await
            .unwrap();
        add(&db, 1, vec![(alice, 10.0)]).await.unwrap();
        add(&db, 2, vec![(alice, 15.0), (bob, 1.0)]).await.unwrap();
        // Bob's work on job 1 was found wrong.
        assert_eq!(withdraw(&db, 1, bob).await.unwrap(), 30.0);
        assert_eq!(withdraw(&db, 1, bob).await.unwrap(), 0.0);
        drop(db);
        let db = Db::open_in_dir(dir.path()).unwrap();
        assert_eq!(total(&db, alice).await.unwrap(), 35.0);
        assert_eq!(total(&db, bob).await.unwrap(), 1.0);
        let board = leaderboard(&db, 10).await.unwrap();
        let want = [
            (Some("alice"), Some("ravens"), 35.0),
            (None, None, 5.0),
            (Some("bob"), None, 1.0),
        ];
        let got: Vec<(Option<&str>, Option<&str>, f64)> = board
            .iter()
            .map(|s| (s.name.as_deref(), s.team.as_deref(), s.gflop))
            .collect();
        assert_eq!(got, want);
        assert_eq!(leaderboard(&db, 1).await.unwrap().len(), 1);
    }
}
