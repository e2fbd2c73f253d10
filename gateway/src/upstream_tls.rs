//! Upstream TLS: a connector that dials TCP then TLS with one rustls configuration, and the
//! set of pooled clients chosen per endpoint (worker, then cluster, then default).
//!
//! Each distinct [`UpstreamTls`] setting gets its own hyper-util client, hence its own pool:
//! a pooled connection is only ever reused by requests with the same TLS identity (CA bundle,
//! client certificate, server name), to the same `https` authority. Identical settings share
//! one client. Endpoints without TLS never reach this module: the plain client is untouched.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use control::routing::Endpoint;
use http::Uri;
use http_body_util::Full;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;

use crate::config::{GatewayConfig, UpstreamTls};
use crate::error::BoxError;
use crate::tls::{self, TlsConfigError};

/// A pooled HTTP/1.1 client over TLS.
pub type TlsClient = Client<TlsConnector, Full<Bytes>>;

/// Why a TLS connection to an upstream could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The handshake failed: untrusted certificate, wrong name, refused client certificate...
    #[error("upstream TLS handshake failed: {0}")]
    Failed(#[source] io::Error),
    /// No handshake within the connect timeout.
    #[error("upstream TLS handshake timed out")]
    Timeout,
    /// The endpoint address is not usable as a server name.
    #[error("upstream address {0:?} is not a valid TLS server name")]
    ServerName(String),
}

/// Dials TCP with the shared connect settings, then TLS with one configuration.
#[derive(Clone)]
pub struct TlsConnector {
    tcp: HttpConnector,
    tls: tokio_rustls::TlsConnector,
    server_name: Option<ServerName<'static>>,
    handshake_timeout: Duration,
}

impl fmt::Debug for TlsConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConnector")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl TlsConnector {
    fn new(
        config: &GatewayConfig,
        tls: Arc<rustls::ClientConfig>,
        server_name: Option<ServerName<'static>>,
    ) -> Self {
        let mut tcp = HttpConnector::new();
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(config.timeouts.connect));
        tcp.enforce_http(false);
        Self {
            tcp,
            tls: tokio_rustls::TlsConnector::from(tls),
            server_name,
            handshake_timeout: config.timeouts.connect,
        }
    }
}

/// The host of `uri` as a server name (IPv6 brackets removed).
fn server_name_of(uri: &Uri) -> Result<ServerName<'static>, HandshakeError> {
    let host = uri.host().unwrap_or_default();
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    ServerName::try_from(host.to_owned()).map_err(|_| HandshakeError::ServerName(host.to_owned()))
}

impl tower_service::Service<Uri> for TlsConnector {
    type Response = TlsConnection;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<TlsConnection, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.tcp.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let name = match &self.server_name {
            Some(name) => Ok(name.clone()),
            None => server_name_of(&uri),
        };
        let connecting = self.tcp.call(uri);
        let tls = self.tls.clone();
        let timeout = self.handshake_timeout;
        Box::pin(async move {
            let name = name?;
            let tcp = connecting.await?.into_inner();
            let stream = tokio::time::timeout(timeout, tls.connect(name, tcp))
                .await
                .map_err(|_| HandshakeError::Timeout)?
                .map_err(HandshakeError::Failed)?;
            Ok(TlsConnection(TokioIo::new(stream)))
        })
    }
}

/// An established TLS connection to an upstream.
#[derive(Debug)]
pub struct TlsConnection(TokioIo<tokio_rustls::client::TlsStream<TcpStream>>);

impl Connection for TlsConnection {
    fn connected(&self) -> Connected {
        self.0.inner().get_ref().0.connected()
    }
}

impl Read for TlsConnection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl Write for TlsConnection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }
}

/// The TLS clients of every configured scope.
#[derive(Debug, Default)]
pub struct TlsClients {
    default: Option<TlsClient>,
    by_cluster: HashMap<i64, TlsClient>,
    by_worker: HashMap<i64, TlsClient>,
}

impl TlsClients {
    /// Loads every configured setting (all files are read now); `None` when no endpoint uses
    /// TLS.
    pub fn from_config(config: &GatewayConfig) -> Result<Option<Self>, TlsConfigError> {
        let upstream = &config.upstream_tls;
        if upstream.is_empty() {
            return Ok(None);
        }
        let mut built: HashMap<&UpstreamTls, TlsClient> = HashMap::new();
        let mut clients = TlsClients::default();
        if let Some(tls) = &upstream.default {
            clients.default = Some(shared_client(&mut built, config, tls, "default")?);
        }
        // Sorted, so the first error reported does not depend on hash order.
        let mut clusters: Vec<_> = upstream.by_cluster.iter().collect();
        clusters.sort_by_key(|(id, _)| **id);
        for (id, tls) in clusters {
            let c = shared_client(&mut built, config, tls, &format!("cluster {id}"))?;
            clients.by_cluster.insert(*id, c);
        }
        let mut workers: Vec<_> = upstream.by_worker.iter().collect();
        workers.sort_by_key(|(id, _)| **id);
        for (id, tls) in workers {
            let c = shared_client(&mut built, config, tls, &format!("worker {id}"))?;
            clients.by_worker.insert(*id, c);
        }
        Ok(Some(clients))
    }

    /// The client for `endpoint`: its worker's, else its cluster's, else the default.
    pub fn for_endpoint(&self, endpoint: &Endpoint) -> Option<&TlsClient> {
        self.by_worker
            .get(&endpoint.worker_id)
            .or_else(|| self.by_cluster.get(&endpoint.cluster_id))
            .or(self.default.as_ref())
    }
}

/// The client for `tls`, shared with earlier scopes that have the same setting.
fn shared_client<'a>(
    built: &mut HashMap<&'a UpstreamTls, TlsClient>,
    config: &GatewayConfig,
    tls: &'a UpstreamTls,
    scope: &str,
) -> Result<TlsClient, TlsConfigError> {
    if let Some(c) = built.get(tls) {
        return Ok(c.clone());
    }
    let (rustls_config, name) = tls::client_config(tls, scope)?;
    let c = Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .pool_idle_timeout(config.pool_idle_timeout)
        .pool_max_idle_per_host(config.pool_max_idle_per_host)
        .retry_canceled_requests(true)
        .build(TlsConnector::new(config, rustls_config, name));
    built.insert(tls, c.clone());
    Ok(c)
}

/// Whether a client error is a TLS failure before any response: a failed handshake, or (TLS
/// 1.3, where the server checks the client certificate after the client's handshake is done)
/// an alert received instead of a response.
pub fn is_tls_failure(error: &(dyn StdError + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(e) = current {
        if e.is::<HandshakeError>() {
            return true;
        }
        let alert = |r: &rustls::Error| matches!(r, rustls::Error::AlertReceived(_));
        if e.downcast_ref::<rustls::Error>().is_some_and(alert) {
            return true;
        }
        // io::Error::source() skips the wrapped error itself; look at it directly.
        let wrapped = e
            .downcast_ref::<io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        if wrapped.is_some_and(alert) {
            return true;
        }
        current = e.source();
    }
    false
}
