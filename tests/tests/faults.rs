//! Providers that send wrong data are caught, with the real binaries: a
//! `rookery-provider` built with `fault-injection` and started with
//! `--fault KIND` misbehaves in one way; the server notices, writes the
//! fault to the job's log, drops the provider (or, for parameters that
//! robust aggregation outvoted, counts them until the third fault bans it),
//! and keeps serving: an honest job on other providers runs to completion
//! beside all of it.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rookery_e2e::{Process, Server, provider_command, rookery};
use rookery_proto::api::{JobInfo, JobMetrics, LeaderboardEntry, LogEntry, ProviderStatus};
use rookery_test_support::job::{job_text, write_classes};
use rookery_test_support::{Classes, dense_mlp, write_job};

/// Generous: every libtorch provider measures itself at start, on all cores,
/// and a shared machine must not turn that into heartbeat timeouts.
const HEARTBEAT_TIMEOUT_MS: u64 = 30_000;

/// A job on a synthetic 3-class dataset of `samples` samples, in its own folder.
fn job(dir: &Path, name: &str, samples: usize, training: &str) -> PathBuf {
    let mlp = dense_mlp(6, &[(16, Some("relu")), (3, None)]);
    write_job(
        &dir.join(name),
        &mlp,
        &Classes::cyclic(samples, 6, 3),
        training,
    )
    .unwrap()
}

struct Client<'a> {
    server: &'a Server,
    token: String,
    http: reqwest::Client,
}

impl<'a> Client<'a> {
    /// A client of `server` with its first Requester's token.
    fn new(server: &'a Server) -> anyhow::Result<Self> {
        Ok(Self {
            token: server.api_token()?,
            server,
            http: reqwest::Client::new(),
        })
    }

    fn submit(&self, job: &Path) -> anyhow::Result<u64> {
        let url = self.server.http_url("");
        let job = job.display().to_string();
        let (ok, id, stderr) =
            rookery(&["submit", &job, "--server", &url, "--token", &self.token])?;
        if !ok {
            bail!("submit failed: {stderr}");
        }
        Ok(id.trim().parse()?)
    }

    async fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        Ok(self
            .http
            .get(self.server.http_url(path))
            .bearer_auth(&self.token)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }

    async fn log(&self, job: u64) -> anyhow::Result<Vec<LogEntry>> {
        self.get(&format!("/api/jobs/{job}/log")).await
    }

