//! Provider identities. The server issues every new provider a secret
//! credential in `Welcome` and keeps only its SHA-256 digest; the provider
//! sends it back in every later `Hello`. Faults, bans and (later) credit
//! attach to the identity, so a new name or a reconnection changes nothing,
//! and nobody can take on another's record by choosing its name.
//!
//! Identities are cheap to make, so making them is rate-limited per
//! address, and the faults of an address's recent identities use up its
//! allowance faster ([`IssueLimit`]).

use std::net::IpAddr;

use rusqlite::{OptionalExtension, params};

use crate::store::db::{Db, DbError};
use crate::store::tokens::{Token, digest_hex};

/// How the allowance for new identities is counted, per address and over
/// the last [`ISSUE_WINDOW_MS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IssueLimit {
    /// New identities an address may make per window when none of them
    /// commits a fault.
    pub per_window: u32,
}

impl Default for IssueLimit {
    fn default() -> Self {
        Self { per_window: 64 }
    }
}

/// The window new identities are counted over: an hour.
pub const ISSUE_WINDOW_MS: u64 = 3_600_000;

/// Each fault of an address's recent identities costs as much of its
/// allowance as this many new identities: an address whose identities get
/// banned (three faults each) can make few more, while a household of
/// honest donors reconnecting is never refused.
pub const FAULT_COST: u64 = 4;

impl IssueLimit {
    /// Whether an address that made `issued` identities in the window, whose
    /// faults add up to `faults`, may make another.
    pub fn allows(&self, issued: u64, faults: u64) -> bool {
        issued.saturating_add(faults.saturating_mul(FAULT_COST)) < u64::from(self.per_window)
    }
}

/// Who a `Hello` turned out to be.
#[derive(Debug, Clone, PartialEq)]
pub enum Resolved {
    /// Its credential names this identity.
    Known(u64),
    /// A new identity, with the credential to hand over in `Welcome`.
    Issued { identity: u64, credential: String },
    /// The address has used up its allowance of new identities.
    Refused { issued: u64, faults: u64 },
}

/// The identity whose credential is `credential`, or a new one for `ip` if
/// there is none (no credential, or one this server never issued: its
/// database may have been reset) and `limit` allows.
pub async fn resolve(
    db: &Db,
    credential: Option<String>,
    ip: Option<IpAddr>,
    now_ms: u64,
    limit: IssueLimit,
) -> Result<Resolved, DbError> {
    let ip = ip.map(|ip| ip.to_string()).unwrap_or_default();
    db.call(move |conn| {
        let tx = conn.transaction()?;
        if let Some(credential) = credential {
            let known: Option<i64> = tx
                .query_row(
                    "SELECT id FROM identities WHERE secret_sha256 = ?1",
                    [digest_hex(&credential)],
                    |row| row.get(0),
                )
                .optional()?;
            if let Some(id) = known {
                tx.execute(
                    "UPDATE identities SET last_seen_ms = ?2 WHERE id = ?1",
                    params![id, now_ms as i64],
                )?;
                tx.commit()?;
                return Ok(Resolved::Known(id as u64));
            }
        }
        let since = now_ms.saturating_sub(ISSUE_WINDOW_MS) as i64;
        let (issued, faults): (i64, i64) = tx.query_row(
            "SELECT COUNT(*), COALESCE(SUM(faults), 0) FROM identities
             WHERE created_ip = ?1 AND created_ms >= ?2",
            params![ip, since],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )?;
        let (issued, faults) = (issued.max(0) as u64, faults.max(0) as u64);
        if !limit.allows(issued, faults) {
            return Ok(Resolved::Refused { issued, faults });
        }
        let token = Token::generate();
        tx.execute(
            "INSERT INTO identities (secret_sha256, created_ms, created_ip, last_seen_ms)
             VALUES (?1, ?2, ?3, ?2)",
            params![token.digest(), now_ms as i64, ip],
        )?;
        let identity = tx.last_insert_rowid() as u64;
        tx.commit()?;
        Ok(Resolved::Issued {
            identity,
            credential: token.secret().to_owned(),
        })
    })
    .await
}

/// The identity whose credential is `credential`, if this server issued
/// it; unlike [`resolve`], nothing is made or touched (a dashboard showing
/// a donor its own providers is no visit).
pub async fn find(db: &Db, credential: String) -> Result<Option<u64>, DbError> {
    db.call(move |conn| {
        conn.query_row(
            "SELECT id FROM identities WHERE secret_sha256 = ?1",
            [digest_hex(&credential)],
            |row| row.get::<_, i64>(0),
        )
        .optional()
        .map(|id| id.map(|id| id as u64))
    })
    .await
}

