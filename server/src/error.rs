//! The server's one error type for HTTP handlers. Clients get a short,
//! stable message; the details go to the log.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use rookery_proto::api::ApiError;

use crate::db::DbError;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("not found: {0}")]
    NotFound(String),
    #[error(transparent)]
    Db(#[from] DbError),
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let (status, message) = match &self {
            AppError::NotFound(what) => (StatusCode::NOT_FOUND, format!("not found: {what}")),
            AppError::Db(error) => {
                tracing::error!(%error, "request failed on the database");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal error; see the server log".to_owned(),
                )
            }
        };
        (status, Json(ApiError { error: message })).into_response()
    }
}
