//! `rookery`: the Rookery server and the Requester's command line. The
//! subcommands live in the library's [`rookery_server::cli`]; this file
//! parses the command line and picks one.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use rookery_server::cli::{generate, plan, predict, remote, serve, tokens, train};

#[derive(Parser, Debug)]
#[command(
    name = "rookery",
    version,
    about = "Train deep learning models on donated hardware"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the server: REST API, provider WebSocket and dashboard.
    Serve(serve::ServeArgs),
    /// Show how a model would be split over a set of providers.
    Plan(plan::PlanArgs),
    /// Submit a job file (and the files it names) to a server; prints the job id.
    Submit {
        job: PathBuf,
        #[command(flatten)]
        server: remote::ServerArgs,
    },
    /// List the server's jobs.
    Jobs {
        #[command(flatten)]
        server: remote::ServerArgs,
    },
    /// Follow a job with a progress bar until it finishes.
    Watch {
        id: u64,
        #[command(flatten)]
        server: remote::ServerArgs,
    },
    /// Download a job's trained weights (safetensors).
    Download {
        id: u64,
        #[arg(short, long, default_value = "weights.safetensors")]
        out: PathBuf,
        /// One cluster's own weights as it finished (0-based; Ravnest's
        /// `model_fusion(cluster_id)`) instead of the clusters' combined ones.
        #[arg(long)]
        cluster: Option<usize>,
        #[command(flatten)]
        server: remote::ServerArgs,
    },
    /// Cancel a job.
    Cancel {
        id: u64,
        #[command(flatten)]
        server: remote::ServerArgs,
    },
    /// Train a job here: an embedded server and N local providers; writes
    /// DIR/weights.safetensors and DIR/metrics.json.
    Train(train::TrainArgs),
    /// Sample text from a trained language model on this machine (forward only).
    Generate(generate::GenerateArgs),
    /// Run one forward pass of a model on `.npy` inputs on this machine and
    /// write each output as `.npy`.
    Predict(predict::PredictArgs),
    /// Manage Requesters' API tokens in a server's data directory.
    Token {
        #[command(subcommand)]
        action: tokens::TokenCommand,
    },
}

/// Errors print as one readable chain (`error: a: b`), never as a backtrace.
fn main() -> std::process::ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Commands for people show their own progress; only `serve` narrates.
    let default_filter = match cli.command {
        Command::Serve(_) => "info,tower_http=warn",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .init();
    match cli.command {
        Command::Serve(args) => serve::run(args).await,
        Command::Plan(args) => plan::run(args),
        Command::Submit { job, server } => remote::submit(job, server).await,
        Command::Jobs { server } => remote::jobs(server).await,
        Command::Watch { id, server } => remote::watch(id, server).await,
        Command::Download {
            id,
            out,
            cluster,
            server,
        } => remote::download(id, cluster, out, server).await,
        Command::Cancel { id, server } => remote::cancel(id, server).await,
        Command::Train(args) => train::run(args).await,
        Command::Generate(args) => generate::run(args).await,
        Command::Predict(args) => predict::run(args).await,
        Command::Token { action } => tokens::run(action).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A relay delay simulates a slow link for benchmarks; every other build
    /// refuses the flag outright rather than ignoring it.
    #[test]
    fn only_a_benchmark_build_takes_a_relay_delay() {
        for args in [
            &["rookery", "serve", "--relay-delay-ms", "20"][..],
            &["rookery", "train", "job.toml", "--relay-delay-ms", "20"],
        ] {
            let parsed = Cli::try_parse_from(args);
            assert_eq!(
                parsed.is_ok(),
                cfg!(feature = "bench-latency"),
                "{args:?}: {:?}",
                parsed.err().map(|e| e.to_string())
            );
        }
    }
}
