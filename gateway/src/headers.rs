//! Header hygiene on both legs: hop-by-hop headers, client credentials and GPUStack's internal
//! headers never cross the proxy.

use http::HeaderMap;
use http::header::{self, HeaderName};

/// GPUStack's instance-routing header (worker and tunnel paths).
pub const X_GPUSTACK_MODEL_INSTANCE: HeaderName =
    HeaderName::from_static("x-gpustack-model-instance");

/// Marks the worker proxy's 404 for an instance it does not host: the upstream has not started
/// any work, so the gateway may try another instance.
pub const X_FADEN_NO_SUCH_INSTANCE: HeaderName =
    HeaderName::from_static("x-faden-no-such-instance");

/// Set on SSE responses so that nginx-like proxies in front do not buffer them.
pub const X_ACCEL_BUFFERING: HeaderName = HeaderName::from_static("x-accel-buffering");

/// Client headers stripped at the edge (internal routing and credentials of GPUStack).
const INTERNAL: [&str; 4] = [
    "x-gpustack-model-instance",
    "x-gpustack-auth-token",
    "x-gpustack-access-key",
    "x-gpustack-key-ref",
];

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus `host`, which the client sets from the URI.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::HOST,
];

/// Removes hop-by-hop headers, including those the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
    headers.remove("trailers");
    headers.remove("proxy-connection");
}

/// Prepares client request headers for the upstream: hop-by-hop headers, the client's key and
/// GPUStack's internal headers go; `content-length` is set again from the buffered body.
pub fn sanitize_request(headers: &mut HeaderMap) {
    strip_hop_by_hop(headers);
    headers.remove(header::AUTHORIZATION);
    headers.remove(crate::auth::X_API_KEY);
    headers.remove(header::CONTENT_LENGTH);
    // The body is already buffered: an upstream `100 Continue` would only add a round trip.
    headers.remove(header::EXPECT);
    for name in INTERNAL {
        headers.remove(name);
    }
}

/// Prepares upstream response headers for the client.
pub fn sanitize_response(headers: &mut HeaderMap) {
    strip_hop_by_hop(headers);
    headers.remove(X_FADEN_NO_SUCH_INSTANCE);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_credentials_internal_and_hop_by_hop() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("authorization", "Bearer secret"),
            ("x-api-key", "secret"),
            ("X-GPUStack-Model-Instance", "model-1-2.static"),
            ("x-gpustack-auth-token", "t"),
            ("x-gpustack-access-key", "a"),
            ("x-gpustack-key-ref", "r"),
            ("connection", "keep-alive, x-custom-hop"),
            ("x-custom-hop", "1"),
            ("te", "trailers"),
            ("host", "example"),
            ("content-length", "10"),
            ("x-request-id", "keep-me"),
            ("content-type", "application/json"),
        ] {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        sanitize_request(&mut h);
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["x-request-id", "content-type"]);
    }
}
