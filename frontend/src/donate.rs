//! The Donate page, for visitors: what donating runs and sends, in plain
//! words, one button that lends this tab's GPU to the server through
//! `rookery_web_provider::donate`, and while it does, the stage and
//! micro-batches done, the time donated, the work credited and a live chart
//! of the tab's own throughput. It is the home page for anyone not signed
//! in as a Requester.
//!
//! DOM contract (end-to-end tests rely on it): `<button id="donate-start">`,
//! `<div id="donate-status" data-state="idle|probing|no-webgpu|benchmarking|
//! connecting|connected|reconnecting|failed">`, and while donating
//! `#donate-time`, `#donate-credit` and `svg#donate-throughput`.

use leptos::prelude::*;
use rookery_web_provider::DonateStatus;

use crate::chart::LineChart;
use crate::format;

/// The donation outlives the Donate page: it is created once by the app and
/// shared through context, so moving to the Providers page (to watch this tab
/// join) neither stops it nor lets a second donation start on return.
#[derive(Debug, Clone, Copy)]
pub struct Donation {
    /// The last status reported; `None` until the button is pressed.
    pub status: RwSignal<Option<DonateStatus>>,
    /// True from the click until `donate` returns.
    pub running: RwSignal<bool>,
    /// When the server first welcomed the tab (the browser's clock, ms).
    pub since_ms: RwSignal<Option<f64>>,
    /// `(ms since then, micro-batches done)` at each step of progress (the
    /// newest [`KEPT_SAMPLES`] are shown).
    pub samples: RwSignal<Vec<(f64, u64)>>,
    /// The accepted work the server last said this browser is credited with.
    pub credit_gflop: RwSignal<Option<f64>>,
    /// Why the donor paused, while paused: the button, or the tab hidden.
    pub paused: RwSignal<Option<String>>,
    /// Whether hiding the tab pauses the donation (on unless unticked).
    pub pause_when_hidden: RwSignal<bool>,
}

/// Progress samples the chart shows: the newest, a few hours' worth. Up to
/// twice as many are kept, the older ones dropped in one go, so a sample
/// costs O(1) rather than a shift of the whole list.
const KEPT_SAMPLES: usize = 20_000;

impl Default for Donation {
    fn default() -> Self {
        Self::new()
    }
}

impl Donation {
    pub fn new() -> Self {
        let donation = Self {
            status: RwSignal::new(None),
            running: RwSignal::new(false),
            since_ms: RwSignal::new(None),
            samples: RwSignal::new(Vec::new()),
            credit_gflop: RwSignal::new(None),
            paused: RwSignal::new(None),
            pause_when_hidden: RwSignal::new(true),
        };
        follow_visibility(donation);
        donation
    }

    /// Pauses with `reason`, or resumes with `None`.
    pub fn set_paused(self, reason: Option<String>) {
        self.paused.set(reason.clone());
        rookery_web_provider::set_paused(reason);
    }

    /// Files a report from the donation: credit beside the state, progress
    /// into the samples, the state itself.
    fn report(self, status: DonateStatus) {
        let now = js_sys::Date::now();
        match status {
            DonateStatus::Credited { gflop } => {
                self.credit_gflop.set(Some(gflop));
                return;
            }
            DonateStatus::Connected { .. } | DonateStatus::Training { .. }
                if self.since_ms.get_untracked().is_none() =>
            {
                self.since_ms.set(Some(now));
            }
            _ => {}
        }
        if let (DonateStatus::Training { micro_batches, .. }, Some(since)) =
            (&status, self.since_ms.get_untracked())
        {
            self.samples.update(|samples| {
                if samples.len() == 2 * KEPT_SAMPLES {
                    samples.drain(..KEPT_SAMPLES);
                }
                samples.push((now - since, *micro_batches));
            });
        }
        self.status.set(Some(status));
    }

    fn start(self) {
        if self.running.get_untracked() {
            return;
        }
        let Some(url) = rookery_web_provider::default_server_url() else {
            self.status.set(Some(DonateStatus::Failed {
                reason: "could not work out the server's address from this page".into(),
            }));
            return;
        };
        self.running.set(true);
        self.status.set(Some(DonateStatus::Probing));
        wasm_bindgen_futures::spawn_local(async move {
            rookery_web_provider::donate(url, move |s| self.report(s)).await;
            // `donate` only returns when the donation is over (failed, or no
            // WebGPU): let the person try again.
            self.running.set(false);
        });
    }
}

