//! The Providers page: a live table of `GET /api/providers`, polled every
//! second while the page is open. Anyone sees the connected providers in
//! numbers; the rows are every provider for a signed-in Requester, and
//! otherwise this browser's own (by the credential its donating tabs keep).
//!
//! DOM contract (end-to-end tests rely on it): `<table id="providers">`, one
//! `<tr class="provider" data-provider-id data-kind data-status>` per provider.
//! Each row shows the job and stage a provider runs, its micro-batches done
//! there, and its uptime; a tab whose donor capped its GPU use says so
//! (`.gpu-cap`, "GPU cap 50%"), and a tab its donor paused reads "paused"
//! with the reason (its `data-status` stays `gone`).

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::future::{Either, select};
use gloo_net::http::Request;
use gloo_timers::future::TimeoutFuture;
use leptos::prelude::*;
use rookery_proto::api::{ApiError, CREDENTIAL_HEADER, ProviderInfo, ProviderList};

use crate::format;

/// Pause between the end of one poll and the start of the next.
const POLL_INTERVAL_MS: u32 = 1_000;
/// A server that accepts the connection but never answers must still turn the
/// banner on; the browser's own fetch timeout is minutes long.
const FETCH_TIMEOUT_MS: u32 = 5_000;

#[component]
pub fn ProvidersPage() -> impl IntoView {
    // `None` until the first successful answer, so "loading" and "no
    // providers" read differently.
    let providers = RwSignal::new(None::<Vec<ProviderInfo>>);
    let summary = RwSignal::new(None::<rookery_proto::api::ProviderSummary>);
    let error = RwSignal::new(None::<String>);
    let last_ok_ms = RwSignal::new(None::<f64>);
    // The browser clock, re-read on every poll so relative times keep moving
    // even when the server is down.
    let now_ms = RwSignal::new(js_sys::Date::now());

    // The poll loop outlives nothing: it stops when the page is left. The
    // flag is checked after every await because the signals are disposed then.
    let alive = Arc::new(AtomicBool::new(true));
    on_cleanup({
        let alive = alive.clone();
        move || alive.store(false, Ordering::Relaxed)
    });
    // A signed-in Requester sees every provider, with its jobs' work;
    // anyone else the counts and this browser's own providers.
    let auth = crate::api::use_auth();
    wasm_bindgen_futures::spawn_local(async move {
        while alive.load(Ordering::Relaxed) {
            let token = auth.token.get_untracked();
            let result = fetch_providers(token).await;
            if !alive.load(Ordering::Relaxed) {
                break;
            }
            let now = js_sys::Date::now();
            now_ms.set(now);
            match result {
                Ok(ProviderList {
                    summary: counts,
                    providers: mut list,
                }) => {
                    format::sort_for_display(&mut list);
                    providers.set(Some(list));
                    summary.set(Some(counts));
                    error.set(None);
                    last_ok_ms.set(Some(now));
                }
                Err(message) => error.set(Some(message)),
            }
            TimeoutFuture::new(POLL_INTERVAL_MS).await;
        }
    });

    // `None` until the first answer: "0 connected" would be a guess.
    let connected = move || {
        summary.with(|s| {
            s.as_ref()
                .map(|s| s.connected.values().sum::<u64>() as usize)
        })
    };
    let counts = move || {
        summary.get().map(|s| {
            let kinds = s
                .connected
                .iter()
                .map(|(kind, n)| format!("{n} {kind}"))
                .collect::<Vec<_>>()
                .join(", ");
            view! {
                <p id="provider-summary" class="note" data-ever-seen=s.ever_seen.to_string()>
                    {format!(
                        "{kinds}; {} GFLOP/s claimed together; {} providers ever joined.",
                        format::gflops(s.connected_gflops),
                        format::count(s.ever_seen),
                    )}
                </p>
            }
        })
    };

    let banner = move || {
        error.get().map(|message| {
            let stale = last_ok_ms.get().map(|ok| {
                format!(
                    "The table below is the last answer, from {}.",
                    format::relative(now_ms.get(), ok as u64)
                )
            });
            view! {
                <div id="api-error" class="banner banner-error" role="alert">
                    <strong>"Cannot reach the server: "</strong>
                    {message}
                    {stale.map(|stale| view! { <span class="stale">{stale}</span> })}
                </div>
            }
        })
    };

    let rows = move || {
        let now = now_ms.get();
        providers
            .get()
            .unwrap_or_default()
            .into_iter()
            .map(|p| provider_row(p, now))
            .collect_view()
    };

    let below_table = move || {
        providers.with(|list| match list {
            None if error.with(Option::is_none) => Some(
                view! {
                    <p class="note">"Loading providers…"</p>
                }
                .into_any(),
            ),
            Some(list) if list.is_empty() && auth.token.with(Option::is_some) => Some(
                view! {
                    <p id="providers-empty" class="empty">
                        "No providers have joined yet. Start a native provider with "
                        <code>"rookery-provider"</code> ", or "
                        <a href="/donate">"donate this browser's GPU"</a> "."
                    </p>
                }
                .into_any(),
            ),
            Some(list) if list.is_empty() => Some(
                view! {
                    <p id="providers-empty" class="empty">
                        "Who donates is shown to Requesters only; this browser has no providers of its own here. "
                        <a href="/donate">"Donate this browser's GPU"</a> " to see yours."
                    </p>
                }
                .into_any(),
            ),
            _ => None,
        })
    };

    view! {
        <section class="page">
            <div class="page-head">
                <h1>"Providers"</h1>
                {move || {
                    connected()
                        .map(|n| {
                            view! {
                                <p id="provider-count" class="count" data-count=n.to_string()>
                                    {format::connected_count(n)}
                                </p>
                            }
                        })
                }}
            </div>
            {banner}
            {counts}
            <div class="table-scroll">
                <table id="providers">
                    <thead>
                        <tr>
                            <th scope="col">"Name"</th>
                            <th scope="col">"Kind"</th>
                            <th scope="col">"Device"</th>
                            <th scope="col" class="num">"Memory"</th>
                            <th scope="col" class="num">"GFLOP/s"</th>
                            <th scope="col" class="num">"Link"</th>
                            <th scope="col">"Status"</th>
                            <th scope="col">"Job and stage"</th>
                            <th scope="col" class="num">"Micro-batches"</th>
                            <th scope="col">"Uptime"</th>
                            <th scope="col">"Last heartbeat"</th>
                        </tr>
                    </thead>
                    <tbody>{rows}</tbody>
                </table>
            </div>
            {below_table}
        </section>
    }
}

