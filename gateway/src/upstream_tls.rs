//! Upstream TLS: a dialer that connects TCP then TLS with one rustls configuration, and the
//! set of dialers chosen per endpoint (worker, then cluster, then default).
//!
//! TLS connections live in the same pool as plain ones ([`net::pool`]: keep-alive, idle
//! timeout, the check before reuse, the first-byte timer kept per connection, cancel on drop),
//! under a key that names the dialer as well as the `https` authority: a pooled connection is
//! only ever reused by requests with the same TLS identity (CA bundle, client certificate,
//! server name). Identical settings share one dialer. Endpoints without TLS never reach this
//! module.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use control_client::routing::Endpoint;
use http::uri::Authority;
use rustls::pki_types::ServerName;

use crate::config::{GatewayConfig, UpstreamTls};
use crate::error::{ErrorKind, GatewayError};
use net::pool::{Connection, bare_host, dial_tcp};
use net::tls::{self, TlsConfigError};

/// What an upstream's TLS failure is answered with.
const TLS_FAILED: &str =
    "TLS with the model instance failed (untrusted certificate or refused client certificate)";

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

impl From<HandshakeError> for GatewayError {
    fn from(e: HandshakeError) -> Self {
        GatewayError::new(ErrorKind::UpstreamTls, TLS_FAILED).with_cause(e)
    }
}

/// Dials TCP with the gateway's connect timeout, then TLS with one configuration.
pub struct TlsDialer {
    /// Tells this dialer's pooled connections from other identities' (its place among the
    /// distinct settings).
    id: usize,
    tls: tokio_rustls::TlsConnector,
    /// The configured server name; `None`: the endpoint's host.
    server_name: Option<ServerName<'static>>,
    connect_timeout: Duration,
}

impl fmt::Debug for TlsDialer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsDialer")
            .field("id", &self.id)
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl TlsDialer {
    /// The pool key of this identity's connections to `authority` (no plain key has a `#`).
    pub(crate) fn key(&self, authority: &Authority) -> String {
        format!("tls#{} {authority}", self.id)
    }

    /// A new connection to `authority` (port 443 when it names none), pooled under `key`.
    /// TCP failures are [`ErrorKind::UpstreamConnect`], handshake failures
    /// [`ErrorKind::UpstreamTls`]; the handshake has the connect timeout too.
    pub(crate) async fn connect(
        &self,
        authority: &Authority,
        key: &str,
    ) -> Result<Connection, GatewayError> {
        let name = match &self.server_name {
            Some(name) => name.clone(),
            None => server_name_of(authority)?,
        };
        let tcp = dial_tcp(authority, 443, self.connect_timeout).await?;
        let stream = tokio::time::timeout(self.connect_timeout, self.tls.connect(name, tcp))
            .await
            .map_err(|_| HandshakeError::Timeout)?
            .map_err(HandshakeError::Failed)?;
        Ok(Connection::new(stream, key, Bytes::new()))
    }
}

/// The host of `authority` as a server name (IPv6 brackets removed).
fn server_name_of(authority: &Authority) -> Result<ServerName<'static>, HandshakeError> {
    let host = bare_host(authority);
    ServerName::try_from(host.to_owned()).map_err(|_| HandshakeError::ServerName(host.to_owned()))
}

/// `error` as an [`ErrorKind::UpstreamTls`] when TLS is what failed: with TLS 1.3 the server
/// checks the client certificate after the client's side of the handshake is done, so a
/// refusal arrives as an alert where the response head was due.
pub(crate) fn tls_kind(error: GatewayError) -> GatewayError {
    if error.kind != ErrorKind::UpstreamTls && is_tls_failure(&error) {
        GatewayError::new(ErrorKind::UpstreamTls, TLS_FAILED).with_cause(error)
    } else {
        error
    }
}

/// The TLS dialers of every configured scope.
#[derive(Debug, Default)]
pub struct TlsDialers {
    default: Option<Arc<TlsDialer>>,
    by_cluster: HashMap<i64, Arc<TlsDialer>>,
    by_worker: HashMap<i64, Arc<TlsDialer>>,
}

impl TlsDialers {
    /// Loads every configured setting (all files are read now); `None` when no endpoint uses
    /// TLS.
    pub fn from_config(config: &GatewayConfig) -> Result<Option<Self>, TlsConfigError> {
        let upstream = &config.upstream_tls;
        if upstream.is_empty() {
            return Ok(None);
        }
        let mut built: HashMap<&UpstreamTls, Arc<TlsDialer>> = HashMap::new();
        let mut dialers = TlsDialers::default();
        if let Some(tls) = &upstream.default {
            dialers.default = Some(shared_dialer(&mut built, config, tls, "default")?);
        }
        // Sorted, so the first error reported does not depend on hash order.
        let mut clusters: Vec<_> = upstream.by_cluster.iter().collect();
        clusters.sort_by_key(|(id, _)| **id);
        for (id, tls) in clusters {
            let c = shared_dialer(&mut built, config, tls, &format!("cluster {id}"))?;
            dialers.by_cluster.insert(*id, c);
        }
        let mut workers: Vec<_> = upstream.by_worker.iter().collect();
        workers.sort_by_key(|(id, _)| **id);
        for (id, tls) in workers {
            let c = shared_dialer(&mut built, config, tls, &format!("worker {id}"))?;
            dialers.by_worker.insert(*id, c);
        }
        Ok(Some(dialers))
    }

    /// The dialer for `endpoint`: its worker's, else its cluster's, else the default.
    pub fn for_endpoint(&self, endpoint: &Endpoint) -> Option<&TlsDialer> {
        self.by_worker
            .get(&endpoint.worker_id)
            .or_else(|| self.by_cluster.get(&endpoint.cluster_id))
            .or(self.default.as_ref())
            .map(|dialer| &**dialer)
    }
}

/// The dialer for `tls`, shared with earlier scopes that have the same setting.
fn shared_dialer<'a>(
    built: &mut HashMap<&'a UpstreamTls, Arc<TlsDialer>>,
    config: &GatewayConfig,
    tls: &'a UpstreamTls,
    scope: &str,
) -> Result<Arc<TlsDialer>, TlsConfigError> {
    if let Some(dialer) = built.get(tls) {
        return Ok(dialer.clone());
    }
    let (rustls_config, server_name) = tls::client_config(tls, scope)?;
    let dialer = Arc::new(TlsDialer {
        id: built.len(),
        tls: tokio_rustls::TlsConnector::from(rustls_config),
        server_name,
        connect_timeout: config.timeouts.connect,
    });
    built.insert(tls, dialer.clone());
    Ok(dialer)
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
