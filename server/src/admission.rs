//! Who may connect: a cap on simultaneous HTTP connections per IP address
//! (checked as the server accepts), and for a provider WebSocket the page
//! it comes from (when the server lists the origins it allows), the join
//! token (when the server requires one) and a cap on provider connections
//! per IP, all checked before the upgrade so a refused peer costs one HTTP
//! response. Plain data with no handlers, so the app state can hold it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use axum::http::HeaderMap;
use axum::http::header::{AUTHORIZATION, HOST, ORIGIN};
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

/// A web origin as browsers send it in `Origin`: scheme, host and port,
/// compared with the host's case and a scheme's default port ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebOrigin {
    scheme: String,
    host: String,
    port: Option<u16>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not an origin: write scheme://host[:port], e.g. https://example.org")]
pub struct BadOrigin(String);

impl std::str::FromStr for WebOrigin {
    type Err = BadOrigin;

    /// `scheme://host[:port]`, with at most a trailing `/` (people paste
    /// URLs); a path, query, user or anything else is refused.
    fn from_str(text: &str) -> Result<Self, BadOrigin> {
        let bad = || BadOrigin(text.to_string());
        let trimmed = text.trim();
        let (scheme, rest) = trimmed.split_once("://").ok_or_else(bad)?;
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        let scheme_ok = !scheme.is_empty()
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
        let (host, port) = split_authority(authority).ok_or_else(bad)?;
        let host_ok = !host.is_empty()
            && (host.starts_with('[') || !host.contains(':'))
            && !host
                .chars()
                .any(|c| c.is_whitespace() || matches!(c, '/' | '?' | '#' | '@' | '\\'));
        if !scheme_ok || !host_ok {
            return Err(bad());
        }
        let scheme = scheme.to_ascii_lowercase();
        // Browsers leave the default port out of `Origin`; an operator may not.
        let port = port.filter(|&p| Some(p) != default_port(&scheme));
        Ok(WebOrigin {
            scheme,
            host: host.to_ascii_lowercase(),
            port,
        })
    }
}

impl std::fmt::Display for WebOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}", self.scheme, self.host)?;
        match self.port {
            Some(port) => write!(f, ":{port}"),
            None => Ok(()),
        }
    }
}

fn default_port(scheme: &str) -> Option<u16> {
    match scheme {
        "http" | "ws" => Some(80),
        "https" | "wss" => Some(443),
        _ => None,
    }
}

