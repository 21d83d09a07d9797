//! The Donate page, for visitors: what donating runs and sends, in plain
//! words, one button that lends this tab's GPU to the server through
//! `rookery_web_provider::donate`, and while it does, the stage and
//! micro-batches done, the time donated, the work credited and a live chart
//! of the tab's own throughput. It is the home page for anyone not signed
//! in as a Requester.
//!
//! The tab pauses itself, saying why, while it is hidden, while the device
//! runs on battery (where the browser tells), and for a while when its GPU
//! is busy with something else; the donor may cap its GPU use.
//!
//! DOM contract (end-to-end tests rely on it): `<button id="donate-start">`,
//! `<div id="donate-status" data-state="idle|probing|no-webgpu|benchmarking|
//! connecting|connected|reconnecting|failed|paused">`, and while donating
//! `#donate-time`, `#donate-credit` and `svg#donate-throughput`; while
//! training `#donate-job` (`data-public="true|false"`: the job's public name,
//! or that it is private); `<input type=range id="donate-cap">` (percent)
//! with `#donate-cap-value`; checkboxes `#pause-when-hidden` and
//! `#pause-on-battery`, and `#battery-status`
//! (`data-battery="unknown|unavailable|charging|discharging"`).

use std::time::Duration;

use leptos::prelude::*;
use rookery_web_provider::DonateStatus;
use rookery_web_provider::pace;

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
    /// The GPU's kernels as the self-check timed them, one line each.
    pub kernel_speeds: RwSignal<Vec<rookery_web_provider::KernelSpeed>>,
    /// Why the donation is paused, while it is: the first of
    /// [`PauseConditions::reason`] that holds.
    pub paused: RwSignal<Option<String>>,
    /// Whether hiding the tab pauses the donation (on unless unticked).
    pub pause_when_hidden: RwSignal<bool>,
    /// The donor pressed Pause (and not Resume since).
    pub paused_by_hand: RwSignal<bool>,
    /// Whether the page is hidden now.
    pub tab_hidden: RwSignal<bool>,
    /// Whether running on battery pauses the donation (on unless unticked).
    pub pause_on_battery: RwSignal<bool>,
    /// What the browser says of the battery.
    pub battery: RwSignal<Battery>,
    /// Why the tab paused for a busy GPU, until it tries again.
    pub busy: RwSignal<Option<String>>,
    /// The last busy pause's wait and when it ended (the browser's clock,
    /// ms), for the next one's back-off.
    busy_backoff: RwSignal<Option<(Duration, f64)>>,
    /// The donor's cap on GPU use, percent.
    pub gpu_cap: RwSignal<u32>,
    /// Which battery watch is current (an older one's events are ignored).
    battery_watch: RwSignal<u32>,
}

/// What the browser says of the device's battery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Battery {
    /// Not asked yet, or no answer yet.
    Unknown,
    /// The browser has no `navigator.getBattery` (or it failed).
    Unavailable,
    Charging,
    Discharging,
}

impl Battery {
    /// The value of `data-battery` on `#battery-status`.
    pub fn attr(self) -> &'static str {
        match self {
            Battery::Unknown => "unknown",
            Battery::Unavailable => "unavailable",
            Battery::Charging => "charging",
            Battery::Discharging => "discharging",
        }
    }

    pub fn text(self) -> &'static str {
        match self {
            Battery::Unknown => "",
            Battery::Unavailable => "battery status not available in this browser",
            Battery::Charging => "plugged in",
            Battery::Discharging => "running on battery",
        }
    }
}

/// Why a donation pauses by hand.
pub const PAUSED_BY_HAND: &str = "paused from the Donate page";
/// Why a hidden tab pauses: its donor is not watching it.
pub const HIDDEN: &str = "the tab is hidden";
/// Why a device on battery pauses: donating would drain it.
pub const ON_BATTERY: &str = "this device is running on battery";

/// Everything that pauses a donation at once; the reason shown is the
/// first that holds, in this order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PauseConditions {
    pub by_hand: bool,
    /// Hidden, and the donor wants a hidden tab paused.
    pub hidden: bool,
    /// Discharging, and the donor wants that to pause.
    pub on_battery: bool,
    /// The busy pause's reason, while it lasts.
    pub busy: Option<String>,
}

