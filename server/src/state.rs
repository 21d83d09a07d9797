//! The state every handler and socket loop shares: the database, the limits
//! peers must keep, the data and dashboard folders, the tokens, the
//! per-address connection counts and the coordinator's handle.

use std::path::PathBuf;
use std::time::Duration;

use crate::admission::{AllowedOrigins, ConnectionCounter, ProviderToken};
use crate::coordinator::{Coordinator, DEFAULT_MAX_OUTBOX_BYTES};
use crate::now_ms;
use crate::store::identities::IssueLimit;
use crate::store::tokens::{Token, token_path};
use crate::store::{Db, DbError, jobs, providers, requesters};

/// Bounds every peer must stay within.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_frame_bytes: usize,
    /// How often providers are asked to send a heartbeat.
    pub heartbeat_interval: Duration,
    /// Silence after which a provider is dropped and marked gone.
    pub heartbeat_timeout: Duration,
    /// Largest job upload (model, data and job file together).
    pub max_upload_bytes: usize,
    /// Provider WebSockets one IP address may hold open at once.
    pub max_connections_per_ip: usize,
    /// A client that takes longer than this to send a request's headers, or
    /// pauses this long in the middle of a request body, is dropped.
    pub slow_client_timeout: Duration,
    /// HTTP connections one IP address may hold open at once (provider
    /// WebSockets count against `max_connections_per_ip` once upgraded).
    pub max_http_connections_per_ip: usize,
    /// Jobs one Requester may have waiting in the queue at once; another
    /// upload is refused before its bytes are read.
    pub max_queued_jobs: usize,
    /// Bytes one Requester's queued jobs' uploads may hold on disk, this
    /// upload included.
    pub max_queued_upload_bytes: u64,
    /// How many new provider identities one address may make.
    pub identities: IssueLimit,
    /// The most bytes waiting to be sent to one provider (relayed frames,
    /// micro-batches) before it is dropped as too slow a reader.
    pub max_outbox_bytes: usize,
    /// The longest one frame may take to go out to a provider before it
    /// is dropped as too slow a reader (its stage is reassigned).
    pub send_timeout: Duration,
    /// How long every frame to a provider is held after it is queued, as a
    /// link between homes would: benchmarks only (feature `bench-latency`,
    /// `--relay-delay-ms`); zero in every other build.
    pub relay_delay: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_frame_bytes: rookery_proto::DEFAULT_MAX_FRAME_BYTES,
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(4),
            max_upload_bytes: 512 << 20,
            max_connections_per_ip: 64,
            slow_client_timeout: Duration::from_secs(30),
            max_http_connections_per_ip: 256,
            max_queued_jobs: 32,
            max_queued_upload_bytes: 4 << 30,
            identities: IssueLimit::default(),
            max_outbox_bytes: DEFAULT_MAX_OUTBOX_BYTES,
            send_timeout: Duration::from_secs(30),
            relay_delay: Duration::ZERO,
        }
    }
}

/// Everything a handler may touch. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    pub db: Db,
    pub limits: Limits,
    /// A built dashboard (`index.html` + `pkg/`), if there is one.
    pub web_dir: Option<PathBuf>,
    /// Uploaded job files, checkpoints and weights live under `jobs/` here.
    pub data_dir: PathBuf,
    /// The first Requester's API token (the data dir's `api-token`); job
    /// endpoints take any Requester's token, checked against the database.
    pub api_token: Token,
    /// When set, providers must present this join token to connect.
    pub provider_token: Option<ProviderToken>,
    /// The pages whose scripts may open provider WebSockets; any when empty.
    pub allowed_origins: AllowedOrigins,
    pub connections: ConnectionCounter,
    pub coordinator: Coordinator,
}

impl AppState {
    /// A state over `db`, with job files under `data_dir`, where `api_token`
    /// is the first Requester's. Starts the coordinator, so it must run
    /// inside a tokio runtime.
    pub fn new(
        db: Db,
        limits: Limits,
        web_dir: Option<PathBuf>,
        data_dir: PathBuf,
        api_token: Token,
    ) -> Self {
        // `open` has done this already (and failed loudly if it could not);
        // here it registers the token of states built directly.
        if let Err(error) = db.call_now(|conn| requesters::ensure_first(conn, &api_token, now_ms()))
        {
            tracing::error!(%error, "cannot register the first Requester's token");
        }
        let coordinator = Coordinator::spawn(db.clone(), data_dir.clone());
        Self {
            db,
            limits,
            web_dir,
            data_dir,
            api_token,
            provider_token: None,
            allowed_origins: AllowedOrigins::default(),
            connections: ConnectionCounter::default(),
            coordinator,
        }
    }

    /// Requires providers to present `token` when they connect.
    pub fn with_provider_token(mut self, token: &str) -> Self {
        self.provider_token = Some(ProviderToken::new(token));
        self
    }

    /// Lets only pages at `origins` (and the server's own) open provider
    /// WebSockets; empty lets any page.
    pub fn with_allowed_origins(mut self, origins: AllowedOrigins) -> Self {
        self.allowed_origins = origins;
        self
    }

    /// Opens the data directory for a starting server: whoever the previous
    /// process saw connected has no socket any more, and jobs it was running
    /// go back to the queue. The API token is created on first start.
    pub async fn open(
        data_dir: &std::path::Path,
        limits: Limits,
        web_dir: Option<PathBuf>,
    ) -> Result<Self, OpenError> {
        let db = Db::open_in_dir(data_dir)?;
        providers::mark_all_gone(&db, now_ms(), "server restarted").await?;
        jobs::requeue_interrupted(&db).await?;
        let token = Token::load_or_create(data_dir).map_err(|source| OpenError::Token {
            path: token_path(data_dir).display().to_string(),
            source,
        })?;
        db.call_now(|conn| requesters::ensure_first(conn, &token, now_ms()))?;
        Ok(Self::new(
            db,
            limits,
            web_dir,
            data_dir.to_path_buf(),
            token,
        ))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("cannot read or create the API token file {path}: {source}")]
    Token {
        path: String,
        source: std::io::Error,
    },
}
