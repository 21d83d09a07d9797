//! The dashboard's side of the REST API: the Requester's token (kept in the
//! browser's local storage), authenticated JSON calls, multipart uploads,
//! downloads of protected files, and the live event stream read from a
//! `fetch` body (an `EventSource` cannot send the `Authorization` header).

use gloo_net::http::{Request, RequestBuilder, Response};
use leptos::prelude::*;
use rookery_proto::api::{ApiError, JobEvent};
use serde::de::DeserializeOwned;
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::JsFuture;

/// Local-storage key of the API token.
const TOKEN_KEY: &str = "rookery-api-token";

/// Why a call failed, in words, with the HTTP status and the job-file field
/// the server named, if any.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// 0 when there was no HTTP answer at all.
    pub status: u16,
    pub message: String,
    pub field: Option<String>,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl Failure {
    fn network(error: gloo_net::Error) -> Self {
        Failure {
            status: 0,
            message: match error {
                // The browser hides why a fetch failed; its message is only
                // "Failed to fetch".
                gloo_net::Error::JsError(_) => format!("no connection to the server ({error})"),
                other => other.to_string(),
            },
            field: None,
        }
    }

    pub fn is_unauthorized(&self) -> bool {
        self.status == 401
    }
}

/// The signed-in state shared by every page.
#[derive(Debug, Clone, Copy)]
pub struct Auth {
    pub token: RwSignal<Option<String>>,
    /// Why the Requester was signed out (a token the server refused).
    pub notice: RwSignal<Option<String>>,
}

impl Auth {
    pub fn from_storage() -> Self {
        Auth {
            token: RwSignal::new(storage().and_then(|s| s.get_item(TOKEN_KEY).ok().flatten())),
            notice: RwSignal::new(None),
        }
    }

    pub fn sign_in(&self, token: String) {
        if let Some(storage) = storage() {
            let _ = storage.set_item(TOKEN_KEY, &token);
        }
        self.notice.set(None);
        self.token.set(Some(token));
    }

    pub fn sign_out(&self, notice: Option<String>) {
        if let Some(storage) = storage() {
            let _ = storage.remove_item(TOKEN_KEY);
        }
        self.notice.set(notice);
        self.token.set(None);
    }

    /// Signs out when the server refused the stored token, so the sign-in
    /// page says why instead of every page showing 401s.
    pub fn check(&self, failure: &Failure) {
        if failure.is_unauthorized() {
            self.sign_out(Some(format!(
                "The server refused the stored token: {}",
                failure.message
            )));
        }
    }
}

pub fn use_auth() -> Auth {
    use_context::<Auth>().unwrap_or_else(Auth::from_storage)
}

fn storage() -> Option<web_sys::Storage> {
    web_sys::window()?.local_storage().ok().flatten()
}

fn authorized(builder: RequestBuilder, token: &str) -> RequestBuilder {
    builder.header("Authorization", &format!("Bearer {token}"))
}

async fn check(response: Response) -> Result<Response, Failure> {
    if response.ok() {
        return Ok(response);
    }
    let status = response.status();
    // The API answers errors with an `ApiError` body; a proxy may not.
    let (message, field) = match response.json::<ApiError>().await {
        Ok(body) => (body.error, body.field),
        Err(_) => (format!("HTTP {status} {}", response.status_text()), None),
    };
    Err(Failure {
        status,
        message,
        field,
    })
}

pub async fn get_json<T: DeserializeOwned>(token: &str, path: &str) -> Result<T, Failure> {
    send_for_json(Request::get(path), token, path).await
}

pub async fn post_empty<T: DeserializeOwned>(token: &str, path: &str) -> Result<T, Failure> {
    send_for_json(Request::post(path), token, path).await
}

/// Sends a bodiless request with the token and reads the JSON answer.
async fn send_for_json<T: DeserializeOwned>(
    request: RequestBuilder,
    token: &str,
    path: &str,
) -> Result<T, Failure> {
    let response = authorized(request, token)
        .send()
        .await
        .map_err(Failure::network)?;
    let response = check(response).await?;
    response.json::<T>().await.map_err(|e| Failure {
        status: 0,
        message: format!("unexpected answer from {path} ({e})"),
        field: None,
    })
}

