//! `rookery train`: everything on this machine, on loopback: an embedded
//! server, N local `rookery-provider` processes, one job; the trained
//! weights and the metrics are written to a folder.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use super::client::Client;
use super::remote::{finished, print_accuracy};
use crate::state::{AppState, Limits};

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    pub job: PathBuf,
    /// How many local `rookery-provider` processes to start.
    #[arg(long, default_value_t = 3)]
    pub local_providers: usize,
    /// Where weights.safetensors (and, with several clusters, each one's own
    /// weights-cluster-N.safetensors) and metrics.json go.
    #[arg(long, default_value = "rookery-out")]
    pub out: PathBuf,
    /// The provider binary (default: `rookery-provider` beside this program).
    #[arg(long, env = "ROOKERY_PROVIDER_BIN")]
    pub provider_bin: Option<PathBuf>,
    #[command(flatten)]
    pub frames: super::serve::FrameLimitArg,
    #[cfg(feature = "bench-latency")]
    #[command(flatten)]
    pub bench: super::serve::BenchArgs,
}

/// `rookery train`: everything on this machine, on loopback.
pub async fn run(args: TrainArgs) -> anyhow::Result<()> {
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
    #[allow(unused_mut)] // Benchmarks' builds set more.
    let mut limits = Limits {
        max_frame_bytes: args.frames.max_frame_bytes,
        // The embedded server takes only this machine's own job files: a
        // model of any size (GPT-2 small exports to 650 MB) is uploaded whole.
        max_upload_bytes: usize::MAX,
        max_queued_upload_bytes: u64::MAX,
        ..Limits::default()
    };
    #[cfg(feature = "bench-latency")]
    args.bench.apply(&mut limits);
    let state = AppState::open(data_dir.path(), limits, None).await?;
    let token = state.api_token.secret().to_string();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(crate::serve(listener, state, async {
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
                // The embedded server lives as long as this run.
                "--ephemeral-identity",
                // All of them share this machine's cores: one waking for a
                // message must not preempt another's computation.
                "--batch-scheduling",
            ])
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            // Several libtorch processes share these cores: OpenMP threads that
            // spin while idle would steal them from the stage that computes.
            .env("OMP_WAIT_POLICY", "PASSIVE")
            // This machine's own providers: trusted to verify spot checks
            // (in the environment, not on a command line others can read).
            .env("ROOKERY_REQUESTER_TOKEN", &token)
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
    client.download(job.id, None, &weights).await?;
    // Each cluster's own too, where several trained.
    let clusters = job.plan.as_ref().map_or(0, |p| p.clusters.len());
    if clusters > 1 {
        for c in 0..clusters {
            let own = args.out.join(format!("weights-cluster-{c}.safetensors"));
            client.download(job.id, Some(c), &own).await?;
        }
    }
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
