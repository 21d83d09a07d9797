//! The dashboard's entry point: mounts [`rookery_frontend::app::App`].

fn main() {
    // `cfg!` rather than `#[cfg]` so the native build still type-checks and
    // lints the call.
    if cfg!(target_arch = "wasm32") {
        console_error_panic_hook::set_once();
        leptos::mount::mount_to_body(rookery_frontend::app::App);
    } else {
        eprintln!(
            "rookery-frontend runs in a browser: build it for wasm32-unknown-unknown \
             and let the Rookery server host it"
        );
        std::process::exit(2);
    }
}
