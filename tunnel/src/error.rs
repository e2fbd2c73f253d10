//! Tunnel errors.

use std::io;

/// What went wrong with a tunnel or one of its streams.
#[derive(Debug, thiserror::Error)]
pub enum TunnelError {
    /// No tunnel of this worker is connected to this server.
    #[error("no tunnel is connected for worker {0}")]
    NotConnected(i64),
    /// The tunnel (its multiplexed connection) is closed.
    #[error("the tunnel is closed")]
    Closed,
    /// The worker said it is going away: the tunnel takes no new streams.
    #[error("the worker is going away: the tunnel takes no new streams")]
    GoingAway,
    /// Opening a stream took longer than allowed (the peer does not acknowledge streams).
    #[error("timed out opening a stream on the tunnel")]
    OpenTimeout,
    /// The address is outside the ranges the worker's GPUStack tunnel reaches.
    #[error("{0} is outside the worker's tunnel address ranges")]
    OutOfRange(std::net::IpAddr),
    /// The stream limit of the tunnel is reached.
    #[error("too many streams open on the tunnel")]
    TooManyStreams,
    /// The server URL cannot be dialled.
    #[error("invalid server url {url:?}: {reason}")]
    InvalidUrl { url: String, reason: &'static str },
    /// The server answered the WebSocket handshake with an HTTP error.
    #[error("the server refused the tunnel: {status}: {message}")]
    Refused { status: u16, message: String },
    /// Connecting, TLS or the WebSocket handshake took too long.
    #[error("the tunnel handshake timed out")]
    HandshakeTimeout,
    /// TLS setup failed (bad server name, handshake error).
    #[error("tls: {0}")]
    Tls(String),
    /// The WebSocket handshake failed (a malformed or unexpected response).
    #[error("websocket handshake: {0}")]
    Handshake(String),
    /// The multiplexer failed.
    #[error("yamux: {0}")]
    Mux(#[from] yamux::ConnectionError),
    /// An I/O error.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

impl TunnelError {
    /// Whether the server refused the credentials (401/403): retrying soon will not help.
    pub fn is_auth_failure(&self) -> bool {
        matches!(
            self,
            TunnelError::Refused {
                status: 401 | 403,
                ..
            }
        )
    }
}
