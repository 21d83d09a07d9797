//! The provider registry: who has joined, what they reported about
//! themselves, and whether they are still here. SQLite is the source of truth
//! so the history survives restarts and the dashboard reads one place.

use rookery_proto::{Hello, ProviderKind};
use rusqlite::{OptionalExtension, params};

use crate::store::db::{Db, DbError};

/// A provider as the server remembers it. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderRecord {
    pub id: u64,
    /// The server-issued identity it connected as.
    pub identity: Option<u64>,
    pub name: String,
    pub kind: ProviderKind,
    pub device: String,
    pub memory_bytes: u64,
    pub gflops: f64,
    pub connected_ms: u64,
    pub last_heartbeat_ms: u64,
    pub gone: Option<Departure>,
    /// Link bandwidth to the server, once measured.
    pub bandwidth_mbps: Option<f64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Departure {
    pub at_ms: u64,
    pub reason: String,
}

pub async fn register(db: &Db, hello: Hello, identity: u64, now_ms: u64) -> Result<u64, DbError> {
    db.call(move |conn| {
        conn.execute(
            "INSERT INTO providers (name, kind, device, memory_bytes, gflops, connected_ms, last_heartbeat_ms, identity)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6, ?7)",
            params![
                hello.display_name,
                hello.kind.as_str(),
                hello.device,
                // SQLite integers are i64; no machine has 8 EiB of memory.
                i64::try_from(hello.memory_bytes).unwrap_or(i64::MAX),
                hello.gflops,
                now_ms as i64,
                identity as i64,
            ],
        )?;
        Ok(conn.last_insert_rowid() as u64)
    })
    .await
}

pub async fn record_heartbeat(db: &Db, id: u64, now_ms: u64) -> Result<(), DbError> {
    db.call(move |conn| {
        conn.execute(
            "UPDATE providers SET last_heartbeat_ms = ?2 WHERE id = ?1 AND gone_ms IS NULL",
            params![id as i64, now_ms as i64],
        )
        .map(drop)
    })
    .await
}

pub async fn record_bandwidth(db: &Db, id: u64, mbps: f64) -> Result<(), DbError> {
    db.call(move |conn| {
        conn.execute(
            "UPDATE providers SET bandwidth_mbps = ?2 WHERE id = ?1",
            params![id as i64, mbps],
        )
        .map(drop)
    })
    .await
}

pub async fn mark_gone(db: &Db, id: u64, now_ms: u64, reason: String) -> Result<(), DbError> {
    db.call(move |conn| {
        conn.execute(
            "UPDATE providers SET gone_ms = ?2, gone_reason = ?3 WHERE id = ?1 AND gone_ms IS NULL",
            params![id as i64, now_ms as i64, reason],
        )
        .map(drop)
    })
    .await
}

/// A fresh server process has no sockets, so whoever the last one saw
/// connected is gone now.
pub async fn mark_all_gone(db: &Db, now_ms: u64, reason: &str) -> Result<usize, DbError> {
    let reason = reason.to_owned();
    db.call(move |conn| {
        conn.execute(
            "UPDATE providers SET gone_ms = ?1, gone_reason = ?2 WHERE gone_ms IS NULL",
            params![now_ms as i64, reason],
        )
    })
    .await
}

/// Every provider ever seen: connected ones first, newest first within each group.
pub async fn list(db: &Db) -> Result<Vec<ProviderRecord>, DbError> {
    db.call(|conn| {
        let mut statement = conn.prepare(
            "SELECT id, name, kind, device, memory_bytes, gflops, connected_ms, last_heartbeat_ms, gone_ms, gone_reason, bandwidth_mbps, identity
             FROM providers ORDER BY gone_ms IS NOT NULL, id DESC",
        )?;
        let rows = statement.query_map([], row_to_record)?;
        rows.collect()
    })
    .await
}

