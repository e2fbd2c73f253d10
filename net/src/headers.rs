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

pub(crate) const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const TRAILERS: HeaderName = HeaderName::from_static("trailers");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
pub const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
/// Client headers stripped at the edge (internal routing and credentials of GPUStack).
const X_GPUSTACK_AUTH_TOKEN: HeaderName = HeaderName::from_static("x-gpustack-auth-token");
const X_GPUSTACK_ACCESS_KEY: HeaderName = HeaderName::from_static("x-gpustack-access-key");
const X_GPUSTACK_KEY_REF: HeaderName = HeaderName::from_static("x-gpustack-key-ref");
/// GPUStack 2.3's `/token-auth` answers 200 without a credential to a request carrying an
/// auth-cache marker bound to the connection header it names: neither may come from a client.
const X_GPUSTACK_AUTH_CACHE: HeaderName = HeaderName::from_static("x-gpustack-auth-cache");
const X_GPUSTACK_DOWNSTREAM_CONN: HeaderName =
    HeaderName::from_static("x-gpustack-downstream-conn");

/// Every header the sanitisers remove, in removal order: the hop-by-hop headers (RFC 9110
/// §7.6.1) plus `host` (set from the URI) and the non-standard `trailers` and
/// `proxy-connection` (the first 11, `connection` first); then, for requests, the client's key,
/// `content-length` (the transports frame the buffered body themselves), `expect` (the body is already buffered:
/// an upstream `100 Continue` would only add a round trip) and GPUStack's internal headers;
/// then, for responses, the worker proxy's no-such-instance mark.
const DROP_ORDER: [HeaderName; 22] = [
    header::CONNECTION,
    KEEP_ALIVE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::HOST,
    TRAILERS,
    PROXY_CONNECTION,
    header::AUTHORIZATION,
    X_API_KEY,
    header::CONTENT_LENGTH,
    header::EXPECT,
    X_GPUSTACK_MODEL_INSTANCE,
    X_GPUSTACK_AUTH_TOKEN,
    X_GPUSTACK_ACCESS_KEY,
    X_GPUSTACK_KEY_REF,
    X_GPUSTACK_AUTH_CACHE,
    X_GPUSTACK_DOWNSTREAM_CONN,
    X_FADEN_NO_SUCH_INSTANCE,
];

/// The sets of [`DROP_ORDER`] each sanitiser removes (bit `i`: `DROP_ORDER[i]`).
const HOP_BY_HOP: u32 = (1 << 11) - 1;
const REQUEST_DROP: u32 = (1 << 21) - 1;
const RESPONSE_DROP: u32 = HOP_BY_HOP | 1 << 21;

/// `name`'s place in [`DROP_ORDER`]. A standard name is one variant of `http`'s enum of them,
/// so those are told apart by one `match` on the variant; the others (custom names, compared
/// as bytes) differ in their (length, last byte) pair, so one `match` on that pair leaves a
/// single candidate, confirmed with one comparison. (A `match` on the name's string compared
/// it with each listed name of its length in turn; this runs for every header of every
/// request and answer.)
fn drop_index(name: &HeaderName) -> Option<u32> {
    let i: u32 = match *name {
        header::CONNECTION => return Some(0),
        header::PROXY_AUTHENTICATE => return Some(2),
        header::PROXY_AUTHORIZATION => return Some(3),
        header::TE => return Some(4),
        header::TRAILER => return Some(5),
        header::TRANSFER_ENCODING => return Some(6),
        header::UPGRADE => return Some(7),
        header::HOST => return Some(8),
        header::AUTHORIZATION => return Some(11),
        header::CONTENT_LENGTH => return Some(13),
        header::EXPECT => return Some(14),
        _ => {
            let s = name.as_str().as_bytes();
            match (s.len(), *s.last()?) {
                (10, b'e') => 1,  // keep-alive
                (8, b's') => 9,   // trailers
                (16, b'n') => 10, // proxy-connection
                (9, b'y') => 12,  // x-api-key
                (25, b'e') => 15, // x-gpustack-model-instance
                (21, b'n') => 16, // x-gpustack-auth-token
                (21, b'y') => 17, // x-gpustack-access-key
                (18, b'f') => 18, // x-gpustack-key-ref
                (21, b'e') => 19, // x-gpustack-auth-cache
                (26, b'n') => 20, // x-gpustack-downstream-conn
                (24, b'e') => 21, // x-faden-no-such-instance
                _ => return None,
            }
        }
    };
    (*name == DROP_ORDER[i as usize]).then_some(i)
}

