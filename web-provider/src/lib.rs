//! Rookery's browser provider: finds a WebGPU adapter through wgpu, measures it
//! with the matmul kernel from `rookery-shared`, and joins the server over the
//! same WebSocket protocol as native providers. Compiled to wasm32 and used by
//! the dashboard's Donate page.

/// What the donation is doing now; the Donate page shows it.
#[derive(Debug, Clone, PartialEq)]
pub enum DonateStatus {
    /// Asking the browser for a WebGPU adapter.
    Probing,
    /// The browser has no usable WebGPU; `reason` is plain words for a person.
    NoWebGpu { reason: String },
    /// Running the matmul benchmark on `adapter`.
    Benchmarking { adapter: String },
    /// Opening the WebSocket.
    Connecting { adapter: String, gflops: f64 },
    /// The server accepted this tab as a provider.
    Connected {
        provider_id: u64,
        adapter: String,
        gflops: f64,
    },
    /// The connection dropped; the tab retries after a pause.
    Reconnecting { reason: String },
    /// Something failed that retrying will not fix.
    Failed { reason: String },
}

/// The provider WebSocket URL of the server that served this page
/// (`ws(s)://<host>/ws/provider`), or `None` outside a browser.
pub fn default_server_url() -> Option<String> {
    None
}

/// Donates this tab's GPU to the server at `server_ws_url` until the page
/// closes, reporting every change of state through `on_status`.
pub async fn donate(server_ws_url: String, on_status: impl Fn(DonateStatus) + 'static) {
    let _ = server_ws_url;
    on_status(DonateStatus::Failed {
        reason: "the browser provider is not built yet".into(),
    });
}
