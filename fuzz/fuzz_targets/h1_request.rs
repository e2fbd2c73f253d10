//! The native HTTP/1 server's request parsing: the head parser, then the body decoder its
//! framing picks. The first byte seeds a read size; the rest is what a client sends.
//! Invariants: an accepted head is the same when parsed from its own bytes alone, and when
//! written out by the gateway's client and parsed again (method, target, kept headers,
//! framing); a refused head answers 400, 431 or 505; its body decodes to the same data, end
//! and verdict for any split of the input.
#![no_main]

use bytes::BytesMut;
use net::h1::fuzzing::{BodyDecoder, BodyFraming, Piece, encode_request_head, request_head};
use libfuzzer_sys::fuzz_target;

fn body(framing: BodyFraming, input: &[u8], step: usize) -> (Vec<u8>, Option<usize>, bool) {
    let mut d = BodyDecoder::new(framing);
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut fed = 0;
    loop {
        match d.decode(&mut buf) {
            Ok(Piece::Data(data)) => out.extend_from_slice(&data),
            Ok(Piece::End) => return (out, Some(fed - buf.len()), false),
            Ok(Piece::More) if fed == input.len() => return (out, None, false),
            Ok(Piece::More) => {
                let n = step.min(input.len() - fed);
                buf.extend_from_slice(&input[fed..fed + n]);
                fed += n;
            }
            Err(_) => return (out, None, true),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&seed, input)) = data.split_first() else {
        return;
    };
    let Some(parsed) = request_head(input) else {
        assert!(
            !input.windows(2).any(|w| w == b"\n\n") && !input.windows(3).any(|w| w == b"\n\r\n"),
            "a complete head was not found"
        );
        return;
    };
    let head = match parsed {
        Ok(head) => head,
        Err(refused) => {
            assert!(
                matches!(refused.status.as_u16(), 400 | 431 | 505),
                "{refused:?}"
            );
            return;
        }
    };
    let again = request_head(&input[..head.len]).and_then(Result::ok);
    let again = again.expect("the head alone parses");
    assert_eq!(again.request.uri(), head.request.uri());
    assert_eq!(again.request.headers(), head.request.headers());
    assert_eq!(again.framing, head.framing);

    let req = &head.request;
    let target = req.uri().to_string();
    let encoded = encode_request_head(req.method(), &target, req.headers(), head.framing);
    let back = match request_head(&encoded) {
        Some(Ok(back)) => back,
        other => panic!(
            "re-encoded head refused: {other:?}\n{:?}",
            String::from_utf8_lossy(&encoded)
        ),
    };
    assert_eq!(back.len, encoded.len());
    assert_eq!(back.request.method(), req.method());
    assert_eq!(back.request.uri(), req.uri());
    assert_eq!(back.request.headers(), req.headers());
    assert_eq!(back.framing, head.framing);

    let rest = &input[head.len..];
    let whole = body(head.framing, rest, rest.len().max(1));
    assert_eq!(body(head.framing, rest, 1), whole, "byte by byte");
    assert_eq!(
        body(head.framing, rest, usize::from(seed) + 1),
        whole,
        "seeded step"
    );
    if let (BodyFraming::Length(n), (data, end, _)) = (head.framing, &whole) {
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        assert_eq!(data.as_slice(), &rest[..n.min(rest.len())]);
        assert_eq!(*end, (n <= rest.len()).then_some(n));
    }
});
