//! The REST API's OpenAPI 3.1 description, generated from the handlers'
//! `#[utoipa::path]` annotations and the DTOs of `rookery_proto::api`, so it
//! cannot drift from the code. Served at `/api/openapi.json`.

use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Rookery API",
        description = "Jobs, plans, metrics and providers of a Rookery server. Job endpoints need the Requester's API token as `Authorization: Bearer <token>`."
    ),
    paths(
        crate::http::health,
        crate::http::list_providers,
        crate::job_api::list,
        crate::job_api::create,
        crate::job_api::get,
        crate::job_api::metrics,
        crate::job_api::metrics_as_csv,
        crate::job_api::log,
        crate::job_api::cancel,
        crate::job_api::weights,
        crate::job_api::plan,
        crate::job_api::events,
        crate::datasets::list_datasets,
        openapi_json,
    ),
    components(schemas(rookery_proto::api::JobEvent, rookery_proto::api::JobEventBody)),
    modifiers(&BearerToken)
)]
pub struct ApiDoc;

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
