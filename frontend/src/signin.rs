//! Sign-in with the server's API token. The token is checked against the
//! server before it is kept (in the browser's local storage), so a wrong one
//! is refused here with the server's own words.
//!
//! DOM contract: `form#signin` with `input#token`, `#signin-error` when the
//! server refused the token, `button#sign-out` in the header when signed in.

use leptos::prelude::*;
use rookery_proto::api::JobInfo;

use crate::api::{self, use_auth};

/// Shows `children` to a signed-in Requester, the sign-in form otherwise.
#[component]
pub fn Guarded(children: ChildrenFn) -> impl IntoView {
    let auth = use_auth();
    move || {
        if auth.token.with(Option::is_some) {
            children().into_any()
        } else {
            view! { <SignIn /> }.into_any()
        }
    }
}

#[component]
pub fn SignIn() -> impl IntoView {
    let auth = use_auth();
    let token = RwSignal::new(String::new());
    let error = RwSignal::new(None::<String>);
    let busy = RwSignal::new(false);
    let submit = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let candidate = token.get_untracked().trim().to_string();
        if candidate.is_empty() {
            error.set(Some("Paste the API token first.".into()));
            return;
        }
        busy.set(true);
        wasm_bindgen_futures::spawn_local(async move {
            // Any job endpoint proves the token; listing is the cheapest.
            let result = api::get_json::<Vec<JobInfo>>(&candidate, "/api/jobs").await;
            busy.set(false);
            match result {
                Ok(_) => auth.sign_in(candidate),
                Err(failure) if failure.is_unauthorized() => error.set(Some(format!(
                    "The server refused this token ({}). It is the line `rookery serve` printed at start, also in the data directory's api-token file.",
                    failure.message
                ))),
                Err(failure) => error.set(Some(failure.message)),
            }
        });
    };
    view! {
        <section class="page narrow">
            <h1>"Sign in"</h1>
            <p>
                "Jobs belong to the Requester holding this server's API token. "
                "Paste it here; this browser keeps it until you sign out."
            </p>
            {move || {
                auth.notice
                    .get()
                    .map(|notice| view! { <div class="banner banner-error" role="alert">{notice}</div> })
            }}
            <form id="signin" class="form" on:submit=submit>
                <label for="token">"API token"</label>
                <input
                    id="token"
                    type="password"
                    autocomplete="current-password"
                    prop:value=move || token.get()
                    on:input=move |ev| token.set(event_target_value(&ev))
                />
                {move || {
                    error
                        .get()
                        .map(|message| {
                            view! {
                                <p id="signin-error" class="field-error" role="alert">
                                    {message}
                                </p>
                            }
                        })
                }}
                <button type="submit" class="primary" disabled=move || busy.get()>
                    "Sign in"
                </button>
            </form>
            <p class="note">
                "Without a token you can still see the " <a href="/providers">"providers"</a>
                " and " <a href="/donate">"donate this browser's GPU"</a> "."
            </p>
        </section>
    }
}