impl PauseConditions {
    pub fn reason(&self) -> Option<String> {
        if self.by_hand {
            Some(PAUSED_BY_HAND.into())
        } else if self.hidden {
            Some(HIDDEN.into())
        } else if self.on_battery {
            Some(ON_BATTERY.into())
        } else {
            self.busy.clone()
        }
    }
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
            kernel_speeds: RwSignal::new(Vec::new()),
            paused: RwSignal::new(None),
            pause_when_hidden: RwSignal::new(true),
            paused_by_hand: RwSignal::new(false),
            tab_hidden: RwSignal::new(false),
            pause_on_battery: RwSignal::new(true),
            battery: RwSignal::new(Battery::Unknown),
            busy: RwSignal::new(None),
            busy_backoff: RwSignal::new(None),
            gpu_cap: RwSignal::new(rookery_web_provider::stored_gpu_cap()),
            battery_watch: RwSignal::new(0),
        };
        follow_visibility(donation);
        donation.watch_battery();
        donation
    }

    /// What pauses the donation now.
    pub fn conditions(self) -> PauseConditions {
        let get = |s: RwSignal<bool>| s.try_get_untracked() == Some(true);
        PauseConditions {
            by_hand: get(self.paused_by_hand),
            hidden: get(self.tab_hidden) && get(self.pause_when_hidden),
            on_battery: get(self.pause_on_battery)
                && self.battery.try_get_untracked() == Some(Battery::Discharging),
            busy: self.busy.try_get_untracked().flatten(),
        }
    }

    /// Pauses or resumes the donation as [`Self::conditions`] say, after
    /// any of them changed.
    pub fn update_pause(self) {
        let reason = self.conditions().reason();
        if self.paused.try_get_untracked().as_ref() != Some(&reason) {
            self.paused.try_set(reason.clone());
            rookery_web_provider::set_paused(reason);
        }
    }

    /// The Pause button: pauses by hand, or, while paused, resumes what the
    /// donor may resume (a hand's pause, a busy GPU's wait).
    pub fn press_pause(self) {
        if self.paused.get_untracked().is_some() {
            self.paused_by_hand.set(false);
            self.busy.set(None);
        } else {
            self.paused_by_hand.set(true);
        }
        self.update_pause();
    }

    /// The tab found its GPU busy: pause for a back-off, then try again.
    fn device_busy(self, busy: pace::Busy) {
        let now = js_sys::Date::now();
        let last = self.busy_backoff.get_untracked().map(|(wait, resumed_ms)| {
            (
                wait,
                Duration::from_millis((now - resumed_ms).max(0.0) as u64),
            )
        });
        let wait = pace::busy_backoff(last);
        let wait_ms = wait.as_millis() as f64;
        self.busy_backoff.set(Some((wait, now + wait_ms)));
        let reason = busy.reason(wait);
        self.busy.set(Some(reason.clone()));
        self.update_pause();
        wasm_bindgen_futures::spawn_local(async move {
            gloo_timers::future::TimeoutFuture::new(wait_ms as u32).await;
            if self.busy.try_get_untracked() == Some(Some(reason)) {
                self.busy.try_set(None);
                self.update_pause();
            }
        });
    }

    /// Asks the browser about the battery (again), following its changes;
    /// without `navigator.getBattery` the battery is `Unavailable` and
    /// nothing pauses for it.
    pub fn watch_battery(self) {
        use wasm_bindgen::JsCast;
        let Some(watch) = self.battery_watch.try_update(|n| {
            *n += 1;
            *n
        }) else {
            return;
        };
        let current = move || self.battery_watch.try_get_untracked() == Some(watch);
        let set = move |battery: Battery| {
            if current() {
                self.battery.try_set(battery);
                self.update_pause();
            }
        };
        let navigator = web_sys::window().map(|w| w.navigator());
        let get_battery = navigator.as_ref().and_then(|navigator| {
            js_sys::Reflect::get(navigator, &"getBattery".into())
                .ok()
                .and_then(|f| f.dyn_into::<js_sys::Function>().ok())
                .and_then(|f| f.call0(navigator).ok())
                .and_then(|p| p.dyn_into::<js_sys::Promise>().ok())
        });
        let Some(promise) = get_battery else {
            set(Battery::Unavailable);
            return;
        };
        set(Battery::Unknown);
        wasm_bindgen_futures::spawn_local(async move {
            let Ok(manager) = wasm_bindgen_futures::JsFuture::from(promise).await else {
                set(Battery::Unavailable);
                return;
            };
            let read = {
                let manager = manager.clone();
                move || match js_sys::Reflect::get(&manager, &"charging".into())
                    .ok()
                    .and_then(|c| c.as_bool())
                {
                    Some(true) => Battery::Charging,
                    Some(false) => Battery::Discharging,
                    None => Battery::Unavailable,
                }
            };
            set(read());
            let Ok(target) = manager.dyn_into::<web_sys::EventTarget>() else {
                return;
            };
            let listener = wasm_bindgen::closure::Closure::<dyn Fn()>::new(move || set(read()));
            let _ = target.add_event_listener_with_callback(
                "chargingchange",
                listener.as_ref().unchecked_ref(),
            );
            // It lives as long as the page does; a later watch outdates it.
            listener.forget();
        });
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
            DonateStatus::DeviceBusy(busy) => {
                self.device_busy(busy);
                return;
            }
            DonateStatus::KernelSpeeds { lines } => {
                self.kernel_speeds.set(lines);
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
    let pause_on_battery = donation.pause_on_battery;
    let gpu_cap = donation.gpu_cap;

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
                            <button id="donate-pause" on:click=move |_| donation.press_pause()>
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
                    on:change=move |ev| {
                        pause_when_hidden.set(event_target_checked(&ev));
                        donation.update_pause();
                    }
                />
                " Pause while this tab is hidden"
            </label>
            <label class="donate-option">
                <input
                    id="pause-on-battery"
                    type="checkbox"
                    prop:checked=move || pause_on_battery.get()
                    on:change=move |ev| {
                        pause_on_battery.set(event_target_checked(&ev));
                        // Asked again: the answer may have changed unseen.
                        donation.watch_battery();
                        donation.update_pause();
                    }
                />
                " Pause while this device runs on battery "
                <span
                    id="battery-status"
                    class="detail"
                    data-battery=move || donation.battery.get().attr()
                >
                    {move || donation.battery.get().text()}
                </span>
            </label>
            <label class="donate-option donate-cap">
                "GPU use "
                <input
                    id="donate-cap"
                    type="range"
                    min=pace::MIN_CAP_PERCENT.to_string()
                    max="100"
                    step="10"
                    prop:value=move || gpu_cap.get().to_string()
                    on:input=move |ev| {
                        if let Ok(percent) = event_target_value(&ev).parse::<u32>() {
                            gpu_cap.set(percent);
                            rookery_web_provider::set_gpu_cap(percent);
                        }
                    }
                />
                <output id="donate-cap-value" for="donate-cap">
                    {move || format!("{}%", gpu_cap.get())}
                </output>
            </label>
            <p class="note">
                "Below 100%, the tab rests after each piece of work so that the GPU computes only that share of the time; the server counts it as that much slower."
            </p>
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
                let lines = donation.kernel_speeds.get();
                (!lines.is_empty())
                    .then(|| {
                        view! {
                            <details id="donate-kernels" class="donate-kernels">
                                <summary>"This GPU's kernels, as its self-check timed them"</summary>
                                <ul>
                                    {lines
                                        .iter()
                                        .map(|line| view! { <li>{format::kernel_speed(line)}</li> })
                                        .collect::<Vec<_>>()}
                                </ul>
                            </details>
                        }
                    })
            }}
            {move || {
                status
                    .with(|s| match s {
                        Some(DonateStatus::Training { public_name, .. }) => {
                            Some(public_name.clone())
                        }
                        _ => None,
                    })
                    .map(|public_name| {
                        view! {
                            <p
                                id="donate-job"
                                class="donate-job"
                                data-public=public_name.is_some().to_string()
                            >
                                {format::donate_job(public_name.as_deref())}
                            </p>
                        }
                    })
            }}
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

