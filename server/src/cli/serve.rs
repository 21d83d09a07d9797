//! `rookery serve`: the server on a data dir, until Ctrl-C or SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::admission::{AllowedOrigins, WebOrigin};
use crate::http::site::is_dashboard;
use crate::state::{AppState, Limits};
use crate::store::identities::IssueLimit;
use crate::store::tokens::token_path;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on; port 0 picks a free port (printed at start).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub addr: SocketAddr,
    /// Where the database and (later) checkpoints live; created on first start.
    #[arg(long, default_value = "rookery-data")]
    pub data_dir: PathBuf,
    /// A built dashboard (`cargo xtask web` writes one to target/web).
    #[arg(long, env = "ROOKERY_WEB_DIR", default_value = "target/web")]
    pub web_dir: PathBuf,
    /// Milliseconds of silence after which a provider is dropped.
    #[arg(long, default_value_t = 4000)]
    pub heartbeat_timeout_ms: u64,
    #[command(flatten)]
    pub frames: FrameLimitArg,
    /// Largest job upload (job file, model and data together), in bytes.
    #[arg(long, default_value_t = Limits::default().max_upload_bytes)]
    pub max_upload_bytes: usize,
    /// Provider WebSockets one IP address may hold open at once.
    #[arg(long, default_value_t = Limits::default().max_connections_per_ip)]
    pub max_connections_per_ip: usize,
    /// HTTP connections one IP address may hold open at once.
    #[arg(long, default_value_t = Limits::default().max_http_connections_per_ip)]
    pub max_http_connections_per_ip: usize,
    /// Jobs one Requester may have waiting in the queue at once.
    #[arg(long, default_value_t = Limits::default().max_queued_jobs)]
    pub max_queued_jobs: usize,
    /// New provider identities one IP address may make an hour; each fault
    /// of those identities counts as 4 more.
    #[arg(long, default_value_t = IssueLimit::default().per_window)]
    pub new_identities_per_hour: u32,
    /// Bytes one Requester's queued jobs' uploads may hold on disk.
    #[arg(long, default_value_t = Limits::default().max_queued_upload_bytes)]
    pub max_queued_upload_bytes: u64,
    /// Bytes that may wait to be sent to one provider (relayed activations
    /// and gradients, micro-batches) before it is dropped as too slow.
    #[arg(long, default_value_t = Limits::default().max_outbox_bytes)]
    pub max_outbox_bytes: usize,
    /// Milliseconds one frame may take to go out to a provider before it is
    /// dropped as too slow a reader and its stage reassigned.
    #[arg(long, default_value_t = 30_000)]
    pub send_timeout_ms: u64,
    /// Milliseconds a client may take to send a request's headers, or pause
    /// in the middle of an upload, before it is dropped.
    #[arg(long, default_value_t = 30_000)]
    pub slow_client_timeout_ms: u64,
    /// Providers must present this join token to connect (kept in memory as
    /// its digest only).
    #[arg(long, env = "ROOKERY_PROVIDER_TOKEN", hide_env_values = true)]
    pub provider_token: Option<String>,
    /// A web page origin (scheme://host[:port]) whose scripts may open
    /// provider WebSockets, so its visitors' browsers may donate; repeat for
    /// more. When any is given, other pages get a 403 (the server's own
    /// pages and native providers are not affected); without it, any page
    /// may.
    #[arg(long = "allowed-origin", value_name = "ORIGIN")]
    pub allowed_origins: Vec<WebOrigin>,
    /// Days a gone provider's row is kept (for the dashboard's history)
    /// before it is deleted; checked at start and then hourly.
    #[arg(long, default_value_t = 30)]
    pub provider_retention_days: u64,
    #[cfg(feature = "bench-latency")]
    #[command(flatten)]
    pub bench: BenchArgs,
}

/// Benchmark-only settings. A build without feature `bench-latency` (every
/// build but the benchmarks') has no such flags and refuses them.
#[cfg(feature = "bench-latency")]
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct BenchArgs {
    /// Benchmarks only: hold every frame to a provider this many ms after
    /// it is queued, as one hop of a link between homes would.
    #[arg(long, default_value_t = 0)]
    pub relay_delay_ms: u64,
}

#[cfg(feature = "bench-latency")]
impl BenchArgs {
    pub fn apply(&self, limits: &mut Limits) {
        limits.relay_delay = Duration::from_millis(self.relay_delay_ms);
    }
}

/// The provider connections' frame limit, for `rookery serve` and `rookery
/// train` alike (tests set it through the environment to run small).
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct FrameLimitArg {
    /// Largest WebSocket frame sent to or accepted from a provider, in
    /// bytes; announced to providers, which stream every tensor within it.
    #[arg(
        long,
        env = "ROOKERY_MAX_FRAME_BYTES",
        default_value_t = rookery_proto::DEFAULT_MAX_FRAME_BYTES,
        value_parser = frame_limit,
    )]
    pub max_frame_bytes: usize,
}

