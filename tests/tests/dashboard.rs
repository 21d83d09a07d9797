//! The Requester's dashboard end to end: a real server, two real libtorch
//! providers and a real headless Chromium. The test signs in (a wrong token
//! first), creates a job through the New job form by uploading an ONNX
//! export with its side file and the MNIST files, previews the plan, submits,
//! watches the loss chart gain points live, sees the job complete, downloads
//! the weights and the CSV metrics through the page and checks the weights
//! load with the model's parameter names; then plans a second job from a
//! dataset kept on the server instead of uploads. Screenshots of the Jobs, New job
//! and Job detail pages (the last also phone-sized) land in
//! `target/screenshots/`.

#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use fantoccini::Locator;
use rookery_e2e::{Browser, Server, start_native_provider};
use rookery_proto::api::ProviderStatus;
use rookery_test_support::workspace_root;

fn fixture(path: &str) -> PathBuf {
    workspace_root().join(path)
}

/// Waits for an element, failing with what was awaited.
async fn find(
    browser: &Browser,
    css: &str,
    timeout: Duration,
) -> anyhow::Result<fantoccini::elements::Element> {
    browser
        .client
        .wait()
        .at_most(timeout)
        .for_element(Locator::Css(css))
        .await
        .with_context(|| format!("waiting {timeout:?} for {css}"))
}

async fn set_text(browser: &Browser, id: &str, value: &str) -> anyhow::Result<()> {
    let input = find(browser, &format!("#{id}"), Duration::from_secs(5)).await?;
    input.clear().await?;
    input.send_keys(value).await?;
    Ok(())
}

async fn choose_file(browser: &Browser, id: &str, path: &Path) -> anyhow::Result<()> {
    ensure!(path.is_file(), "{} is missing", path.display());
    let input = find(browser, &format!("#{id}"), Duration::from_secs(5)).await?;
    input.send_keys(&path.display().to_string()).await?;
    Ok(())
}

