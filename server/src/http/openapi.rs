//! The REST API's OpenAPI 3.1 description, generated from the handlers'
//! `#[utoipa::path]` annotations and the DTOs of `rookery_proto::api`, so it
//! cannot drift from the code. Served at `/api/openapi.json`.

use axum::routing::get;
use axum::{Json, Router};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::state::AppState;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Rookery API",
        description = "Jobs, plans, metrics and providers of a Rookery server. Job endpoints need the Requester's API token as `Authorization: Bearer <token>`."
    ),
    paths(
        super::site::health,
        super::providers::list_providers,
        super::providers::leaderboard,
        super::jobs::list,
        super::upload::create,
        super::jobs::get,
        super::jobs::metrics,
        super::jobs::metrics_as_csv,
        super::jobs::log,
        super::jobs::cancel,
        super::jobs::weights,
        super::upload::plan,
        super::jobs::events,
        super::upload::list_datasets,
        openapi_json,
    ),
    components(schemas(rookery_proto::api::JobEvent, rookery_proto::api::JobEventBody)),
    modifiers(&BearerToken)
)]
pub struct ApiDoc;

pub fn routes() -> Router<AppState> {
    Router::new().route("/openapi.json", get(openapi_json))
}

struct BearerToken;

impl Modify for BearerToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_token",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// This description.
#[utoipa::path(get, path = "/api/openapi.json", tag = "server",
    responses((status = 200, description = "The OpenAPI description of this API", body = Object)))]
pub async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