/// Removes the headers of the set `drop` that are present, plus the headers the `Connection`
/// header names when `connection` is in the set.
///
/// One pass over the names present instead of one hash lookup per listed name: requests carry a
/// handful of headers and the list is long. Removal happens in [`DROP_ORDER`], as separate
/// `remove` calls in that order would (`HeaderMap::remove` moves the last entry into the hole,
/// so the order decides where the remaining headers end up).
fn remove_listed(headers: &mut HeaderMap, drop: u32) {
    let mut present: u32 = 0;
    for name in headers.keys() {
        if let Some(i) = drop_index(name) {
            present |= 1 << i;
        }
    }
    present &= drop;
    if present == 0 {
        return;
    }
    if present & 1 != 0 {
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
    }
    for (i, name) in DROP_ORDER.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(name);
        }
    }
}

/// Removes hop-by-hop headers, including those the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    remove_listed(headers, HOP_BY_HOP);
}

/// Prepares client request headers for the upstream: hop-by-hop headers, the client's key and
/// GPUStack's internal headers go, and `content-length` (each transport frames the buffered
/// body itself).
pub fn sanitize_request(headers: &mut HeaderMap) {
    remove_listed(headers, REQUEST_DROP);
}

/// Prepares upstream response headers for the client.
pub fn sanitize_response(headers: &mut HeaderMap) {
    remove_listed(headers, RESPONSE_DROP);
}

/// The token of an `Authorization: Bearer <token>` value (scheme in any case), trimmed;
/// `None` for another scheme or an empty token.
pub fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// The key a client presents: `Authorization: Bearer <key>`, else `X-API-Key: <key>`.
pub fn presented_key(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer)
        .or_else(|| {
            headers
                .get(X_API_KEY)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|k| !k.is_empty())
        })
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
            ("x-gpustack-auth-cache", "marker"),
            ("x-gpustack-downstream-conn", "1.2.3.4:5"),
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

    /// The straightforward version: one `remove` per listed name, in the same order.
    fn reference_request(headers: &mut HeaderMap) {
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
        for name in &DROP_ORDER[..21] {
            headers.remove(name);
        }
    }

    #[test]
    fn drop_index_follows_the_order() {
        for (i, name) in DROP_ORDER.iter().enumerate() {
            assert_eq!(drop_index(name), Some(i as u32), "{name}");
        }
        assert_eq!(drop_index(&header::CONTENT_TYPE), None);
        // A name of the same length and last byte as a listed one, but not that name (first
        // byte changed), and the listed names with another last byte.
        for name in DROP_ORDER.iter() {
            let mut other = name.as_str().as_bytes().to_vec();
            other[0] = b'z';
            let other = HeaderName::from_bytes(&other).unwrap();
            assert_eq!(drop_index(&other), None, "{other}");
            let mut other = name.as_str().as_bytes().to_vec();
            *other.last_mut().unwrap() = b'z';
            let other = HeaderName::from_bytes(&other).unwrap();
            assert_eq!(drop_index(&other), None, "{other}");
        }
    }

    #[test]
    fn single_pass_matches_one_remove_per_name() {
        let pool = [
            ("authorization", "Bearer k"),
            ("host", "h"),
            ("content-length", "3"),
            ("content-type", "application/json"),
            ("x-request-id", "1"),
            ("connection", "x-hop, keep-alive"),
            ("x-hop", "v"),
            ("keep-alive", "5"),
            ("x-gpustack-key-ref", "r"),
            ("accept", "*/*"),
            ("expect", "100-continue"),
            ("user-agent", "wrk"),
        ];
        // Every subset of the pool, in two insertion orders.
        for mask in 0u32..(1 << pool.len()) {
            for reversed in [false, true] {
                let mut h = HeaderMap::new();
                let mut items: Vec<_> = pool
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, kv)| *kv)
                    .collect();
                if reversed {
                    items.reverse();
                }
                for (k, v) in items {
                    h.append(
                        HeaderName::from_bytes(k.as_bytes()).unwrap(),
                        v.parse().unwrap(),
                    );
                }
                let mut expected = h.clone();
                reference_request(&mut expected);
                sanitize_request(&mut h);
                let got: Vec<_> = h.iter().collect();
                let want: Vec<_> = expected.iter().collect();
                assert_eq!(got, want, "mask {mask:#x} reversed {reversed}");
            }
        }
    }
}
