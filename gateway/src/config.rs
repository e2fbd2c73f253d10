//! Gateway settings. Plain values: the `faden` binary builds them from its own configuration.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use control::admission::{AuthLimits, PendingLimits};

/// Limits of a listening socket, shared by the gateway, the worker proxy and the proxy port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenerConfig {
    /// Time a client has to send its first complete request head, counted from the accept (TLS
    /// handshake included); also the keep-alive idle time between requests.
    pub header_read_timeout: Duration,
    /// Largest request head (HTTP/1 read buffer, HTTP/2 header list); larger heads get 431.
    /// HTTP/1 cannot go below 8 KiB.
    pub max_header_bytes: usize,
    /// Open client connections at most; further clients wait in the accept backlog.
    pub max_connections: usize,
    /// How long in-flight requests may run after shutdown is requested.
    pub drain_timeout: Duration,
    /// Connections still before their first complete request head, in total and per source;
    /// more are refused at once (429 per source, 503 in total, on plain listeners; closed on TLS).
    pub pending: PendingLimits,
    /// Failed authentications per source before that source gets 429 (the listener's table).
    pub auth: AuthLimits,
    /// A write to a client that stays pending this long (the client stopped reading) closes
    /// the connection, which cancels its upstream request. `None`: no limit.
    pub write_stall_timeout: Option<Duration>,
}

impl Default for ListenerConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(30),
            max_header_bytes: 64 * 1024,
            max_connections: 16 * 1024,
            drain_timeout: Duration::from_secs(30),
            pending: PendingLimits::default(),
            auth: AuthLimits::default(),
            write_stall_timeout: Some(Duration::from_secs(60)),
        }
    }
}

/// Upstream timeouts, each separately configurable (a slow prefill must not be cut by the
/// inter-chunk timeout, a stalled stream must not hold a connection for the total timeout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP connect to the upstream.
    pub connect: Duration,
    /// From sending the request to the first byte of the response body (for a non-streamed
    /// answer this is the whole generation, hence the default equal to `total`).
    pub first_byte: Duration,
    /// Between two body chunks once the first one arrived.
    pub idle: Duration,
    /// The whole request (GPUStack's `GPUSTACK_PROXY_TIMEOUT_SECONDS`: 1800 s).
    pub total: Duration,
    /// Time a client has to send its whole request body.
    pub request_body: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(5),
            first_byte: Duration::from_secs(1800),
            idle: Duration::from_secs(300),
            total: Duration::from_secs(1800),
            request_body: Duration::from_secs(60),
        }
    }
}

/// Passive outlier ejection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EjectionConfig {
    /// Consecutive connect failures / 5xx answers that eject an instance.
    pub consecutive_failures: u32,
    /// First ejection period; it doubles on each ejection in a row.
    pub base_ejection: Duration,
    /// Longest ejection period.
    pub max_ejection: Duration,
}

impl Default for EjectionConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            base_ejection: Duration::from_secs(5),
            max_ejection: Duration::from_secs(60),
        }
    }
}

/// Everything the gateway needs besides routing snapshots.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    pub listener: ListenerConfig,
    pub timeouts: Timeouts,
    pub ejection: EjectionConfig,
    /// Largest request body; larger bodies get 413.
    pub max_body_bytes: usize,
    /// Pooled upstream connections idle longer than this are closed. Must stay below the
    /// upstream's own keep-alive timeout (uvicorn: 5 s) or reuse races its close (GPUStack #4419).
    pub pool_idle_timeout: Duration,
    /// Idle pooled connections kept per upstream address.
    pub pool_max_idle_per_host: usize,
    /// Bearer credential presented to worker reverse proxies (`worker` path).
    pub worker_credential: Option<String>,
    /// `/readyz` answers 503 when the snapshot is older than this (needs a staleness probe).
    pub max_snapshot_staleness: Option<Duration>,
    /// Whether a retry on another instance is allowed (connect failures, unknown instance).
    pub retry: bool,
    /// TLS on the client-facing listener; `None`: plain HTTP.
    pub tls: Option<ServerTlsConfig>,
    /// TLS towards instances and worker proxies; empty: plain HTTP everywhere.
    pub upstream_tls: UpstreamTlsConfig,
    /// Add `"stream_options":{"include_usage":true}` to streamed chat and text completion
    /// requests without `stream_options`, so that `faden_tokens_total` counts them too (the
    /// client then also gets the engine's usage-only last chunk). Usage the answers carry anyway
    /// is always counted.
    pub count_tokens: bool,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            listener: ListenerConfig::default(),
            timeouts: Timeouts::default(),
            ejection: EjectionConfig::default(),
            max_body_bytes: 64 * 1024 * 1024,
            pool_idle_timeout: Duration::from_secs(3),
            pool_max_idle_per_host: 256,
            worker_credential: None,
            max_snapshot_staleness: Some(Duration::from_secs(60)),
            retry: true,
            tls: None,
            upstream_tls: UpstreamTlsConfig::default(),
            count_tokens: false,
        }
    }
}

