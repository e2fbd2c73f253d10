//! The worker's check of the server's answer to its tunnel handshake
//! (`tunnel::client::check_answer`), for the RFC 6455 sample key. Invariants: an accepted
//! answer is a complete `101` head naming the WebSocket upgrade, the key's accept value and
//! the tunnel subprotocol; bytes after the head never change the verdict; a proper prefix of
//! an accepted head is incomplete, never accepted.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tunnel::client::check_answer;
use tunnel::protocol::SUBPROTOCOL;

const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";
const ACCEPT: &str = "s3pPLMBiTxaQ9kYGJRbzPxOo6xo=";

fn contains_ci(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle))
}

fuzz_target!(|data: &[u8]| {
    let verdict = check_answer(data, KEY);
    let Ok(Some(size)) = verdict else {
        return;
    };
    assert!(size <= data.len());
    let head = &data[..size];
    assert!(head.ends_with(b"\n\n") || head.ends_with(b"\n\r\n"));
    assert!(head.starts_with(b"HTTP/1.") && head[9..12] == *b"101");
    assert!(contains_ci(head, b"websocket"));
    assert!(contains_ci(head, b"upgrade"));
    assert!(head.windows(ACCEPT.len()).any(|w| w == ACCEPT.as_bytes()));
    assert!(
        head.windows(SUBPROTOCOL.len())
            .any(|w| w == SUBPROTOCOL.as_bytes())
    );
    assert!(matches!(check_answer(head, KEY), Ok(Some(s)) if s == size));
    for cut in [size / 2, size - 1] {
        assert!(
            !matches!(check_answer(&head[..cut], KEY), Ok(Some(_))),
            "prefix {cut}"
        );
    }
});
