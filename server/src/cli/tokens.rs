//! `rookery token`: Requesters and their API tokens, in a server's data dir.
//!
//! These commands write the database a running server reads on every
//! request, so a revocation or a new token counts at once, without a
//! restart.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Subcommand;

use crate::now_ms;
use crate::store::Db;
use crate::store::requesters::{self, FIRST};
use crate::store::tokens::{Token, token_path};

#[derive(Subcommand, Debug)]
pub enum TokenCommand {
    /// Make a Requester with a fresh API token, or give a revoked one a new
    /// token (and its jobs back); prints the token once.
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
    /// Revoke a Requester's token, at once, on a running server too; its
    /// jobs stay, readable again once `create NAME` issues a new token.
    Revoke {
        name: String,
        #[arg(long, default_value = "rookery-data")]
        data_dir: PathBuf,
    },
}

fn open(data_dir: &Path) -> anyhow::Result<Db> {
    Db::open_in_dir(data_dir)
        .with_context(|| format!("opening the data directory {}", data_dir.display()))
}

/// Carries out `action`.
pub async fn run(action: TokenCommand) -> anyhow::Result<()> {
    match action {
        TokenCommand::Create { name, data_dir } => create(&name, &data_dir).await,
        TokenCommand::List { data_dir } => {
            for listed in requesters::list(&open(&data_dir)?).await? {
                match listed.revoked_ms {
                    None => println!("{}", listed.requester.name),
                    Some(_) => println!("{} (revoked)", listed.requester.name),
                }
            }
            Ok(())
        }
        TokenCommand::Revoke { name, data_dir } => revoke(&name, &data_dir).await,
    }
}

async fn create(name: &str, data_dir: &Path) -> anyhow::Result<()> {
    let db = open(data_dir)?;
    let token = Token::generate();
    if name == FIRST {
        // The data dir's token file is the first Requester's token: it must
        // hold the new one before the database does, or a server started in
        // between would take the file's token for a replacement.
        refuse_a_working_token(&db, name).await?;
        token.save(data_dir).with_context(|| {
            format!("writing the token file {}", token_path(data_dir).display())
        })?;
    }
    let issued = requesters::issue(&db, name, &token, now_ms()).await?;
    let name = &issued.requester.name;
    if issued.reissued {
        eprintln!(
            "Requester `{name}` had its token revoked; this new API token gives it its jobs back. It follows, shown only this once."
        );
    } else {
        eprintln!(
            "Requester `{name}` created. Their API token follows; it is shown only this once."
        );
    }
    if name == FIRST {
        eprintln!("(Also written to {}.)", token_path(data_dir).display());
    }
    println!("{}", token.secret());
    Ok(())
}

/// Fails with [`requesters::CreateError::Taken`] when `name` has a working
/// token, before anything is written.
async fn refuse_a_working_token(db: &Db, name: &str) -> anyhow::Result<()> {
    let working = requesters::list(db)
        .await?
        .into_iter()
        .any(|l| l.requester.name == name && l.revoked_ms.is_none());
    if working {
        return Err(requesters::CreateError::Taken(name.to_string()).into());
    }
    Ok(())
}

async fn revoke(name: &str, data_dir: &Path) -> anyhow::Result<()> {
    let db = open(data_dir)?;
    let revoked = requesters::revoke(&db, name, now_ms()).await?;
    if name == FIRST {
        // Its token lives in this file; nobody should pick up a dead secret.
        Token::remove_file(data_dir).with_context(|| {
            format!("deleting the token file {}", token_path(data_dir).display())
        })?;
    }
    let jobs = match revoked.jobs {
        1 => "Its 1 job stays".to_string(),
        n => format!("Its {n} jobs stay"),
    };
    if revoked.already {
        eprintln!("Requester `{name}` was revoked already; nothing changed.");
    } else {
        eprintln!(
            "Requester `{name}` revoked: its token is refused from now on, by a running server too."
        );
    }
    eprintln!(
        "{jobs} (running ones go on), readable by nobody until `rookery token create {name}` issues it a new token."
    );
    if name == FIRST {
        eprintln!(
            "{} is deleted; the next `rookery serve` on this data dir makes a new one, as on a first start.",
            token_path(data_dir).display()
        );
    }
    Ok(())
}