/// `host[:port]` (an IPv6 host in brackets); `None` when the port is not a
/// number.
fn split_authority(authority: &str) -> Option<(&str, Option<u16>)> {
    let (host, port) = if authority.starts_with('[') {
        let end = authority.find(']')?;
        let (host, after) = authority.split_at(end + 1);
        match after {
            "" => (host, None),
            _ => (host, Some(after.strip_prefix(':')?)),
        }
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    match port {
        None => Some((host, None)),
        Some(port) => Some((host, Some(port.parse().ok()?))),
    }
}

/// The pages whose scripts may open provider WebSockets, or anyone's (the
/// default) when empty. A browser tab that loads some web page can be made
/// to donate its GPU to whatever server that page names; a listed server
/// takes donations only from pages it trusts. Native providers send no
/// `Origin` and are not affected.
#[derive(Debug, Clone, Default)]
pub struct AllowedOrigins(Arc<[WebOrigin]>);

impl AllowedOrigins {
    pub fn new(origins: Vec<WebOrigin>) -> Self {
        AllowedOrigins(origins.into())
    }

    /// Whether any page may connect (no `--allowed-origin` given).
    pub fn is_open(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an upgrade with these headers may go ahead: without an
    /// `Origin` it may (no browser sent it), and with one, when the list is
    /// set, only from a listed origin or from the server's own pages (an
    /// origin whose host and port are the request's `Host`). `Err` carries
    /// the refused origin as the browser sent it.
    pub fn admits(&self, headers: &HeaderMap) -> Result<(), String> {
        if self.is_open() {
            return Ok(());
        }
        let Some(origin) = headers.get(ORIGIN) else {
            return Ok(());
        };
        let shown = String::from_utf8_lossy(origin.as_bytes()).into_owned();
        let host = headers.get(HOST).and_then(|h| h.to_str().ok());
        let allowed = origin
            .to_str()
            .ok()
            .and_then(|text| text.parse::<WebOrigin>().ok())
            .is_some_and(|origin| self.0.contains(&origin) || is_own(&origin, host));
        if allowed { Ok(()) } else { Err(shown) }
    }
}

/// Whether a page at `origin` is one this server served: its host and port
/// are the request's `Host` (which browsers write without the default port).
fn is_own(origin: &WebOrigin, host: Option<&str>) -> bool {
    let Some((host, port)) = host.and_then(split_authority) else {
        return false;
    };
    let port = port.filter(|&p| Some(p) != default_port(&origin.scheme));
    host.eq_ignore_ascii_case(&origin.host) && port == origin.port
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
    fn origins_are_parsed_to_scheme_host_and_port_or_refused() {
        let cases: [(&str, Option<&str>); 14] = [
            ("https://example.org", Some("https://example.org")),
            ("HTTPS://Example.ORG/", Some("https://example.org")),
            ("https://example.org:443", Some("https://example.org")),
            ("http://example.org:80", Some("http://example.org")),
            ("http://example.org:8080", Some("http://example.org:8080")),
            ("https://example.org:80", Some("https://example.org:80")),
            ("http://[::1]:8080", Some("http://[::1]:8080")),
            ("http://127.0.0.1:3000", Some("http://127.0.0.1:3000")),
            ("example.org", None),
            ("https://example.org/donate", None),
            ("https://user@example.org", None),
            ("https://example.org:port", None),
            ("https://", None),
            ("null", None),
        ];
        for (text, expected) in cases {
            let parsed = text.parse::<WebOrigin>().ok().map(|o| o.to_string());
            assert_eq!(parsed.as_deref(), expected, "{text}");
        }
    }

    #[test]
    fn only_listed_origins_and_the_servers_own_pages_may_open_a_socket() {
        let allowed = AllowedOrigins::new(vec![
            "https://donate.example.org".parse().unwrap(),
            "http://localhost:3000".parse().unwrap(),
        ]);
        // (Origin, Host, admitted)
        let cases: [(Option<&str>, Option<&str>, bool); 14] = [
            // Native providers send no Origin.
            (None, Some("rookery.example.org"), true),
            (None, None, true),
            (
                Some("https://donate.example.org"),
                Some("rookery.example.org"),
                true,
            ),
            (Some("https://DONATE.example.org"), None, true),
            (Some("https://donate.example.org:443"), None, true),
            (Some("http://donate.example.org"), None, false),
            (Some("https://donate.example.org:8443"), None, false),
            (Some("http://localhost:3000"), None, true),
            (Some("http://localhost:3001"), None, false),
            (
                Some("https://evil.example"),
                Some("rookery.example.org"),
                false,
            ),
            (Some("null"), Some("rookery.example.org"), false),
            // The server's own pages: the Origin's host and port are the Host.
            (Some("http://127.0.0.1:8080"), Some("127.0.0.1:8080"), true),
            (
                Some("https://Rookery.example.org"),
                Some("rookery.example.org"),
                true,
            ),
            (Some("http://127.0.0.1:9090"), Some("127.0.0.1:8080"), false),
        ];
        for (origin, host, admitted) in cases {
            let mut headers = HeaderMap::new();
            if let Some(origin) = origin {
                headers.insert(ORIGIN, origin.parse().unwrap());
            }
            if let Some(host) = host {
                headers.insert(HOST, host.parse().unwrap());
            }
            let result = allowed.admits(&headers);
            assert_eq!(result.is_ok(), admitted, "{origin:?} {host:?}");
            if let (Err(refused), Some(origin)) = (result, origin) {
                assert_eq!(refused, origin);
            }
        }
        // With no list, any page may connect.
        let mut headers = HeaderMap::new();
        headers.insert(ORIGIN, "https://evil.example".parse().unwrap());
        assert!(AllowedOrigins::default().admits(&headers).is_ok());
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
