//! Tokens: every job endpoint requires a Requester's token as
//! `Authorization: Bearer <token>` and serves that Requester only; the first
//! Requester's token is created on the server's first start, kept in the data
//! dir (readable by its owner only) and printed. Providers may be required to
//! present a join token on the WebSocket upgrade. The server keeps only
//! SHA-256 digests of tokens (in the database, or in memory for the join token).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};

use crate::AppState;
use crate::error::AppError;
use crate::requesters;

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
        std::fs::create_dir_all(data_dir)?;
        let token = Token::generate();
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, token.secret())?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
        }
        std::fs::rename(&tmp, &path)?;
        Ok(token)
    }

    /// Constant-time comparison, so response times do not leak a prefix.
    pub fn matches(&self, candidate: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), candidate.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

/// The `Bearer` token of a request, if it has one.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// Middleware: the request must carry a Requester's token; handlers find
/// that [`requesters::Requester`] in the request's extensions.
pub async fn require_token(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, AppError> {
    let Some(given) = bearer(request.headers()) else {
        return Err(AppError::Unauthorized(
            "this endpoint needs a Requester's API token as `Authorization: Bearer <token>` (the server printed the first one at start; it is in the data dir's api-token file)",
        ));
    };
    match requesters::authenticate(&state.db, given).await? {
        Some(requester) => {
            request.extensions_mut().insert(requester);
            Ok(next.run(request).await)
        }
        None => Err(AppError::Unauthorized("the API token is wrong")),
    }
}

/// The join token providers must present, kept as its digest only.
#[derive(Clone)]
pub struct ProviderToken([u8; 32]);

impl std::fmt::Debug for ProviderToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProviderToken(..)")
    }
}

impl ProviderToken {
    pub fn new(secret: &str) -> Self {
        ProviderToken(Sha256::digest(secret.as_bytes()).into())
    }

    /// Digests compared in constant time.
    pub fn matches(&self, candidate: &str) -> bool {
        let candidate: [u8; 32] = Sha256::digest(candidate.as_bytes()).into();
        self.0
            .iter()
            .zip(candidate)
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
    }

    /// Whether a WebSocket upgrade carries the token: as a `Bearer` header
    /// (native providers) or as the `token` query parameter (browsers cannot
    /// set headers on a WebSocket).
    pub fn admits(&self, headers: &HeaderMap, query: Option<&str>) -> bool {
        let from_query = query
            .into_iter()
            .flat_map(|q| q.split('&'))
            .find_map(|pair| pair.strip_prefix("token=").map(percent_decode));
        bearer(headers)
            .map(str::to_string)
            .into_iter()
            .chain(from_query)
            .any(|candidate| self.matches(&candidate))
    }
}

/// Decodes `%XX` escapes and `+` of a query value; bad escapes stay as they are.
fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(hi), Some(lo)) => {
                    out.push((hi * 16 + lo) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
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
    }

    #[test]
    fn the_join_token_is_accepted_from_a_header_or_the_query() {
        let token = ProviderToken::new("join me");
        let mut headers = HeaderMap::new();
        let cases: [(Option<&str>, Option<&str>, bool); 8] = [
            (None, None, false),
            (Some("Bearer join me"), None, true),
            (Some("Bearer join"), None, false),
            (Some("join me"), None, false),
            (None, Some("token=join%20me"), true),
            (None, Some("name=x&token=join+me"), true),
            (None, Some("token=join%2"), false),
            (Some("Bearer wrong"), Some("token=wrong"), false),
        ];
        for (header, query, admitted) in cases {
            headers.remove(AUTHORIZATION);
            if let Some(value) = header {
                headers.insert(AUTHORIZATION, value.parse().unwrap());
            }
            assert_eq!(
                token.admits(&headers, query),
                admitted,
                "{header:?} {query:?}"
            );
        }
        assert_eq!(format!("{token:?}"), "ProviderToken(..)");
    }
}
