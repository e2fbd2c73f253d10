//! Proxy-port request targets: the CONNECT / absolute-form authority and the
//! `X-GPUStack-Model-Instance` value of origin-form requests. The first byte picks the default
//! port (absolute-form: 80, CONNECT: none); the rest is the authority or header text.
//! Invariants: an accepted target is a canonical host (an IP literal or a lowercase DNS name)
//! and a non-zero port, and parsing its canonical form again gives the same pair.
#![no_main]

use std::net::IpAddr;

use libfuzzer_sys::fuzz_target;
use tunnel::proxy_port::parse_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let default_port = (mode & 1 == 1).then_some(80);

    if let Some(id) = tunnel::target::parse_instance_id(text) {
        assert!(id >= 0);
        assert!(text.starts_with("model-"));
    }

    let Some((host, port)) = parse_target(text, default_port) else {
        return;
    };
    assert_ne!(port, 0);
    let canonical = match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(ip)) => {
            assert_eq!(host, ip.to_string());
            format!("[{host}]:{port}")
        }
        Ok(ip) => {
            assert_eq!(host, ip.to_string());
            format!("{host}:{port}")
        }
        Err(_) => {
            assert!(!host.is_empty() && host.len() <= 253);
            assert!(
                host.bytes().all(|b| b.is_ascii_lowercase()
                    || b.is_ascii_digit()
                    || b == b'-'
                    || b == b'.'),
                "{host:?}"
            );
            format!("{host}:{port}")
        }
    };
    assert_eq!(
        parse_target(&canonical, None),
        Some((host.clone(), port)),
        "{text:?} → {canonical:?}"
    );
});