pub async fn post_form<T: DeserializeOwned>(
    token: &str,
    path: &str,
    form: &web_sys::FormData,
) -> Result<T, Failure> {
    let request = authorized(Request::post(path), token)
        .body(form)
        .map_err(Failure::network)?;
    let response = request.send().await.map_err(Failure::network)?;
    let response = check(response).await?;
    response.json::<T>().await.map_err(|e| Failure {
        status: 0,
        message: format!("unexpected answer from {path} ({e})"),
        field: None,
    })
}

/// Fetches a protected file and hands it to the browser as a download.
pub async fn download(token: &str, path: &str, file_name: &str) -> Result<(), Failure> {
    let response = authorized(Request::get(path), token)
        .send()
        .await
        .map_err(Failure::network)?;
    let response = check(response).await?;
    let raw: web_sys::Response = response.into();
    let failure = |what: &str| Failure {
        status: 0,
        message: format!("cannot save {file_name}: {what}"),
        field: None,
    };
    let blob = JsFuture::from(raw.blob().map_err(|_| failure("no body"))?)
        .await
        .map_err(|_| failure("reading the body failed"))?
        .unchecked_into::<web_sys::Blob>();
    let url =
        web_sys::Url::create_object_url_with_blob(&blob).map_err(|_| failure("no object URL"))?;
    let document = web_sys::window()
        .and_then(|w| w.document())
        .ok_or_else(|| failure("no document"))?;
    let anchor = document
        .create_element("a")
        .map_err(|_| failure("no anchor"))?
        .unchecked_into::<web_sys::HtmlAnchorElement>();
    anchor.set_href(&url);
    anchor.set_download(file_name);
    anchor.click();
    let _ = web_sys::Url::revoke_object_url(&url);
    Ok(())
}

/// Splits server-sent-event text into complete events, leaving an
/// unfinished tail in `buffer`. Returns (event name, data) pairs.
pub fn take_events(buffer: &mut String) -> Vec<(String, String)> {
    let mut events = Vec::new();
    // The SSE spec allows CRLF; axum writes LF.
    if buffer.contains('\r') {
        *buffer = buffer.replace("\r\n", "\n");
    }
    while let Some(end) = buffer.find("\n\n") {
        let block: String = buffer.drain(..end + 2).collect();
        let mut name = String::from("message");
        let mut data = Vec::new();
        for line in block.lines() {
            if let Some(value) = line.strip_prefix("event:") {
                name = value.trim_start().to_string();
            } else if let Some(value) = line.strip_prefix("data:") {
                data.push(value.strip_prefix(' ').unwrap_or(value));
            }
        }
        if !data.is_empty() {
            events.push((name, data.join("\n")));
        }
    }
    events
}

/// What the live stream reports.
#[derive(Debug, Clone)]
pub enum Live {
    /// The stream is open: reload what is shown, events follow.
    Open,
    Event(Box<JobEvent>),
    /// Events were missed; reload what is shown.
    Lagged,
}

/// Reads `GET /api/events` (optionally one job's) until `alive` turns false,
/// reconnecting after a pause when the connection drops. Each open and every
/// missed stretch is reported, so pages reload instead of showing gaps.
/// Sets `now_ms` to the browser's clock every second while `alive`, so
/// elapsed times tick without server traffic.
pub fn tick_clock(alive: std::sync::Arc<std::sync::atomic::AtomicBool>, now_ms: RwSignal<f64>) {
    use std::sync::atomic::Ordering;
    wasm_bindgen_futures::spawn_local(async move {
        while alive.load(Ordering::Relaxed) {
            gloo_timers::future::TimeoutFuture::new(1_000).await;
            if alive.load(Ordering::Relaxed) {
                now_ms.set(js_sys::Date::now());
            }
        }
    });
}

/// A page's live view: follows `job`'s events (every job's for `None`),
/// calling `reload` when the stream opens and after missed events and
/// `on_event` for each event, and ticks `now_ms`, both while `alive`. A
/// failure shows in `error` as paused live updates (and signs the Requester
/// out when the server refused the token).
#[allow(clippy::too_many_arguments)]
pub fn watch_live(
    auth: Auth,
    token: String,
    job: Option<u64>,
    alive: std::sync::Arc<std::sync::atomic::AtomicBool>,
    now_ms: RwSignal<f64>,
    error: RwSignal<Option<String>>,
    reload: impl Fn() + 'static,
    mut on_event: impl FnMut(&JobEvent) + 'static,
) {
    wasm_bindgen_futures::spawn_local({
        let alive = alive.clone();
        async move {
            follow_events(
                token,
                job,
                alive,
                move |live| match live {
                    Live::Open | Live::Lagged => reload(),
                    Live::Event(event) => on_event(&event),
                },
                move |failure| {
                    auth.check(&failure);
                    error.set(Some(format!("live updates paused: {}", failure.message)));
                },
            )
            .await;
        }
    });
    tick_clock(alive, now_ms);
}

