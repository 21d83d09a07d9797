//! Training survives what happens to real processes: providers SIGKILLed in
//! the middle of a job, or closing their socket politely as a closed browser
//! tab does (their stages go to a standby, or to the next provider to join,
//! and their clusters replay from the last checkpoint) and the
//! server itself SIGKILLed and restarted on the same data dir (running jobs
//! resume from their checkpoints when the providers reconnect, queued jobs
//! stay queued, finished ones keep their weights and metrics).
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rookery_e2e::{Process, Server, rookery_train, start_native_provider};
use rookery_proto::api::{JobInfo, JobMetrics, LogEntry, ProviderStatus};
use rookery_server::cli::client::Client;
use rookery_test_support::job::{job_text, write_classes};
use rookery_test_support::{Classes, dense_mlp};

const HEARTBEAT_TIMEOUT_MS: u64 = 5_000;

/// A job of 2 clusters of 2 stages with a test set, under `schedule`;
/// returns the job file.
fn job(dir: &Path, train_samples: usize, epochs: u64, schedule: &str) -> PathBuf {
    let mlp = dense_mlp(12, &[(64, Some("relu")), (32, Some("tanh")), (4, None)]);
    std::fs::write(dir.join("model.toml"), mlp).unwrap();
    let train = Classes::learnable(train_samples, &[12], 0x2545_f491_4f6c_dd1d);
    write_classes(dir, "train_", &train).unwrap();
    write_classes(
        dir,
        "test_",
        &Classes::learnable(1024, &[12], 0x9e37_79b9_7f4a_7c15),
    )
    .unwrap();
    let path = dir.join("job.toml");
    let training = format!(
        "epochs = {epochs}\nbatch_size = 32\nmicro_batches = 4\n\
         optimizer = {{ name = \"sgd\", lr = 0.05, momentum = 0.9 }}\n\
         clusters = 2\nstages = 2\nsync_every = 4\nseed = 3\nschedule = \"{schedule}\""
    );
    let text = job_text(
        Path::new("model.toml"),
        &[12],
        "train_",
        Some("test_"),
        &training,
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn client(server: &Server) -> Client {
    Client::new(&server.http_url(""), &server.api_token().unwrap())
}

async fn log(server: &Server, id: u64) -> Vec<LogEntry> {
    reqwest::Client::new()
        .get(server.http_url(&format!("/api/jobs/{id}/log")))
        .bearer_auth(server.api_token().unwrap())
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Polls the job until `done` holds; fails after `timeout` showing the job
/// and its log.
async fn wait_for_job(
    server: &Server,
    id: u64,
    what: &str,
    timeout: Duration,
    done: impl Fn(&JobInfo) -> bool,
) -> JobInfo {
    let started = Instant::now();
    loop {
        let job = client(server).job(id).await.unwrap();
        if done(&job) {
            return job;
        }
        assert!(
            !matches!(job.status.as_str(), "failed" | "cancelled"),
            "waiting for {what}: {job:#?}\n{:#?}",
            log(server, id).await
        );
        assert!(
            started.elapsed() < timeout,
            "timed out waiting for {what}: {job:#?}\n{:#?}",
            log(server, id).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `count` providers are connected and measured (plannable).
async fn wait_for_measured(server: &Server, count: usize) {
    server
        .wait_for_providers("measured providers", Duration::from_secs(60), |p| {
            p.iter()
                .filter(|p| p.status == ProviderStatus::Connected && p.bandwidth_mbps.is_some())
                .count()
                >= count
        })
        .await
        .unwrap();
}

/// The name of the provider running stage `stage` of cluster `cluster`.
async fn runs(server: &Server, cluster: u32, stage: u32) -> String {
    let providers = server
        .wait_for_providers("a provider on the stage", Duration::from_secs(30), |p| {
            p.iter().any(|p| {
                p.status == ProviderStatus::Connected
                    && p.work
                        .as_ref()
                        .is_some_and(|w| (w.cluster, w.stage) == (cluster, stage))
            })
        })
        .await
        .unwrap();
    providers
        .into_iter()
        .find(|p| {
            p.status == ProviderStatus::Connected
                && p.work
                    .as_ref()
                    .is_some_and(|w| (w.cluster, w.stage) == (cluster, stage))
        })
        .unwrap()
        .name
}

/// Waits until the job's log holds `count` stage reassignments.
async fn wait_for_reassignments(server: &Server, id: u64, count: usize) {
    let started = Instant::now();
    loop {
        let log = log(server, id).await;
        if kinds(&log)
            .iter()
            .filter(|k| **k == "stage_reassigned")
            .count()
            >= count
        {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "{log:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits for ten more recorded steps.
async fn more_steps(server: &Server, id: u64) {
    let before = client(server).job(id).await.unwrap().step;
    wait_for_job(server, id, "more steps", Duration::from_secs(120), |j| {
        j.step >= before + 10
    })
    .await;
}

/// Every step recorded exactly once, in order, and every epoch evaluated.
fn assert_continuous(metrics: &JobMetrics, total_steps: u64, epochs: u64) {
    let steps: Vec<u64> = metrics.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, (0..total_steps).collect::<Vec<_>>());
    let evaluated: Vec<u64> = metrics.epochs.iter().map(|e| e.epoch).collect();
    assert_eq!(evaluated, (0..epochs).collect::<Vec<_>>());
}

fn kinds(log: &[LogEntry]) -> Vec<&str> {
    log.iter().map(|l| l.kind.as_str()).collect()
}

/// Under 1F1B, whose Roots hold back forwards a kill may strand.
#[tokio::test(flavor = "multi_thread")]
async fn providers_killed_mid_step_cost_a_replay_and_the_job_ends_as_an_undisturbed_one() {
    kill_providers_mid_job("1f1b").await;
}

/// Under `async`, where a kill strands two steps and each stage's stashed
/// weights: the rebuilt cluster replays from the checkpoint's.
#[tokio::test(flavor = "multi_thread")]
async fn async_providers_killed_mid_step_cost_a_replay_and_the_job_ends_as_an_undisturbed_one() {
    kill_providers_mid_job("async").await;
}

async fn kill_providers_mid_job(schedule: &str) {
    let dir = tempfile::tempdir().unwrap();
    let job_file = job(dir.path(), 8192, 2, schedule);
    let undisturbed = rookery_train(&job_file, 4, &dir.path().join("undisturbed")).unwrap();
    let total_steps = undisturbed.steps.len() as u64;
    assert_eq!(total_steps, 2 * 8192 / 64);

    let server = Server::start(HEARTBEAT_TIMEOUT_MS).unwrap();
    let mut providers: BTreeMap<String, Process> = (0..6)
        .map(|i| {
            let name = format!("p{i}");
            let process = start_native_provider(&server, &name).unwrap();
            (name, process)
        })
        .collect();
    wait_for_measured(&server, 6).await;
    let id = client(&server).submit(&job_file).await.unwrap().id;

    // Four providers run the stages; two stand by. Cluster 1's Leaf dies
    // mid-job.
    wait_for_job(&server, id, "step 20", Duration::from_secs(120), |j| {
        j.step >= 20
    })
    .await;
    let victim = runs(&server, 1, 1).await;
    providers.get_mut(&victim).unwrap().kill();
    wait_for_reassignments(&server, id, 1).await;

    // Cluster 1's Root closes its socket politely, as a closed browser tab
    // does: the same path onto the other standby.
    more_steps(&server, id).await;
    let victim = runs(&server, 1, 0).await;
    providers.get_mut(&victim).unwrap().terminate().unwrap();
    wait_for_reassignments(&server, id, 2).await;

    // Then cluster 0's Root dies with no standby left: the job says what it
    // waits for, and goes on once a new provider joins.
    more_steps(&server, id).await;
    let victim = runs(&server, 0, 0).await;
    providers.get_mut(&victim).unwrap().kill();
    let waiting = wait_for_job(
        &server,
        id,
        "the job to wait for a provider",
        Duration::from_secs(60),
        |j| {
            j.detail
                .as_deref()
                .is_some_and(|d| d.contains("waiting for a provider for cluster 0, stage 0"))
        },
    )
    .await;
    assert_eq!(waiting.status, "running");
    providers.insert(
        "late".into(),
        start_native_provider(&server, "late").unwrap(),
    );
    let done = wait_for_job(&server, id, "completion", Duration::from_secs(300), |j| {
        j.status == "completed"
    })
    .await;
    assert_eq!((done.step, done.total_steps), (total_steps, total_steps));

    let metrics = client(&server).metrics(id).await.unwrap();
    assert_continuous(&metrics, total_steps, 2);
    let got = metrics.epochs.last().unwrap().test_accuracy;
    let want = undisturbed.epochs.last().unwrap().test_accuracy;
    assert!(
        (got - want).abs() <= 0.01,
        "accuracy {got} after the kills, {want} undisturbed"
    );
    assert!(want > 0.5, "the job learns: {want}");
    let log = log(&server, id).await;
    for line in &log {
        eprintln!("{}: {}", line.kind, line.message);
    }
    eprintln!("test accuracy {got} after the kills, {want} undisturbed");
    // Three providers left and three stages were reassigned; on a loaded
    // machine a straggling stage may also have moved to a standby.
    let left = log.iter().filter(|l| l.kind == "provider_left").count();
    assert_eq!(left, 3, "{log:#?}");
    let count = |kind: &str| log.iter().filter(|l| l.kind == kind).count();
    assert!(count("stage_lost") >= 3, "{log:#?}");
    assert_eq!(count("stage_lost"), count("stage_reassigned"), "{log:#?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_server_killed_mid_job_resumes_from_its_checkpoint_and_keeps_the_queue_and_history() {
    let dir = tempfile::tempdir().unwrap();
    let short = tempfile::tempdir().unwrap();
    let short_job = job(short.path(), 512, 1, "gpipe");
    let long_job = job(dir.path(), 8192, 2, "gpipe");

    let mut server = Server::start(HEARTBEAT_TIMEOUT_MS).unwrap();
    let _providers: Vec<Process> = (0..4)
        .map(|i| start_native_provider(&server, &format!("p{i}")).unwrap())
        .collect();
    wait_for_measured(&server, 4).await;

    // A finished job, whose weights and metrics must outlive the crash.
    let finished = client(&server).submit(&short_job).await.unwrap().id;
    wait_for_job(
        &server,
        finished,
        "the short job",
        Duration::from_secs(120),
        |j| j.status == "completed",
    )
    .await;
    let finished_metrics = client(&server).metrics(finished).await.unwrap();
    let weights = dir.path().join("finished.safetensors");
    client(&server)
        .download(finished, None, &weights)
        .await
        .unwrap();
    let weights_before = std::fs::read(&weights).unwrap();

    // A running job and, behind it, a queued one (every provider is busy).
    let running = client(&server).submit(&long_job).await.unwrap().id;
    wait_for_job(
        &server,
        running,
        "a few checkpoints",
        Duration::from_secs(120),
        |j| j.step >= 30,
    )
    .await;
    let queued = client(&server).submit(&short_job).await.unwrap().id;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(client(&server).job(queued).await.unwrap().status, "queued");
    let total_steps = client(&server).job(running).await.unwrap().total_steps;

    server = server.kill_and_restart(HEARTBEAT_TIMEOUT_MS).unwrap();
    // Back in the queue (or, if the providers were quick, already planned
    // again): a job the restart interrupted is never failed.
    let after = client(&server).job(running).await.unwrap();
    assert!(
        matches!(after.status.as_str(), "queued" | "planning" | "running"),
        "{after:#?}"
    );
    assert_eq!(client(&server).job(queued).await.unwrap().status, "queued");
    assert_eq!(
        client(&server).metrics(finished).await.unwrap(),
        finished_metrics
    );
    client(&server)
        .download(finished, None, &weights)
        .await
        .unwrap();
    assert_eq!(std::fs::read(&weights).unwrap(), weights_before);

    // The providers reconnect by themselves; the running job resumes from its
    // checkpoint, then the queued one runs.
    let done = wait_for_job(
        &server,
        running,
        "the resumed job",
        Duration::from_secs(300),
        |j| j.status == "completed",
    )
    .await;
    assert_eq!(done.step, total_steps);
    let log = log(&server, running).await;
    assert!(
        log.iter()
            .any(|l| l.message.contains("resuming from the checkpoint at step")),
        "{log:#?}"
    );
    let metrics = client(&server).metrics(running).await.unwrap();
    assert_continuous(&metrics, total_steps, 2);
    let undisturbed = rookery_train(&long_job, 4, &dir.path().join("undisturbed")).unwrap();
    let got = metrics.epochs.last().unwrap().test_accuracy;
    let want = undisturbed.epochs.last().unwrap().test_accuracy;
    assert!(
        (got - want).abs() <= 0.01,
        "accuracy {got} across the restart, {want} undisturbed"
    );
    wait_for_job(
        &server,
        queued,
        "the queued job",
        Duration::from_secs(120),
        |j| j.status == "completed",
    )
    .await;
}
