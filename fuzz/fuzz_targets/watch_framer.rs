//! The sync client's watch-stream framer (`control_client::sync::fuzzing::WatchFramer`) and its
//! payload reader. Byte 0 seeds the size of body frames; the rest is the watch body.
//! Invariants: the same blocks for any framing of the body, equal to a whole-input split on
//! blank lines (LF or CRLF) that drops blank blocks; no block ends in a line break; the
//! bytes left pending are the unfinished event; a small limit refuses exactly when the
//! buffered bytes would exceed it.
#![no_main]

use control_client::sync::fuzzing::{WatchFramer, payload};
use libfuzzer_sys::fuzz_target;

fn frame(input: &[u8], step: usize, limit: usize) -> (Vec<Vec<u8>>, usize, bool) {
    let mut f = WatchFramer::new(limit);
    let mut out = Vec::new();
    for piece in input.chunks(step) {
        let pending = f.pending();
        match f.push(piece) {
            Ok(()) => assert!(pending + piece.len() <= limit),
            Err(e) => {
                assert_eq!(e.limit, limit);
                assert!(pending + piece.len() > limit);
                return (out, f.pending(), true);
            }
        }
        while let Some(block) = f.next_block() {
            out.push(block.to_vec());
        }
    }
    (out, f.pending(), false)
}

/// Splits the whole input on blank lines: the blocks, and where the unfinished event starts.
fn reference(input: &[u8]) -> (Vec<Vec<u8>>, usize) {
    let mut blocks = Vec::new();
    let (mut start, mut line_start) = (0, 0);
    for (i, &b) in input.iter().enumerate() {
        if b != b'\n' {
            continue;
        }
        let line = &input[line_start..i];
        if line.is_empty() || line == b"\r" {
            let content = &input[start..line_start];
            let content = content.strip_suffix(b"\n").unwrap_or(content);
            let content = content.strip_suffix(b"\r").unwrap_or(content);
            if !content.iter().all(u8::is_ascii_whitespace) {
                blocks.push(content.to_vec());
            }
            start = i + 1;
        }
        line_start = i + 1;
    }
    (blocks, start)
}

fuzz_target!(|data: &[u8]| {
    let Some((&seed, input)) = data.split_first() else {
        return;
    };
    let (want, unfinished) = reference(input);
    let big = usize::MAX;
    let whole = frame(input, input.len().max(1), big);
    assert_eq!(whole.0, want);
    assert_eq!(whole.1, input.len() - unfinished);
    assert_eq!(frame(input, 1, big), whole, "byte by byte");
    let step = usize::from(seed) + 1;
    assert_eq!(frame(input, step, big), whole, "step {step}");
    for block in &whole.0 {
        assert!(!block.ends_with(b"\n"));
        let text = block.trim_ascii();
        if text.starts_with(b"{") {
            assert_eq!(
                payload(block).as_deref(),
                Some(text),
                "bare JSON is its own payload"
            );
        }
    }
    // A small limit: every block before the refusal is one the unlimited framer gives.
    let limit = usize::from(seed % 32) + 1;
    let (small, _, _) = frame(input, step, limit);
    assert!(small.len() <= whole.0.len());
    assert_eq!(small[..], whole.0[..small.len()]);
});
