//! `rookery token`: Requesters and their API tokens, in a server's data dir.

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;

use crate::now_ms;
use crate::store::{Db, requesters};

#[derive(Subcommand, Debug)]
pub enum TokenCommand {
    /// Make a Requester with a fresh API token; prints the token once.
    Create {
        /// Letters, digits, `.`, `_` or `-`.
        name: String,
        #[arg(long, default_value = "rookery-data")]
        data_dir: PathBuf,
    },
    /// List the Requesters (names only; tokens are not stored).
    List {
        #[arg(long, default_value = "rookery-data")]
        data_dir: PathBuf,
    },
}

/// Carries out `action`.
pub async fn run(action: TokenCommand) -> anyhow::Result<()> {
    match action {
        TokenCommand::Create { name, data_dir } => {
            let db = Db::open_in_dir(&data_dir)
                .with_context(|| format!("opening the data directory {}", data_dir.display()))?;
            let (requester, token) = requesters::create(&db, &name, now_ms()).await?;
            eprintln!(
                "Requester `{}` created. Their API token follows; it is shown only this once.",
                requester.name
            );
            println!("{}", token.secret());
            Ok(())
        }
        TokenCommand::List { data_dir } => {
            let db = Db::open_in_dir(&data_dir)
                .with_context(|| format!("opening the data directory {}", data_dir.display()))?;
            for requester in requesters::list(&db).await? {
                println!("{}", requester.name);
            }
            Ok(())
        }
    }
}
