//! The Requester's side of the REST API, for the `rookery` command line:
//! submit a job with its files, list jobs, watch one, download weights, and
//! `train`, which runs all of that against an embedded server and local
//! providers.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use futures_util::StreamExt;
use rookery_job::{DataRef, JobSpec, ModelSource};
use rookery_proto::api::{
    ApiError, JobCreated, JobInfo, JobMetrics, ProviderInfo, ProviderList, ProviderStatus,
};
use tokio::io::AsyncWriteExt;

/// A server and the token to talk to it.
#[derive(Debug, Clone)]
pub struct Client {
    base: String,
    token: String,
    http: reqwest::Client,
}

/// Turns what a person types (`127.0.0.1:8080`, `http://host/`, `ws://host`) into the HTTP base URL.
pub fn http_base(server: &str) -> String {
    let server = server.trim().trim_end_matches('/');
    let rest = server
        .split_once("://")
        .map(|(_, rest)| rest)
        .unwrap_or(server);
    let host = rest.split('/').next().unwrap_or(rest);
    format!("http://{host}")
}

impl Client {
    pub fn new(server: &str, token: &str) -> Self {
        Client {
            base: http_base(server),
            token: token.trim().to_string(),
            http: reqwest::Client::new(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn check(response: reqwest::Response) -> anyhow::Result<reqwest::Response> {
        if response.status().is_success() {
            return Ok(response);
        }
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        let message = serde_json::from_str::<ApiError>(&body)
            .map(|e| e.error)
            .unwrap_or(body);
        bail!("the server answered {status}: {message}")
    }

    async fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        let response = self
            .http
            .get(self.url(path))
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("cannot reach {}", self.base))?;
        Ok(Self::check(response).await?.json().await?)
    }

    /// Every provider the server keeps (the client always has a token).
    pub async fn providers(&self) -> anyhow::Result<Vec<ProviderInfo>> {
        let list: ProviderList = self.get_json("/api/providers").await?;
        Ok(list.providers)
    }

    pub async fn jobs(&self) -> anyhow::Result<Vec<JobInfo>> {
        self.get_json("/api/jobs").await
    }

    pub async fn job(&self, id: u64) -> anyhow::Result<JobInfo> {
        self.get_json(&format!("/api/jobs/{id}")).await
    }

    pub async fn metrics(&self, id: u64) -> anyhow::Result<JobMetrics> {
        self.get_json(&format!("/api/jobs/{id}/metrics")).await
    }

    /// Uploads the job file (as JSON naming the uploaded files) and every
    /// file it references: the model (and an ONNX model's `.data` side
    /// file) and the datasets.
    pub async fn submit(&self, job_file: &Path) -> anyhow::Result<JobCreated> {
        let mut spec = JobSpec::from_file(job_file)
            .with_context(|| format!("reading the job file {}", job_file.display()))?;
        let mut files: BTreeMap<String, PathBuf> = BTreeMap::new();
        let mut upload_name = |path: &Path| -> PathBuf {
            let base = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "file".into());
            // Two different files with one name get distinct upload names.
            let mut name = base.clone();
            let mut n = 1;
            while files.get(&name).is_some_and(|p| p != path) {
                name = format!("{n}-{base}");
                n += 1;
            }
            files.insert(name.clone(), path.to_path_buf());
            PathBuf::from(name)
        };
        let model_path = spec.model.source.path().to_path_buf();
        let model_name = upload_name(&model_path);
        // The dynamo exporter writes weights beside the model; keep the pair together.
        let side = PathBuf::from(format!("{}.data", model_path.display()));
        let side = (matches!(spec.model.source, ModelSource::Onnx(_)) && side.is_file())
            .then(|| (format!("{}.data", model_name.display()), side));
        spec.model.source = match spec.model.source {
            ModelSource::Onnx(_) => ModelSource::Onnx(model_name),
            ModelSource::Spec(_) => ModelSource::Spec(model_name),
        };
        let mut rename = |r: &DataRef| DataRef {
            path: upload_name(&r.path),
            member: r.member.clone(),
        };
        spec.data.train_inputs = rename(&spec.data.train_inputs);
        spec.data.train_labels = spec.data.train_labels.take().map(|r| rename(&r));
        spec.data.test_inputs = spec.data.test_inputs.as_ref().map(&mut rename);
        spec.data.test_labels = spec.data.test_labels.as_ref().map(&mut rename);
        files.extend(side);
        let job_name = job_file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "job.json".into());
        let mut form = reqwest::multipart::Form::new().part(
            crate::http::upload::JOB_PART,
            reqwest::multipart::Part::text(spec.to_json()?).file_name(job_name),
        );
        for (name, path) in files {
            // Streamed from disk: a GPT-2's weights need not sit in memory.
            let file = tokio::fs::File::open(&path)
                .await
                .with_context(|| format!("reading {}", path.display()))?;
            let len = file
                .metadata()
                .await
                .with_context(|| format!("reading {}", path.display()))?
                .len();
            let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(file));
            form = form.part(
                name.clone(),
                reqwest::multipart::Part::stream_with_length(body, len).file_name(name),
            );
        }
        let response = self
            .http
            .post(self.url("/api/jobs"))
            .bearer_auth(&self.token)
            .multipart(form)
            .send()
            .await
            .with_context(|| format!("cannot reach {}", self.base))?;
        Ok(Self::check(response).await?.json().await?)
    }

    pub async fn cancel(&self, id: u64) -> anyhow::Result<JobInfo> {
        let response = self
            .http
            .post(self.url(&format!("/api/jobs/{id}/cancel")))
            .bearer_auth(&self.token)
            .send()
            .await?;
        Ok(Self::check(response).await?.json().await?)
    }

    /// Writes the job's weights (or latest checkpoint) to `out`.
    /// Downloads a job's weights into `out`: the combined ones, or one
    /// cluster's own.
    pub async fn download(
        &self,
        id: u64,
        cluster: Option<usize>,
        out: &Path,
    ) -> anyhow::Result<u64> {
        let query = cluster.map(|c| format!("?cluster={c}")).unwrap_or_default();
        let response = self
            .http
            .get(self.url(&format!("/api/jobs/{id}/weights{query}")))
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("cannot reach {}", self.base))?;
        let response = Self::check(response).await?;
        if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
            tokio::fs::create_dir_all(dir).await?;
        }
        // Chunk by chunk to disk: the weights need not fit in memory twice.
        // Into a side file first, so a broken download leaves no torn file.
        let part = PathBuf::from(format!("{}.part", out.display()));
        let writing = || format!("writing {}", part.display());
        let mut file = tokio::fs::File::create(&part).await.with_context(writing)?;
        let mut body = response.bytes_stream();
        let mut written = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.with_context(|| format!("downloading job {id}'s weights"))?;
            file.write_all(&chunk).await.with_context(writing)?;
            written += chunk.len() as u64;
        }
        file.flush().await.with_context(writing)?;
        drop(file);
        tokio::fs::rename(&part, out)
            .await
            .with_context(|| format!("moving {} to {}", part.display(), out.display()))?;
        Ok(written)
    }

    /// Follows a job until it finishes, drawing a progress bar on stderr.
    pub async fn watch(&self, id: u64) -> anyhow::Result<JobInfo> {
        let mut progress = Progress::new();
        loop {
            let job = self.job(id).await?;
            progress.show(&job);
            if matches!(job.status.as_str(), "completed" | "failed" | "cancelled") {
                progress.finish();
                return Ok(job);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits until at least `count` providers are connected.
    pub async fn wait_for_providers(&self, count: usize, timeout: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let connected = self
                .providers()
                .await?
                .iter()
                .filter(|p| p.status == ProviderStatus::Connected)
                .count();
            if connected >= count {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!("only {connected} of {count} providers connected within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// A one-line progress display: redrawn in place on a terminal, a line per
/// tenth of the job otherwise (logs stay short).
struct Progress {
    tty: bool,
    last_tenth: Option<u64>,
    last_status: String,
}

impl Progress {
    fn new() -> Self {
        Progress {
            tty: std::io::stderr().is_terminal(),
            last_tenth: None,
            last_status: String::new(),
        }
    }

    fn show(&mut self, job: &JobInfo) {
        let line = describe(job);
        let mut err = std::io::stderr();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K{line}");
            let _ = err.flush();
            return;
        }
        let tenth = (job.step * 10).checked_div(job.total_steps).unwrap_or(0);
        if self.last_tenth != Some(tenth) || self.last_status != job.status {
            let _ = writeln!(err, "{line}");
            self.last_tenth = Some(tenth);
            self.last_status = job.status.clone();
        }
    }

    fn finish(&self) {
        if self.tty {
            eprintln!();
        }
    }
}

/// `job 3 running [########------------] 120/300 loss 0.4321 5120 samples/s`
pub fn describe(job: &JobInfo) -> String {
    const WIDTH: u64 = 20;
    let filled = (job.step * WIDTH)
        .checked_div(job.total_steps)
        .unwrap_or(0)
        .min(WIDTH);
    let bar: String = (0..WIDTH)
        .map(|i| if i < filled { '#' } else { '-' })
        .collect();
    let mut line = format!(
        "job {} {} [{bar}] {}/{}",
        job.id, job.status, job.step, job.total_steps
    );
    if let Some(loss) = job.last_loss {
        line.push_str(&format!(" loss {loss:.4}"));
    }
    if let Some(rate) = job.samples_per_s {
        line.push_str(&format!(" {rate:.0} samples/s"));
    }
    if let Some(detail) = &job.detail {
        line.push_str(&format!(" ({detail})"));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_addresses_become_http_bases() {
        for (given, want) in [
            ("127.0.0.1:8080", "http://127.0.0.1:8080"),
            ("http://127.0.0.1:8080/", "http://127.0.0.1:8080"),
            ("ws://host:1/ws/provider", "http://host:1"),
        ] {
            assert_eq!(http_base(given), want);
        }
    }
}