/// Pauses the donation while the tab is hidden (if the donor wants that),
/// and resumes it when the tab shows again, unless something else pauses
/// it. Registered once, with the donation, for the page's lifetime.
fn follow_visibility(donation: Donation) {
    use wasm_bindgen::JsCast;
    let Some(document) = web_sys::window().and_then(|w| w.document()) else {
        return;
    };
    let listener = wasm_bindgen::closure::Closure::<dyn Fn()>::new({
        let document = document.clone();
        move || {
            donation.tab_hidden.try_set(document.hidden());
            donation.update_pause();
        }
    });
    let _ = document
        .add_event_listener_with_callback("visibilitychange", listener.as_ref().unchecked_ref());
    // It lives as long as the page does, as the donation does.
    listener.forget();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_says_its_first_reason_and_ends_when_none_holds() {
        let busy = Some("the GPU is busy with something else".to_string());
        let all = PauseConditions {
            by_hand: true,
            hidden: true,
            on_battery: true,
            busy: busy.clone(),
        };
        assert_eq!(all.reason().as_deref(), Some(PAUSED_BY_HAND));
        let c = PauseConditions {
            by_hand: false,
            ..all.clone()
        };
        assert_eq!(c.reason().as_deref(), Some(HIDDEN));
        let c = PauseConditions { hidden: false, ..c };
        assert_eq!(c.reason().as_deref(), Some(ON_BATTERY));
        let c = PauseConditions {
            on_battery: false,
            ..c
        };
        assert_eq!(c.reason(), busy);
        assert_eq!(PauseConditions::default().reason(), None);
    }
}
