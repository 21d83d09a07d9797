//! Requesters: the people who submit jobs, each with their own API token.
//!
//! The database keeps only a token's SHA-256 digest, so a copied database
//! grants nothing. The first Requester ("default") is the one whose token the
//! server writes to the data dir's `api-token` file on first start; more are
//! made with `rookery token create NAME`, which shows the new token once.
//! Jobs belong to the Requester who submitted them.
//!
//! `rookery token revoke NAME` marks a Requester revoked: no token of its
//! is accepted from then on, by a server already running on the data dir
//! too, since every request is checked against the database and nothing
//! caches a token. The row stays, and with it the Requester's jobs, which
//! nobody can read until `rookery token create NAME` issues the same
//! Requester a new token.

use rusqlite::{Connection, OptionalExtension, params};

use crate::store::db::{Db, DbError};
use crate::store::tokens::Token;

/// The name of the Requester whose token lives in the data dir.
pub const FIRST: &str = "default";

/// Someone whose token the server accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requester {
    pub id: u64,
    pub name: String,
}

#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error(
        "a Requester's name must have 1 to 64 letters, digits, `.`, `_` or `-`; `{0}` does not"
    )]
    BadName(String),
    #[error(
        "a Requester named `{0}` exists already and its token works; `rookery token revoke {0}` first to issue it a new one"
    )]
    Taken(String),
    #[error(transparent)]
    Db(#[from] DbError),
}

#[derive(Debug, thiserror::Error)]
pub enum RevokeError {
    #[error("there is no Requester named `{0}` (`rookery token list` shows them)")]
    Unknown(String),
    #[error(transparent)]
    Db(#[from] DbError),
}

/// A Requester as `rookery token list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub requester: Requester,
    /// When its token was revoked; `None` while it works.
    pub revoked_ms: Option<u64>,
}

/// What [`issue`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    pub requester: Requester,
    /// The Requester existed, revoked, and got its jobs back with the token.
    pub reissued: bool,
}

/// What [`revoke`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revoked {
    pub requester: Requester,
    /// Its jobs, which stay its own.
    pub jobs: u64,
    /// It was revoked before; nothing changed.
    pub already: bool,
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// Makes a Requester with a fresh token, or gives a revoked one a fresh
/// token (see [`issue`]). The token is returned once and stored nowhere in
/// plaintext.
pub async fn create(db: &Db, name: &str, now_ms: u64) -> Result<(Requester, Token), CreateError> {
    let token = Token::generate();
    let issued = issue(db, name, &token, now_ms).await?;
    Ok((issued.requester, token))
}

/// Makes `token` the token of a new Requester called `name`, or of the
/// revoked Requester of that name, who then has its jobs back. A Requester
/// whose token works is never given another one here: an operator who
/// means to replace a working token revokes it first, so no typo silently
/// locks someone out.
pub async fn issue(db: &Db, name: &str, token: &Token, now_ms: u64) -> Result<Issued, CreateError> {
    if !valid_name(name) {
        return Err(CreateError::BadName(name.to_string()));
    }
    let digest = token.digest();
    let owned = name.to_string();
    db.call_durable(move |conn| {
        let tx = conn.transaction()?;
        let known: Option<(i64, Option<i64>)> = tx
            .query_row(
                "SELECT id, revoked_ms FROM requesters WHERE name = ?1",
                [&owned],
                |row| Ok((row.get(0)?, row.get(1)?)),
            )
            .optional()?;
        let issued = match known {
            Some((_, None)) => None,
            Some((id, Some(_))) => {
                tx.execute(
                    "UPDATE requesters SET token_sha256 = ?2, revoked_ms = NULL WHERE id = ?1",
                    params![id, digest],
                )?;
                Some((id, true))
            }
            None => {
                tx.execute(
                    "INSERT INTO requesters (name, token_sha256, created_ms) VALUES (?1, ?2, ?3)",
                    params![owned, digest, now_ms as i64],
                )?;
                Some((tx.last_insert_rowid(), false))
            }
        };
        tx.commit()?;
        Ok(issued.map(|(id, reissued)| Issued {
            requester: Requester {
                id: id as u64,
                name: owned,
            },
            reissued,
        }))
    })
    .await?
    .ok_or_else(|| CreateError::Taken(name.to_string()))
}

