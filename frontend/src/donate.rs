//! The Donate page: lends this tab's GPU to the server through
//! `rookery_web_provider::donate`.
//!
//! DOM contract (end-to-end tests rely on it): `<button id="donate-start">` and
//! `<div id="donate-status" data-state="idle|probing|no-webgpu|benchmarking|
//! connecting|connected|reconnecting|failed">`.

use leptos::prelude::*;
use rookery_web_provider::DonateStatus;

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
}

impl Default for Donation {
    fn default() -> Self {
        Self::new()
    }
}

impl Donation {
    pub fn new() -> Self {
        Self {
            status: RwSignal::new(None),
            running: RwSignal::new(false),
        }
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
            let status = self.status;
            rookery_web_provider::donate(url, move |s| status.set(Some(s))).await;
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

    view! {
        <section class="page donate-page">
            <h1>"Donate this GPU"</h1>
            <p>
                "Donating lends this browser tab's graphics card to Rookery: the tab runs parts of a model's training on your GPU through WebGPU and sends the results back to the server."
            </p>
            <p>
                "Nothing is installed on your computer. You can keep browsing this dashboard while donating; closing the tab stops it at once."
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
        </section>
    }
}

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
