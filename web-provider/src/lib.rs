//! Rookery's browser provider: finds a WebGPU adapter through wgpu, measures it
//! with the matmul kernel from `rookery-kernels`, and joins the server over the
//! same WebSocket protocol as native providers. Compiled to wasm32 and used by
//! the dashboard's Donate page.
//!
//! The public API also compiles natively, so the workspace builds and lints on
//! the host; there, [`donate`] only reports that it needs a browser.

#[cfg(target_arch = "wasm32")]
mod browser;
mod measure;
pub mod pace;

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
    /// Running a stage of a job (`stage` of `stages`: this tab's share of the
    /// model), with `micro_batches` forward and backward passes done.
    /// `public_name` is the job's name if its Requester lets donors see
    /// it; `None` for a private job.
    Training {
        provider_id: u64,
        adapter: String,
        gflops: f64,
        job_id: u64,
        stage: u32,
        stages: u32,
        micro_batches: u64,
        public_name: Option<String>,
    },
    /// The connection dropped; the tab retries after a pause.
    Reconnecting { reason: String },
    /// Something failed that retrying will not fix.
    Failed { reason: String },
    /// The donor paused donating (`reason`, for a person); resuming
    /// connects again.
    Paused { reason: String },
    /// Not a state but news beside it: the server now credits this
    /// browser's identity with `gflop` of accepted work in all.
    Credited { gflop: f64 },
    /// News beside the state: what the GPU's kernels ran at in the
    /// self-check, one line per kernel and shape (the GPU kit's
    /// `kernel_speed` measures the same way).
    KernelSpeeds { lines: Vec<KernelSpeed> },
    /// News beside the state: the stage's micro-batches have been far
    /// slower than usual several times in a row, so something else is
    /// using the GPU; the page pauses the donation for a while.
    DeviceBusy(pace::Busy),
}

/// One kernel's speed on the donor's GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelSpeed {
    /// The kernel and its shape, e.g. `matmul 256x256x256 (16x16 x 4x4 d16)`.
    pub name: String,
    pub gflops: f64,
}

/// The provider WebSocket URL of the server that served this page
/// (`ws(s)://<host>/ws/provider`), or `None` outside a browser.
pub fn default_server_url() -> Option<String> {
    #[cfg(target_arch = "wasm32")]
    {
        browser::default_server_url()
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        None
    }
}

/// The provider credential this browser keeps for the page's server, if
/// it ever donated: the dashboard presents it to list its own providers.
pub fn stored_credential() -> Option<String> {
    #[cfg(target_arch = "wasm32")]
    {
        browser::stored_credential()
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        None
    }
}

/// The name and team this browser's donor chose for the leaderboard, if
/// any: sent in every `Hello` from then on.
pub fn stored_donor() -> Option<rookery_proto::DonorCard> {
    #[cfg(target_arch = "wasm32")]
    {
        browser::stored_donor()
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        None
    }
}

/// Keeps the donor's leaderboard name and team (blank: anonymous) for this
/// browser's tabs; a tab donating now sends them when it next connects.
pub fn keep_donor(name: &str, team: &str) {
    #[cfg(target_arch = "wasm32")]
    browser::keep_donor(name, team);
    #[cfg(not(target_arch = "wasm32"))]
    let _ = (name, team);
}

/// The cap on GPU use this browser's donor chose, in percent (10 to 100;
/// 100 when never set): kept in local storage like the donor's name.
pub fn stored_gpu_cap() -> u32 {
    #[cfg(target_arch = "wasm32")]
    {
        browser::stored_gpu_cap()
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        100
    }
}

/// Caps this browser's GPU use at `percent` (clamped to 10 to 100): kept
/// for its tabs, kept by this tab from its next piece of work (it idles
/// after each so the GPU works that share of the time), and told to the
/// server at once, whose planner counts the tab that much slower.
pub fn set_gpu_cap(percent: u32) {
    #[cfg(target_arch = "wasm32")]
    browser::set_gpu_cap(percent);
    #[cfg(not(target_arch = "wasm32"))]
    let _ = percent;
}

/// Pauses this tab's donation with `reason` (shown to the donor and in the
/// server's provider list), or resumes it with `None`.
pub fn set_paused(reason: Option<String>) {
    #[cfg(target_arch = "wasm32")]
    browser::set_paused(reason);
    #[cfg(not(target_arch = "wasm32"))]
    let _ = reason;
}

/// Donates this tab's GPU to the server at `server_ws_url` until the page
/// closes, reporting every change of state through `on_status`.
///
/// In order: `Probing`; `NoWebGpu` without a usable adapter, after which the
/// tab donates its CPU instead (the kernels' references, compiled to wasm);
/// `Benchmarking` while the kernel is checked against the CPU reference
/// (`Failed` and return if it is wrong) and timed; then `Connecting`,
/// `Connected` once the server welcomes the tab, `Training` while it runs a
/// stage, and `Reconnecting` after
/// every drop, forever, with pauses from 1 s doubling to 15 s. It returns
/// only after `Failed` (for example when the server speaks
/// another protocol version); dropping the future stops the donation.
pub async fn donate(server_ws_url: String, on_status: impl Fn(DonateStatus) + 'static) {
    #[cfg(target_arch = "wasm32")]
    {
        browser::donate(server_ws_url, on_status).await;
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = server_ws_url;
        on_status(DonateStatus::Failed {
            reason: "donating a GPU needs this code compiled to WebAssembly and run in a browser"
                .into(),
        });
    }
}