/// The providers that connected as `identity`, in [`list`]'s order.
pub async fn list_of_identity(db: &Db, identity: u64) -> Result<Vec<ProviderRecord>, DbError> {
    db.call(move |conn| {
        let mut statement = conn.prepare(
            "SELECT id, name, kind, device, memory_bytes, gflops, connected_ms, last_heartbeat_ms, gone_ms, gone_reason, bandwidth_mbps, identity
             FROM providers WHERE identity = ?1 ORDER BY gone_ms IS NOT NULL, id DESC",
        )?;
        let rows = statement.query_map([identity as i64], row_to_record)?;
        rows.collect()
    })
    .await
}

/// The connected providers in numbers: how many of each kind, and the
/// GFLOP/s they claim together.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Connected {
    pub by_kind: Vec<(ProviderKind, u64)>,
    pub gflops: f64,
}

pub async fn connected(db: &Db) -> Result<Connected, DbError> {
    db.call(|conn| {
        let mut statement = conn.prepare(
            "SELECT kind, COUNT(*), COALESCE(SUM(gflops), 0) FROM providers
             WHERE gone_ms IS NULL GROUP BY kind ORDER BY kind",
        )?;
        let mut counts = Connected::default();
        let rows = statement.query_map([], |row| {
            Ok((
                row.get::<_, String>(0)?,
                row.get::<_, i64>(1)?,
                row.get::<_, f64>(2)?,
            ))
        })?;
        for row in rows {
            let (kind, n, gflops) = row?;
            if let Some(kind) = ProviderKind::parse(&kind) {
                counts.by_kind.push((kind, n.max(0) as u64));
                counts.gflops += gflops;
            }
        }
        Ok(counts)
    })
    .await
}

/// Forgets providers gone before `before_ms` (their history is kept for
/// a retention period, not for ever); returns how many. Connected ones stay
/// whatever their age. Nothing refers to a provider row: bans, faults and
/// plans name identities or keep their own copy.
pub async fn prune_gone(db: &Db, before_ms: u64) -> Result<usize, DbError> {
    db.call(move |conn| {
        conn.execute(
            "DELETE FROM providers WHERE gone_ms IS NOT NULL AND gone_ms < ?1",
            [before_ms as i64],
        )
    })
    .await
}

pub async fn get(db: &Db, id: u64) -> Result<Option<ProviderRecord>, DbError> {
    db.call(move |conn| {
        conn.query_row(
            "SELECT id, name, kind, device, memory_bytes, gflops, connected_ms, last_heartbeat_ms, gone_ms, gone_reason, bandwidth_mbps, identity
             FROM providers WHERE id = ?1",
            [id as i64],
            row_to_record,
        )
        .optional()
    })
    .await
}

