//! The usage scanners (gateway::usage) fed a response body in pieces. The first byte is the
//! number of split points, followed by two bytes per split point; the rest is the body.
//! Invariants:
//! - SSE: the same usage for one piece, byte by byte and the fuzzed split points, equal to a
//!   reference that splits the whole body into lines; the carry never exceeds MAX_LINE.
//! - JSON: the same usage for any split; when serde also reads a usage from the whole body,
//!   both agree.
#![no_main]

use gateway::usage::{JsonUsageScanner, MAX_LINE, SseUsageScanner, Usage, usage_from_json};
use libfuzzer_sys::fuzz_target;

fn reference(body: &[u8]) -> Option<Usage> {
    let mut lines: Vec<&[u8]> = body.split(|b| *b == b'\n' || *b == b'\r').collect();
    // The piece after the last terminator is not a complete line.
    lines.pop();
    lines
        .into_iter()
        .filter(|l| l.len() <= MAX_LINE)
        .filter_map(|l| l.strip_prefix(b"data:"))
        .map(|d| d.strip_prefix(b" ").unwrap_or(d))
        .filter_map(usage_from_json)
        .last()
}

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 16);
    if rest.len() < 2 * n {
        return;
    }
    let (splits, body) = rest.split_at(2 * n);
    let mut cuts: Vec<usize> = splits
        .chunks(2)
        .map(|c| usize::from(u16::from_le_bytes([c[0], c[1]])) % (body.len() + 1))
        .collect();
    cuts.sort_unstable();
    let mut pieces = Vec::new();
    let mut from = 0;
    for cut in cuts {
        pieces.push(&body[from..cut]);
        from = cut;
    }
    pieces.push(&body[from..]);

    let sse = |pieces: &mut dyn Iterator<Item = &[u8]>| {
        let mut s = SseUsageScanner::new();
        for p in pieces {
            s.feed(p);
            assert!(s.carried() <= MAX_LINE);
        }
        s.usage()
    };
    let whole = sse(&mut std::iter::once(body));
    assert_eq!(whole, reference(body));
    assert_eq!(sse(&mut pieces.iter().copied()), whole);
    assert_eq!(sse(&mut body.chunks(1)), whole);

    let json = |pieces: &mut dyn Iterator<Item = &[u8]>| {
        let mut s = JsonUsageScanner::new();
        for p in pieces {
            s.feed(p);
        }
        s.usage()
    };
    let whole = json(&mut std::iter::once(body));
    assert_eq!(json(&mut pieces.iter().copied()), whole);
    assert_eq!(json(&mut body.chunks(1)), whole);
    if let (Some(scanned), Some(parsed)) = (whole, usage_from_json(body)) {
        assert_eq!(scanned, parsed);
    }
});
