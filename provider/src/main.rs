//! `rookery-provider`: donate this machine's CPU or GPU to a Rookery server.

use anyhow::Context;
use clap::Parser;
use rookery_proto::{Hello, PROTOCOL_VERSION, ProviderKind};
use rookery_provider::backend::{self, DeviceChoice};
use rookery_provider::connection;

#[derive(Parser, Debug)]
#[command(
    name = "rookery-provider",
    version,
    about = "Donate this machine to a Rookery server"
)]
struct Cli {
    /// The server, e.g. ws://127.0.0.1:8080 (http:// works too).
    #[arg(long, env = "ROOKERY_SERVER", default_value = "ws://127.0.0.1:8080")]
    server: String,
    /// Device to compute on; `auto` picks CUDA when libtorch sees a GPU.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceChoice,
    /// A name shown on the dashboard (default: host name and process id).
    #[arg(long)]
    name: Option<String>,
    /// The server's join token, if it requires one (`rookery serve --provider-token`).
    #[arg(long, env = "ROOKERY_PROVIDER_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Test only: misbehave in this one way (see `rookery_provider::fault`).
    #[cfg(feature = "fault-injection")]
    #[arg(long, value_enum, hide = true)]
    fault: Option<rookery_provider::fault::Fault>,
}

/// Errors print as one readable chain (`error: a: b`), never as a backtrace.
fn main() -> std::process::ExitCode {
    keep_freed_memory();
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

/// A stage allocates and frees tensors of megabytes every micro-batch.
/// glibc hands blocks that large straight back to the kernel, so every step
/// paid for page faults and zeroing again: about 15% of a CNN stage's CPU
/// time, measured with perf. A provider keeps its working set for the whole
/// job, so it keeps freed memory for reuse instead (as PyTorch's CPU
/// training guides advise with jemalloc or tcmalloc).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: mallopt only changes allocator parameters; it runs before any
    // other thread exists, so no allocation races with it.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

async fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let cli = Cli::parse();
    #[cfg(feature = "fault-injection")]
    if let Some(fault) = cli.fault {
        tracing::warn!(
            ?fault,
            "fault injection: this provider will send wrong data"
        );
        rookery_provider::fault::set(fault);
    }

    let backend = backend::select(cli.device).context("choosing a compute backend")?;
    let profile = tokio::task::spawn_blocking(move || backend.profile())
        .await
        .context("the benchmark thread failed")?
        .context("measuring this machine")?;
    let name = cli.name.unwrap_or_else(default_name);
    println!(
        "{name}: {} with {:.1} GiB, {:.1} GFLOP/s measured",
        profile.device,
        profile.memory_bytes as f64 / f64::from(1u32 << 30),
        profile.gflops
    );
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        kind: ProviderKind::Native,
        device: profile.device,
        memory_bytes: profile.memory_bytes,
        gflops: profile.gflops,
        display_name: name,
    };

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutting down");
        let _ = stop_tx.send(true);
    });
    let make_trainer = trainer_factory(cli.device)?;
    let url = connection::provider_url(&cli.server);
    tracing::info!(%url, "connecting");
    connection::run(&url, cli.token.as_deref(), &hello, stop_rx, make_trainer)
        .await
        .map_err(|reason| anyhow::anyhow!("the server refused this provider: {reason}"))?;
    println!("rookery-provider stopped");
    Ok(())
}

/// Builds each session's trainer: libtorch stages on the chosen device, or,
/// in a build without libtorch, one that refuses every job with the reason.
#[cfg(feature = "torch")]
fn trainer_factory(
    choice: DeviceChoice,
) -> anyhow::Result<impl Fn() -> Box<dyn rookery_provider::trainer::Trainer>> {
    let device = backend::torch::TorchBackend::new(choice)
        .context("choosing the training device")?
        .device();
    Ok(move || {
        Box::new(rookery_provider::worker::StageWorker::new(device))
            as Box<dyn rookery_provider::trainer::Trainer>
    })
}

#[cfg(not(feature = "torch"))]
fn trainer_factory(
    _choice: DeviceChoice,
) -> anyhow::Result<impl Fn() -> Box<dyn rookery_provider::trainer::Trainer>> {
    Ok(|| {
        Box::new(rookery_provider::trainer::NoTorch) as Box<dyn rookery_provider::trainer::Trainer>
    })
}

fn default_name() -> String {
    let host = sysinfo::System::host_name().unwrap_or_else(|_| "provider".into());
    format!("{host}-{}", std::process::id())
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = terminate.recv() => {}
            },
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
