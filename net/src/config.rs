//! Settings of listeners and TLS: plain values, built by the binary from its configuration.

use std::path::PathBuf;
use std::time::Duration;

use crate::admission::{AuthLimits, PendingLimits};

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
