//! `rookery-provider`: donate this machine's CPU or GPU to a Rookery server.

use anyhow::Context;
use clap::Parser;
use rookery_proto::Hello;
use rookery_provider::compute::{self, DeviceChoice};
use rookery_provider::connection;
use rookery_provider::identity::CredentialFile;
#[cfg(any(feature = "torch", feature = "wgpu"))]
use rookery_provider::trainer::StageTrainer;
use rookery_provider::trainer::Trainer;
use rookery_stage::session::SessionPolicy;
#[cfg(any(feature = "torch", feature = "wgpu"))]
use rookery_stage::worker::BackendFactory;

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
    /// Where to keep the credential the server issues this provider, so its
    /// record (faults, bans, credit) follows it across restarts (default: a
    /// file per server and name under ~/.local/state/rookery/credentials).
    #[arg(
        long,
        env = "ROOKERY_IDENTITY_FILE",
        conflicts_with = "ephemeral_identity"
    )]
    identity_file: Option<std::path::PathBuf>,
    /// Keep the credential in memory only: a new identity every start.
    #[arg(long)]
    ephemeral_identity: bool,
    /// Vouch for this provider with a Requester's API token (as `rookery
    /// serve` or `rookery token create` printed it): the server then trusts
    /// it to re-run spot checks of that Requester's jobs, or of every job
    /// with the operator's token.
    #[arg(long, env = "ROOKERY_REQUESTER_TOKEN", hide_env_values = true)]
    requester_token: Option<String>,
    /// The name to show on the server's public leaderboard for this
    /// provider's credit (default: anonymous).
    #[arg(long, env = "ROOKERY_DONOR_NAME")]
    donor_name: Option<String>,
    /// A team to count this provider's credit toward on the leaderboard.
    #[arg(long, env = "ROOKERY_TEAM", requires = "donor_name")]
    team: Option<String>,
    /// The most memory the server may plan stages into on this machine, in
    /// MiB (default: all the memory the device has).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    max_memory_mib: Option<u64>,
    /// What runs the stages: libtorch (CPU or CUDA, see --device), or our own
    /// WGSL kernels on any GPU through wgpu (Vulkan, Metal, DX12), so AMD,
    /// Intel and Apple GPUs can donate without CUDA.
    #[arg(long, value_enum, default_value = "torch")]
    backend: BackendChoice,
    /// CPU threads for each libtorch operation (default: one per core).
    /// Several providers sharing one machine should split its cores: two
    /// threads of one operation wait for each other, so one of them
    /// descheduled by a neighbour stalls both (`rookery train` splits them).
    #[arg(long, env = "ROOKERY_THREADS", value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
    /// Keep the device working at most this share of the time, in percent
    /// (10 to 100): after each piece of work the provider rests in
    /// proportion, and the server plans it at that share of its speed.
    #[arg(long, env = "ROOKERY_GPU_CAP", default_value_t = 100,
          value_parser = clap::value_parser!(u32).range(i64::from(rookery_stage::duty::MIN_CAP_PERCENT)..=100))]
    gpu_cap: u32,
    /// Run as a batch process (Linux's `SCHED_BATCH`; no privilege needed):
    /// a thread of it that wakes does not preempt whatever runs. For
    /// providers that share cores with each other, as `rookery train`'s
    /// local ones do: with small micro-batches each wakes for a message
    /// every few hundred microseconds, and each wake interrupted another
    /// stage's computation. Not for a provider among other people's
    /// processes: under load its wake-ups wait, and the server's straggler
    /// check reads the longer compute time as a slow machine.
    #[arg(long)]
    batch_scheduling: bool,
    /// Test only: misbehave in this one way (see `rookery_provider::fault`).
    #[cfg(feature = "fault-injection")]
    #[arg(long, value_enum, hide = true)]
    fault: Option<rookery_provider::fault::Fault>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackendChoice {
    Torch,
    Wgpu,
}

/// Errors print as one readable chain (`error: a: b`), never as a backtrace.
fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if cli.batch_scheduling
        && let Err(error) = run_as_batch_process()
    {
        eprintln!("warning: keeping the normal scheduling policy: {error}");
    }
    if let Some(threads) = cli.threads {
        limit_cpu_threads(threads);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// libtorch sizes its OpenMP and MKL thread pools from these variables when
/// it first computes; `tch::set_num_threads` would reach only the thread
/// that calls it, not the training thread.
fn limit_cpu_threads(threads: u16) {
    let threads = threads.to_string();
    #[allow(unsafe_code)]
    // SAFETY: no other thread exists yet (the runtime starts after this), so
    // nothing reads the environment while it changes.
    unsafe {
        std::env::set_var("OMP_NUM_THREADS", &threads);
        std::env::set_var("MKL_NUM_THREADS", &threads);
    }
}

/// Makes the calling thread, and so every thread and process it starts
/// later, a batch one (`--batch-scheduling`). On the MNIST CNN in 3 stages
/// on 2 cores (`rookery train`), 16 micro-batches of 4 took about 8% less
/// time a step and 4 of 16 about 3% less; a batch policy on the trainer
/// thread alone gained nothing, and on the socket threads alone about half.
fn run_as_batch_process() -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        #[allow(unsafe_code)]
        // SAFETY: pid 0 is the calling thread (the only one so far); the
        // parameter is a valid value on the stack; nothing of ours is touched.
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "batch scheduling is Linux's",
    ))
}

