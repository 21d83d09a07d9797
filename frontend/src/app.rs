//! The app shell: the header with the product name and navigation, and the
//! client-side routes. The server answers every unknown path with
//! `index.html`, so deep links such as `/donate` land here.

use leptos::prelude::*;
use leptos_router::components::{Route, Router, Routes};
use leptos_router::hooks::use_location;
use leptos_router::path;

use crate::api::Auth;
use crate::donate::{DonatePage, Donation};
use crate::job_detail::JobDetailPage;
use crate::jobs::JobsPage;
use crate::leaderboard::LeaderboardPage;
use crate::new_job::NewJobPage;
use crate::providers::ProvidersPage;
use crate::signin::Guarded;

#[component]
pub fn App() -> impl IntoView {
    provide_context(Donation::new());
    provide_context(Auth::from_storage());
    view! {
        <Router>
            <Header />
            <main>
                <Routes fallback=NotFound>
                    <Route path=path!("/") view=Home />
                    <Route path=path!("/jobs") view=|| view! { <Guarded><JobsPage /></Guarded> } />
                    <Route path=path!("/jobs/new") view=|| view! { <Guarded><NewJobPage /></Guarded> } />
                    <Route path=path!("/jobs/:id") view=|| view! { <Guarded><JobDetailPage /></Guarded> } />
                    <Route path=path!("/providers") view=ProvidersPage />
                    <Route path=path!("/donate") view=DonatePage />
                    <Route path=path!("/leaderboard") view=LeaderboardPage />
                </Routes>
            </main>
        </Router>
    }
}

/// `/`: a Requester's jobs once signed in; for everyone else, a visitor
/// who may donate, the Donate page.
#[component]
fn Home() -> impl IntoView {
    let auth = crate::api::use_auth();
    move || {
        if auth.token.with(Option::is_some) {
            view! { <JobsPage /> }.into_any()
        } else {
            view! { <DonatePage /> }.into_any()
        }
    }
}

#[component]
fn Header() -> impl IntoView {
    let pathname = use_location().pathname;
    // Plain `<a>` links (the router intercepts their clicks) with
    // `aria-current` set here, because `/` and `/providers` are one page.
    let current = move |paths: &'static [&'static str]| {
        move || {
            pathname
                .with(|p| paths.contains(&p.trim_end_matches('/')))
                .then_some("page")
        }
    };
    let donating = use_context::<Donation>().map(|d| d.running);
    let auth = crate::api::use_auth();
    // Signed out, `/` is the Donate page.
    let donate_current = move || {
        let home = pathname.with(|p| p.trim_end_matches('/').is_empty());
        let donate = pathname.with(|p| p.trim_end_matches('/') == "/donate");
        (donate || (home && auth.token.with(Option::is_none))).then_some("page")
    };
    view! {
        <header class="site-header">
            <a class="brand" href="/">
                "Rookery"
            </a>
            <nav aria-label="Main">
                // A visitor sees what donors see; the Requester's pages
                // appear once signed in.
                {move || {
                    auth.token
                        .with(Option::is_some)
                        .then(|| {
                            view! {
                                <a href="/jobs" aria-current=current(&["", "/jobs"])>
                                    "Jobs"
                                </a>
                                <a href="/jobs/new" aria-current=current(&["/jobs/new"])>
                                    "New job"
                                </a>
                            }
                        })
                }}
                <a href="/providers" aria-current=current(&["/providers"])>
                    "Providers"
                </a>
                <a href="/leaderboard" aria-current=current(&["/leaderboard"])>
                    "Leaderboard"
                </a>
                <a href="/donate" aria-current=donate_current>
                    "Donate"
                    {move || {
                        donating
                            .is_some_and(|running| running.get())
                            .then(|| view! { <span class="live-dot" title="This tab is donating"></span> })
                    }}
                </a>
            </nav>
            {move || {
                if auth.token.with(Option::is_some) {
                    view! {
                        <button id="sign-out" class="link" on:click=move |_| auth.sign_out(None)>
                            "Sign out"
                        </button>
                    }
                        .into_any()
                } else {
                    view! {
                        <a id="sign-in" class="link" href="/jobs">
                            "Requesters: sign in"
                        </a>
                    }
                        .into_any()
                }
            }}
        </header>
    }
}

#[component]
fn NotFound() -> impl IntoView {
    view! {
        <section class="page">
            <h1>"Page not found"</h1>
            <p>
                "There is nothing at this address. See the " <a href="/jobs">"jobs"</a> ", the "
                <a href="/providers">"providers"</a> " or "
                <a href="/donate">"donate this GPU"</a> "."
            </p>
        </section>
    }
}
