//! The app shell: the header with the product name and navigation, and the
//! client-side routes. The server answers every unknown path with
//! `index.html`, so deep links such as `/donate` land here.

use leptos::prelude::*;
use leptos_router::components::{Route, Router, Routes};
use leptos_router::hooks::use_location;
use leptos_router::path;

use crate::donate::{DonatePage, Donation};
use crate::providers::ProvidersPage;

#[component]
pub fn App() -> impl IntoView {
    provide_context(Donation::new());
    view! {
        <Router>
            <Header />
            <main>
                <Routes fallback=NotFound>
                    <Route path=path!("/") view=ProvidersPage />
                    <Route path=path!("/providers") view=ProvidersPage />
                    <Route path=path!("/donate") view=DonatePage />
                </Routes>
            </main>
        </Router>
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
    view! {
        <header class="site-header">
            <a class="brand" href="/">
                "Rookery"
            </a>
            <nav aria-label="Main">
                <a href="/providers" aria-current=current(&["", "/providers"])>
                    "Providers"
                </a>
                <a href="/donate" aria-current=current(&["/donate"])>
                    "Donate"
                    {move || {
                        donating
                            .is_some_and(|running| running.get())
                            .then(|| view! { <span class="live-dot" title="This tab is donating"></span> })
                    }}
                </a>
            </nav>
        </header>
    }
}

#[component]
fn NotFound() -> impl IntoView {
    view! {
        <section class="page">
            <h1>"Page not found"</h1>
            <p>
                "There is nothing at this address. See the "
                <a href="/providers">"providers"</a> " or "
                <a href="/donate">"donate this GPU"</a> "."
            </p>
        </section>
    }
}
