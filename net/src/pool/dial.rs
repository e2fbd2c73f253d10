//! Dialling TCP, and the host names a request URI gives.

use std::io;
use std::time::Duration;

use http::uri::Authority;
use tokio::net::TcpStream;

use super::error::{PoolError, PoolErrorKind};

/// Dials `authority` (`default_port` when it names none) within `timeout`, with
/// `TCP_NODELAY`; the error is a [`PoolErrorKind::Connect`].
pub async fn dial_tcp(
    authority: &Authority,
    default_port: u16,
    timeout: Duration,
) -> Result<TcpStream, PoolError> {
    let connect_error = |e: io::Error| {
        PoolError::new(
            PoolErrorKind::Connect,
            "could not connect to the model instance",
        )
        .with_cause(e)
    };
    let port = authority.port_u16().unwrap_or(default_port);
    let target = (bare_host(authority), port);
    let io = match tokio::time::timeout(timeout, TcpStream::connect(target)).await {
        Ok(Ok(io)) => io,
        Ok(Err(e)) => return Err(connect_error(e)),
        Err(_) => {
            return Err(connect_error(io::Error::new(
                io::ErrorKind::TimedOut,
                "connect timed out",
            )));
        }
    };
    let _ = io.set_nodelay(true);
    Ok(io)
}

/// The host of `authority` without the brackets of an IPv6 address: what a socket address or
/// a TLS server name is made from.
pub fn bare_host(authority: &Authority) -> &str {
    let host = authority.host();
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// `Host` for a request URI: its authority, with the port only when it is not the scheme's
/// default (80, or 443 for `https`), as hyper-util's client writes it; empty without one.
pub(super) fn host(uri: &http::Uri) -> &str {
    let Some(authority) = uri.authority() else {
        return "";
    };
    let default = if uri.scheme() == Some(&http::uri::Scheme::HTTPS) {
        443
    } else {
        80
    };
    match authority.port_u16() {
        Some(port) if port != default => authority.as_str(),
        _ => authority.host(),
    }
}
