//! `rookery`: the Rookery server and the Requester's command line.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use rookery_server::client::Client;
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
    /// Submit a job file (and the files it names) to a server; prints the job id.
    Submit {
        job: PathBuf,
        #[command(flatten)]
        server: ServerArgs,
    },
    /// List the server's jobs.
    Jobs {
        #[command(flatten)]
        server: ServerArgs,
    },
    /// Follow a job with a progress bar until it finishes.
    Watch {
        id: u64,
        #[command(flatten)]
        server: ServerArgs,
    },
    /// Download a job's trained weights (safetensors).
    Download {
        id: u64,
        #[arg(short, long, default_value = "weights.safetensors")]
        out: PathBuf,
        #[command(flatten)]
        server: ServerArgs,
    },
    /// Cancel a job.
    Cancel {
        id: u64,
        #[command(flatten)]
        server: ServerArgs,
    },
    /// Train a job here: an embedded server and N local providers; writes
    /// DIR/weights.safetensors and DIR/metrics.json.
    Train(TrainArgs),
    /// Manage Requesters' API tokens in a server's data directory.
    Token {
        #[command(subcommand)]
        action: TokenCommand,
    },
}

#[derive(Subcommand, Debug)]
enum TokenCommand {
    /// Make a Requester with a fresh API token; prints the token once.
    Create {
        /// Letters, digits, `.`, `_` or `-`.
        name: String,
        #[arg(long, default_value = "rookery-data")]
        data_dir: PathBuf,
    },
    /// List the Requesters (names only; tokens are not stored).
    List {
        #[arg(long, default_value = "rookery-data")]
        data_dir: PathBuf,
    },
}

#[derive(clap::Args, Debug)]
struct ServerArgs {
    /// The server, e.g. http://127.0.0.1:8080.
    #[arg(long, env = "ROOKERY_SERVER", default_value = "http://127.0.0.1:8080")]
    server: String,
    /// The API token the server printed (default: read from ./rookery-data/api-token).
    #[arg(long, env = "ROOKERY_TOKEN")]
    token: Option<String>,
}

impl ServerArgs {
    fn client(&self) -> anyhow::Result<Client> {
        let token = match &self.token {
            Some(token) => token.clone(),
            None => std::fs::read_to_string("rookery-data/api-token").context(
                "no API token: pass --token (or set ROOKERY_TOKEN) with the token the server printed",
            )?,
        };
        Ok(Client::new(&self.server, &token))
    }
}

