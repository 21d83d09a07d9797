//! Rookery's intermediary server: the axum application (REST API, provider
//! WebSocket, static dashboard) over an embedded SQLite database.
//!
//! Entry points: [`app`] builds the router (tests drive it with
//! `tower::ServiceExt::oneshot`), [`serve`] runs it on a listener, and the
//! `rookery` binary in `main.rs` parses the command line. Nothing here links
//! libtorch or a GPU API: the server only coordinates and relays.

pub mod db;
pub mod error;
pub mod http;
pub mod plan_cli;
pub mod providers;
pub mod ws;

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::routing::get;
use tokio::net::TcpListener;
use tower_http::services::{ServeDir, ServeFile};
use tower_http::trace::TraceLayer;

use crate::db::{Db, DbError};

/// Bounds every peer must stay within.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_frame_bytes: usize,
    /// How often providers are asked to send a heartbeat.
    pub heartbeat_interval: Duration,
    /// Silence after which a provider is dropped and marked gone.
    pub heartbeat_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_frame_bytes: rookery_proto::DEFAULT_MAX_FRAME_BYTES,
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(4),
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
}

impl AppState {
    pub fn new(db: Db, limits: Limits, web_dir: Option<PathBuf>) -> Self {
        Self {
            db,
            limits,
            web_dir,
        }
    }

    /// Opens the data directory for a starting server: whoever the previous
    /// process saw connected has no socket any more.
    pub async fn open(
        data_dir: &std::path::Path,
        limits: Limits,
        web_dir: Option<PathBuf>,
    ) -> Result<Self, DbError> {
        let db = Db::open_in_dir(data_dir)?;
        providers::mark_all_gone(&db, now_ms(), "server restarted").await?;
        Ok(Self::new(db, limits, web_dir))
    }
}

/// The whole HTTP surface of the server.
pub fn app(state: AppState) -> Router {
    let api = Router::new()
        .route("/providers", get(http::list_providers))
        .route("/health", get(http::health))
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
    router.layer(TraceLayer::new_for_http()).with_state(state)
}

/// Serves [`app`] on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app(state))
        .with_graceful_shutdown(shutdown)
        .await
}

/// Wall-clock Unix milliseconds, the unit of every stored time.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_millis() as u64)
        .unwrap_or(0)
}