fn frame_limit(text: &str) -> Result<usize, String> {
    let bytes: u64 = text
        .parse()
        .map_err(|_| format!("`{text}` is not a number of bytes"))?;
    rookery_proto::check_frame_limit(bytes)
}

/// `rookery serve`: prints the API token (when it creates it) and the address, then serves
/// until Ctrl-C or SIGTERM.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let heartbeat_timeout = Duration::from_millis(args.heartbeat_timeout_ms.max(100));
    #[allow(unused_mut)] // Benchmarks' builds set more.
    let mut limits = Limits {
        max_frame_bytes: args.frames.max_frame_bytes,
        heartbeat_interval: heartbeat_timeout / 4,
        heartbeat_timeout,
        max_upload_bytes: args.max_upload_bytes,
        max_connections_per_ip: args.max_connections_per_ip.max(1),
        slow_client_timeout: Duration::from_millis(args.slow_client_timeout_ms.max(100)),
        max_http_connections_per_ip: args.max_http_connections_per_ip.max(1),
        max_queued_jobs: args.max_queued_jobs.max(1),
        max_queued_upload_bytes: args.max_queued_upload_bytes,
        identities: IssueLimit {
            per_window: args.new_identities_per_hour.max(1),
        },
        // A stage's frames are at most 512 KiB; the bound must hold a few.
        max_outbox_bytes: args.max_outbox_bytes.max(16 << 20),
        send_timeout: Duration::from_millis(args.send_timeout_ms.max(100)),
        relay_delay: Duration::ZERO,
    };
    #[cfg(feature = "bench-latency")]
    args.bench.apply(&mut limits);
    let web_dir = is_dashboard(&args.web_dir).then_some(args.web_dir.clone());
    if web_dir.is_none() {
        tracing::warn!(
            dir = %args.web_dir.display(),
            "no built dashboard there; run `cargo xtask web` to build it"
        );
    }
    let token_file = token_path(&args.data_dir);
    let first_start = !token_file.exists();
    let mut state = AppState::open(&args.data_dir, limits, web_dir)
        .await
        .with_context(|| format!("opening the data directory {}", args.data_dir.display()))?;
    match args.provider_token.as_deref().map(str::trim) {
        Some("") => anyhow::bail!("--provider-token is empty"),
        Some(token) => {
            state = state.with_provider_token(token);
            println!("Providers must present the join token (--provider-token).");
        }
        None => {}
    }
    if args.allowed_origins.is_empty() {
        // Off by default so a server on a laptop just works; said loudly
        // because a public server without it lends its visitors' GPUs to
        // whoever embeds it.
        tracing::warn!(
            "no --allowed-origin given: any web page may make its visitors' browsers donate to this server; pass --allowed-origin ORIGIN (repeatable) to allow only your pages"
        );
    } else {
        let shown: Vec<String> = args
            .allowed_origins
            .iter()
            .map(ToString::to_string)
            .collect();
        println!(
            "Browser providers only from this server's pages and {}.",
            shown.join(", ")
        );
        state = state.with_allowed_origins(AllowedOrigins::new(args.allowed_origins));
    }
    let listener = tokio::net::TcpListener::bind(args.addr)
        .await
        .with_context(|| format!("binding {}", args.addr))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    // The secret is shown once, when it is made; later starts say where it
    // is, so logs of a running server do not carry it.
    if first_start {
        println!(
            "API token (also in {}): {}",
            token_file.display(),
            state.api_token.secret()
        );
    } else {
        println!("API token: in {}", token_file.display());
    }
    // Tests and scripts read this line to learn the port when --addr used port 0.
    println!(
        "Rookery server listening on http://{addr}/ (providers: ws://{addr}{})",
        rookery_proto::PROVIDER_WS_PATH
    );
    tokio::spawn(prune_providers(
        state.db.clone(),
        Duration::from_secs(args.provider_retention_days.saturating_mul(86_400)),
    ));
    crate::serve(listener, state, shutdown_signal())
        .await
        .context("serving")?;
    println!("Rookery server stopped");
    Ok(())
}

/// Deletes providers gone longer than `retention`, now and then hourly: a
/// public server sees a new row per tab visit, and the history is only
/// there for the dashboard.
async fn prune_providers(db: crate::store::Db, retention: Duration) {
    let mut hourly = tokio::time::interval(Duration::from_secs(3_600));
    loop {
        hourly.tick().await;
        let before = crate::now_ms().saturating_sub(retention.as_millis() as u64);
        match crate::store::providers::prune_gone(&db, before).await {
            Ok(0) => {}
            Ok(pruned) => tracing::info!(pruned, "forgot providers gone longer than the retention"),
            Err(error) => tracing::error!(%error, "cannot prune gone providers"),
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
}