#[derive(clap::Args, Debug)]
struct TrainArgs {
    job: PathBuf,
    /// How many local `rookery-provider` processes to start.
    #[arg(long, default_value_t = 3)]
    local_providers: usize,
    /// Where weights.safetensors and metrics.json go.
    #[arg(long, default_value = "rookery-out")]
    out: PathBuf,
    /// The provider binary (default: `rookery-provider` beside this program).
    #[arg(long, env = "ROOKERY_PROVIDER_BIN")]
    provider_bin: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
struct PlanArgs {
    /// The model: an ONNX export (`.onnx`) or a layer-spec `.toml` file.
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
    /// Largest job upload (job file, model and data together), in bytes.
    #[arg(long, default_value_t = Limits::default().max_upload_bytes)]
    max_upload_bytes: usize,
    /// Provider WebSockets one IP address may hold open at once.
    #[arg(long, default_value_t = Limits::default().max_connections_per_ip)]
    max_connections_per_ip: usize,
    /// HTTP connections one IP address may hold open at once.
    #[arg(long, default_value_t = Limits::default().max_http_connections_per_ip)]
    max_http_connections_per_ip: usize,
    /// Milliseconds a client may take to send a request's headers, or pause
    /// in the middle of an upload, before it is dropped.
    #[arg(long, default_value_t = 30_000)]
    slow_client_timeout_ms: u64,
    /// Providers must present this join token to connect (kept in memory as
    /// its digest only).
    #[arg(long, env = "ROOKERY_PROVIDER_TOKEN", hide_env_values = true)]
    provider_token: Option<String>,
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
    let cli = Cli::parse();
    // Commands for people show their own progress; only `serve` narrates.
    let default_filter = match cli.command {
        Command::Serve(_) => "info,tower_http=warn",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .init();
    match cli.command {
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
        Command::Submit { job, server } => {
            let created = server.client()?.submit(&job).await?;
            for warning in &created.warnings {
                eprintln!("warning: {warning}");
            }
            println!("{}", created.id);
            Ok(())
        }
        Command::Jobs { server } => {
            for job in server.client()?.jobs().await? {
                println!("{}", rookery_server::client::describe(&job));
            }
            Ok(())
        }
        Command::Watch { id, server } => {
            let client = server.client()?;
            let job = client.watch(id).await?;
            finished(&job)?;
            print_accuracy(&client.metrics(id).await?);
            Ok(())
        }
        Command::Download { id, out, server } => {
            let bytes = server.client()?.download(id, &out).await?;
            println!("wrote {} ({bytes} bytes)", out.display());
            Ok(())
        }
        Command::Cancel { id, server } => {
            let job = server.client()?.cancel(id).await?;
            println!("{}", rookery_server::client::describe(&job));
            Ok(())
        }
        Command::Train(args) => train(args).await,
        Command::Token { action } => token(action).await,
    }
}

async fn token(action: TokenCommand) -> anyhow::Result<()> {
    match action {
        TokenCommand::Create { name, data_dir } => {
            let db = rookery_server::db::Db::open_in_dir(&data_dir)
                .with_context(|| format!("opening the data directory {}", data_dir.display()))?;
            let (requester, token) =
                rookery_server::requesters::create(&db, &name, rookery_server::now_ms()).await?;
            eprintln!(
                "Requester `{}` created. Their API token follows; it is shown only this once.",
                requester.name
            );
            println!("{}", token.secret());
            Ok(())
        }
        TokenCommand::List { data_dir } => {
            let db = rookery_server::db::Db::open_in_dir(&data_dir)
                .with_context(|| format!("opening the data directory {}", data_dir.display()))?;
            for requester in rookery_server::requesters::list(&db).await? {
                println!("{}", requester.name);
            }
            Ok(())
        }
    }
}

fn finished(job: &rookery_proto::api::JobInfo) -> anyhow::Result<()> {
    match job.status.as_str() {
        "completed" => Ok(()),
        status => anyhow::bail!(
            "job {} {status}: {}",
            job.id,
            job.detail.as_deref().unwrap_or("no reason recorded")
        ),
    }
}

fn print_accuracy(metrics: &rookery_proto::api::JobMetrics) {
    if let Some(last) = metrics.epochs.last() {
        println!(
            "test accuracy {:.2}% (loss {:.4}) on {} held-out samples",
            last.test_accuracy * 100.0,
            last.test_loss,
            last.samples
        );
    }
}

/// `rookery train`: everything on this machine, on loopback.
async fn train(args: TrainArgs) -> anyhow::Result<()> {
    if args.local_providers == 0 {
        anyhow::bail!("--local-providers must be at least 1");
    }
    let provider_bin = match args.provider_bin {
        Some(bin) => bin,
        None => std::env::current_exe()
            .context("locating this program")?
            .with_file_name("rookery-provider"),
    };
    if !provider_bin.is_file() {
        anyhow::bail!(
            "no provider binary at {} (build it with `cargo build -p rookery-provider --features torch`, or pass --provider-bin)",
            provider_bin.display()
        );
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let data_dir = tempfile::tempdir().context("creating a data directory")?;
    let state = AppState::open(data_dir.path(), Limits::default(), None).await?;
    let token = state.api_token.secret().to_string();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(rookery_server::serve(listener, state, async {
        let _ = stop_rx.await;
    }));
    println!(
        "embedded server on http://{addr}/, starting {} local providers",
        args.local_providers
    );
    // Each provider gets its share of the cores: libtorch's threads of one
    // operation wait for each other, and with more threads than cores a
    // descheduled one stalls the whole operation.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / args.local_providers).max(1).to_string();
    let mut children = Vec::new();
    for i in 0..args.local_providers {
        let child = tokio::process::Command::new(&provider_bin)
            .args([
                "--server",
                &format!("ws://{addr}"),
                "--name",
                &format!("local-{i}"),
                "--threads",
                &threads,
            ])
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            // Several libtorch processes share these cores: OpenMP threads that
            // spin while idle would steal them from the stage that computes.
            .env("OMP_WAIT_POLICY", "PASSIVE")
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", provider_bin.display()))?;
        children.push(child);
    }
    let client = Client::new(&addr.to_string(), &token);
    client
        .wait_for_providers(args.local_providers, Duration::from_secs(120))
        .await?;
    let created = client.submit(&args.job).await?;
    for warning in &created.warnings {
        eprintln!("warning: {warning}");
    }
    let job = client.watch(created.id).await?;
    finished(&job)?;
    let weights = args.out.join("weights.safetensors");
    client.download(job.id, &weights).await?;
    let metrics = client.metrics(job.id).await?;
    let metrics_path = args.out.join("metrics.json");
    std::fs::write(&metrics_path, serde_json::to_string_pretty(&metrics)?)
        .with_context(|| format!("writing {}", metrics_path.display()))?;
    print_accuracy(&metrics);
    println!("weights: {}", weights.display());
    println!("metrics: {}", metrics_path.display());
    for mut child in children {
        let _ = child.kill().await;
    }
    let _ = stop_tx.send(());
    let _ = server.await;
    Ok(())
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let heartbeat_timeout = Duration::from_millis(args.heartbeat_timeout_ms.max(100));
    let limits = Limits {
        max_frame_bytes: args.max_frame_bytes,
        heartbeat_interval: heartbeat_timeout / 4,
        heartbeat_timeout,
        max_upload_bytes: args.max_upload_bytes,
        max_connections_per_ip: args.max_connections_per_ip.max(1),
        slow_client_timeout: Duration::from_millis(args.slow_client_timeout_ms.max(100)),
        max_http_connections_per_ip: args.max_http_connections_per_ip.max(1),
    };
    let web_dir = rookery_server::http::is_dashboard(&args.web_dir).then_some(args.web_dir.clone());
    if web_dir.is_none() {
        tracing::warn!(
            dir = %args.web_dir.display(),
            "no built dashboard there; run `cargo xtask web` to build it"
        );
    }
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
    let listener = tokio::net::TcpListener::bind(args.addr)
        .await
        .with_context(|| format!("binding {}", args.addr))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    println!(
        "API token (also in {}): {}",
        rookery_server::auth::token_path(&args.data_dir).display(),
        state.api_token.secret()
    );
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
