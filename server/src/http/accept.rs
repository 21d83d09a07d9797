//! The accept loop: HTTP/1 connections with a bound on how long a client
//! may take to send its headers, a cap per IP address, and a graceful stop.

use std::future::Future;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::Request;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tower::ServiceExt;

use super::app;
use crate::admission;
use crate::state::AppState;

/// Serves [`app`] on `listener` until `shutdown` completes, then lets
/// requests in flight finish.
///
/// Its own accept loop rather than `axum::serve`, which has no way to bound
/// how long a client may take to send its request headers (slowloris).
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let header_timeout = state.limits.slow_client_timeout;
    let max_per_ip = state.limits.max_http_connections_per_ip;
    let connections = admission::ConnectionCounter::default();
    let router = app(state);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Every connection task holds a receiver; `closed()` resolves when all are gone.
    let (open_tx, open_rx) = tokio::sync::watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (tcp, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors, usually: wait instead of spinning.
                    tracing::warn!(%error, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Training sends many small frames (losses, step reports) between large
        // ones; Nagle's algorithm would hold each behind a delayed ACK (40 ms).
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::warn!(%error, "cannot set TCP_NODELAY");
        }
        let Some(slot) = connections.take(remote.ip(), max_per_ip) else {
            tokio::spawn(admission::refuse_connection(tcp, remote.ip(), max_per_ip));
            continue;
        };
        let router = router.clone();
        // Connection info lets the provider socket count connections per IP.
        let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(remote));
            router.clone().oneshot(request.map(Body::new))
        });
        let mut stop = stop_rx.clone();
        let open = open_rx.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout);
            let connection = builder
                .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                .with_upgrades();
            let mut connection = std::pin::pin!(connection);
            let finished = tokio::select! {
                result = connection.as_mut() => Some(result),
                _ = stop.changed() => None,
            };
            let result = match finished {
                Some(result) => result,
                None => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(error) = result {
                tracing::debug!(%remote, %error, "connection ended with an error");
            }
            drop((slot, open));
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(open_rx);
    open_tx.closed().await;
    Ok(())
}