/// Revokes `name`'s token: from the next request on (a running server's
/// included) it is refused. The Requester and its jobs stay; revoking a
/// revoked Requester changes nothing.
pub async fn revoke(db: &Db, name: &str, now_ms: u64) -> Result<Revoked, RevokeError> {
    let owned = name.to_string();
    db.call_durable(move |conn| {
        let tx = conn.transaction()?;
        let known: Option<(i64, bool)> = tx
            .query_row(
                "SELECT id, revoked_ms IS NOT NULL FROM requesters WHERE name = ?1",
                [&owned],
                |row| Ok((row.get(0)?, row.get(1)?)),
            )
            .optional()?;
        let Some((id, already)) = known else {
            return Ok(None);
        };
        if !already {
            tx.execute(
                "UPDATE requesters SET revoked_ms = ?2 WHERE id = ?1",
                params![id, now_ms as i64],
            )?;
        }
        let jobs: i64 =
            tx.query_row("SELECT COUNT(*) FROM jobs WHERE owner = ?1", [id], |row| {
                row.get(0)
            })?;
        tx.commit()?;
        Ok(Some(Revoked {
            requester: Requester {
                id: id as u64,
                name: owned,
            },
            jobs: jobs as u64,
            already,
        }))
    })
    .await?
    .ok_or_else(|| RevokeError::Unknown(name.to_string()))
}

/// The Requester a presented token belongs to, if any. Only digests are
/// compared, so lookup time says nothing about the secret.
pub async fn authenticate(db: &Db, presented: &str) -> Result<Option<Requester>, DbError> {
    authenticate_digest(db, crate::store::tokens::digest_hex(presented)).await
}

/// [`authenticate`] by the token's digest, for a check repeated over a
/// connection's life without keeping the secret.
pub async fn authenticate_digest(db: &Db, digest: String) -> Result<Option<Requester>, DbError> {
    db.call(move |conn| {
        conn.query_row(
            "SELECT id, name FROM requesters WHERE token_sha256 = ?1 AND revoked_ms IS NULL",
            [digest],
            |row| {
                Ok(Requester {
                    id: row.get::<_, i64>(0)? as u64,
                    name: row.get(1)?,
                })
            },
        )
        .optional()
    })
    .await
}

/// Every Requester, revoked ones included, oldest first.
pub async fn list(db: &Db) -> Result<Vec<Listed>, DbError> {
    db.call(|conn| {
        let mut statement =
            conn.prepare("SELECT id, name, revoked_ms FROM requesters ORDER BY id")?;
        let rows = statement.query_map([], |row| {
            Ok(Listed {
                requester: Requester {
                    id: row.get::<_, i64>(0)? as u64,
                    name: row.get(1)?,
                },
                revoked_ms: row.get::<_, Option<i64>>(2)?.map(|ms| ms as u64),
            })
        })?;
        rows.collect()
    })
    .await
}