/// How many identities this server has issued.
pub async fn count(db: &Db) -> Result<u64, DbError> {
    db.call(|conn| {
        conn.query_row("SELECT COUNT(*) FROM identities", [], |row| {
            row.get::<_, i64>(0)
        })
        .map(|n| n.max(0) as u64)
    })
    .await
}

/// Counts a fault against `identity`: it spends its address's allowance
/// for new identities.
pub async fn record_fault(db: &Db, identity: u64) -> Result<(), DbError> {
    db.call(move |conn| {
        conn.execute(
            "UPDATE identities SET faults = faults + 1 WHERE id = ?1",
            [identity as i64],
        )
        .map(drop)
    })
    .await
}

/// Faults counted against `identity` on every job.
pub async fn faults(db: &Db, identity: u64) -> Result<u64, DbError> {
    db.call(move |conn| {
        conn.query_row(
            "SELECT faults FROM identities WHERE id = ?1",
            [identity as i64],
            |row| row.get::<_, i64>(0),
        )
        .optional()
        .map(|faults| faults.unwrap_or(0).max(0) as u64)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: IssueLimit = IssueLimit { per_window: 8 };

    fn ip(last: u8) -> Option<IpAddr> {
        Some(IpAddr::from([10, 0, 0, last]))
    }

    async fn issue(db: &Db, address: Option<IpAddr>, now_ms: u64) -> Resolved {
        resolve(db, None, address, now_ms, LIMIT).await.unwrap()
    }

    #[tokio::test]
    async fn a_credential_names_its_identity_and_only_its_digest_is_kept() {
        let db = Db::open_in_memory().unwrap();
        let Resolved::Issued {
            identity,
            credential,
        } = issue(&db, ip(1), 1_000).await
        else {
            panic!("a first visit gets an identity");
        };
        assert_eq!(credential.len(), 64);
        // The same credential from anywhere, under any name, is the same identity.
        for address in [ip(1), ip(2), None] {
            let again = resolve(&db, Some(credential.clone()), address, 2_000, LIMIT);
            assert_eq!(again.await.unwrap(), Resolved::Known(identity));
        }
        // A credential the server never issued gets a new identity.
        let unknown = resolve(&db, Some("guess".into()), ip(1), 3_000, LIMIT);
        assert!(
            matches!(unknown.await.unwrap(), Resolved::Issued { identity: other, .. } if other != identity)
        );
        let stored: Vec<String> = db
            .call(|conn| {
                let mut statement = conn.prepare("SELECT secret_sha256 FROM identities")?;
                let rows = statement.query_map([], |row| row.get(0))?;
                rows.collect()
            })
            .await
            .unwrap();
        assert!(stored.contains(&digest_hex(&credential)));
        assert!(!stored.contains(&credential));
    }

    #[tokio::test]
    async fn an_address_makes_few_identities_an_hour_and_fewer_once_they_fault() {
        let db = Db::open_in_memory().unwrap();
        let mut issued = Vec::new();
        for i in 0..8 {
            match issue(&db, ip(1), 1_000 + i).await {
                Resolved::Issued { identity, .. } => issued.push(identity),
                other => panic!("identity {i} refused: {other:?}"),
            }
        }
        assert_eq!(
            issue(&db, ip(1), 2_000).await,
            Resolved::Refused {
                issued: 8,
                faults: 0
            }
        );
        // Another address is not affected, and an hour later the first may
        // make identities again.
        assert!(matches!(
            issue(&db, ip(2), 2_000).await,
            Resolved::Issued { .. }
        ));
        let later = 1_000 + ISSUE_WINDOW_MS + 8;
        let Resolved::Issued { identity, .. } = issue(&db, ip(1), later).await else {
            panic!("the window has passed");
        };
        // Two faults of the new identity use up most of the allowance.
        record_fault(&db, identity).await.unwrap();
        record_fault(&db, identity).await.unwrap();
        assert_eq!(faults(&db, identity).await.unwrap(), 2);
        assert_eq!(
            issue(&db, ip(1), later + 1).await,
            Resolved::Refused {
                issued: 1,
                faults: 2
            }
        );
    }

    #[test]
    fn the_allowance_counts_faults_at_their_cost() {
        // (issued, faults, allowed) with 8 a window
        let cases = [
            (0, 0, true),
            (7, 0, true),
            (8, 0, false),
            (3, 1, true),
            (4, 1, false),
            (0, 2, false),
            (0, u64::MAX, false),
        ];
        for (issued, faults, allowed) in cases {
            assert_eq!(LIMIT.allows(issued, faults), allowed, "{issued} {faults}");
        }
    }
}
