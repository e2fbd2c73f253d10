//! The gateway's HTTP/1 CL/TE framing scanner (request smuggling guard). The first byte seeds
//! the chunk size the stream is fed in; the rest is the byte stream a client sends.
//! Invariants: the conflict offset does not depend on how the stream is split; it points at
//! the line feed of a blank line of a head that named both headers.
#![no_main]

use net::framing::Scanner;
use libfuzzer_sys::fuzz_target;

fn scan(input: &[u8], step: usize) -> Option<usize> {
    let mut s = Scanner::new();
    let mut offset = 0;
    for piece in input.chunks(step) {
        if let Some(at) = s.feed(piece) {
            return Some(offset + at);
        }
        offset += piece.len();
    }
    None
}

fn contains_ci(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle))
}

fuzz_target!(|data: &[u8]| {
    let Some((&seed, input)) = data.split_first() else {
        return;
    };
    let whole = scan(input, input.len().max(1));
    assert_eq!(scan(input, 1), whole, "byte by byte");
    assert_eq!(
        scan(input, usize::from(seed % 64) + 1),
        whole,
        "step {}",
        seed % 64 + 1
    );
    if let Some(lf) = whole {
        assert_eq!(input[lf], b'\n');
        let head = &input[..lf];
        assert!(contains_ci(head, b"content-length"));
        assert!(contains_ci(head, b"transfer-encoding"));
    }
});