/// A stage allocates and frees dozens of tensors and hundreds of small
/// objects every micro-batch, in libtorch and here. glibc's malloc spent
/// about 54 us of every stage-micro-batch on them (`malloc_consolidate`,
/// `_int_memalign`, measured with perf on the MNIST CNN at 4 samples a
/// micro-batch), a fifth of what a small micro-batch costs beyond its
/// arithmetic. mimalloc keeps per-thread free lists and freed pages for
/// reuse, so it also keeps the working set a step frees and allocates
/// again. `override` makes it the process's `malloc` as well, so libtorch's
/// C++ allocations (which never see Rust's global allocator) use it too; a
/// test below checks that a tensor's storage comes from it.
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

async fn run(cli: Cli) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    #[cfg(feature = "fault-injection")]
    if let Some(fault) = cli.fault {
        tracing::warn!(
            ?fault,
            "fault injection: this provider will send wrong data"
        );
        rookery_provider::fault::set(fault);
    }

    let name = cli.name.unwrap_or_else(default_name);
    let (mut hello, make_trainer) = match cli.backend {
        BackendChoice::Torch => {
            let device = compute::select(cli.device).context("choosing a compute device")?;
            let profile = tokio::task::spawn_blocking(move || device.profile())
                .await
                .context("the benchmark thread failed")?
                .context("measuring this machine")?;
            let hello = SessionPolicy::NATIVE.hello(name, profile);
            (hello, trainer_factory(cli.device)?)
        }
        BackendChoice::Wgpu => wgpu_provider(name).await?,
    };
    if let Some(mib) = cli.max_memory_mib {
        hello.memory_bytes = hello.memory_bytes.min(mib.saturating_mul(1 << 20));
    }
    hello.duty_cycle = rookery_stage::duty::duty_cycle_of_percent(cli.gpu_cap);
    let make_trainer: MakeTrainer = if hello.duty_cycle < 1.0 {
        let duty_cycle = hello.duty_cycle;
        println!(
            "keeping the device busy at most {}% of the time",
            cli.gpu_cap
        );
        Box::new(move || -> Box<dyn Trainer> {
            Box::new(rookery_provider::trainer::Paced::new(
                make_trainer(),
                duty_cycle,
            ))
        })
    } else {
        make_trainer
    };
    println!(
        "{}: {} with {:.1} GiB, {:.1} GFLOP/s measured",
        hello.display_name,
        hello.device,
        hello.memory_bytes as f64 / f64::from(1u32 << 30),
        hello.gflops
    );

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutting down");
        let _ = stop_tx.send(true);
    });
    let url = rookery_stage::session::provider_url(&cli.server);
    let credentials = match (cli.identity_file, cli.ephemeral_identity) {
        (Some(path), _) => CredentialFile::at(path),
        (None, true) => CredentialFile::ephemeral(),
        (None, false) => CredentialFile::default_for(&url, &hello.display_name),
    };
    hello.credential = credentials.load()?;
    hello.requester_token = cli.requester_token;
    hello.donor = cli.donor_name.map(|name| rookery_proto::DonorCard {
        name,
        team: cli.team,
    });
    #[cfg(feature = "fault-injection")]
    if rookery_provider::fault::current() == Some(rookery_provider::fault::Fault::Claim) {
        hello.gflops *= rookery_provider::fault::CLAIM_FACTOR;
    }
    tracing::info!(%url, credential = ?credentials.path(), known = hello.credential.is_some(), "connecting");
    connection::run(
        &url,
        cli.token.as_deref(),
        hello,
        &credentials,
        stop_rx,
        make_trainer,
    )
    .await
    .map_err(|reason| anyhow::anyhow!("the server refused this provider: {reason}"))?;
    println!("rookery-provider stopped");
    Ok(())
}

/// Makes each session's trainer.
type MakeTrainer = Box<dyn Fn() -> Box<dyn Trainer> + Send + Sync>;

/// libtorch stages on the chosen device, or, in a build without libtorch,
/// a trainer that refuses every job with the reason.
#[cfg(feature = "torch")]
fn trainer_factory(choice: DeviceChoice) -> anyhow::Result<MakeTrainer> {
    let device = compute::torch::TorchCompute::new(choice)
        .context("choosing the training device")?
        .device();
    Ok(Box::new(move || {
        let stages = rookery_torch::TorchStageFactory::new(device);
        Box::new(StageTrainer::new(with_faults(stages))) as Box<dyn Trainer>
    }))
}

