//! Requesters' API tokens: the first Requester's is created on the server's
//! first start, kept in the data dir (readable by its owner only) and
//! printed. The server keeps only SHA-256 digests of tokens in the database
//! (see the `requesters` module).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// A token's SHA-256 digest as lowercase hex: what the database stores.
pub fn digest_hex(secret: &str) -> String {
    Sha256::digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A secret compared in constant time. Debug output never shows it.
#[derive(Clone)]
pub struct Token(Arc<str>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

pub fn token_path(data_dir: &Path) -> PathBuf {
    data_dir.join("api-token")
}

impl Token {
    pub fn new(secret: impl Into<Arc<str>>) -> Self {
        Token(secret.into())
    }

    /// 256 random bits as hex.
    pub fn generate() -> Self {
        let bytes: [u8; 32] = rand::random();
        Token(
            bytes
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
                .into(),
        )
    }

    pub fn secret(&self) -> &str {
        &self.0
    }

    /// What the server stores in place of the secret.
    pub fn digest(&self) -> String {
        digest_hex(&self.0)
    }

    /// Reads the data dir's token, creating it on first start.
    pub fn load_or_create(data_dir: &Path) -> std::io::Result<Self> {
        let path = token_path(data_dir);
        match std::fs::read_to_string(&path) {
            Ok(text) if !text.trim().is_empty() => return Ok(Token(text.trim().into())),
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
        let token = Token::generate();
        token.save(data_dir)?;
        Ok(token)
    }

    /// Writes this token as the data dir's token file, replacing any:
    /// `rookery token create default` after a revocation. The file holds
    /// the first Requester's token, so a reissued one must land there too,
    /// or the next start would take the file's old token for a replacement.
    pub fn save(&self, data_dir: &Path) -> std::io::Result<()> {
        let path = token_path(data_dir);
        std::fs::create_dir_all(data_dir)?;
        let tmp = path.with_extension("tmp");
        // A stale temporary file from a crash could have other permissions.
        match std::fs::remove_file(&tmp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        // Owner-only from the moment the file exists, never readable by
        // others even briefly; then written whole and renamed into place.
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut file = options.open(&tmp)?;
        std::io::Write::write_all(&mut file, self.secret().as_bytes())?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, &path)
    }

    /// Deletes the data dir's token file, if there is one: its token was
    /// revoked, and a dead secret left there would only mislead.
    pub fn remove_file(data_dir: &Path) -> std::io::Result<()> {
        match std::fs::remove_file(token_path(data_dir)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Constant-time comparison, so response times do not leak a prefix.
    pub fn matches(&self, candidate: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), candidate.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_created_once_and_then_reused() {
        let dir = tempfile::tempdir().unwrap();
        let first = Token::load_or_create(dir.path()).unwrap();
        let second = Token::load_or_create(dir.path()).unwrap();
        assert_eq!(first.secret(), second.secret());
        assert_eq!(first.secret().len(), 64);
        assert!(first.matches(second.secret()));
        assert!(!first.matches(&second.secret()[1..]));
        assert!(!first.matches(""));
        assert_ne!(Token::generate().secret(), first.secret());
        assert_eq!(format!("{first:?}"), "Token(..)");
        assert_eq!(first.digest(), digest_hex(first.secret()));
        assert_eq!(first.digest().len(), 64);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(token_path(dir.path()))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        }
    }
}