/// One table row; `now_ms` is the browser clock for the relative times.
fn provider_row(p: ProviderInfo, now_ms: f64) -> impl IntoView {
    let gone_detail = format::gone_detail(&p, now_ms);
    let uptime = format::uptime(&p, now_ms);
    let status = format::status_attr(p.status);
    let status_word = format::status_word(&p);
    let cap = format::gpu_cap(p.duty_cycle);
    let kind = p.kind.as_str();
    view! {
        <tr
            class="provider"
            data-provider-id=p.id.to_string()
            data-kind=kind
            data-status=status
        >
            <td class="name" title=format!("provider #{}", p.id)>{p.name}</td>
            <td>
                <span class=format!("badge kind-{kind}")>{kind}</span>
            </td>
            <td class="device">{p.device}</td>
            <td class="num">{format::gib(p.memory_bytes)}</td>
            <td class="num">
                {format::gflops(p.gflops)}
                {cap.map(|cap| view! { <span class="detail gpu-cap">{cap}</span> })}
            </td>
            <td class="num link">{format::bandwidth(p.bandwidth_mbps)}</td>
            <td class="status">
                <span class=format!("dot dot-{status}") aria-hidden="true"></span>
                {status_word}
                {gone_detail.map(|detail| view! { <span class="detail">{detail}</span> })}
            </td>
            <td class="work">
                {match &p.work {
                    Some(w) => {
                        view! {
                            <a href=format!("/jobs/{}", w.job_id)>{format!("job #{}", w.job_id)}</a>
                            {format!(", cluster {} {} (stage {})", w.cluster, w.role, w.stage)}
                        }
                            .into_any()
                    }
                    None => "idle".into_any(),
                }}
            </td>
            <td class="num">{p.work.as_ref().map_or_else(|| "–".into(), |w| format::count(w.micro_batches_done))}</td>
            <td title=format!("connected {}", format::relative(now_ms, p.connected_since_ms))>
                {uptime}
            </td>
            <td>{format::relative(now_ms, p.last_heartbeat_ms)}</td>
        </tr>
    }
}

/// One poll of the API, bounded by [`FETCH_TIMEOUT_MS`]. The error is the
/// text of the banner, so it says what went wrong in words.
async fn fetch_providers(token: Option<String>) -> Result<ProviderList, String> {
    let request = pin!(request_providers(token));
    let timeout = pin!(TimeoutFuture::new(FETCH_TIMEOUT_MS));
    match select(request, timeout).await {
        Either::Left((result, _)) => result,
        Either::Right(_) => Err(format!("no answer within {} s", FETCH_TIMEOUT_MS / 1_000)),
    }
}

async fn request_providers(token: Option<String>) -> Result<ProviderList, String> {
    let mut request = Request::get("/api/providers");
    if let Some(token) = token {
        request = request.header("Authorization", &format!("Bearer {token}"));
    }
    if let Some(credential) = rookery_web_provider::stored_credential() {
        request = request.header(CREDENTIAL_HEADER, &credential);
    }
    let response = request.send().await.map_err(|e| match e {
        // The browser hides the cause of a failed fetch (refused, DNS,
        // CORS); its message is only "Failed to fetch".
        gloo_net::Error::JsError(_) => format!("no connection ({e})"),
        other => other.to_string(),
    })?;
    if !response.ok() {
        // The API answers errors with an `ApiError` body; a proxy or an old
        // server may not, so fall back to the status line.
        let detail = match response.json::<ApiError>().await {
            Ok(body) => body.error,
            Err(_) => response.status_text(),
        };
        return Err(format!("HTTP {}: {detail}", response.status()));
    }
    response
        .json::<ProviderList>()
        .await
        .map_err(|e| format!("unexpected answer from /api/providers ({e})"))
}
