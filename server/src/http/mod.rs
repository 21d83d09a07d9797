//! The HTTP surface: the REST API under `/api` (each module brings its own
//! routes), the provider WebSocket, and the dashboard's static files.
//!
//! - [`jobs`]: a Requester's jobs (list, inspect, metrics, log, live events,
//!   cancel, weights); [`upload`]: submitting a job and previewing its plan.
//! - [`providers`]: the provider list; [`site`]: health, unknown paths, the
//!   dashboard; [`openapi`]: the API's description.
//! - [`auth`]: the Requester's token on job endpoints; [`ws`]: one provider
//!   connection end to end.
//! - [`accept`]: the accept loop ([`serve`]); [`error`]: what handlers answer when
//!   they fail.

pub mod accept;
pub mod auth;
pub mod error;
pub mod jobs;
pub mod openapi;
pub mod providers;
pub mod site;
pub mod upload;
pub mod ws;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use tower_http::timeout::RequestBodyTimeoutLayer;
use tower_http::trace::TraceLayer;

pub use self::accept::serve;
use crate::state::AppState;

/// The whole HTTP surface of the server.
pub fn app(state: AppState) -> Router {
    let requester_only = auth::requester_only(
        Router::new().merge(jobs::routes()).merge(upload::routes()),
        &state,
    )
    .layer(DefaultBodyLimit::max(state.limits.max_upload_bytes));
    let api = Router::new()
        .merge(providers::routes())
        .merge(site::routes())
        .merge(openapi::routes())
        .merge(requester_only)
        .fallback(site::api_not_found);
    let router = Router::new().nest("/api", api).merge(ws::routes());
    let router = site::with_dashboard(router, state.web_dir.as_deref());
    let body_timeout = state.limits.slow_client_timeout;
    router
        .layer(RequestBodyTimeoutLayer::new(body_timeout))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}
