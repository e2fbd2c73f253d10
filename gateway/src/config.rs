//! Gateway settings. Plain values: the `faden` binary builds them from its own configuration.

use std::collections::HashMap;
use std::time::Duration;

pub use net::config::{ListenerConfig, ServerTlsConfig, UpstreamTls};

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
    /// How instances are chosen ([`crate::policy`]).
    pub routing: crate::policy::PolicyConfig,
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
            routing: crate::policy::PolicyConfig::default(),
        }
    }
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
    use std::path::PathBuf;

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
