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

use anyhow::bail;
use rookery_e2e::{NpyValues, Process, Server, provider_command, rookery, write_npy};
use rookery_proto::api::{JobInfo, LogEntry, ProviderStatus};

const MLP: &str = r#"
input_shape = [6]
[[layers]]
type = "Dense"
units = 16
activation = "relu"
[[layers]]
type = "Dense"
units = 3
"#;

/// A job on a synthetic 3-class dataset of `samples` samples, in its own folder.
fn job(dir: &Path, name: &str, samples: usize, training: &str) -> PathBuf {
    let dir = dir.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("model.toml"), MLP).unwrap();
    let x: Vec<f32> = (0..samples * 6)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let y: Vec<i64> = (0..samples).map(|i| (i % 3) as i64).collect();
    write_npy(&dir.join("x.npy"), &[samples, 6], NpyValues::F32(&x)).unwrap();
    write_npy(&dir.join("y.npy"), &[samples], NpyValues::I64(&y)).unwrap();
    let path = dir.join("job.toml");
    std::fs::write(
        &path,
        format!(
            "[model]\nspec = \"model.toml\"\ninput_shape = [6]\n\
             [data]\nformat = \"npy\"\ntrain_inputs = \"x.npy\"\ntrain_labels = \"y.npy\"\n\
             [training]\n{training}\n"
        ),
    )
    .unwrap();
    path
}

struct Client<'a> {
    server: &'a Server,
    token: String,
    http: reqwest::Client,
}

impl Client<'_> {
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
    Process::spawn(provider_command(server, name, &extra)?.env("RUST_LOG", "warn"))
}

fn faults_of<'a>(log: &'a [LogEntry], name: &str) -> Vec<&'a LogEntry> {
    log.iter()
        .filter(|l| l.kind == "provider_fault" && l.message.contains(&format!("({name})")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_kind_of_wrong_data_is_caught_and_its_sender_dropped_or_banned_while_others_train()
-> anyhow::Result<()> {
    let server = Server::start(4000)?;
    let dir = tempfile::tempdir()?;
    let client = Client {
        server: &server,
        token: server.api_token()?,
        http: reqwest::Client::new(),
    };

    // An honest job on two honest providers, running beside every fault.
    let _honest: Vec<Process> = (0..2)
        .map(|i| provider(&server, &format!("honest-{i}"), None))
        .collect::<anyhow::Result<_>>()?;
    server
        .wait_for_providers("the honest providers", Duration::from_secs(120), |all| {
            all.iter().filter(|p| p.bandwidth_mbps.is_some()).count() == 2
        })
        .await?;
    let steady = client.submit(&job(
        dir.path(),
        "steady",
        4000,
        "batch_size = 8\nmicro_batches = 2\nclusters = 1\nstages = 2\nepochs = 20\n\
         optimizer = { name = \"sgd\", lr = 0.05 }",
    ))?;
    client
        .wait_for_log(steady, "the honest job running", |log| {
            log.iter().any(|l| l.kind == "running")
        })
        .await?;
    let before: JobInfo = client.get(&format!("/api/jobs/{steady}")).await?;

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
        let _pair = [
            provider(&server, &format!("partner-{fault}"), None)?,
            provider(&server, &name, Some(fault))?,
        ];
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
        let partner = format!("partner-{fault}");
        assert!(
            providers
                .iter()
                .any(|p| p.name == partner && p.status == ProviderStatus::Connected),
            "{fault}: the partner was dropped too: {providers:#?}"
        );
        client.cancel(id)?;
    }

    // Far-off parameters at a sync: three clusters with the median, so the
    // job goes on; the faults count, and the third bans the provider.
    let name = "faulty-far-params";
    let _three = [
        provider(&server, "far-a", None)?,
        provider(&server, "far-b", None)?,
        provider(&server, name, Some("far-params"))?,
    ];
    let id = client.submit(&job(
        dir.path(),
        "far",
        480,
        "batch_size = 8\nclusters = 3\nstages = 1\nsync_every = 1\naggregation = \"median\"",
    ))?;
    let log = client
        .wait_for_log(id, "the ban", |log| {
            log.iter().any(|l| l.kind == "provider_banned")
        })
        .await?;
    let counted = faults_of(&log, name);
    assert_eq!(counted.len(), 3, "{log:#?}");
    for (i, line) in counted.iter().enumerate() {
        assert!(
            line.message.contains(&format!("fault {} of 3", i + 1))
                && line.message.contains("away from the median"),
            "{}",
            line.message
        );
        // One fault per sync: the job went on between them.
        assert!(
            line.message.contains(&format!("sync of step {}", i + 1)),
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
    client.cancel(id)?;

    // The server kept serving, and the honest job trained through all of it
    // (it may have finished already) without a fault of its own.
    let after: JobInfo = client.get(&format!("/api/jobs/{steady}")).await?;
    assert!(
        after.status == "completed" || (after.status == "running" && after.step > before.step),
        "the honest job: {after:?} (before the faults: {before:?})"
    );
    let log = client.log(steady).await?;
    assert!(log.iter().all(|l| l.kind != "provider_fault"), "{log:#?}");
    client.cancel(steady)?;
    Ok(())
}