#[component]
pub fn DonatePage() -> impl IntoView {
    let donation = use_context::<Donation>().unwrap_or_else(|| {
        // Only reachable if the page is mounted outside `App`; a local state
        // still works, it just does not survive navigation.
        let donation = Donation::new();
        provide_context(donation);
        donation
    });
    let status = donation.status;
    // The clock the time donated is read against, ticking while the page is open.
    let now_ms = RwSignal::new(js_sys::Date::now());
    let alive = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    on_cleanup({
        let alive = alive.clone();
        move || alive.store(false, std::sync::atomic::Ordering::Relaxed)
    });
    crate::api::tick_clock(alive, now_ms);
    let throughput = Signal::derive(move || {
        donation.samples.with(|s| {
            format::throughput(
                &s[s.len().saturating_sub(KEPT_SAMPLES)..],
                THROUGHPUT_WINDOW_MS,
            )
        })
    });
    let pause_when_hidden = donation.pause_when_hidden;

    view! {
        <section class="page donate-page">
            <h1>"Donate this GPU"</h1>
            <p>
                "Donating lends this browser tab's graphics card to people training AI models on this Rookery server. The tab runs a slice of a model (a few of its layers) on your GPU through WebGPU, on numbers the server sends it, and sends the results back."
            </p>
            <p>
                "What is sent: the numbers of the layers it runs and what they compute, nothing else. Nothing is read from your computer, nothing is installed, and closing the tab stops it at once."
            </p>
            <DonorFields />
            <button
                id="donate-start"
                class="button-primary"
                disabled=move || donation.running.get()
                on:click=move |_| donation.start()
            >
                "Donate this GPU"
            </button>
            {move || {
                donation
                    .running
                    .get()
                    .then(|| {
                        view! {
                            <button
                                id="donate-pause"
                                on:click=move |_| {
                                    let reason = donation
                                        .paused
                                        .get_untracked()
                                        .is_none()
                                        .then(|| "paused from the Donate page".to_string());
                                    donation.set_paused(reason);
                                }
                            >
                                {move || if donation.paused.get().is_some() { "Resume" } else { "Pause" }}
                            </button>
                        }
                    })
            }}
            <label class="donate-option">
                <input
                    id="pause-when-hidden"
                    type="checkbox"
                    prop:checked=move || pause_when_hidden.get()
                    on:change=move |ev| pause_when_hidden.set(event_target_checked(&ev))
                />
                " Pause while this tab is hidden"
            </label>
            <div
                id="donate-status"
                class="donate-status"
                role="status"
                aria-live="polite"
                data-state=move || status.with(|s| format::donate_state(s.as_ref()))
            >
                {move || {
                    let (headline, detail) = status.with(|s| format::donate_text(s.as_ref()));
                    view! {
                        <span class="headline">{headline}</span>
                        {detail.map(|detail| view! { <span class="detail">{detail}</span> })}
                    }
                }}
            </div>
            {move || {
                donation
                    .since_ms
                    .get()
                    .map(|since| {
                        let donated = (now_ms.get() - since).max(0.0) as u64;
                        view! {
                            <dl class="donate-figures">
                                <dt>"Time donated"</dt>
                                <dd id="donate-time">{format::duration(donated)}</dd>
                                <dt>"Work credited"</dt>
                                <dd id="donate-credit">
                                    {move || {
                                        donation
                                            .credit_gflop
                                            .get()
                                            .map_or(
                                                "none yet (credit comes at the job's checkpoints)".to_string(),
                                                rookery_proto::api::flop_text,
                                            )
                                    }}
                                </dd>
                            </dl>
                            <div class="charts">
                                <LineChart
                                    id="donate-throughput"
                                    title="This tab's micro-batches per minute"
                                    x_label="min"
                                    points=throughput
                                />
                            </div>
                        }
                    })
            }}
        </section>
    }
}

/// The throughput chart's resolution.
const THROUGHPUT_WINDOW_MS: f64 = 10_000.0;

/// The name and team the leaderboard shows for this browser's donations,
/// kept in local storage as they are typed (blank: anonymous).
#[component]
fn DonorFields() -> impl IntoView {
    let card = rookery_web_provider::stored_donor();
    let name = RwSignal::new(card.as_ref().map(|c| c.name.clone()).unwrap_or_default());
    let team = RwSignal::new(card.and_then(|c| c.team).unwrap_or_default());
    let keep =
        move || rookery_web_provider::keep_donor(&name.get_untracked(), &team.get_untracked());
    let field = move |id: &'static str, label: &'static str, value: RwSignal<String>| {
        view! {
            <label>
                {label}
                <input
                    id=id
                    maxlength="40"
                    placeholder=(id == "donor-name").then_some("anonymous")
                    prop:value=move || value.get()
                    on:input=move |ev| {
                        value.set(event_target_value(&ev));
                        keep();
                    }
                />
            </label>
        }
    };
    view! {
        <fieldset class="donor-fields">
            <legend>"On the leaderboard (optional)"</legend>
            {field("donor-name", "Your name ", name)}
            {field("donor-team", "Team ", team)}
        </fieldset>
    }
}

/// Why a hidden tab pauses: its donor is not watching it.
const HIDDEN: &str = "the tab is hidden";

/// Pauses the donation while the tab is hidden (if the donor wants that),
/// and resumes it when the tab shows again, unless the donor paused it by
/// hand. Registered once, with the donation, for the page's lifetime.
fn follow_visibility(donation: Donation) {
    use wasm_bindgen::JsCast;
    let Some(document) = web_sys::window().and_then(|w| w.document()) else {
        return;
    };
    let listener = wasm_bindgen::closure::Closure::<dyn Fn()>::new({
        let document = document.clone();
        move || {
            let wanted = donation.pause_when_hidden.try_get_untracked() == Some(true);
            let hidden = document.hidden() && wanted;
            let paused = donation.paused.try_get_untracked().flatten();
            if hidden && paused.is_none() && donation.running.try_get_untracked() == Some(true) {
                donation.set_paused(Some(HIDDEN.into()));
            } else if !hidden && paused.as_deref() == Some(HIDDEN) {
                donation.set_paused(None);
            }
        }
    });
    let _ = document
        .add_event_listener_with_callback("visibilitychange", listener.as_ref().unchecked_ref());
    // It lives as long as the page does, as the donation does.
    listener.forget();
}
