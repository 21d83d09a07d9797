//! Who may connect: a cap on simultaneous HTTP connections per IP address
//! (checked as the server accepts), and for a provider WebSocket the join
//! token (when the server requires one) and a cap on provider connections
//! per IP, both checked before the upgrade so a refused peer costs one HTTP
//! response. Plain data with no handlers, so the app state can hold it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use sha2::{Digest, Sha256};

/// Live provider connections per IP address.
#[derive(Debug, Clone, Default)]
pub struct ConnectionCounter(Arc<Mutex<HashMap<IpAddr, usize>>>);

/// One counted connection; dropping it frees the slot.
#[derive(Debug)]
pub struct Slot {
    counter: ConnectionCounter,
    ip: IpAddr,
}

impl ConnectionCounter {
    /// A slot for `ip`, unless it holds `max` already.
    pub fn take(&self, ip: IpAddr, max: usize) -> Option<Slot> {
        let mut counts = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let count = counts.entry(ip).or_insert(0);
        if *count >= max {
            return None;
        }
        *count += 1;
        Some(Slot {
            counter: self.clone(),
            ip,
        })
    }

    pub fn count(&self, ip: IpAddr) -> usize {
        let counts = self.0.lock().unwrap_or_else(|p| p.into_inner());
        counts.get(&ip).copied().unwrap_or(0)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = self.counter.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = counts.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.ip);
            }
        }
    }
}

/// Answers a connection over the per-IP cap with a 429 and closes it,
/// without reading its request (the peer may be a flood).
pub async fn refuse_connection(mut tcp: tokio::net::TcpStream, ip: IpAddr, max: usize) {
    use tokio::io::AsyncWriteExt;
    tracing::info!(%ip, max, "too many HTTP connections from one address");
    let body = format!(
        r#"{{"error":"too many connections from {ip} (at most {max}); close some and retry"}}"#
    );
    let response = format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let write = async {
        tcp.write_all(response.as_bytes()).await?;
        tcp.shutdown().await
    };
    // A peer that does not read gets nothing more than a second of our time.
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), write).await;
}

/// The `Bearer` token of a request, if it has one.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
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
    fn slots_are_capped_per_address_and_freed_on_drop() {
        let counter = ConnectionCounter::default();
        let a: IpAddr = [10, 0, 0, 1].into();
        let b: IpAddr = [10, 0, 0, 2].into();
        let first = counter.take(a, 2).unwrap();
        let second = counter.take(a, 2).unwrap();
        assert!(counter.take(a, 2).is_none());
        let other = counter.take(b, 2).unwrap();
        drop(first);
        assert_eq!(counter.count(a), 1);
        let third = counter.take(a, 2).unwrap();
        drop((second, third, other));
        assert_eq!((counter.count(a), counter.count(b)), (0, 0));
        assert!(counter.0.lock().unwrap().is_empty());
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
