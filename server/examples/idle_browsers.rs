//! What an idle browser provider costs the server in memory, without
//! release binaries or a training job: `cargo run -p rookery-server
//! --example idle_browsers [-- --clients N]`.
//!
//! The server runs in this process on an in-memory database; the browsers
//! (lightweight protocol clients: Hello as a tab, probe answers,
//! heartbeats) run in a child process, so their own sockets and buffers
//! are not counted. Prints this process's resident memory before the
//! browsers connect and once every one is welcomed and probed, and the
//! difference per browser (target: under 100 KiB; `cargo xtask bench load`
//! measures the same on the real binaries while a job trains).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::{SinkExt, StreamExt};
use rookery_proto::stream::{self, Incoming};
use rookery_proto::{
    DEFAULT_MAX_FRAME_BYTES, Hello, PROTOCOL_VERSION, ProviderKind, ToProvider, ToServer,
};
use rookery_server::store::Db;
use rookery_server::store::identities::IssueLimit;
use rookery_server::store::tokens::Token;
use rookery_server::{AppState, Limits};
use tokio_tungstenite::tungstenite::Message;

/// Clients opening their connection at once, so the listen backlog holds.
const CONNECT_AT_ONCE: usize = 25;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = tokio::runtime::Runtime::new()?;
    if let [mode, addr, n] = args.as_slice()
        && mode == "--client"
    {
        return runtime.block_on(clients(addr.clone(), n.parse()?));
    }
    let clients = match args.iter().position(|a| a == "--clients") {
        Some(i) => args
            .get(i + 1)
            .context("--clients takes a number")?
            .parse()?,
        None => 300,
    };
    runtime.block_on(server(clients))
}

async fn server(clients: usize) -> anyhow::Result<()> {
    let limits = Limits {
        max_connections_per_ip: clients + 10,
        identities: IssueLimit {
            per_window: u32::try_from(clients + 10)?,
        },
        ..Limits::default()
    };
    let data_dir = tempfile::tempdir()?;
    let state = AppState::new(
        Db::open_in_memory()?,
        limits,
        None,
        data_dir.path().to_path_buf(),
        Token::new("token"),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(rookery_server::serve(
        listener,
        state,
        std::future::pending(),
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = rss_kib()?;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--client", &addr.to_string(), &clients.to_string()])
        .stdout(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().context("no stdout")?;
    let ready = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line == "ready")
    })
    .await?;
    if !ready {
        bail!("the browsers never all connected");
    }
    // Probing goes on for up to half a second after the first round.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = rss_kib()?;
    let _ = child.kill();
    let _ = child.wait();
    println!(
        "server memory (VmRSS): {:.1} MiB before, {:.1} MiB with {clients} idle browsers: \
         {:.1} KiB per browser (target < 100 KiB)",
        before as f64 / 1024.0,
        after as f64 / 1024.0,
        after.saturating_sub(before) as f64 / clients as f64
    );
    Ok(())
}

/// This process's resident memory, in KiB.
fn rss_kib() -> anyhow::Result<usize> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .context("statm has no resident field")?
        .parse()?;
    Ok(pages * 4)
}

async fn clients(addr: String, n: usize) -> anyhow::Result<()> {
    let url = format!("ws://{addr}{}", rookery_proto::PROVIDER_WS_PATH);
    let ready = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    for i in 0..n {
        while i >= ready.load(Ordering::SeqCst) + CONNECT_AT_ONCE {
            if started.elapsed() > Duration::from_secs(120) {
                bail!(
                    "only {} of {n} browsers connected",
                    ready.load(Ordering::SeqCst)
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (url, ready) = (url.clone(), ready.clone());
        tokio::spawn(async move {
            if let Err(error) = browser(url, i, ready).await {
                eprintln!("browser {i}: {error:#}");
            }
        });
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
    println!("ready");
    std::future::pending::<()>().await;
    Ok(())
}

/// One tab: Hello, answers to the probes, heartbeats at the asked interval.
async fn browser(url: String, i: usize, ready: Arc<AtomicUsize>) -> anyhow::Result<()> {
    let (socket, _) = tokio_tungstenite::connect_async(url.as_str()).await?;
    let (mut sink, mut stream) = socket.split();
    let hello = ToServer::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        kind: ProviderKind::Browser,
        device: "WebGPU (simulated)".into(),
        memory_bytes: 4 << 30,
        gflops: 0.01,
        display_name: format!("browser-{i}"),
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
            _ = tick => {
                let beat = rookery_proto::encode(&ToServer::Heartbeat { seq })?;
                sink.send(Message::Binary(beat.into())).await?;
                seq += 1;
            }
            frame = stream.next() => {
                let bytes = match frame {
                    Some(Ok(Message::Binary(bytes))) => bytes,
                    Some(Ok(Message::Close(reason))) => bail!("closed by the server: {reason:?}"),
                    Some(Ok(_)) => continue,
                    Some(Err(error)) => bail!("{error}"),
                    None => bail!("connection lost"),
                };
                let Incoming::Message(message) =
                    stream::read_frame::<ToProvider>(&bytes, DEFAULT_MAX_FRAME_BYTES)?
                else {
                    continue;
                };
                match message {
                    ToProvider::Welcome { heartbeat_interval_ms, .. } => {
                        let every = Duration::from_millis(u64::from(heartbeat_interval_ms.max(10)));
                        ticker = Some(tokio::time::interval(every));
                    }
                    ToProvider::Probe { seq, .. } => {
                        let ack = rookery_proto::encode(&ToServer::ProbeAck { seq })?;
                        sink.send(Message::Binary(ack.into())).await?;
                        probes += 1;
                        if probes == 2 {
                            ready.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}