pub async fn follow_events(
    token: String,
    job: Option<u64>,
    alive: std::sync::Arc<std::sync::atomic::AtomicBool>,
    mut on_event: impl FnMut(Live),
    on_failure: impl Fn(Failure),
) {
    use std::sync::atomic::Ordering;
    let path = match job {
        Some(id) => format!("/api/events?job={id}"),
        None => "/api/events".to_string(),
    };
    while alive.load(Ordering::Relaxed) {
        match read_stream(&token, &path, &alive, &mut on_event).await {
            Ok(()) => {}
            Err(failure) => {
                if !alive.load(Ordering::Relaxed) {
                    return;
                }
                let unauthorized = failure.is_unauthorized();
                on_failure(failure);
                if unauthorized {
                    return;
                }
            }
        }
        gloo_timers::future::TimeoutFuture::new(2_000).await;
    }
}

async fn read_stream(
    token: &str,
    path: &str,
    alive: &std::sync::atomic::AtomicBool,
    on_event: &mut impl FnMut(Live),
) -> Result<(), Failure> {
    use std::sync::atomic::Ordering;
    let response = authorized(Request::get(path), token)
        .send()
        .await
        .map_err(Failure::network)?;
    let response = check(response).await?;
    let broken = |what: &str| Failure {
        status: 0,
        message: format!("the live event stream broke: {what}"),
        field: None,
    };
    let body = response.body().ok_or_else(|| broken("no body"))?;
    let reader = body
        .get_reader()
        .unchecked_into::<web_sys::ReadableStreamDefaultReader>();
    on_event(Live::Open);
    let mut bytes: Vec<u8> = Vec::new();
    let mut text = String::new();
    while alive.load(Ordering::Relaxed) {
        let chunk = JsFuture::from(reader.read())
            .await
            .map_err(|_| broken("read failed"))?;
        let done = js_sys::Reflect::get(&chunk, &"done".into())
            .ok()
            .and_then(|d| d.as_bool())
            .unwrap_or(true);
        if done {
            return Ok(());
        }
        let value =
            js_sys::Reflect::get(&chunk, &"value".into()).map_err(|_| broken("no value"))?;
        bytes.extend(js_sys::Uint8Array::new(&value).to_vec());
        // Keep a multi-byte character split across chunks for the next one.
        let valid = match std::str::from_utf8(&bytes) {
            Ok(s) => s.len(),
            Err(e) => e.valid_up_to(),
        };
        text.push_str(&String::from_utf8_lossy(&bytes[..valid]));
        bytes.drain(..valid);
        for (name, data) in take_events(&mut text) {
            match name.as_str() {
                "job" => {
                    if let Ok(event) = serde_json::from_str::<JobEvent>(&data) {
                        on_event(Live::Event(Box::new(event)));
                    }
                }
                "lagged" => on_event(Live::Lagged),
                _ => {}
            }
        }
    }
    let _ = reader.cancel();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_sent_events_split_at_blank_lines_and_keep_the_tail() {
        let mut buffer =
            "event: job\ndata: {\"a\":1}\n\n: keep-alive\n\nevent: lagged\ndata: 3\n\nevent: job\ndata: {\"b\""
                .to_string();
        let events = take_events(&mut buffer);
        assert_eq!(
            events,
            [
                ("job".to_string(), "{\"a\":1}".to_string()),
                ("lagged".to_string(), "3".to_string())
            ]
        );
        assert_eq!(buffer, "event: job\ndata: {\"b\"");
        buffer.push_str(":2}\r\n\r\n");
        assert_eq!(
            take_events(&mut buffer),
            [("job".to_string(), "{\"b\":2}".to_string())]
        );
        assert!(buffer.is_empty());
    }
}