#[cfg(not(feature = "torch"))]
fn trainer_factory(_choice: DeviceChoice) -> anyhow::Result<MakeTrainer> {
    Ok(Box::new(|| {
        Box::new(rookery_provider::trainer::NoTorch) as Box<dyn Trainer>
    }))
}

/// Opens the best GPU adapter wgpu finds, measures it with our own matmul
/// kernel, and trains with our own executor on it.
#[cfg(feature = "wgpu")]
async fn wgpu_provider(name: String) -> anyhow::Result<(Hello, MakeTrainer)> {
    use std::sync::Arc;

    use rookery_stage::session::DeviceOffer;
    use rookery_stage::{GpuDevice, OwnFactory};

    let device = GpuDevice::open()
        .await
        .context("opening a GPU through wgpu (install a Vulkan, Metal or DX12 driver)")?;
    let context = device.context();
    let gflops = context
        .benchmark_gflops(0.3)
        .await
        .context("measuring the GPU")?;
    let offer = DeviceOffer {
        device: context.adapter_description(),
        // wgpu does not say how much memory a GPU has; the host's is the
        // bound for integrated and software adapters, and buffer limits
        // bound each tensor.
        memory_bytes: compute::host_memory_bytes(),
        gflops,
        max_buffer_bytes: Some(
            context
                .max_storage_buffer_binding_size()
                .min(context.max_buffer_size()),
        ),
    };
    let hello = SessionPolicy::NATIVE.hello(name, offer);
    let device = Arc::new(device);
    Ok((
        hello,
        Box::new(move || {
            let stages = OwnFactory::new(device.clone());
            Box::new(StageTrainer::new(with_faults(stages))) as Box<dyn Trainer>
        }),
    ))
}

#[cfg(not(feature = "wgpu"))]
async fn wgpu_provider(_name: String) -> anyhow::Result<(Hello, MakeTrainer)> {
    anyhow::bail!(
        "this build has no wgpu backend (rebuild rookery-provider with `--features wgpu`)"
    )
}

/// Stages that misbehave as `--fault` asks (in fault-injection builds).
#[cfg(all(feature = "fault-injection", any(feature = "torch", feature = "wgpu")))]
fn with_faults<F: BackendFactory>(stages: F) -> rookery_provider::fault::SlowedStages<F> {
    rookery_provider::fault::SlowedStages(stages)
}

#[cfg(all(
    not(feature = "fault-injection"),
    any(feature = "torch", feature = "wgpu")
))]
fn with_faults<F: BackendFactory>(stages: F) -> F {
    stages
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

#[cfg(all(test, target_os = "linux"))]
mod tests {
    /// libtorch allocates through C's `malloc`, which Rust's
    /// `#[global_allocator]` never reaches: only mimalloc's `override`
    /// brings its tensors (small and large) to mimalloc. Fails where the
    /// linker keeps libtorch on glibc's malloc.
    #[cfg(feature = "torch")]
    #[test]
    fn libtorch_tensors_are_allocated_by_mimalloc() {
        for numel in [16_i64, 1 << 20, 16 << 20] {
            let t = tch::Tensor::zeros([numel], (tch::Kind::Float, tch::Device::Cpu));
            #[allow(unsafe_code)]
            // SAFETY: a query about an address; nothing is read through it.
            let ours = unsafe { libmimalloc_sys::mi_is_in_heap_region(t.data_ptr()) };
            assert!(ours, "a tensor of {numel} floats is not in mimalloc's heap");
        }
    }

    /// `--batch-scheduling` reaches every thread the provider starts after
    /// it (the runtime's, the trainer's, libtorch's).
    #[test]
    fn threads_started_after_batch_scheduling_are_batch_threads() {
        let policy = || {
            #[allow(unsafe_code)]
            // SAFETY: a query about the calling thread.
            unsafe {
                libc::sched_getscheduler(0)
            }
        };
        let before = std::thread::spawn(policy).join().unwrap();
        assert_eq!(before, libc::SCHED_OTHER);
        std::thread::spawn(move || {
            super::run_as_batch_process().unwrap();
            assert_eq!(policy(), libc::SCHED_BATCH);
            let started_later = std::thread::spawn(policy).join().unwrap();
            assert_eq!(started_later, libc::SCHED_BATCH);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn rust_allocations_come_from_mimalloc() {
        let v = vec![0_u8; 1 << 20];
        #[allow(unsafe_code)]
        // SAFETY: as above.
        let ours = unsafe { libmimalloc_sys::mi_is_in_heap_region(v.as_ptr().cast()) };
        assert!(ours);
    }
}
