//! HTTP/1.1 on a single stream: serving one connection with a hyper service (the worker end),
//! and a client connection on one (the server end's relay request, see
//! [`crate::connector`]).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use http::{HeaderValue, Request, Response, Uri, header};
use http_body::Body;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::service::Service;
use hyper::upgrade::Upgraded;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};

use net::headers::X_GPUSTACK_MODEL_INSTANCE;
use net::relay::{RelayIo, with_read_ahead};

use crate::mux::TunnelStream;

/// A boxed error, as bodies and services report them.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A boxed, sendable future.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Limits of one served connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeConfig {
    /// Time to receive a complete request head (also the idle time between keep-alive requests).
    pub header_read_timeout: Duration,
    /// Largest request head.
    pub max_header_bytes: usize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(30),
            max_header_bytes: 64 * 1024,
        }
    }
}

/// Serves one HTTP/1.1 connection (keep-alive, upgrades allowed) on an already accepted `io`
/// with `service`, until the peer closes it.
pub async fn serve_connection<I, S, B>(
    io: I,
    service: S,
    config: &ServeConfig,
) -> Result<(), hyper::Error>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: Service<Request<Incoming>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_read_timeout)
        .max_buf_size(config.max_header_bytes.max(8192))
        .keep_alive(true)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades()
        .await
}

/// What the worker end does with each stream the server opens.
pub trait StreamHandler: Send + Sync + 'static {
    fn handle(&self, stream: TunnelStream) -> BoxFuture<()>;
}

impl<F, Fut> StreamHandler for F
where
    F: Fn(TunnelStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    fn handle(&self, stream: TunnelStream) -> BoxFuture<()> {
        Box::pin(self(stream))
    }
}

/// Serves a hyper service (HTTP/1.1) on every stream: the worker's reverse proxy.
#[derive(Clone, Debug)]
pub struct HttpHandler<S> {
    service: S,
    config: ServeConfig,
}

impl<S> HttpHandler<S> {
    pub fn new(service: S, config: ServeConfig) -> Self {
        Self { service, config }
    }
}

impl<S, B> StreamHandler for HttpHandler<S>
where
    S: Service<Request<Incoming>, Response = Response<B>> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    fn handle(&self, stream: TunnelStream) -> BoxFuture<()> {
        let service = self.service.clone();
        let config = self.config.clone();
        Box::pin(async move {
            if let Err(e) = serve_connection(stream, service, &config).await {
                tracing::debug!(error = %e, "tunnel stream: connection ended with an error");
            }
        })
    }
}

/// Starts an HTTP/1.1 client connection on `stream`, driven by a task of its own until the
/// connection closes (the sender and every response body dropped, or the stream reset) or is
/// taken over by a `CONNECT`.
pub async fn handshake<B>(stream: TunnelStream) -> Result<SendRequest<B>, hyper::Error>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let (sender, conn) = hyper::client::conn::http1::Builder::new()
        .handshake(TokioIo::new(stream))
        .await?;
    // Ends with the connection: when `sender` and the stream under it are dropped.
    net::task::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "tunnel client connection ended with an error");
        }
    });
    Ok(sender)
}

/// The worker end's [`net::relay::TakeOver`]: a connection [`serve_connection`] served on
/// a tunnel stream and hyper handed over after a `CONNECT` is the stream itself again, so
/// the worker proxy's instance relay reads and writes it directly.
pub fn take_stream(upgraded: Upgraded) -> Result<Box<dyn RelayIo>, Upgraded> {
    let parts = upgraded.downcast::<TokioIo<TunnelStream>>()?;
    Ok(with_read_ahead(parts.io.into_inner(), parts.read_buf))
}

/// Sends `request` as the only request of an HTTP/1.1 connection on `stream` (tests and
/// benchmarks; the data plane sends through [`crate::connector::Connector`]); the answer's
/// body streams as it arrives. The connection ends with the answer (or when the body is
/// dropped, which resets the stream and so cancels the work upstream).
pub async fn send_request<B>(
    stream: TunnelStream,
    request: Request<B>,
) -> Result<Response<Incoming>, hyper::Error>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    handshake(stream).await?.send_request(request).await
}
/// Turns a proxied request into the one sent on a stream: origin-form target, `Host` from the
/// original authority, and the instance header (the gateway sets it; added if missing).
pub fn to_origin_form<B>(
    request: &mut Request<B>,
    instance: Option<HeaderValue>,
) -> Result<(), http::Error> {
    let authority = request.uri().authority().cloned();
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    *request.uri_mut() = Uri::try_from(path)?;
    *request.version_mut() = http::Version::HTTP_11;
    let headers = request.headers_mut();
    if let Some(authority) = authority
        && let Ok(host) = HeaderValue::from_str(authority.as_str())
    {
        headers.insert(header::HOST, host);
    }
    if let Some(instance) = instance
        && !headers.contains_key(X_GPUSTACK_MODEL_INSTANCE)
    {
        headers.insert(X_GPUSTACK_MODEL_INSTANCE, instance);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::disallowed_methods
    )]

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use crate::mux::tests::pair;

    /// The worker end: after a `CONNECT` served by [`crate::http::serve_connection`], the
    /// instance relay takes the tunnel stream out of `Upgraded` (`take_stream`), and bytes the
    /// opener sent right behind its request come first.
    #[tokio::test]
    async fn served_connects_give_the_stream_back() {
        use net::relay::RelayIo;
        let (_mux, mut out, inc) = pair().await;
        let (taken_tx, taken_rx) = tokio::sync::oneshot::channel::<Box<dyn RelayIo>>();
        let taken_tx = std::sync::Arc::new(parking_lot::Mutex::new(Some(taken_tx)));
        let service = hyper::service::service_fn(move |mut req: http::Request<_>| {
            let on_upgrade = hyper::upgrade::on(&mut req);
            let taken_tx = taken_tx.clone();
            tokio::spawn(async move {
                let upgraded = on_upgrade.await.unwrap();
                let Ok(io) = crate::http::take_stream(upgraded) else {
                    panic!("the tunnel stream was not taken out of Upgraded");
                };
                let sender = taken_tx.lock().take();
                let _ = sender.unwrap().send(io);
            });
            async {
                Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Empty::<
                    bytes::Bytes,
                >::new()))
            }
        });
        tokio::spawn(async move {
            let config = crate::http::ServeConfig::default();
            crate::http::serve_connection(inc, service, &config).await
        });
        // The request and the first relayed bytes in one write.
        out.write_all(
            b"CONNECT model-1-2.static:0 HTTP/1.1\r\nhost: model-1-2.static:0\r\n\r\nearly",
        )
        .await
        .unwrap();
        let head = testkit::raw::read_head(&mut out).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let mut io = taken_rx.await.unwrap();
        let mut early = [0u8; 5];
        io.read_exact(&mut early).await.unwrap();
        assert_eq!(&early, b"early");
        io.write_all(b"back").await.unwrap();
        let mut back = [0u8; 4];
        out.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"back");
    }
}
