//! Accepting connections: HTTP/1.1 and HTTP/2 prior knowledge on one port, TCP_NODELAY, a cap
//! on open connections, header read timeout and size limit, and draining on shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use http::{Request, Response};
use http_body::Body;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::config::ListenerConfig;

/// Serves `handler` on every accepted connection until `shutdown` fires, then drains: stops
/// accepting, lets in-flight requests and streams finish for up to `drain_timeout`, and returns.
/// `on_drain` runs as soon as shutdown starts (the gateway uses it to fail `/readyz`).
pub async fn serve<H, Fut, B>(
    listener: TcpListener,
    config: &ListenerConfig,
    handler: H,
    shutdown: CancellationToken,
    on_drain: impl FnOnce(),
) where
    H: Fn(Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_read_timeout)
        .max_buf_size(config.max_header_bytes.max(8192))
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(config.max_header_bytes).unwrap_or(u32::MAX));
    let builder = Arc::new(builder);
    let permits = Arc::new(Semaphore::new(config.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut conns = JoinSet::new();
    let local = listener.local_addr().ok();

    loop {
        let permit = tokio::select! {
            () = shutdown.cancelled() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let builder = builder.clone();
        let handler = handler.clone();
        let header_timeout = config.header_read_timeout;
        let watcher = graceful.watcher();
        let stop = shutdown.clone();
        let span = tracing::debug_span!("conn", %peer);
        conns.spawn(
            async move {
                let _permit = permit;
                // A connection that sends nothing is closed after the header timeout (the
                // protocol sniffing of `auto` has no timeout of its own).
                tokio::select! {
                    () = stop.cancelled() => return,
                    ready = first_byte_within(&stream, header_timeout) => if !ready { return },
                }
                let service = service_fn(move |req| {
                    let handler = handler.clone();
                    async move { Ok::<_, Infallible>(handler(req, peer).await) }
                });
                let conn = builder.serve_connection(TokioIo::new(stream), service);
                if let Err(e) = watcher.watch(conn.into_owned()).await {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
            }
            .instrument(span),
        );
    }

    on_drain();
    drop(listener);
    tracing::info!(?local, open = conns.len(), "draining");
    let drained = tokio::time::timeout(config.drain_timeout, async {
        graceful.shutdown().await;
        while conns.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            open = conns.len(),
            "drain timeout: closing remaining connections"
        );
    }
    conns.shutdown().await;
}

async fn first_byte_within(stream: &TcpStream, timeout: std::time::Duration) -> bool {
    let mut buf = [0u8; 1];
    matches!(
        tokio::time::timeout(timeout, stream.peek(&mut buf)).await,
        Ok(Ok(n)) if n > 0
    )
}
