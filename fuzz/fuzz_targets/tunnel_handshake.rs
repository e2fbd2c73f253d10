//! Header checks of the tunnel's `/connect` handshake (Upgrade, version, key,
//! Sec-WebSocket-Protocol, Authorization). The input is header lines `name: value` separated by
//! line feeds; lines that are not valid header names or values are dropped (hyper would have
//! refused them).
//! Invariants: an accepted request carries a non-empty, trimmed bearer token taken from its
//! Authorization header, and either offers the tunnel subprotocol (faden's dialect) or offers
//! none and carries `x-client-id` and at least one address range (GPUStack's).
#![no_main]

use http::{HeaderMap, HeaderName, HeaderValue, header};
use libfuzzer_sys::fuzz_target;
use tunnel::protocol::SUBPROTOCOL;
use tunnel::server::{Dialect, check_handshake_headers};

fuzz_target!(|data: &[u8]| {
    let mut headers = HeaderMap::new();
    for line in data.split(|b| *b == b'\n') {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(line[colon + 1..].trim_ascii()),
        ) else {
            continue;
        };
        headers.append(name, value);
    }
    let Ok(accepted) = check_handshake_headers(&headers) else {
        return;
    };
    assert!(!accepted.token.is_empty());
    assert_eq!(accepted.token.trim(), accepted.token);
    let auth = headers[header::AUTHORIZATION].to_str().expect("ASCII");
    assert!(auth.len() > 7 && auth[..7].eq_ignore_ascii_case("bearer "));
    assert!(auth.contains(&accepted.token));
    let offered = headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim().eq_ignore_ascii_case(SUBPROTOCOL));
    match accepted.dialect {
        Dialect::Faden => assert!(offered && accepted.cidrs.is_empty()),
        Dialect::GpuStack => {
            assert!(!headers.contains_key(header::SEC_WEBSOCKET_PROTOCOL));
            assert!(headers.contains_key("x-client-id"));
            assert!(!accepted.cidrs.is_empty());
        }
    }
    assert_eq!(headers[header::SEC_WEBSOCKET_VERSION], "13");
});
