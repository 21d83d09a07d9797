//! The Leaderboard page: `GET /api/leaderboard`, the donors with the most
//! accepted training work, as each chose to appear (a name and team from
//! `rookery-provider --donor-name --team`, else "anonymous"). Public: no
//! token, no credential. Read when the page opens and every
//! [`REFRESH_MS`] while it stays open.
//!
//! DOM contract (tests rely on it): `<table id="leaderboard">`, one
//! `<tr class="donor" data-rank data-credit>` per donor, most credit first.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use gloo_net::http::Request;
use gloo_timers::future::TimeoutFuture;
use leptos::prelude::*;
use rookery_proto::api::{LeaderboardEntry, flop_text};

/// How often an open page reads the leaderboard again.
pub const REFRESH_MS: u32 = 10_000;

#[component]
pub fn LeaderboardPage() -> impl IntoView {
    let board = RwSignal::new(None::<Result<Vec<LeaderboardEntry>, String>>);
    let alive = Arc::new(AtomicBool::new(true));
    on_cleanup({
        let alive = alive.clone();
        move || alive.store(false, Ordering::Relaxed)
    });
    wasm_bindgen_futures::spawn_local(async move {
        while alive.load(Ordering::Relaxed) {
            let result = fetch_leaderboard().await;
            if !alive.load(Ordering::Relaxed) {
                break;
            }
            board.set(Some(result));
            TimeoutFuture::new(REFRESH_MS).await;
        }
    });
    view! {
        <section class="page">
            <h1>"Leaderboard"</h1>
            <p class="note">
                "Donors ranked by the training work the server accepted: each step's planned "
                "floating-point operations on their stages, once a checkpoint holds it. Work a "
                "spot check found wrong is not credited. Give your provider a name with "
                <code>"rookery-provider --donor-name NAME --team TEAM"</code> "."
            </p>
            {move || match board.get() {
                None => view! { <p class="note">"Loading the leaderboard…"</p> }.into_any(),
                Some(Err(message)) => {
                    view! {
                        <div id="api-error" class="banner banner-error" role="alert">
                            <strong>"Cannot read the leaderboard: "</strong>
                            {message}
                        </div>
                    }
                        .into_any()
                }
                Some(Ok(entries)) => leaderboard_table(&entries).into_any(),
            }}
        </section>
    }
}

/// The ranked table, or a line saying nobody has credit yet.
pub fn leaderboard_table(entries: &[LeaderboardEntry]) -> impl IntoView + use<> {
    if entries.is_empty() {
        return view! { <p class="note">"No accepted work yet: be the first to donate."</p> }
            .into_any();
    }
    let rows = entries
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let rank = i + 1;
            view! {
                <tr class="donor" data-rank=rank.to_string() data-credit=e.credit.to_string()>
                    <td class="num">{rank}</td>
                    <td>{e.name.clone()}</td>
                    <td>{e.team.clone().unwrap_or_default()}</td>
                    <td class="num">{flop_text(e.credit)}</td>
                </tr>
            }
        })
        .collect_view();
    view! {
        <div class="table-scroll">
            <table id="leaderboard">
                <thead>
                    <tr>
                        <th class="num">"#"</th>
                        <th>"Donor"</th>
                        <th>"Team"</th>
                        <th class="num">"Credit"</th>
                    </tr>
                </thead>
                <tbody>{rows}</tbody>
            </table>
        </div>
    }
    .into_any()
}

async fn fetch_leaderboard() -> Result<Vec<LeaderboardEntry>, String> {
    let response = Request::get("/api/leaderboard")
        .send()
        .await
        .map_err(|e| format!("no connection ({e})"))?;
    if !response.ok() {
        return Err(format!(
            "HTTP {} {}",
            response.status(),
            response.status_text()
        ));
    }
    response.json().await.map_err(|e| e.to_string())
}
