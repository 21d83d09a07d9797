//! The subcommands that talk to a running server: `submit`, `jobs`,
//! `watch`, `download` and `cancel`.

use std::path::PathBuf;

use anyhow::Context;
use rookery_proto::api::{JobInfo, JobMetrics};

use super::client::{Client, describe};

#[derive(clap::Args, Debug)]
pub struct ServerArgs {
    /// The server, e.g. http://127.0.0.1:8080.
    #[arg(long, env = "ROOKERY_SERVER", default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// The API token the server printed (default: read from ./rookery-data/api-token).
    #[arg(long, env = "ROOKERY_TOKEN")]
    pub token: Option<String>,
}

impl ServerArgs {
    pub fn client(&self) -> anyhow::Result<Client> {
        let token = match &self.token {
            Some(token) => token.clone(),
            None => std::fs::read_to_string("rookery-data/api-token").context(
                "no API token: pass --token (or set ROOKERY_TOKEN) with the token the server printed",
            )?,
        };
        Ok(Client::new(&self.server, &token))
    }
}

/// `rookery submit`: prints the job id (and the importer's warnings).
pub async fn submit(job: PathBuf, server: ServerArgs) -> anyhow::Result<()> {
    let created = server.client()?.submit(&job).await?;
    for warning in &created.warnings {
        eprintln!("warning: {warning}");
    }
    println!("{}", created.id);
    Ok(())
}

/// `rookery jobs`: one line per job.
pub async fn jobs(server: ServerArgs) -> anyhow::Result<()> {
    for job in server.client()?.jobs().await? {
        println!("{}", describe(&job));
    }
    Ok(())
}

/// `rookery watch`: a progress bar until the job finishes, then its accuracy.
pub async fn watch(id: u64, server: ServerArgs) -> anyhow::Result<()> {
    let client = server.client()?;
    let job = client.watch(id).await?;
    finished(&job)?;
    print_accuracy(&client.metrics(id).await?);
    Ok(())
}

/// `rookery download`: the job's weights (or latest checkpoint) to `out`.
pub async fn download(
    id: u64,
    cluster: Option<usize>,
    out: PathBuf,
    server: ServerArgs,
) -> anyhow::Result<()> {
    let bytes = server.client()?.download(id, cluster, &out).await?;
    println!("wrote {} ({bytes} bytes)", out.display());
    Ok(())
}

/// `rookery cancel`.
pub async fn cancel(id: u64, server: ServerArgs) -> anyhow::Result<()> {
    let job = server.client()?.cancel(id).await?;
    println!("{}", describe(&job));
    Ok(())
}

/// Whether the job completed; an error saying how it ended otherwise.
pub fn finished(job: &JobInfo) -> anyhow::Result<()> {
    match job.status.as_str() {
        "completed" => Ok(()),
        status => anyhow::bail!(
            "job {} {status}: {}",
            job.id,
            job.detail.as_deref().unwrap_or("no reason recorded")
        ),
    }
}

/// The last evaluated epoch's figures.
pub fn print_accuracy(metrics: &JobMetrics) {
    if let Some(last) = metrics.epochs.last() {
        println!(
            "test accuracy {:.2}% (loss {:.4}) on {} held-out samples",
            last.test_accuracy * 100.0,
            last.test_loss,
            last.samples
        );
    }
}
