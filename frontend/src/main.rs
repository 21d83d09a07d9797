//! Rookery's dashboard: a Leptos client-side app served by the Rookery server
//! as static files (`index.html`, `style.css`, `pkg/`). It shows the live
//! provider table and the Donate page, which runs the browser provider.
//!
//! Built for `wasm32-unknown-unknown`; it also compiles natively so the
//! workspace lints and unit-tests it, but there is nothing to run there.

mod app;
mod donate;
mod format;
mod providers;

fn main() {
    // `cfg!` rather than `#[cfg]` so the native build still type-checks and
    // lints every component.
    if cfg!(target_arch = "wasm32") {
        console_error_panic_hook::set_once();
        leptos::mount::mount_to_body(app::App);
    } else {
        eprintln!(
            "rookery-frontend runs in a browser: build it for wasm32-unknown-unknown \
             and let the Rookery server host it"
        );
        std::process::exit(2);
    }
}
