//! Protocol constants and the dial URL (see `docs/protocol.md`).

use http::Uri;

use crate::error::TunnelError;

/// The WebSocket subprotocol of this tunnel protocol, version 1: yamux over binary messages.
pub const SUBPROTOCOL: &str = "faden-tunnel.v1";

/// Subprotocols this implementation speaks, preferred first.
pub const SUPPORTED: &[&str] = &[SUBPROTOCOL];

/// The path the worker dials on the server's management API port.
pub const CONNECT_PATH: &str = "/connect";

/// Response header listing the subprotocols a server speaks, sent with a 400 for a wrong one.
pub const X_FADEN_TUNNEL_PROTOCOLS: &str = "x-faden-tunnel-protocols";

/// The largest WebSocket message (and frame) either side accepts.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;

/// Turns the worker's `--server-url` (`http(s)://host[:port][/prefix]` or `ws(s)://…`) into
/// the tunnel URL `ws(s)://host[:port][/prefix]/connect`.
pub fn connect_url(server_url: &str) -> Result<Uri, TunnelError> {
    let bad = |reason| TunnelError::InvalidUrl {
        url: server_url.to_owned(),
        reason,
    };
    let uri: Uri = server_url.trim().parse().map_err(|_| bad("not a URL"))?;
    let scheme = match uri.scheme_str() {
        Some("http" | "ws") => "ws",
        Some("https" | "wss") => "wss",
        Some(_) => return Err(bad("scheme must be http, https, ws or wss")),
        None => return Err(bad("missing scheme")),
    };
    let authority = uri.authority().ok_or_else(|| bad("missing host"))?;
    if authority.as_str().contains('@') {
        return Err(bad("credentials in the URL are not supported"));
    }
    let prefix = uri.path().trim_end_matches('/');
    let path = if prefix.ends_with(CONNECT_PATH) {
        prefix.to_owned()
    } else {
        format!("{prefix}{CONNECT_PATH}")
    };
    Uri::builder()
        .scheme(scheme)
        .authority(authority.as_str())
        .path_and_query(path)
        .build()
        .map_err(|_| bad("cannot build the tunnel URL"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_connect_urls() {
        let ok = |s: &str| connect_url(s).map(|u| u.to_string());
        assert_eq!(
            ok("http://10.0.0.1:30080").ok().as_deref(),
            Some("ws://10.0.0.1:30080/connect")
        );
        assert_eq!(
            ok("https://srv/").ok().as_deref(),
            Some("wss://srv/connect")
        );
        assert_eq!(
            ok("https://srv/faden/").ok().as_deref(),
            Some("wss://srv/faden/connect")
        );
        assert_eq!(
            ok("ws://srv:1/connect").ok().as_deref(),
            Some("ws://srv:1/connect")
        );
        assert!(connect_url("ftp://srv").is_err());
        assert!(connect_url("srv:30080").is_err());
        assert!(connect_url("http://u:p@srv").is_err());
    }
}