fn row_to_record(row: &rusqlite::Row<'_>) -> rusqlite::Result<ProviderRecord> {
    let kind: String = row.get(2)?;
    let gone_ms: Option<i64> = row.get(8)?;
    let gone_reason: Option<String> = row.get(9)?;
    Ok(ProviderRecord {
        id: row.get::<_, i64>(0)? as u64,
        identity: row.get::<_, Option<i64>>(11)?.map(|i| i as u64),
        name: row.get(1)?,
        // Only this module writes the column, from a ProviderKind.
        kind: ProviderKind::parse(&kind).unwrap_or(ProviderKind::Native),
        device: row.get(3)?,
        memory_bytes: row.get::<_, i64>(4)? as u64,
        gflops: row.get(5)?,
        connected_ms: row.get::<_, i64>(6)? as u64,
        last_heartbeat_ms: row.get::<_, i64>(7)? as u64,
        gone: gone_ms.map(|at| Departure {
            at_ms: at as u64,
            reason: gone_reason.unwrap_or_default(),
        }),
        bandwidth_mbps: row.get(10)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_proto::PROTOCOL_VERSION;

    fn hello(name: &str) -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            kind: ProviderKind::Browser,
            device: "SwiftShader".into(),
            memory_bytes: 1 << 30,
            gflops: 3.5,
            display_name: name.into(),
            max_buffer_bytes: None,
            credential: None,
            requester_token: None,
            donor: None,
            duty_cycle: 1.0,
        }
    }

    #[tokio::test]
    async fn a_provider_lives_and_leaves() {
        let db = Db::open_in_memory().unwrap();
        let id = register(&db, hello("tab"), 7, 1_000).await.unwrap();
        record_heartbeat(&db, id, 2_000).await.unwrap();
        let record = get(&db, id).await.unwrap().unwrap();
        assert_eq!(record.bandwidth_mbps, None);
        record_bandwidth(&db, id, 940.5).await.unwrap();
        let record = get(&db, id).await.unwrap().unwrap();
        assert_eq!(record.bandwidth_mbps, Some(940.5));
        assert_eq!(
            (record.kind, record.identity),
            (ProviderKind::Browser, Some(7))
        );
        assert_eq!(
            (record.connected_ms, record.last_heartbeat_ms),
            (1_000, 2_000)
        );
        assert_eq!(record.gone, None);

        mark_gone(&db, id, 3_000, "closed".into()).await.unwrap();
        // Late heartbeats and second departures do not rewrite history.
        record_heartbeat(&db, id, 4_000).await.unwrap();
        mark_gone(&db, id, 5_000, "again".into()).await.unwrap();
        let record = get(&db, id).await.unwrap().unwrap();
        assert_eq!(record.last_heartbeat_ms, 2_000);
        assert_eq!(
            record.gone,
            Some(Departure {
                at_ms: 3_000,
                reason: "closed".into()
            })
        );
    }

    #[tokio::test]
    async fn list_puts_connected_providers_first() {
        let db = Db::open_in_memory().unwrap();
        let first = register(&db, hello("first"), 7, 1).await.unwrap();
        let second = register(&db, hello("second"), 7, 2).await.unwrap();
        let third = register(&db, hello("third"), 7, 3).await.unwrap();
        mark_gone(&db, second, 4, "closed".into()).await.unwrap();
        let ids: Vec<u64> = list(&db).await.unwrap().iter().map(|p| p.id).collect();
        assert_eq!(ids, vec![third, first, second]);
        assert_eq!(mark_all_gone(&db, 5, "server restarted").await.unwrap(), 2);
    }

    #[tokio::test]
    async fn pruning_forgets_only_providers_gone_before_the_cutoff() {
        let db = Db::open_in_memory().unwrap();
        let long_gone = register(&db, hello("long gone"), 1, 10).await.unwrap();
        let just_gone = register(&db, hello("just gone"), 2, 20).await.unwrap();
        let connected = register(&db, hello("connected"), 3, 30).await.unwrap();
        let old_but_here = register(&db, hello("old but here"), 4, 0).await.unwrap();
        mark_gone(&db, long_gone, 99, "closed".into())
            .await
            .unwrap();
        mark_gone(&db, just_gone, 100, "closed".into())
            .await
            .unwrap();

        assert_eq!(prune_gone(&db, 100).await.unwrap(), 1);
        let mut ids: Vec<u64> = list(&db).await.unwrap().iter().map(|p| p.id).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![just_gone, connected, old_but_here]);
        // Ids are never reused: a pruned provider's id stays its own.
        let next = register(&db, hello("next"), 5, 200).await.unwrap();
        assert!(next > old_but_here);
    }

    #[tokio::test]
    async fn connected_counts_each_kind_and_adds_up_claimed_speed() {
        let db = Db::open_in_memory().unwrap();
        let native = Hello {
            kind: ProviderKind::Native,
            gflops: 100.0,
            ..hello("box")
        };
        register(&db, native.clone(), 1, 1).await.unwrap();
        register(&db, hello("tab"), 2, 2).await.unwrap();
        let gone = register(&db, native, 3, 3).await.unwrap();
        mark_gone(&db, gone, 4, "closed".into()).await.unwrap();
        let counts = connected(&db).await.unwrap();
        assert_eq!(
            counts.by_kind,
            vec![(ProviderKind::Browser, 1), (ProviderKind::Native, 1)]
        );
        assert_eq!(counts.gflops, 103.5);
        let own: Vec<String> = list_of_identity(&db, 2)
            .await
            .unwrap()
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(own, vec!["tab"]);
    }
}
