//! Who may connect: a cap on simultaneous HTTP connections per IP address
//! (checked as the server accepts), and for a provider WebSocket the join
//! token (when the server requires one) and a cap on provider connections
//! per IP, both checked before the upgrade so a refused peer costs one HTTP
//! response.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use axum::http::HeaderMap;

use crate::AppState;
use crate::error::AppError;

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

/// Checks a provider's upgrade request. `ip` is `None` when the server runs
/// without connection info (in-process tests); such requests are not counted.
pub fn admit(
    state: &AppState,
    ip: Option<IpAddr>,
    headers: &HeaderMap,
    query: Option<&str>,
) -> Result<Option<Slot>, AppError> {
    if let Some(token) = &state.provider_token
        && !token.admits(headers, query)
    {
        return Err(AppError::Unauthorized(
            "this server requires providers to present its join token (rookery-provider --token, or `?token=` on the WebSocket URL)",
        ));
    }
    let Some(ip) = ip else {
        return Ok(None);
    };
    let max = state.limits.max_connections_per_ip;
    match state.connections.take(ip, max) {
        Some(slot) => Ok(Some(slot)),
        None => Err(AppError::TooManyConnections(format!(
            "too many provider connections from {ip} (at most {max})"
        ))),
    }
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
}
