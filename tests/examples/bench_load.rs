//! `cargo xtask bench load`: one server carrying a real training job while
//! 500 simulated browser providers stay connected and heartbeat, against the
//! same job on the same server with no extra connections (target: samples/s
//! ratio >= 0.9). Prints the server's memory (target: under 100 KiB per
//! idle browser), the heartbeat round trip (p50, p99) and the ratio.
//!
//! The job is real: `rookery serve` with three `rookery-provider` processes
//! (libtorch, one cluster of three stages) training the MNIST CNN of the
//! demo. The 500 browsers are lightweight protocol clients in this process,
//! one real loopback WebSocket each: they say Hello as a browser tab would
//! (kind `browser`, measuring a slow GPU, so the planner keeps the job on the
//! three libtorch trainers), answer the
//! server's link probe, and heartbeat at the interval the server's Welcome
//! asks for. The server answers each heartbeat with the same `seq` (after
//! recording it in SQLite), so a client's round trip is the time from
//! sending `Heartbeat { seq }` to reading it back.
//!
//! Runs: alone, with the 500 connected, alone again; the ratio is the loaded
//! run against the mean of the two lone runs, so a drift of the shared
//! machine during the benchmark does not land on one side only.
//! `--clients N` and `--steps N` change the defaults.
//!
//! Needs release binaries (`ROOKERY_BIN_DIR`, set by xtask).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::{SinkExt, StreamExt};
use rookery_e2e::{Process, Server, rookery, start_native_provider};
use rookery_proto::api::{JobInfo, JobMetrics};
use rookery_proto::stream::{self, Incoming};
use rookery_proto::{
    DEFAULT_MAX_FRAME_BYTES, Hello, PROTOCOL_VERSION, ProviderKind, ToProvider, ToServer,
};
use rookery_test_support::job::{job_text, write_mnist_digits};
use rookery_test_support::workspace_root;
use tokio::sync::{Mutex, watch};
use tokio_tungstenite::tungstenite::Message;

