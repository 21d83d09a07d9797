//! Part of `cargo xtask bench kernels`: how long a visitor waits from opening
//! the Donate page to their tab's first micro-batch done, measured with the
//! real parts: `rookery serve`, two libtorch providers, and headless Chromium
//! (WebGPU on SwiftShader) on the Donate page.
//!
//! Printed in three parts: page load to connected (downloading and compiling
//! the wasm, finding the adapter, checking and timing the matmul kernel, the
//! WebSocket handshake and link probe), a job's submission to the tab's
//! first micro-batch done (planning, the stage's assignment and build,
//! compiling its kernels, the first forward and backward), and their sum.

use std::time::{Duration, Instant};

use anyhow::bail;
use fantoccini::Locator;
use rookery_e2e::{Browser, Server, start_native_provider};
use rookery_server::cli::client::Client;
use rookery_test_support::{Classes, dense_mlp};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let job_file = write_job(dir.path())?;
    let server = Server::start(30_000)?;
    let _a = start_native_provider(&server, "native-a")?;
    let _b = start_native_provider(&server, "native-b")?;
    server
        .wait_for_providers("two libtorch providers", Duration::from_secs(120), |all| {
            all.iter().filter(|p| p.bandwidth_mbps.is_some()).count() == 2
        })
        .await?;
    let browser = Browser::start().await?;
    let opened = Instant::now();
    browser.start_donating(&server).await?;
    server
        .wait_for_providers("the tab, measured", Duration::from_secs(60), |all| {
            all.len() == 3 && all.iter().all(|p| p.bandwidth_mbps.is_some())
        })
        .await?;
    let connected = opened.elapsed();
    let client = Client::new(&server.http_url(""), &server.api_token()?);
    let submitted = Instant::now();
    client.submit(&job_file).await?;
    loop {
        if let Ok(status) = browser.client.find(Locator::Css("#donate-status")).await
            && status.attr("data-state").await?.as_deref() == Some("training")
            && micro_batches_done(&status.text().await?) >= 1
        {
            break;
        }
        if submitted.elapsed() > Duration::from_secs(300) {
            bail!("the tab did no micro-batch within 5 minutes");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let first = submitted.elapsed();
    println!(
        "Donate page opened to connected and measured: {:>8.2} s",
        connected.as_secs_f64()
    );
    println!(
        "job submitted to the tab's first micro-batch: {:>8.2} s",
        first.as_secs_f64()
    );
    println!(
        "page load to first micro-batch done:          {:>8.2} s",
        (connected + first).as_secs_f64()
    );
    Ok(())
}

/// The count in the page's "N micro-batches done".
fn micro_batches_done(text: &str) -> u64 {
    text.split(" micro-batches done")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn write_job(dir: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    let mlp = dense_mlp(12, &[(24, Some("relu")), (16, Some("tanh")), (4, None)]);
    rookery_test_support::write_job(
        dir,
        &mlp,
        &Classes::cyclic(16 * 20, 12, 4),
        "epochs = 1\nbatch_size = 16\nmicro_batches = 4\n\
         optimizer = { name = \"adam\", lr = 0.01 }\nclusters = 1\nstages = 3\nseed = 5",
    )
}