/// Makes `token` the first Requester's: on first start it creates
/// [`FIRST`]; if the data dir's token file was replaced, the new token
/// replaces the old digest (and a revoked first Requester works again with
/// it: `rookery token revoke default` deletes the file, and the next start
/// makes a new one). A token that was revoked stays revoked: putting the
/// old file back revives nothing. Jobs from before Requesters existed
/// become the first Requester's.
pub(crate) fn ensure_first(
    conn: &mut Connection,
    token: &Token,
    now_ms: u64,
) -> rusqlite::Result<Requester> {
    let digest = token.digest();
    let tx = conn.transaction()?;
    let known: Option<(i64, String, bool)> = tx
        .query_row(
            "SELECT id, name, revoked_ms IS NOT NULL FROM requesters WHERE token_sha256 = ?1",
            [&digest],
            |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)),
        )
        .optional()?;
    let (id, name) = match known {
        Some((id, name, revoked)) => {
            if revoked {
                tracing::warn!(
                    requester = %name,
                    "the data dir's api-token was revoked and is refused; `rookery token create {name}` issues a new one"
                );
            }
            (id, name)
        }
        None => {
            tx.execute(
                "INSERT INTO requesters (name, token_sha256, created_ms) VALUES (?1, ?2, ?3)
                 ON CONFLICT (name) DO UPDATE SET token_sha256 = excluded.token_sha256,
                     revoked_ms = NULL",
                params![FIRST, digest, now_ms as i64],
            )?;
            let id = tx.query_row(
                "SELECT id FROM requesters WHERE name = ?1",
                [FIRST],
                |row| row.get(0),
            )?;
            (id, FIRST.to_string())
        }
    };
    tx.execute("UPDATE jobs SET owner = ?1 WHERE owner IS NULL", [id])?;
    tx.commit()?;
    Ok(Requester {
        id: id as u64,
        name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tokens_are_stored_as_digests_and_name_their_requester() {
        let db = Db::open_in_memory().unwrap();
        let (alice, token) = create(&db, "alice", 1).await.unwrap();
        let (bob, _) = create(&db, "bob", 2).await.unwrap();
        assert_ne!(alice.id, bob.id);
        assert_eq!(
            authenticate(&db, token.secret()).await.unwrap(),
            Some(alice.clone())
        );
        assert_eq!(authenticate(&db, "nope").await.unwrap(), None);
        assert_eq!(authenticate(&db, &token.secret()[1..]).await.unwrap(), None);
        let stored: Vec<String> = db
            .call(|conn| {
                let mut statement = conn.prepare("SELECT name || token_sha256 FROM requesters")?;
                let rows = statement.query_map([], |row| row.get(0))?;
                rows.collect()
            })
            .await
            .unwrap();
        let secret = token.secret().to_string();
        assert!(
            stored.iter().all(|row| !row.contains(&secret)),
            "{stored:?}"
        );
        assert!(stored[0].contains(&token.digest()));
    }

    /// A second connection stands for `rookery token` run beside a
    /// server: what it revokes, the server's connection refuses at once.
    #[tokio::test]
    async fn a_revoked_token_is_refused_at_once_and_a_reissued_one_gets_the_jobs_back() {
        let dir = tempfile::tempdir().unwrap();
        let server = Db::open_in_dir(dir.path()).unwrap();
        let command = Db::open_in_dir(dir.path()).unwrap();
        let (alice, old) = create(&server, "alice", 1).await.unwrap();
        let (bob, bobs) = create(&server, "bob", 2).await.unwrap();
        let job =
            crate::store::jobs::insert(&server, alice.id, "j".into(), "{}".into(), "d".into(), 3)
                .await
                .unwrap();
        assert_eq!(
            authenticate(&server, old.secret()).await.unwrap(),
            Some(alice.clone())
        );

        let revoked = revoke(&command, "alice", 4).await.unwrap();
        assert_eq!(
            revoked,
            Revoked {
                requester: alice.clone(),
                jobs: 1,
                already: false
            }
        );
        assert_eq!(authenticate(&server, old.secret()).await.unwrap(), None);
        assert_eq!(
            authenticate(&server, bobs.secret()).await.unwrap(),
            Some(bob)
        );
        let standing: Vec<_> = list(&server)
            .await
            .unwrap()
            .into_iter()
            .map(|l| (l.requester.name, l.revoked_ms))
            .collect();
        assert_eq!(
            standing,
            [("alice".to_string(), Some(4)), ("bob".to_string(), None)]
        );
        // Revoking twice changes nothing; an unknown name is an error.
        assert!(revoke(&command, "alice", 5).await.unwrap().already);
        assert_eq!(list(&server).await.unwrap()[0].revoked_ms, Some(4));
        assert!(matches!(
            revoke(&command, "carol", 5).await,
            Err(RevokeError::Unknown(name)) if name == "carol"
        ));

        // A new token for the same name is the same Requester, with its job;
        // the old token stays refused.
        let (again, new) = create(&command, "alice", 6).await.unwrap();
        assert_eq!(again, alice);
        assert_eq!(
            authenticate(&server, new.secret()).await.unwrap(),
            Some(alice.clone())
        );
        assert_eq!(authenticate(&server, old.secret()).await.unwrap(), None);
        let owned = crate::store::jobs::list_owned(&server, alice.id)
            .await
            .unwrap();
        assert_eq!(owned.iter().map(|j| j.id).collect::<Vec<_>>(), [job]);
        // A working token is never replaced by `create`.
        assert!(matches!(
            create(&command, "alice", 7).await,
            Err(CreateError::Taken(_))
        ));
    }

    #[tokio::test]
    async fn a_revoked_first_requester_stays_revoked_until_its_token_file_is_replaced() {
        let db = Db::open_in_memory().unwrap();
        let token = Token::generate();
        let first = db.call_now(|conn| ensure_first(conn, &token, 1)).unwrap();
        revoke(&db, FIRST, 2).await.unwrap();
        // A restart with the revoked token (the old file put back) revives nothing.
        db.call_now(|conn| ensure_first(conn, &token, 3)).unwrap();
        assert_eq!(authenticate(&db, token.secret()).await.unwrap(), None);
        // A new file, as the next start makes after the revocation deleted
        // it, is the first Requester's new token.
        let fresh = Token::generate();
        let again = db.call_now(|conn| ensure_first(conn, &fresh, 4)).unwrap();
        assert_eq!(again, first);
        assert_eq!(
            authenticate(&db, fresh.secret()).await.unwrap(),
            Some(first)
        );
        assert_eq!(authenticate(&db, token.secret()).await.unwrap(), None);
    }

    #[tokio::test]
    async fn names_are_unique_and_plain() {
        let db = Db::open_in_memory().unwrap();
        create(&db, "alice", 1).await.unwrap();
        assert!(matches!(
            create(&db, "alice", 2).await,
            Err(CreateError::Taken(name)) if name == "alice"
        ));
        for bad in ["", "a b", "é", "x/y", &"n".repeat(65)] {
            assert!(
                matches!(create(&db, bad, 3).await, Err(CreateError::BadName(_))),
                "{bad:?}"
            );
        }
        assert_eq!(list(&db).await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn jobs_from_before_requesters_become_the_first_requesters() {
        let dir = tempfile::tempdir().unwrap();
        {
            // A data dir as the server left it before Requesters existed.
            let conn = Connection::open(dir.path().join("rookery.sqlite3")).unwrap();
            for migration in &crate::store::db::MIGRATIONS[..2] {
                conn.execute_batch(migration).unwrap();
            }
            conn.pragma_update(None, "user_version", 2).unwrap();
            conn.execute(
                "INSERT INTO jobs (name, status, spec_json, dir, created_ms) VALUES ('old', 'completed', '{}', 'd', 1)",
                [],
            )
            .unwrap();
        }
        let db = Db::open_in_dir(dir.path()).unwrap();
        let token = Token::generate();
        let first = db.call_now(|conn| ensure_first(conn, &token, 5)).unwrap();
        assert_eq!(first.name, FIRST);
        let old = crate::store::jobs::get(&db, 1).await.unwrap().unwrap();
        assert_eq!(old.owner, Some(first.id));
        assert_eq!(
            crate::store::jobs::list_owned(&db, first.id)
                .await
                .unwrap()
                .len(),
            1
        );

        // Starting again with the same token changes nothing; a replaced
        // token file replaces the first Requester's token.
        let again = db.call_now(|conn| ensure_first(conn, &token, 6)).unwrap();
        assert_eq!(again, first);
        let replaced = Token::generate();
        let rotated = db
            .call_now(|conn| ensure_first(conn, &replaced, 7))
            .unwrap();
        assert_eq!(rotated.id, first.id);
        assert_eq!(authenticate(&db, token.secret()).await.unwrap(), None);
        assert_eq!(
            authenticate(&db, replaced.secret()).await.unwrap(),
            Some(first)
        );
    }
}