const BATCH: usize = 64;
/// Steps left out of each timing: the first allocations and page faults.
const WARMUP: usize = 5;
/// Clients opening their connection at once; the rest wait their turn.
const CONNECT_AT_ONCE: usize = 25;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let clients = flag(&args, "--clients")?.unwrap_or(500);
    // The demo's MNIST subset has 8,000 training digits: 125 steps of 64.
    let steps = flag(&args, "--steps")?.unwrap_or(120);
    let dir = tempfile::tempdir()?;
    let job = write_job(dir.path(), steps)?;
    let limit = (clients + 100).to_string();
    let server = Server::start_with(
        4000,
        &[
            "--max-connections-per-ip",
            &limit,
            "--max-http-connections-per-ip",
            &limit,
            // Every simulated browser is a new identity from loopback.
            "--new-identities-per-hour",
            &limit,
        ],
    )?;
    let _providers: Vec<Process> = (0..3)
        .map(|i| start_native_provider(&server, &format!("trainer-{i}")))
        .collect::<anyhow::Result<_>>()?;
    server
        .wait_for_providers("the three trainers", Duration::from_secs(120), |all| {
            all.iter().filter(|p| p.bandwidth_mbps.is_some()).count() == 3
        })
        .await?;
    let token = server.api_token()?;
    println!(
        "job: examples/mnist-cnn.toml on MNIST, 1 cluster x 3 stages (3 rookery-provider \
         processes), batch {BATCH}, 4 micro-batches, {steps} steps ({WARMUP} warm-up)"
    );

    let rss_idle = rss_kib(server.pid())?;
    let alone_1 = train(&server, &token, &job).await?;
    println!("alone:                   {alone_1:>8.1} samples/s");

    // After a job has run: what training keeps is not the browsers'.
    let rss_trained = rss_kib(server.pid())?;
    let swarm = Swarm::connect(&server, clients).await?;
    let rss_connected = rss_kib(server.pid())?;
    swarm.recording.store(true, Ordering::SeqCst);
    let peak = Arc::new(AtomicUsize::new(rss_connected));
    let sampler = {
        let (pid, peak) = (server.pid(), peak.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(kib) = rss_kib(pid) {
                    peak.fetch_max(kib, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let loaded = train(&server, &token, &job).await?;
    sampler.abort();
    swarm.recording.store(false, Ordering::SeqCst);
    println!("with {clients} browsers:      {loaded:>8.1} samples/s");
    let mut rtts = std::mem::take(&mut *swarm.rtts_ms.lock().await);
    let still = swarm.connected.load(Ordering::SeqCst);
    swarm.stop().await;

    let alone_2 = train(&server, &token, &job).await?;
    println!("alone again:             {alone_2:>8.1} samples/s");

    rtts.sort_by(f64::total_cmp);
    let pct = |p: f64| rtts[((rtts.len() - 1) as f64 * p).round() as usize];
    if rtts.is_empty() {
        bail!("no heartbeat came back while the job trained");
    }
    let mib = |kib: usize| kib as f64 / 1024.0;
    println!(
        "server memory (VmRSS): {:.1} MiB idle with 3 trainers, {:.1} MiB after a job, {:.1} MiB \
         with {clients} browsers connected, {:.1} MiB peak while training with them ({:.1} KiB \
         per browser, target < 100 KiB)",
        mib(rss_idle),
        mib(rss_trained),
        mib(rss_connected),
        mib(peak.load(Ordering::SeqCst)),
        (rss_connected.saturating_sub(rss_trained)) as f64 / clients as f64
    );
    println!(
        "heartbeat round trip while training: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms \
         ({} heartbeats; {still} of {clients} browsers still connected at the end)",
        pct(0.5),
        pct(0.99),
        rtts[rtts.len() - 1],
        rtts.len()
    );
    let baseline = (alone_1 + alone_2) / 2.0;
    println!(
        "ratio with {clients} browsers / alone: {:.3} (target >= 0.9)",
        loaded / baseline
    );
    if still < clients {
        bail!("{} browsers were dropped", clients - still);
    }
    Ok(())
}

fn flag(args: &[String], name: &str) -> anyhow::Result<Option<usize>> {
    match args.iter().position(|a| a == name) {
        None => Ok(None),
        Some(i) => Ok(Some(
            args.get(i + 1)
                .with_context(|| format!("{name} takes a number"))?
                .parse()
                .with_context(|| format!("{name} takes a number"))?,
        )),
    }
}

/// The server process's resident memory, in KiB.
fn rss_kib(pid: u32) -> anyhow::Result<usize> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS in /proc/PID/status")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("VmRSS has no value")?
        .parse()?)
}

/// Submits the job, waits for it to complete, and returns its samples/s over
/// the steps after the warm-up (samples over the steps' wall time).
async fn train(server: &Server, token: &str, job: &Path) -> anyhow::Result<f64> {
    let url = server.http_url("");
    let (ok, id, stderr) = rookery(&[
        "submit",
        &job.display().to_string(),
        "--server",
        &url,
        "--token",
        token,
    ])?;
    if !ok {
        bail!("rookery submit failed: {stderr}");
    }
    let id = id.trim().to_string();
    let http = reqwest::Client::new();
    let get = |path: String| http.get(server.http_url(&path)).bearer_auth(token).send();
    let started = Instant::now();
    loop {
        let info: JobInfo = get(format!("/api/jobs/{id}"))
            .await?
            .error_for_status()?
            .json()
            .await?;
        match info.status.as_str() {
            "completed" => break,
            "failed" | "cancelled" => bail!("job {id} {}: {:?}", info.status, info.detail),
            _ if started.elapsed() > Duration::from_secs(600) => {
                bail!("job {id} is still {}", info.status)
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let metrics: JobMetrics = get(format!("/api/jobs/{id}/metrics"))
        .await?
        .error_for_status()?
        .json()
        .await?;
    let timed = metrics
        .steps
        .get(WARMUP..)
        .context("fewer steps than the warm-up")?;
    let ms: f64 = timed.iter().map(|s| s.elapsed_ms).sum();
    Ok((timed.len() * BATCH) as f64 / (ms / 1e3))
}

/// The simulated browsers.
struct Swarm {
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Round trips recorded while `recording` holds.
    rtts_ms: Arc<Mutex<Vec<f64>>>,
    recording: Arc<AtomicBool>,
    /// Clients whose connection is open.
    connected: Arc<AtomicUsize>,
}

impl Swarm {
    /// Opens `n` connections and returns once every one is welcomed and
    /// measured by the server's probe.
    async fn connect(server: &Server, n: usize) -> anyhow::Result<Self> {
        let url = format!("ws://{}{}", server.addr, rookery_proto::PROVIDER_WS_PATH);
        let (stop, stopped) = watch::channel(false);
        let swarm_rtts = Arc::new(Mutex::new(Vec::new()));
        let recording = Arc::new(AtomicBool::new(false));
        let connected = Arc::new(AtomicUsize::new(0));
        let ready = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::with_capacity(n);
        let started = Instant::now();
        for i in 0..n {
            // Open in waves so the listen backlog never overflows.
            while i >= ready.load(Ordering::SeqCst) + CONNECT_AT_ONCE {
                if started.elapsed() > Duration::from_secs(120) {
                    bail!(
                        "only {} of {n} browsers connected",
                        ready.load(Ordering::SeqCst)
                    );
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let browser = Browser {
                url: url.clone(),
                name: format!("browser-{i}"),
                rtts_ms: swarm_rtts.clone(),
                recording: recording.clone(),
                connected: connected.clone(),
                ready: ready.clone(),
            };
            let stopped = stopped.clone();
            tasks.push(tokio::spawn(async move {
                if let Err(error) = browser.run(stopped).await {
                    eprintln!("a browser client failed: {error:#}");
                }
            }));
        }
        while ready.load(Ordering::SeqCst) < n {
            if started.elapsed() > Duration::from_secs(120) {
                bail!(
                    "only {} of {n} browsers connected",
                    ready.load(Ordering::SeqCst)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!(
            "{n} browsers connected and probed in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        Ok(Self {
            stop,
            tasks,
            rtts_ms: swarm_rtts,
            recording,
            connected,
        })
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

struct Browser {
    url: String,
    name: String,
    rtts_ms: Arc<Mutex<Vec<f64>>>,
    recording: Arc<AtomicBool>,
    connected: Arc<AtomicUsize>,
    /// Counts clients that are welcomed and have answered both probes.
    ready: Arc<AtomicUsize>,
}

impl Browser {
    async fn run(self, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
        let (socket, _) = tokio_tungstenite::connect_async(self.url.as_str()).await?;
        self.connected.fetch_add(1, Ordering::SeqCst);
        let result = self.session(socket, &mut stop).await;
        self.connected.fetch_sub(1, Ordering::SeqCst);
        result
    }

    async fn session<S>(
        &self,
        socket: tokio_tungstenite::WebSocketStream<S>,
        stop: &mut watch::Receiver<bool>,
    ) -> anyhow::Result<()>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let (mut sink, mut stream) = socket.split();
        let hello = ToServer::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            kind: ProviderKind::Browser,
            device: "WebGPU (simulated)".into(),
            memory_bytes: 4 << 30,
            // A slow tab: browsers are plannable now, and the bench measures
            // what their connections cost the server, not their compute, so
            // the planner must keep the job on the three libtorch trainers.
            gflops: 0.01,
            display_name: self.name.clone(),
            max_buffer_bytes: Some(128 << 20),
            credential: None,
            requester_token: None,
            donor: None,
            duty_cycle: 1.0,
        });
        sink.send(Message::Binary(rookery_proto::encode(&hello)?.into()))
            .await?;
        let mut ticker: Option<tokio::time::Interval> = None;
        let mut seq = 0u64;
        // (seq, sent) of heartbeats not answered yet, oldest first.
        let mut pending: std::collections::VecDeque<(u64, Instant)> = Default::default();
        let mut probes = 0;
        loop {
            let tick = async {
                match ticker.as_mut() {
                    Some(t) => {
                        t.tick().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = stop.changed() => {
                    let _ = sink.send(Message::Close(None)).await;
                    return Ok(());
                }
                _ = tick => {
                    pending.push_back((seq, Instant::now()));
                    sink.send(Message::Binary(rookery_proto::encode(&ToServer::Heartbeat { seq })?.into())).await?;
                    seq += 1;
                }
                frame = stream.next() => {
                    let bytes = match frame {
                        Some(Ok(Message::Binary(bytes))) => bytes,
                        Some(Ok(Message::Close(reason))) => bail!("{} closed by the server: {reason:?}", self.name),
                        Some(Ok(_)) => continue,
                        Some(Err(error)) => bail!("{}: {error}", self.name),
                        None => bail!("{}: connection lost", self.name),
                    };
                    let message = match stream::read_frame::<ToProvider>(&bytes, DEFAULT_MAX_FRAME_BYTES)? {
                        Incoming::Message(message) => message,
                        Incoming::Payload(_) => continue,
                    };
                    match message {
                        ToProvider::Welcome { heartbeat_interval_ms, .. } => {
                            let interval = Duration::from_millis(u64::from(heartbeat_interval_ms.max(10)));
                            // Spread the first beats over one interval, as tabs
                            // opened at different times would be.
                            let offset = interval.mul_f64(rand_fraction(&self.name));
                            ticker = Some(tokio::time::interval_at(tokio::time::Instant::now() + offset, interval));
                        }
                        ToProvider::Probe { seq, .. } => {
                            sink.send(Message::Binary(rookery_proto::encode(&ToServer::ProbeAck { seq })?.into())).await?;
                            probes += 1;
                            if probes == 2 {
                                self.ready.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                        ToProvider::Heartbeat { seq } => {
                            while let Some(&(s, sent)) = pending.front() {
                                if s > seq {
                                    break;
                                }
                                pending.pop_front();
                                if s == seq && self.recording.load(Ordering::SeqCst) {
                                    self.rtts_ms.lock().await.push(sent.elapsed().as_secs_f64() * 1e3);
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}

/// A fixed fraction in [0, 1) from a name (FNV-1a), for spreading beats.
fn rand_fraction(name: &str) -> f64 {
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (hash >> 11) as f64 / (1u64 << 53) as f64
}

/// The demo's model on the first `steps * BATCH` MNIST digits, as npy files
/// beside a job file.
fn write_job(dir: &Path, steps: usize) -> anyhow::Result<PathBuf> {
    write_mnist_digits(dir, steps * BATCH)?;
    let path = dir.join("job.toml");
    let spec = workspace_root().join("examples/mnist-cnn.toml");
    let training = format!(
        "epochs = 1\nbatch_size = {BATCH}\nmicro_batches = 4\n\
         optimizer = {{ name = \"adam\", lr = 0.001 }}\nclusters = 1\nstages = 3\nseed = 1"
    );
    std::fs::write(&path, job_text(&spec, &[1, 28, 28], "", None, &training))?;
    Ok(path)
}
