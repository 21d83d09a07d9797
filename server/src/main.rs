//! `rookery`: the Rookery server and the Requester's command line.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use rookery_server::{AppState, Limits};

#[derive(Parser, Debug)]
#[command(
    name = "rookery",
    version,
    about = "Train deep learning models on donated hardware"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the server: REST API, provider WebSocket and dashboard.
    Serve(ServeArgs),
    /// Show how a model would be split over a set of providers.
    Plan(PlanArgs),
}

#[derive(clap::Args, Debug)]
struct PlanArgs {
    /// The model: a layer-spec `.toml` file.
    #[arg(long)]
    model: PathBuf,
    /// One sample's shape, e.g. 1,28,28 (overrides the model file's own).
    #[arg(long)]
    input_shape: Option<String>,
    /// JSON list of providers: id, kind (native|browser), memory_gb, gflops, bandwidth_mbps.
    #[arg(long)]
    providers: PathBuf,
    /// Samples per micro-batch.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    micro_batch: u64,
    /// Number of data-parallel clusters, or `auto`.
    #[arg(long, default_value = "auto", value_parser = rookery_server::plan_cli::parse_clusters)]
    clusters: rookery_model::ClusterCount,
    /// Print the plan as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Address to listen on; port 0 picks a free port (printed at start).
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: SocketAddr,
    /// Where the database and (later) checkpoints live; created on first start.
    #[arg(long, default_value = "rookery-data")]
    data_dir: PathBuf,
    /// A built dashboard (`cargo xtask web` writes one to target/web).
    #[arg(long, env = "ROOKERY_WEB_DIR", default_value = "target/web")]
    web_dir: PathBuf,
    /// Milliseconds of silence after which a provider is dropped.
    #[arg(long, default_value_t = 4000)]
    heartbeat_timeout_ms: u64,
    /// Largest WebSocket frame accepted from a provider, in bytes.
    #[arg(long, default_value_t = rookery_proto::DEFAULT_MAX_FRAME_BYTES)]
    max_frame_bytes: usize,
}

/// Errors print as one readable chain (`error: a: b`), never as a backtrace.
fn main() -> std::process::ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_http=warn".into()),
        )
        .init();
    match Cli::parse().command {
        Command::Serve(args) => serve(args).await,
        Command::Plan(args) => {
            let input_shape = args
                .input_shape
                .as_deref()
                .map(rookery_server::plan_cli::parse_shape)
                .transpose()
                .map_err(anyhow::Error::msg)?;
            let plan = rookery_server::plan_cli::plan(
                &args.model,
                input_shape.as_deref(),
                &args.providers,
                args.micro_batch as usize,
                args.clusters,
                args.json,
            )?;
            println!("{plan}");
            Ok(())
        }
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let heartbeat_timeout = Duration::from_millis(args.heartbeat_timeout_ms.max(100));
    let limits = Limits {
        max_frame_bytes: args.max_frame_bytes,
        heartbeat_interval: heartbeat_timeout / 4,
        heartbeat_timeout,
    };
    let web_dir = rookery_server::http::is_dashboard(&args.web_dir).then_some(args.web_dir.clone());
    if web_dir.is_none() {
        tracing::warn!(
            dir = %args.web_dir.display(),
            "no built dashboard there; run `cargo xtask web` to build it"
        );
    }
    let state = AppState::open(&args.data_dir, limits, web_dir)
        .await
        .with_context(|| format!("opening the data directory {}", args.data_dir.display()))?;
    let listener = tokio::net::TcpListener::bind(args.addr)
        .await
        .with_context(|| format!("binding {}", args.addr))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    // Tests and scripts read this line to learn the port when --addr used port 0.
    println!(
        "Rookery server listening on http://{addr}/ (providers: ws://{addr}{})",
        rookery_proto::PROVIDER_WS_PATH
    );
    rookery_server::serve(listener, state, shutdown_signal())
        .await
        .context("serving")?;
    println!("Rookery server stopped");
    Ok(())
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