/// Waits until a finished download named `name` is in `dir`.
async fn downloaded(dir: &Path, name: &str, timeout: Duration) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    let started = Instant::now();
    while started.elapsed() < timeout {
        // Chromium writes `<name>.crdownload` and renames it when done.
        if path.is_file() {
            return Ok(path);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seen: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    bail!("{name} was not downloaded within {timeout:?}; the folder holds {seen:?}")
}

/// Names and shapes from a safetensors file's JSON header.
fn safetensors_header(bytes: &[u8]) -> anyhow::Result<BTreeMap<String, Vec<u64>>> {
    ensure!(
        bytes.len() >= 8,
        "{} bytes is no safetensors file",
        bytes.len()
    );
    let len = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    let header: serde_json::Value = serde_json::from_slice(
        bytes
            .get(8..8 + len)
            .context("the header is longer than the file")?,
    )?;
    let mut out = BTreeMap::new();
    for (name, info) in header.as_object().context("the header is no JSON object")? {
        if name == "__metadata__" {
            continue;
        }
        let shape = info["shape"]
            .as_array()
            .context("a tensor without a shape")?
            .iter()
            .map(|d| d.as_u64().context("a dimension that is no number"))
            .collect::<anyhow::Result<Vec<u64>>>()?;
        out.insert(name.clone(), shape);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requester_creates_watches_and_collects_a_job_in_the_browser() -> anyhow::Result<()> {
    let server = Server::start(4000)?;
    let _providers = [
        start_native_provider(&server, "dash-a")?,
        start_native_provider(&server, "dash-b")?,
    ];
    server
        .wait_for_providers("two native providers", Duration::from_secs(60), |all| {
            all.iter()
                .filter(|p| p.status == ProviderStatus::Connected)
                .count()
                == 2
        })
        .await?;
    let token = server.api_token()?;
    let downloads = tempfile::tempdir()?;
    let browser = Browser::start_with_downloads(downloads.path()).await?;

    // Sign in: a wrong token is refused in words, the right one kept.
    browser.client.goto(&server.http_url("/jobs")).await?;
    set_text(&browser, "token", "not-the-token").await?;
    find(
        &browser,
        "#signin button[type=submit]",
        Duration::from_secs(5),
    )
    .await?
    .click()
    .await?;
    let refusal = find(&browser, "#signin-error", Duration::from_secs(10))
        .await?
        .text()
        .await?;
    ensure!(refusal.contains("refused"), "sign-in error: {refusal}");
    set_text(&browser, "token", &token).await?;
    find(
        &browser,
        "#signin button[type=submit]",
        Duration::from_secs(5),
    )
    .await?
    .click()
    .await?;
    find(&browser, "#jobs-empty", Duration::from_secs(10)).await?;

    // New job: the ONNX export and its side file, the MNIST files, settings.
    find(&browser, "#new-job-link", Duration::from_secs(5))
        .await?
        .click()
        .await?;
    find(&browser, "form#new-job", Duration::from_secs(10)).await?;
    let onnx = fixture("tests/fixtures/mnist-onnx");
    let mnist = fixture("datasets/mnist-10k");
    choose_file(&browser, "model-file", &onnx.join("model.onnx")).await?;
    choose_file(&browser, "model-data-file", &onnx.join("model.onnx.data")).await?;
    for (id, file) in [
        ("train-inputs", "train-images-idx3-ubyte.gz"),
        ("train-labels", "train-labels-idx1-ubyte.gz"),
        ("test-inputs", "t10k-images-idx3-ubyte.gz"),
        ("test-labels", "t10k-labels-idx1-ubyte.gz"),
    ] {
        choose_file(&browser, id, &mnist.join(file)).await?;
    }
    for (id, value) in [
        ("epochs", "2"),
        ("batch-size", "32"),
        ("micro-batches", "2"),
        ("clusters", "1"),
        ("stages", "2"),
        ("lr", "0.002"),
    ] {
        set_text(&browser, id, value).await?;
    }
    // A mistake is shown next to its field and nothing is sent.
    set_text(&browser, "batch-size", "0").await?;
    find(&browser, "#preview-plan", Duration::from_secs(5))
        .await?
        .click()
        .await?;
    find(&browser, "#error-batch-size", Duration::from_secs(5)).await?;
    set_text(&browser, "batch-size", "32").await?;

    // The plan over the two providers connected now, before submitting.
    find(&browser, "#preview-plan", Duration::from_secs(5))
        .await?
        .click()
        .await?;
    find(&browser, "#plan-preview .cluster", Duration::from_secs(30)).await?;
    let stages = browser
        .client
        .find_all(Locator::Css("#plan-preview tr.plan-stage"))
        .await?;
    let mut roles = Vec::new();
    for stage in &stages {
        roles.push(stage.attr("data-role").await?.unwrap_or_default());
    }
    assert_eq!(roles, ["root", "leaf"]);
    let shot = browser.screenshot("dashboard-new-job").await?;
    println!("New job screenshot: {}", shot.display());

    // Submit: the page moves to the job, whose loss chart grows live.
    find(&browser, "#submit-job", Duration::from_secs(5))
        .await?
        .click()
        .await?;
    find(&browser, "#job", Duration::from_secs(15)).await?;
    let job_id = find(&browser, "#job", Duration::from_secs(1))
        .await?
        .attr("data-job-id")
        .await?
        .context("the job page names its job")?;
    let started = Instant::now();
    let mut counts = Vec::new();
    let mut busy_providers = BTreeMap::new();
    let status = loop {
        let chart = find(&browser, "#loss-chart", Duration::from_secs(5)).await?;
        let points: u64 = chart
            .attr("data-points")
            .await?
            .unwrap_or_default()
            .parse()
            .unwrap_or(0);
        if counts.last() != Some(&points) {
            counts.push(points);
        }
        let status = find(&browser, "#job", Duration::from_secs(1))
            .await?
            .attr("data-status")
            .await?
            .unwrap_or_default();
        if matches!(status.as_str(), "completed" | "failed" | "cancelled") {
            break status;
        }
        // The Providers page's data: who runs which stage, how far along.
        for p in server.providers().await? {
            if let Some(work) = p.work
                && work.job_id.to_string() == job_id
                && work.micro_batches_done > 0
            {
                busy_providers.insert(p.id, work.role);
            }
        }
        ensure!(
            started.elapsed() < Duration::from_secs(300),
            "the job did not finish in 5 min; loss points seen: {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
    };
    ensure!(status == "completed", "the job ended {status}");
    // 8,000 digits in batches of 32: 250 steps an epoch, two epochs.
    let chart = find(&browser, "#loss-chart", Duration::from_secs(5)).await?;
    let final_points = chart.attr("data-points").await?.unwrap_or_default();
    assert_eq!(final_points, "500");
    // The chart gained points while the job ran, not only at the end.
    let growing: Vec<&u64> = counts.iter().filter(|&&c| c > 0 && c < 500).collect();
    ensure!(
        growing.len() >= 2,
        "too few live updates of the loss chart: {counts:?}"
    );
    let mut roles: Vec<&str> = busy_providers.values().map(String::as_str).collect();
    roles.sort_unstable();
    assert_eq!(
        roles,
        ["leaf", "root"],
        "the providers reported their stages while the job ran"
    );
    let accuracy = find(&browser, "#accuracy-chart", Duration::from_secs(5)).await?;
    assert_eq!(accuracy.attr("data-points").await?.as_deref(), Some("2"));
    // The cluster diagram: Root -> Leaf on native providers.
    let nodes = browser
        .client
        .find_all(Locator::Css(".cluster .stage-node"))
        .await?;
    let mut diagram = Vec::new();
    for node in &nodes {
        diagram.push((
            node.attr("data-role").await?.unwrap_or_default(),
            node.attr("data-kind").await?.unwrap_or_default(),
        ));
    }
    assert_eq!(
        diagram,
        [
            ("root".to_string(), "native".to_string()),
            ("leaf".to_string(), "native".to_string())
        ]
    );
    // The event log tells the story.
    let log = browser.client.find_all(Locator::Css("#job-log li")).await?;
    let mut kinds = Vec::new();
    for line in &log {
        kinds.push(line.attr("data-kind").await?.unwrap_or_default());
    }
    for kind in [
        "submitted",
        "stage_assigned",
        "running",
        "checkpoint",
        "epoch",
        "completed",
    ] {
        ensure!(
            kinds.iter().any(|k| k == kind),
            "no {kind} in the log: {kinds:?}"
        );
    }
    let shot = browser.screenshot("dashboard-job-detail").await?;
    println!("Job detail screenshot: {}", shot.display());

    // Downloads through the page: the weights load, with the model's names.
    find(&browser, "#download-weights", Duration::from_secs(5))
        .await?
        .click()
        .await?;
    let weights = downloaded(
        downloads.path(),
        &format!("job-{job_id}-weights.safetensors"),
        Duration::from_secs(30),
    )
    .await?;
    let bytes = std::fs::read(&weights)?;
    let header = safetensors_header(&bytes)?;
    let expected: BTreeMap<String, Vec<u64>> =
        serde_json::from_str(&std::fs::read_to_string(onnx.join("parameter_names.json"))?)?;
    assert_eq!(header, expected);
    let loaded = rookery_job::read_safetensors(&weights)?;
    assert!(
        loaded
            .iter()
            .all(|t| t.values.iter().all(|v| v.is_finite())),
        "weights are finite"
    );
    find(&browser, "#download-metrics-csv", Duration::from_secs(5))
        .await?
        .click()
        .await?;
    let csv = downloaded(
        downloads.path(),
        &format!("job-{job_id}-metrics.csv"),
        Duration::from_secs(30),
    )
    .await?;
    let csv = std::fs::read_to_string(csv)?;
    assert_eq!(csv.lines().filter(|l| l.starts_with("step,")).count(), 500);
    assert_eq!(csv.lines().filter(|l| l.starts_with("epoch,")).count(), 2);

    // The same page on a phone-sized screen.
    browser.client.set_window_size(390, 844).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    browser.screenshot("dashboard-job-detail-phone").await?;
    browser.client.set_window_size(1280, 900).await?;

    // The Jobs page lists the completed job.
    find(&browser, "a[href='/jobs']", Duration::from_secs(5))
        .await?
        .click()
        .await?;
    browser
        .wait_for_attr(
            &format!("#jobs tr.job[data-job-id='{job_id}']"),
            "data-status",
            "completed",
            Duration::from_secs(10),
        )
        .await?;
    let shot = browser.screenshot("dashboard-jobs").await?;
    println!("Jobs screenshot: {}", shot.display());

    // A dataset kept on the server stands in for the uploads: the form
    // fills the data fields from its files and the server plans the job.
    let kept = server.data_dir().join("datasets/mnist-10k");
    std::fs::create_dir_all(&kept)?;
    for entry in std::fs::read_dir(&mnist)? {
        let entry = entry?;
        std::fs::copy(entry.path(), kept.join(entry.file_name()))?;
    }
    find(&browser, "#new-job-link", Duration::from_secs(5))
        .await?
        .click()
        .await?;
    choose_file(&browser, "model-file", &onnx.join("model.onnx")).await?;
    choose_file(&browser, "model-data-file", &onnx.join("model.onnx.data")).await?;
    find(
        &browser,
        "#data-source option[value='mnist-10k']",
        Duration::from_secs(10),
    )
    .await?
    .click()
    .await?;
    let picked = find(&browser, "select#train-labels", Duration::from_secs(5))
        .await?
        .prop("value")
        .await?;
    assert_eq!(picked.as_deref(), Some("train-labels-idx1-ubyte.gz"));
    find(&browser, "#preview-plan", Duration::from_secs(5))
        .await?
        .click()
        .await?;
    let summary = find(&browser, "#plan-preview .note", Duration::from_secs(30))
        .await?
        .text()
        .await?;
    ensure!(
        summary.contains("8,000 training and 2,000 test samples"),
        "{summary}"
    );
    browser.client.clone().close().await?;
    Ok(())
}
