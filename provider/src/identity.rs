//! Where a provider keeps the credential a server issued it, so that its
//! faults, bans and credit follow it across restarts. One file per server
//! and provider name, readable by its owner only.

use std::io::Write;
use std::path::{Path, PathBuf};

use rookery_proto::MAX_CREDENTIAL_CHARS;

/// Why a credential file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    #[error("cannot read the credential file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot write the credential file {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "the credential file {path} does not hold a credential (1 to {MAX_CREDENTIAL_CHARS} letters and digits); delete it to get a new identity"
    )]
    Malformed { path: String },
}

/// A provider's credential store: a file, or nothing (the credential lives
/// as long as the process).
#[derive(Debug, Clone, PartialEq)]
pub struct CredentialFile(Option<PathBuf>);

impl CredentialFile {
    pub fn at(path: PathBuf) -> Self {
        CredentialFile(Some(path))
    }

    /// Keeps the credential in memory only.
    pub fn ephemeral() -> Self {
        CredentialFile(None)
    }

    /// The default file for a provider named `name` of `server`, under the
    /// user's state folder (`$XDG_STATE_HOME`, `~/.local/state`, or
    /// `%LOCALAPPDATA%`); ephemeral where there is none.
    pub fn default_for(server_url: &str, name: &str) -> Self {
        let base = std::env::var_os("XDG_STATE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".local/state")))
            .or_else(|| std::env::var_os("LOCALAPPDATA").map(PathBuf::from));
        match base {
            Some(base) => CredentialFile(Some(
                base.join("rookery")
                    .join("credentials")
                    .join(file_name(server_url))
                    .join(file_name(name)),
            )),
            None => CredentialFile(None),
        }
    }

    pub fn path(&self) -> Option<&Path> {
        self.0.as_deref()
    }

    /// The kept credential; `None` before the first visit.
    pub fn load(&self) -> Result<Option<String>, CredentialError> {
        let Some(path) = &self.0 else {
            return Ok(None);
        };
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(CredentialError::Read {
                    path: path.display().to_string(),
                    source,
                });
            }
        };
        let credential = text.trim();
        if credential.is_empty()
            || credential.len() > MAX_CREDENTIAL_CHARS
            || !credential.chars().all(|c| c.is_ascii_alphanumeric())
        {
            return Err(CredentialError::Malformed {
                path: path.display().to_string(),
            });
        }
        Ok(Some(credential.to_owned()))
    }

    /// Keeps `credential`, replacing any older one whole: written to a new
    /// file readable by its owner only, then renamed over the old one.
    pub fn save(&self, credential: &str) -> Result<(), CredentialError> {
        let Some(path) = &self.0 else {
            return Ok(());
        };
        let error = |source| CredentialError::Write {
            path: path.display().to_string(),
            source,
        };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(error)?;
        }
        let partial = path.with_extension("partial");
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut file = options.open(&partial).map_err(error)?;
        file.write_all(credential.as_bytes()).map_err(error)?;
        file.sync_all().map_err(error)?;
        std::fs::rename(&partial, path).map_err(error)
    }
}

/// `text` as one safe file name: letters, digits, `-`, `_` and `.` kept,
/// anything else `_`.
fn file_name(text: &str) -> String {
    let name: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .take(96)
        .collect();
    match name.trim_matches('.') {
        "" => "_".into(),
        _ => name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_credential_loads_back_and_is_private() {
        let dir = std::env::temp_dir().join(format!("rookery-cred-{}", std::process::id()));
        let file = CredentialFile::at(dir.join("a/b/provider"));
        assert_eq!(file.load().unwrap(), None);
        file.save("abc123").unwrap();
        file.save("def456").unwrap();
        assert_eq!(file.load().unwrap().as_deref(), Some("def456"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(file.path().unwrap())
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        std::fs::write(file.path().unwrap(), "not a credential!").unwrap();
        assert!(matches!(
            file.load(),
            Err(CredentialError::Malformed { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
        let memory = CredentialFile::ephemeral();
        memory.save("abc").unwrap();
        assert_eq!(memory.load().unwrap(), None);
    }

    #[test]
    fn server_addresses_and_names_become_safe_file_names() {
        let cases = [
            (
                "ws://127.0.0.1:8080/ws/provider",
                "ws___127.0.0.1_8080_ws_provider",
            ),
            ("../../etc", ".._.._etc"),
            ("..", "_"),
            ("", "_"),
            ("laptop-7", "laptop-7"),
        ];
        for (text, want) in cases {
            assert_eq!(file_name(text), want, "{text}");
        }
    }
}
