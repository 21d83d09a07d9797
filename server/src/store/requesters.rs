//! Requesters: the people who submit jobs, each with their own API token.
//!
//! The database keeps only a token's SHA-256 digest, so a copied database
//! grants nothing. The first Requester ("default") is the one whose token the
//! server writes to the data dir's `api-token` file on first start; more are
//! made with `rookery token create NAME`, which shows the new token once.
//! Jobs belong to the Requester who submitted them.

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
    #[error("a Requester named `{0}` exists already")]
    Taken(String),
    #[error(transparent)]
    Db(#[from] DbError),
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// Makes a Requester with a fresh token. The token is returned once and
/// stored nowhere in plaintext.
pub async fn create(db: &Db, name: &str, now_ms: u64) -> Result<(Requester, Token), CreateError> {
    if !valid_name(name) {
        return Err(CreateError::BadName(name.to_string()));
    }
    let token = Token::generate();
    let digest = token.digest();
    let owned = name.to_string();
    let id = db
        .call(move |conn| {
            let inserted = conn.execute(
                "INSERT INTO requesters (name, token_sha256, created_ms) VALUES (?1, ?2, ?3)
                 ON CONFLICT (name) DO NOTHING",
                params![owned, digest, now_ms as i64],
            )?;
            Ok((inserted > 0).then(|| conn.last_insert_rowid() as u64))
        })
        .await?
        .ok_or_else(|| CreateError::Taken(name.to_string()))?;
    Ok((
        Requester {
            id,
            name: name.to_string(),
        },
        token,
    ))
}

/// The Requester a presented token belongs to, if any. Only digests are
/// compared, so lookup time says nothing about the secret.
pub async fn authenticate(db: &Db, presented: &str) -> Result<Option<Requester>, DbError> {
    let digest = crate::store::tokens::digest_hex(presented);
    db.call(move |conn| {
        conn.query_row(
            "SELECT id, name FROM requesters WHERE token_sha256 = ?1",
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

/// Every Requester, oldest first.
pub async fn list(db: &Db) -> Result<Vec<Requester>, DbError> {
    db.call(|conn| {
        let mut statement = conn.prepare("SELECT id, name FROM requesters ORDER BY id")?;
        let rows = statement.query_map([], |row| {
            Ok(Requester {
                id: row.get::<_, i64>(0)? as u64,
                name: row.get(1)?,
            })
        })?;
        rows.collect()
    })
    .await
}

/// Makes `token` the first Requester's: on first start it creates
/// [`FIRST`]; if the data dir's token file was replaced, the new token
/// replaces the old digest. Jobs from before Requesters existed become the
/// first Requester's.
pub(crate) fn ensure_first(
    conn: &mut Connection,
    token: &Token,
    now_ms: u64,
) -> rusqlite::Result<Requester> {
    let digest = token.digest();
    let tx = conn.transaction()?;
    let known: Option<(i64, String)> = tx
        .query_row(
            "SELECT id, name FROM requesters WHERE token_sha256 = ?1",
            [&digest],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .optional()?;
    let (id, name) = match known {
        Some(known) => known,
        None => {
            tx.execute(
                "INSERT INTO requesters (name, token_sha256, created_ms) VALUES (?1, ?2, ?3)
                 ON CONFLICT (name) DO UPDATE SET token_sha256 = excluded.token_sha256",
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
