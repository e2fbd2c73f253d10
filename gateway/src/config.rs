//! Gateway settings. Plain values: the `faden` binary builds them from its own configuration.

use std::time::Duration;

/// Limits of a listening socket, shared by the gateway and the worker proxy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenerConfig {
    /// Time a client has to send a complete request head (also: the first byte after accepting).
    pub header_read_timeout: Duration,
    /// Largest request head (HTTP/1 read buffer, HTTP/2 header list); larger heads get 431.
    /// HTTP/1 cannot go below 8 KiB.
    pub max_header_bytes: usize,
    /// Open client connections at most; further clients wait in the accept backlog.
    pub max_connections: usize,
    /// How long in-flight requests may run after shutdown is requested.
    pub drain_timeout: Duration,
}

impl Default for ListenerConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(30),
            max_header_bytes: 64 * 1024,
            max_connections: 16 * 1024,
            drain_timeout: Duration::from_secs(30),
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
        }
    }
}
