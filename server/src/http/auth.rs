//! Requester authentication: every job endpoint requires a Requester's API
//! token as `Authorization: Bearer <token>` and serves that Requester only.
//! (Providers' join token is checked at the WebSocket upgrade, in
//! [`super::ws`].)

use axum::Router;
use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::{self, Next};
use axum::response::Response;

use super::error::AppError;
use crate::admission;
use crate::state::AppState;
use crate::store::requesters::{self, Requester};

/// `routes` with every request checked by [`require_token`].
pub fn requester_only(routes: Router<AppState>, state: &AppState) -> Router<AppState> {
    routes.route_layer(middleware::from_fn_with_state(state.clone(), require_token))
}

/// Middleware: the request must carry a Requester's token; handlers find
/// that [`Requester`](crate::store::requesters::Requester) in the request's extensions.
pub async fn require_token(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, AppError> {
    let Some(requester) = requester_of(&state, request.headers()).await? else {
        return Err(AppError::Unauthorized(
            "this endpoint needs a Requester's API token as `Authorization: Bearer <token>` (the server printed the first one at start; it is in the data dir's api-token file)",
        ));
    };
    request.extensions_mut().insert(requester);
    Ok(next.run(request).await)
}

/// The Requester whose token `headers` carry, `None` without one; a wrong
/// token is an error, never taken for no token.
pub async fn requester_of(
    state: &AppState,
    headers: &HeaderMap,
) -> Result<Option<Requester>, AppError> {
    let Some(given) = admission::bearer(headers) else {
        return Ok(None);
    };
    match requesters::authenticate(&state.db, given).await? {
        Some(requester) => Ok(Some(requester)),
        None => Err(AppError::Unauthorized("the API token is wrong")),
    }
}
