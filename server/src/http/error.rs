//! The server's one error type for HTTP handlers. Clients get a short,
//! stable message; the details go to the log.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use rookery_proto::api::ApiError;

use crate::store::DbError;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("not found: {0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    /// A bad request about one job-file field or uploaded file.
    #[error("{message}")]
    Field { field: String, message: String },
    #[error("{0}")]
    Unauthorized(&'static str),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    TooManyRequests(String),
    #[error("{0}")]
    Timeout(String),
    #[error("internal error: {0}")]
    Internal(String),
    #[error(transparent)]
    Db(#[from] DbError),
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let field = match &self {
            AppError::Field { field, .. } => Some(field.clone()),
            _ => None,
        };
        let (status, message) = match &self {
            AppError::Field { message, .. } => (StatusCode::BAD_REQUEST, message.clone()),
            AppError::NotFound(what) => (StatusCode::NOT_FOUND, format!("not found: {what}")),
            AppError::BadRequest(why) => (StatusCode::BAD_REQUEST, why.clone()),
            AppError::Unauthorized(why) => (StatusCode::UNAUTHORIZED, (*why).to_owned()),
            AppError::Forbidden(why) => (StatusCode::FORBIDDEN, why.clone()),
            AppError::Conflict(why) => (StatusCode::CONFLICT, why.clone()),
            AppError::PayloadTooLarge(why) => (StatusCode::PAYLOAD_TOO_LARGE, why.clone()),
            AppError::TooManyRequests(why) => (StatusCode::TOO_MANY_REQUESTS, why.clone()),
            AppError::Timeout(why) => (StatusCode::REQUEST_TIMEOUT, why.clone()),
            AppError::Internal(error) => {
                tracing::error!(%error, "request failed");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal error; see the server log".to_owned(),
                )
            }
            AppError::Db(error) => {
                tracing::error!(%error, "request failed on the database");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal error; see the server log".to_owned(),
                )
            }
        };
        (
            status,
            Json(ApiError {
                error: message,
                field,
            }),
        )
            .into_response()
    }
}
