//! Rookery's intermediary server: the axum application (REST API, provider
//! WebSocket, static dashboard) over an embedded SQLite database.
//!
//! Entry points: [`app`] builds the router (tests drive it with
//! `tower::ServiceExt::oneshot`), [`serve`] runs it on a listener, and the
//! `rookery` binary in `main.rs` parses the command line. Nothing here links
//! libtorch or a GPU API: the server only coordinates and relays.

pub mod admission;
pub mod aggregate;
pub mod auth;
pub mod checkpoints;
pub mod client;
pub mod coordinator;
pub mod datasets;
pub mod db;
pub mod error;
pub mod http;
pub mod job_api;
pub mod jobs;
pub mod openapi;
pub mod plan_cli;
pub mod plan_view;
pub mod providers;
pub mod requesters;
pub mod resume;
pub mod run;
pub mod ws;

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::extract::DefaultBodyLimit;
use axum::http::Request;
use axum::middleware;
use axum::routing::{get, post};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tower::ServiceExt;
use tower_http::services::{ServeDir, ServeFile};
use tower_http::timeout::RequestBodyTimeoutLayer;
use tower_http::trace::TraceLayer;

use crate::coordinator::Coordinator;
use crate::db::{Db, DbError};

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
    pub api_token: auth::Token,
    /// When set, providers must present this join token to connect.
    pub provider_token: Option<auth::ProviderToken>,
    pub connections: admission::ConnectionCounter,
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
        api_token: auth::Token,
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
            connections: admission::ConnectionCounter::default(),
            coordinator,
        }
    }

    /// Requires providers to present `token` when they connect.
    pub fn with_provider_token(mut self, token: &str) -> Self {
        self.provider_token = Some(auth::ProviderToken::new(token));
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
        let token = auth::Token::load_or_create(data_dir).map_err(|source| OpenError::Token {
            path: auth::token_path(data_dir).display().to_string(),
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

/// The whole HTTP surface of the server.
pub fn app(state: AppState) -> Router {
    let jobs = Router::new()
        .route("/jobs", get(job_api::list).post(job_api::create))
        .route("/jobs/{id}", get(job_api::get))
        .route("/jobs/{id}/metrics", get(job_api::metrics))
        .route("/jobs/{id}/metrics.csv", get(job_api::metrics_as_csv))
        .route("/jobs/{id}/log", get(job_api::log))
        .route("/plan", post(job_api::plan))
        .route("/datasets", get(datasets::list_datasets))
        .route("/events", get(job_api::events))
        .route("/jobs/{id}/cancel", post(job_api::cancel))
        .route("/jobs/{id}/weights", get(job_api::weights))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ))
        .layer(DefaultBodyLimit::max(state.limits.max_upload_bytes));
    let api = Router::new()
        .route("/providers", get(http::list_providers))
        .route("/health", get(http::health))
        .route("/openapi.json", get(openapi::openapi_json))
        .merge(jobs)
        .fallback(http::api_not_found);
    let router = Router::new()
        .nest("/api", api)
        .route(rookery_proto::PROVIDER_WS_PATH, get(ws::provider_socket));
    let router = match state
        .web_dir
        .as_deref()
        .filter(|dir| http::is_dashboard(dir))
    {
        // Unknown paths get index.html so the dashboard's own routes deep-link.
        Some(dir) => router
            .fallback_service(ServeDir::new(dir).fallback(ServeFile::new(dir.join("index.html")))),
        None => router.fallback(http::dashboard_missing),
    };
    let body_timeout = state.limits.slow_client_timeout;
    router
        .layer(RequestBodyTimeoutLayer::new(body_timeout))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

/// Serves [`app`] on `listener` until `shutdown` completes, then lets
/// requests in flight finish.
///
/// Its own accept loop rather than `axum::serve`, which has no way to bound
/// how long a client may take to send its request headers (slowloris).
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let header_timeout = state.limits.slow_client_timeout;
    let max_per_ip = state.limits.max_http_connections_per_ip;
    let connections = admission::ConnectionCounter::default();
    let router = app(state);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Every connection task holds a receiver; `closed()` resolves when all are gone.
    let (open_tx, open_rx) = tokio::sync::watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (tcp, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors, usually: wait instead of spinning.
                    tracing::warn!(%error, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Training sends many small frames (losses, step reports) between large
        // ones; Nagle's algorithm would hold each behind a delayed ACK (40 ms).
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::warn!(%error, "cannot set TCP_NODELAY");
        }
        let Some(slot) = connections.take(remote.ip(), max_per_ip) else {
            tokio::spawn(admission::refuse_connection(tcp, remote.ip(), max_per_ip));
            continue;
        };
        let router = router.clone();
        // Connection info lets the provider socket count connections per IP.
        let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(remote));
            router.clone().oneshot(request.map(Body::new))
        });
        let mut stop = stop_rx.clone();
        let open = open_rx.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout);
            let connection = builder
                .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                .with_upgrades();
            let mut connection = std::pin::pin!(connection);
            let finished = tokio::select! {
                result = connection.as_mut() => Some(result),
                _ = stop.changed() => None,
            };
            let result = match finished {
                Some(result) => result,
                None => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(error) = result {
                tracing::debug!(%remote, %error, "connection ended with an error");
            }
            drop((slot, open));
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(open_rx);
    open_tx.closed().await;
    Ok(())
}

/// Wall-clock Unix milliseconds, the unit of every stored time.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_millis() as u64)
        .unwrap_or(0)
}