    /// Polls the job's log until `done` holds for it.
    async fn wait_for_log(
        &self,
        job: u64,
        what: &str,
        done: impl Fn(&[LogEntry]) -> bool,
    ) -> anyhow::Result<Vec<LogEntry>> {
        let started = Instant::now();
        loop {
            let log = self.log(job).await?;
            if done(&log) {
                return Ok(log);
            }
            if started.elapsed() > Duration::from_secs(120) {
                bail!("timed out waiting for {what} in job {job}'s log: {log:#?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn cancel(&self, job: u64) -> anyhow::Result<()> {
        let url = self.server.http_url("");
        let id = job.to_string();
        rookery(&["cancel", &id, "--server", &url, "--token", &self.token])?;
        Ok(())
    }
}

fn provider(server: &Server, name: &str, fault: Option<&str>) -> anyhow::Result<Process> {
    let extra: Vec<&str> = fault.map_or(Vec::new(), |f| vec!["--fault", f]);
    provider_with(server, name, &extra)
}

fn provider_with(server: &Server, name: &str, extra: &[&str]) -> anyhow::Result<Process> {
    Process::spawn(provider_command(server, name, extra)?.env("RUST_LOG", "warn"))
}

/// A provider the operator vouches for with the server's first Requester
/// token: trusted to verify spot checks.
fn vouched_provider(server: &Server, name: &str) -> anyhow::Result<Process> {
    provider_with(server, name, &["--requester-token", &server.api_token()?])
}

fn faults_of<'a>(log: &'a [LogEntry], name: &str) -> Vec<&'a LogEntry> {
    log.iter()
        .filter(|l| l.kind == "provider_fault" && l.message.contains(&format!(", {name})")))
        .collect()
}

/// Waits until `name` is banned from job `id`, after exactly three faults;
/// the job's log then.
async fn banned_after_three_faults(
    client: &Client<'_>,
    id: u64,
    name: &str,
) -> anyhow::Result<Vec<LogEntry>> {
    let log = client
        .wait_for_log(id, "the ban", |log| {
            log.iter().any(|l| l.kind == "provider_banned")
        })
        .await?;
    anyhow::ensure!(faults_of(&log, name).len() == 3, "{log:#?}");
    Ok(log)
}

/// Starts the providers named (with their faults) and waits until the
/// server has measured all of them, so the next job is planned onto them.
async fn join(server: &Server, who: &[(&str, Option<&str>)]) -> anyhow::Result<Vec<Process>> {
    let who: Vec<(&str, Vec<&str>)> = who
        .iter()
        .map(|(name, fault)| (*name, fault.map_or(Vec::new(), |f| vec!["--fault", f])))
        .collect();
    join_with(server, &who).await
}

/// [`join`], each provider with its own arguments.
async fn join_with(server: &Server, who: &[(&str, Vec<&str>)]) -> anyhow::Result<Vec<Process>> {
    let before = server.providers().await?.len();
    let started: Vec<Process> = who
        .iter()
        .map(|(name, extra)| provider_with(server, name, extra))
        .collect::<anyhow::Result<_>>()?;
    server
        .wait_for_providers("the new providers", Duration::from_secs(120), |all| {
            all[before.min(all.len())..]
                .iter()
                .filter(|p| p.bandwidth_mbps.is_some())
                .count()
                >= who.len()
        })
        .await?;
    Ok(started)
}

async fn wait_for_status(client: &Client<'_>, id: u64, want: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let info: JobInfo = client.get(&format!("/api/jobs/{id}")).await?;
        if info.status == want {
            return Ok(());
        }
        if matches!(info.status.as_str(), "completed" | "failed" | "cancelled")
            || started.elapsed() > Duration::from_secs(180)
        {
            bail!("job {info:?}, not {want}: {:#?}", client.log(id).await?);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_kind_of_wrong_data_is_caught_and_its_sender_dropped_while_the_server_serves_on()
-> anyhow::Result<()> {
    let server = Server::start(HEARTBEAT_TIMEOUT_MS)?;
    let dir = tempfile::tempdir()?;
    let client = Client::new(&server)?;
    // (fault, what the fault line must say: any of these)
    let dropped: [(&str, &[&str]); 5] = [
        ("malformed", &["dropped:"]),
        ("other-job", &["a frame for job"]),
        ("other-stage", &["another-stage/", "tensors, expected"]),
        ("wrong-shape", &["shape"]),
        ("nan", &["finite"]),
    ];
    for (fault, says) in dropped {
        let name = format!("faulty-{fault}");
        let partner = format!("partner-{fault}");
        // Only these two are idle, so the job runs on both.
        let _pair = join(&server, &[(&partner, None), (&name, Some(fault))]).await?;
        let id = client.submit(&job(
            dir.path(),
            fault,
            64,
            "batch_size = 8\nmicro_batches = 2\nclusters = 1\nstages = 2",
        ))?;
        let log = client
            .wait_for_log(id, "the fault", |log| !faults_of(log, &name).is_empty())
            .await?;
        let line = &faults_of(&log, &name)[0].message;
        assert!(
            says.iter().any(|s| line.contains(s)),
            "{fault}: {line}\n{log:#?}"
        );
        assert!(line.contains("fault 1 of 3"), "{fault}: {line}");
        // Its connection is closed; the partner is still there.
        let providers = server
            .wait_for_providers(
                "the faulty provider's first connection to close",
                Duration::from_secs(30),
                |all| {
                    all.iter()
                        .any(|p| p.name == name && p.status == ProviderStatus::Gone)
                },
            )
            .await?;
        let first = providers.iter().find(|p| p.name == name).unwrap();
        assert!(
            first
                .gone_reason
                .as_deref()
                .is_some_and(|r| r.starts_with("dropped:")),
            "{fault}: {first:?}"
        );
        assert!(
            providers
                .iter()
                .any(|p| p.name == partner && p.status == ProviderStatus::Connected),
            "{fault}: the partner was dropped too: {providers:#?}"
        );
        client.cancel(id)?;
        wait_for_status(&client, id, "cancelled").await?;
    }

    // The server serves on: a job on honest providers trains to the end,
    // and nothing counts against them.
    let _honest = join(&server, &[("honest-a", None), ("honest-b", None)]).await?;
    let id = client.submit(&job(
        dir.path(),
        "after",
        64,
        "batch_size = 8\nmicro_batches = 2\nclusters = 1\nstages = 2",
    ))?;
    wait_for_status(&client, id, "completed").await?;
    let log = client.log(id).await?;
    assert!(log.iter().all(|l| l.kind != "provider_fault"), "{log:#?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn far_off_parameters_are_outvoted_three_times_then_banned_by_identity_not_name_and_a_standby_finishes()
-> anyhow::Result<()> {
    let server = Server::start(HEARTBEAT_TIMEOUT_MS)?;
    let dir = tempfile::tempdir()?;
    let client = Client::new(&server)?;
    let name = "faulty-far-params";
    let _two = join(&server, &[("far-a", None), ("far-b", None)]).await?;
    // The faulty one keeps its credential in a file, as a provider does by
    // default, so that it can come back as the same identity.
    let credential = dir.path().join("faulty.credential");
    let credential = credential.to_str().unwrap();
    let mut faulty = Process::spawn(
        provider_command(
            &server,
            name,
            &["--fault", "far-params", "--identity-file", credential],
        )?
        .env("RUST_LOG", "warn"),
    )?;
    server
        .wait_for_providers("the faulty provider", Duration::from_secs(120), |all| {
            all.iter()
                .any(|p| p.name == name && p.bandwidth_mbps.is_some())
        })
        .await?;
    // Three single-stage clusters with the median: the job goes on while the
    // faults count, and the third bans the provider.
    let id = client.submit(&job(
        dir.path(),
        "far",
        240,
        "batch_size = 8\nclusters = 3\nstages = 1\nsync_every = 1\naggregation = \"median\"",
    ))?;
    let log = banned_after_three_faults(&client, id, name).await?;
    let counted = faults_of(&log, name);
    for (i, line) in counted.iter().enumerate() {
        assert!(
            line.message.contains(&format!("fault {} of 3", i + 1))
                && line.message.contains("away from the median")
                // One fault per sync: the job went on between them.
                && line.message.contains(&format!("sync of step {}", i + 1)),
            "{}",
            line.message
        );
    }
    let banned = log.iter().find(|l| l.kind == "provider_banned").unwrap();
    assert!(
        banned.message.starts_with("provider ") && banned.message.contains(" banned: "),
        "{}",
        banned.message
    );
    // The banned provider comes back as a new process under a new name,
    // behaving well: its identity is banned, so idle and measured it is
    // still not given the job's vacant stage...
    faulty.kill();
    let renamed = "an-innocent-name";
    let _back = Process::spawn(
        provider_command(&server, renamed, &["--identity-file", credential])?
            .env("RUST_LOG", "warn"),
    )?;
    server
        .wait_for_providers("the banned provider back", Duration::from_secs(60), |all| {
            all.iter().any(|p| {
                p.name == renamed
                    && p.status == ProviderStatus::Connected
                    && p.bandwidth_mbps.is_some()
            })
        })
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let info: JobInfo = client.get(&format!("/api/jobs/{id}")).await?;
    assert!(
        info.detail
            .as_deref()
            .is_some_and(|d| d.contains("waiting for a provider")),
        "{info:?}"
    );
    // ... while a stranger that takes the banned provider's name is a new
    // identity, not banned: it takes the stage, and the job completes.
    let _standby = provider(&server, name, None)?;
    wait_for_status(&client, id, "completed").await?;
    let log = client.log(id).await?;
    assert_eq!(faults_of(&log, name).len(), 3, "{log:#?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_provider_sends_nans_goes_on_on_a_standby_and_completes() -> anyhow::Result<()>
{
    let server = Server::start(HEARTBEAT_TIMEOUT_MS)?;
    let dir = tempfile::tempdir()?;
    let client = Client::new(&server)?;
    // The job is planned onto these two, so the faulty one runs a stage...
    let mut running = vec![
        provider(&server, "honest", None)?,
        provider(&server, "faulty-nan", Some("nan"))?,
    ];
    server
        .wait_for_providers("the first two providers", Duration::from_secs(120), |all| {
            all.iter().filter(|p| p.bandwidth_mbps.is_some()).count() == 2
        })
        .await?;
    let id = client.submit(&job(
        dir.path(),
        "nan",
        96,
        "batch_size = 8\nmicro_batches = 2\nclusters = 1\nstages = 2\nsync_every = 2",
    ))?;
    client
        .wait_for_log(id, "the plan", |log| {
            log.iter().any(|l| l.kind == "stage_assigned")
        })
        .await?;
    // ... and the standby joins once the plan is made.
    running.push(provider(&server, "standby", None)?);

    wait_for_status(&client, id, "completed").await?;
    let log = client.log(id).await?;
    let faults = faults_of(&log, "faulty-nan");
    assert!(!faults.is_empty(), "{log:#?}");
    assert!(
        faults[0].message.contains("finite"),
        "{}",
        faults[0].message
    );
    // Every step was trained and recorded once, the rolled-back ones again.
    let metrics: rookery_proto::api::JobMetrics =
        client.get(&format!("/api/jobs/{id}/metrics")).await?;
    let steps: Vec<u64> = metrics.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, (0..12).collect::<Vec<_>>(), "{log:#?}");
    assert!(metrics.steps.iter().all(|s| s.loss.is_finite()));
    Ok(())
}

/// A provider far slower than the plan expects (one that sleeps in every
/// forward, as an overloaded machine would) is a straggler: after a few slow
/// steps its stage moves, at the next sync, to a standby, and the job
/// completes with every step recorded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_straggler_stage_moves_to_a_standby_at_a_sync_and_the_job_completes() -> anyhow::Result<()>
{
    let server = Server::start(HEARTBEAT_TIMEOUT_MS)?;
    let dir = tempfile::tempdir()?;
    let client = Client::new(&server)?;
    let mut running = join(
        &server,
        &[("quick-a", None), ("quick-b", None), ("slow", Some("slow"))],
    )
    .await?;
    let id = client.submit(&job(
        dir.path(),
        "straggler",
        // Long enough that the standby has measured itself (on a loaded
        // machine that takes seconds) before the job ends: the steps after
        // the move are fast, so the length costs little.
        8 * 200,
        "batch_size = 8\nmicro_batches = 2\nclusters = 1\nstages = 3\nsync_every = 2",
    ))?;
    client
        .wait_for_log(id, "the plan", |log| {
            log.iter().any(|l| l.kind == "stage_assigned")
        })
        .await?;
    running.push(provider(&server, "standby", None)?);
    let slow_id = server
        .providers()
        .await?
        .iter()
        .find(|p| p.name == "slow")
        .map(|p| p.id)
        .unwrap();
    let log = client
        .wait_for_log(id, "the straggler's stage moving", |log| {
            log.iter().any(|l| {
                l.kind == "stage_lost"
                    && l.message.contains(&format!("provider {slow_id} left"))
                    && l.message.contains("slower")
            }) && log.iter().any(|l| l.kind == "stage_reassigned")
        })
        .await?;
    wait_for_status(&client, id, "completed")
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{log:#?}"))?;
    let metrics: rookery_proto::api::JobMetrics =
        client.get(&format!("/api/jobs/{id}/metrics")).await?;
    let steps: Vec<u64> = metrics.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, (0..200).collect::<Vec<_>>());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_overstates_its_speed_is_measured_caught_and_banned() -> anyhow::Result<()>
{
    let server = Server::start(HEARTBEAT_TIMEOUT_MS)?;
    let dir = tempfile::tempdir()?;
    let client = Client::new(&server)?;
    let name = "boaster";
    let _boaster = join(&server, &[(name, Some("claim"))]).await?;
    // 29 GFLOP a step: the stage stays busy beyond the server's least
    // measured time (100 ms) on any CPU a test runs on.
    let mlp = dense_mlp(
        256,
        &[(2048, Some("relu")), (2048, Some("relu")), (3, None)],
    );
    let job = write_job(
        &dir.path().join("wide"),
        &mlp,
        &Classes::cyclic(1024 * 12, 256, 3),
        "batch_size = 1024\nclusters = 1\nstages = 1",
    )?;
    let id = client.submit(&job)?;
    let log = banned_after_three_faults(&client, id, name).await?;
    for line in faults_of(&log, name) {
        assert!(
            line.message.contains("claims") && line.message.contains("computed its stage at"),
            "{}",
            line.message
        );
    }
    // An honest standby finishes the job.
    let _standby = provider(&server, "honest", None)?;
    wait_for_status(&client, id, "completed").await?;
    let log = client.log(id).await?;
    assert!(faults_of(&log, "honest").is_empty(), "{log:#?}");
    Ok(())
}

/// A learnable 4-class job with a test set, spot-checking `rate` of each
/// stage's micro-batches.
fn checked_job(dir: &Path, name: &str, rate: f64) -> anyhow::Result<PathBuf> {
    let dir = dir.join(name);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("model.toml"),
        dense_mlp(6, &[(32, Some("relu")), (4, None)]),
    )?;
    write_classes(&dir, "", &Classes::learnable(16 * 600, &[6], 1))?;
    write_classes(&dir, "test_", &Classes::learnable(400, &[6], 2))?;
    let training = format!(
        "batch_size = 16\nmicro_batches = 4\nclusters = 1\nstages = 2\nseed = 3\n\
         optimizer = {{ name = \"sgd\", lr = 0.1 }}\n[training.verify]\nrate = {rate:?}"
    );
    let path = dir.join("job.toml");
    std::fs::write(
        &path,
        job_text(Path::new("model.toml"), &[6], "", Some("test_"), &training),
    )?;
    Ok(path)
}

/// The step a spot check's log line names.
fn step_of(line: &LogEntry) -> Option<u64> {
    line.message
        .split(", step ")
        .nth(1)?
        .split(',')
        .next()?
        .parse()
        .ok()
}

/// The job's final test accuracy.
async fn accuracy(client: &Client<'_>, id: u64) -> anyhow::Result<f64> {
    let metrics: JobMetrics = client.get(&format!("/api/jobs/{id}/metrics")).await?;
    Ok(metrics
        .epochs
        .last()
        .context("no epoch evaluated")?
        .test_accuracy)
}

/// Starts `name`, vouched for, once the job is running on the providers it
/// was planned onto, so that it is idle: the verifier.
async fn verifier_once_running(
    server: &Server,
    client: &Client<'_>,
    id: u64,
    name: &str,
) -> anyhow::Result<Process> {
    wait_for_status(client, id, "running").await?;
    let verifier = vouched_provider(server, name)?;
    server
        .wait_for_providers("the verifier", Duration::from_secs(120), |all| {
            all.iter()
                .any(|p| p.name == name && p.bandwidth_mbps.is_some())
        })
        .await?;
    Ok(verifier)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spot_checks_catch_a_subtly_wrong_provider_and_the_job_ends_as_an_honest_run_does()
-> anyhow::Result<()> {
    let server = Server::start(HEARTBEAT_TIMEOUT_MS)?;
    let dir = tempfile::tempdir()?;
    let client = Client::new(&server)?;
    let liar = "subtle";
    let mut first = join(&server, &[(liar, Some("subtle")), ("honest-a", None)]).await?;
    let id = client.submit(&checked_job(dir.path(), "checked", 0.02)?)?;
    let _verifier = verifier_once_running(&server, &client, id, "verifier").await?;
    // Caught by three spot checks within 200 steps of the first (the
    // verifier joins a job already under way), each naming its step.
    let log = banned_after_three_faults(&client, id, liar).await?;
    let faults = faults_of(&log, liar);
    let last_step = step_of(faults[2]).context("the fault names its step")?;
    let first_check = log
        .iter()
        .filter(|l| l.kind == "spot_check")
        .filter_map(step_of)
        .min()
        .context("no spot check ran")?;
    assert!(
        last_step - first_check < 200,
        "banned only at step {last_step}, checked from step {first_check}"
    );
    eprintln!(
        "the liar's third disagreement was at step {last_step}, the first check at step {first_check}"
    );
    // The verifier takes the vacant stage, and the job completes.
    wait_for_status(&client, id, "completed").await?;
    let checked = accuracy(&client, id).await?;
    let log = client.log(id).await?;
    let summary = log
        .iter()
        .find(|l| l.kind == "spot_checks")
        .context("no spot check summary")?;
    eprintln!("with a liar: {}", summary.message);

    // The same job with honest providers only: no check disagrees, and the
    // accuracy is the same.
    first.remove(0).kill();
    let honest = client.submit(&checked_job(dir.path(), "honest", 0.02)?)?;
    let _second = verifier_once_running(&server, &client, honest, "verifier-2").await?;
    wait_for_status(&client, honest, "completed").await?;
    let log = client.log(honest).await?;
    let summary = log
        .iter()
        .find(|l| l.kind == "spot_checks")
        .context("no spot check summary")?;
    eprintln!("honest: {}", summary.message);
    assert!(
        summary.message.contains(" 0 disagreed"),
        "{}",
        summary.message
    );
    assert!(log.iter().all(|l| l.kind != "provider_fault"), "{log:#?}");
    let want = accuracy(&client, honest).await?;
    assert!(want > 0.5, "the job learns: {want}");
    // What the checks cost, for people: the same job without them.
    let unchecked = client.submit(&checked_job(dir.path(), "unchecked", 0.0)?)?;
    wait_for_status(&client, unchecked, "completed").await?;
    let took = |info: JobInfo| info.finished_ms.unwrap_or(0) - info.started_ms.unwrap_or(0);
    let with: JobInfo = client.get(&format!("/api/jobs/{honest}")).await?;
    let without: JobInfo = client.get(&format!("/api/jobs/{unchecked}")).await?;
    eprintln!(
        "600 steps with checks at 0.02: {} ms; without: {} ms",
        took(with),
        took(without)
    );
    assert!(
        (checked - want).abs() <= 0.02,
        "accuracy {checked} with the liar caught, {want} honest"
    );
    Ok(())
}

/// A learnable job whose Root holds nearly all the memory (a 512 -> 1024
/// layer) and whose Leaf almost none, spot-checking a quarter of each
/// stage's micro-batches.
fn lopsided_job(dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::write(
        dir.join("model.toml"),
        dense_mlp(512, &[(1024, Some("relu")), (4, None)]),
    )?;
    write_classes(dir, "", &Classes::learnable(16 * 300, &[512], 1))?;
    let training = "batch_size = 16\nmicro_batches = 4\nclusters = 1\nstages = 2\nseed = 5\n\
         optimizer = { name = \"sgd\", lr = 0.05 }\n[training.verify]\nrate = 0.25";
    let path = dir.join("job.toml");
    std::fs::write(
        &path,
        job_text(Path::new("model.toml"), &[512], "", None, training),
    )?;
    Ok(path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spot_checks_rerun_the_backward_only_vouched_for_providers_verify_and_a_liar_keeps_no_credit()
-> anyhow::Result<()> {
    let server = Server::start(HEARTBEAT_TIMEOUT_MS)?;
    let dir = tempfile::tempdir()?;
    let client = Client::new(&server)?;
    // Its forwards are honest, its gradients 1% off; with 2 MiB it fits
    // only the Leaf, whose gradients go back to the Root.
    let liar = "gradients";
    let _first = join_with(
        &server,
        &[
            (
                liar,
                vec![
                    "--fault",
                    "subtle-gradients",
                    "--max-memory-mib",
                    "2",
                    "--donor-name",
                    "liar",
                ],
            ),
            (
                "honest-root",
                vec!["--donor-name", "honest root", "--team", "ravens"],
            ),
        ],
    )
    .await?;
    let id = client.submit(&lopsided_job(dir.path())?)?;
    // A stranger idles beside the vouched-for verifier, and never verifies.
    let stranger = provider(&server, "stranger", None)?;
    let _verifier = verifier_once_running(&server, &client, id, "verifier").await?;
    let log = banned_after_three_faults(&client, id, liar).await?;
    for fault in faults_of(&log, liar) {
        assert!(
            fault.message.contains("stage 1") && fault.message.contains("input gradients differ"),
            "{}",
            fault.message
        );
    }
    wait_for_status(&client, id, "completed").await?;
    let stranger_id = server
        .providers()
        .await?
        .iter()
        .find(|p| p.name == "stranger")
        .context("the stranger connected")?
        .id;
    let log = client.log(id).await?;
    let reruns: Vec<&LogEntry> = log.iter().filter(|l| l.kind == "spot_check").collect();
    assert!(reruns.len() >= 3, "{log:#?}");
    assert!(
        reruns.iter().all(|l| !l
            .message
            .contains(&format!("provider {stranger_id}'s re-run"))),
        "{reruns:#?}"
    );
    // Credit: the public leaderboard shows the honest donor's accepted
    // work, and none of the liar's, which its ban withdrew.
    assert!(log.iter().any(|l| l.kind == "credit_withdrawn"), "{log:#?}");
    let board: Vec<LeaderboardEntry> = reqwest::get(server.http_url("/api/leaderboard"))
        .await?
        .error_for_status()?
        .json()
        .await?;
    let honest = board
        .iter()
        .find(|e| e.name == "honest root")
        .with_context(|| format!("{board:?}"))?;
    assert_eq!(honest.team.as_deref(), Some("ravens"));
    assert!(honest.credit > 0.0, "{board:?}");
    assert!(board.iter().all(|e| e.name != "liar"), "{board:?}");
    assert!(
        board.windows(2).all(|w| w[0].credit >= w[1].credit),
        "{board:?}"
    );
    drop(stranger);
    Ok(())
}