/// TLS on the client-facing listener. Files are read once, when the gateway is built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTlsConfig {
    /// PEM: the server certificate first, then its intermediates.
    pub cert_chain: PathBuf,
    /// PEM: the private key of the server certificate (PKCS#8, PKCS#1 or SEC1).
    pub private_key: PathBuf,
    /// PEM bundle of CA certificates. When set, every client must present a certificate that
    /// chains to one of them (mutual TLS); without it, no client certificate is asked for.
    pub client_ca: Option<PathBuf>,
}

/// TLS towards one upstream (an instance on the `direct` path, a worker proxy on the `worker`
/// path): the gateway dials `https://address:port`, trusts only `ca_bundle` and presents the
/// client certificate when one is set.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct UpstreamTls {
    /// PEM bundle of the CAs the upstream certificate must chain to. The only roots used: no
    /// system or webpki roots.
    pub ca_bundle: PathBuf,
    /// PEM: the client certificate (and intermediates) presented to the upstream.
    pub client_cert: Option<PathBuf>,
    /// PEM: the key of `client_cert`. Set both or neither.
    pub client_key: Option<PathBuf>,
    /// The name verified in (and sent as SNI for) the upstream certificate; by default the
    /// endpoint address (an IP address is checked against IP SANs).
    pub server_name: Option<String>,
}

/// Upstream TLS per endpoint: a worker's entry wins over its cluster's, which wins over the
/// default. An endpoint with none of the three is reached over plain HTTP. `tunnel` endpoints
/// are not affected (their transport has its own security).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UpstreamTlsConfig {
    pub default: Option<UpstreamTls>,
    /// By cluster id.
    pub by_cluster: HashMap<i64, UpstreamTls>,
    /// By worker id.
    pub by_worker: HashMap<i64, UpstreamTls>,
}

impl UpstreamTlsConfig {
    /// Whether no endpoint uses TLS.
    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.by_cluster.is_empty() && self.by_worker.is_empty()
    }

    /// The TLS settings of an endpoint on `worker_id` in `cluster_id`, if any.
    pub fn lookup(&self, cluster_id: i64, worker_id: i64) -> Option<&UpstreamTls> {
        self.by_worker
            .get(&worker_id)
            .or_else(|| self.by_cluster.get(&cluster_id))
            .or(self.default.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls(name: &str) -> UpstreamTls {
        UpstreamTls {
            ca_bundle: PathBuf::from(format!("{name}.pem")),
            client_cert: None,
            client_key: None,
            server_name: None,
        }
    }

    #[test]
    fn worker_wins_over_cluster_over_default() {
        let mut c = UpstreamTlsConfig::default();
        assert!(c.is_empty() && c.lookup(1, 1).is_none());
        c.default = Some(tls("default"));
        c.by_cluster.insert(2, tls("cluster"));
        c.by_worker.insert(7, tls("worker"));
        assert_eq!(c.lookup(1, 1), Some(&tls("default")));
        assert_eq!(c.lookup(2, 1), Some(&tls("cluster")));
        assert_eq!(c.lookup(2, 7), Some(&tls("worker")));
        assert_eq!(c.lookup(1, 7), Some(&tls("worker")));
    }
}
