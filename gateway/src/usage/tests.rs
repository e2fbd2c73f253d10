use super::sse::only_null_usage;
use super::value::usage_value;
use super::*;

/// A vLLM-shaped stream with a usage chunk, CRLF and LF mixed, non-ASCII text.
const STREAM: &str = concat!(
    ": keep-alive\r\n\r\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Grüße \\\"usage\\\": 🚀\"}}]}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"},\"finish_reason\":\"stop\"}]}\r\n\r\n",
    "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":7,\"total_tokens\":19}}\n\n",
    "data: [DONE]\n\n",
);

const EXPECTED: Usage = Usage {
    prompt_tokens: 12,
    completion_tokens: 7,
    total_tokens: 19,
};

fn scan_sse(chunks: &[&[u8]]) -> Option<Usage> {
    let mut s = SseUsageScanner::new();
    for c in chunks {
        s.feed(c);
    }
    s.usage()
}

#[test]
fn null_usage_events_are_skipped_without_changing_the_result() {
    assert!(only_null_usage(br#"{"choices":[],"usage":null}"#));
    assert!(only_null_usage(br#"{"choices":[], "usage" :  null }"#));
    assert!(only_null_usage(br#"{"choices":[]}"#));
    assert!(!only_null_usage(
        br#"{"usage":null,"x":{"usage":{"prompt_tokens":1}}}"#
    ));
    assert!(!only_null_usage(br#"{"usage":{"prompt_tokens":1}}"#));
    assert!(!only_null_usage(br#"{"note":"usage","usage":nul"#));
    let mut s = SseUsageScanner::new();
    s.feed(b"data: {\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":3}}\n\n");
    s.feed(b"data: {\"choices\":[],\"usage\":null}\n\n");
    assert_eq!(s.usage().map(|u| u.total_tokens), Some(5));
}

#[test]
fn sse_usage_at_every_split() {
    let b = STREAM.as_bytes();
    assert_eq!(scan_sse(&[b]), Some(EXPECTED));
    for i in 0..=b.len() {
        assert_eq!(
            scan_sse(&[&b[..i], &b[i..]]),
            Some(EXPECTED),
            "split at {i}"
        );
    }
    // Byte by byte, and in three pieces around every pair of offsets in a window.
    let singles: Vec<&[u8]> = b.chunks(1).collect();
    assert_eq!(scan_sse(&singles), Some(EXPECTED));
    let n = b.len();
    for i in (0..n).step_by(7) {
        for j in (i..n).step_by(13) {
            assert_eq!(scan_sse(&[&b[..i], &b[i..j], &b[j..]]), Some(EXPECTED));
        }
    }
}

#[test]
fn sse_last_usage_wins_and_null_is_ignored() {
    let s = "data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\
             data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":5}}\n\
             data: {\"usage\":null}\n\
             data:{\"usage\":{\"prompt_tokens\":\"x\"}}\n";
    assert_eq!(
        scan_sse(&[s.as_bytes()]),
        Some(Usage {
            prompt_tokens: 1,
            completion_tokens: 5,
            total_tokens: 6
        })
    );
}

#[test]
fn sse_without_usage() {
    let s =
        "data: {\"choices\":[{\"delta\":{\"content\":\"\\\"usage\\\":{}\"}}]}\n\ndata: [DONE]\n\n";
    assert_eq!(scan_sse(&[s.as_bytes()]), None);
    assert_eq!(scan_sse(&[b"event: usage\nid: 1\n\n"]), None);
    // Not `data:`, or not terminated.
    let u = r#"{"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;
    assert_eq!(scan_sse(&[format!("datum: {u}\n").as_bytes()]), None);
    assert_eq!(scan_sse(&[format!("data: {u}").as_bytes()]), None);
    assert!(scan_sse(&[format!("data: {u}\r").as_bytes()]).is_some());
}

#[test]
fn sse_oversize_lines_are_skipped_in_bounded_memory() {
    let usage = r#"data: {"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#;
    // A usage line padded past the limit is skipped, whatever the chunking.
    let pad = " ".repeat(MAX_LINE);
    let long = format!("data: {{\"pad\":\"{pad}\",\"usage\":{{\"prompt_tokens\":9}}}}\n");
    let stream = format!("{usage}\n{long}data: [DONE]\n");
    let b = stream.as_bytes();
    let want = Some(Usage {
        prompt_tokens: 3,
        completion_tokens: 4,
        total_tokens: 7,
    });
    assert_eq!(scan_sse(&[b]), want);
    let mut s = SseUsageScanner::new();
    for c in b.chunks(1000) {
        s.feed(c);
        assert!(s.carried() <= MAX_LINE);
    }
    assert_eq!(s.usage(), want);
    // A line of exactly MAX_LINE bytes is still read.
    let frame = |pad: usize| {
        format!(
            "data: {{\"usage\":{{\"prompt_tokens\":2}},\"p\":\"{}\"}}",
            "x".repeat(pad)
        )
    };
    let exact = frame(MAX_LINE - frame(0).len());
    assert_eq!(exact.len(), MAX_LINE);
    let exact = format!("{exact}\n");
    for chunk in [MAX_LINE + 1, 100, 1] {
        let mut s = SseUsageScanner::new();
        for c in exact.as_bytes().chunks(chunk) {
            s.feed(c);
        }
        assert_eq!(s.usage().map(|u| u.prompt_tokens), Some(2));
    }
    // An endless line never grows the carry.
    let mut s = SseUsageScanner::new();
    for _ in 0..100 {
        s.feed(&[b'a'; 4096]);
        assert!(s.carried() <= MAX_LINE);
    }
    s.feed(b"\n");
    s.feed(usage.as_bytes());
    s.feed(b"\n");
    assert_eq!(s.usage(), want);
}

const BODY: &str = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"a \"usage\": {\"prompt_tokens\": 99} }"},"usage":{"prompt_tokens":1}}],"usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30,"prompt_tokens_details":{"cached_tokens":0}},"x":[{}]}"#;

fn scan_json(chunks: &[&[u8]]) -> Option<Usage> {
    let mut s = JsonUsageScanner::new();
    for c in chunks {
        s.feed(c);
    }
    s.usage()
}

#[test]
fn json_usage_at_every_split() {
    let want = Some(Usage {
        prompt_tokens: 10,
        completion_tokens: 20,
        total_tokens: 30,
    });
    let b = BODY.as_bytes();
    assert_eq!(usage_from_json(b), want);
    for i in 0..=b.len() {
        assert_eq!(scan_json(&[&b[..i], &b[i..]]), want, "split at {i}");
    }
    let pretty =
        serde_json::to_vec_pretty(&serde_json::from_slice::<serde_json::Value>(b).unwrap())
            .unwrap();
    assert_eq!(scan_json(&[&pretty]), want);
    assert_eq!(usage_from_json(&pretty), want);
}

#[test]
fn json_without_usage() {
    for body in [
        &br#"{"usage":null}"#[..],
        br#"{"data":[{"usage":{"prompt_tokens":1}}]}"#,
        br#"{"\"usage":{"prompt_tokens":1}}"#,
        br#"{"usages":{"prompt_tokens":1}}"#,
        br#"[{"usage":{"prompt_tokens":1}}]"#,
        br#"{"usage":{"prompt_tokens":-1}}"#,
        b"",
        b"not json",
    ] {
        assert_eq!(
            scan_json(&[body]),
            None,
            "{}",
            String::from_utf8_lossy(body)
        );
        assert_eq!(usage_from_json(body), None);
    }
    // A usage value too long to copy.
    let long = format!(
        r#"{{"usage":{{"prompt_tokens":1,"pad":"{}"}}}}"#,
        "x".repeat(MAX_USAGE_VALUE)
    );
    assert_eq!(scan_json(&[long.as_bytes()]), None);
    // Embeddings: no completion tokens.
    assert_eq!(
        scan_json(&[br#" {"data":[],"usage":{"prompt_tokens":4,"total_tokens":4}}"#]),
        Some(Usage {
            prompt_tokens: 4,
            completion_tokens: 0,
            total_tokens: 4
        })
    );
}

/// xorshift64*: a small deterministic generator for the property tests.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

/// Pieces of string contents, already escaped for JSON.
const TEXT: &[&str] = &[
    "usage",
    "tok",
    " ",
    r#"\"usage\":{\"prompt_tokens\":7}"#,
    r#"\""#,
    r"\\",
    r#"\\\""#,
    r"\n",
    r"\/",
    r"\u0075sage",
    r"\u00e9",
    "é",
    "Grüße",
    "🚀",
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    "|",
];

/// Keys of the top-level object besides `usage` (none of them `usage` once unescaped).
const KEYS: &[&str] = &[
    "id",
    "model",
    "choices",
    "usages",
    "Usage",
    "usag",
    "u",
    "usage_",
    r#"\"usage"#,
    r"usage\\",
    r"\\usage",
    "data",
    "x",
];

/// Random JSON, with blanks, strings of `TEXT` (some longer than a block) and nested
/// `usage` members.
struct Gen {
    rng: Rng,
    out: String,
}

impl Gen {
    fn blank(&mut self) {
        let blank = self.rng.pick(&["", "", "", " ", "\n  ", "\t", "\r\n"]);
        self.out.push_str(blank);
    }

    fn string(&mut self) {
        self.out.push('"');
        if self.rng.below(8) == 0 {
            let long = "y".repeat(60 + self.rng.below(150));
            self.out.push_str(&long);
        }
        for _ in 0..self.rng.below(6) {
            let piece = self.rng.pick(TEXT);
            self.out.push_str(piece);
        }
        self.out.push('"');
    }

    fn value(&mut self, depth: usize) {
        match self.rng.below(if depth < 3 { 8 } else { 4 }) {
            0 => self.string(),
            1 => {
                let n = self
                    .rng
                    .pick(&["0", "1", "-2", "3.5", "1e3", "12345678901234567890123"]);
                self.out.push_str(n);
            }
            2 => {
                let literal = self.rng.pick(&["true", "false", "null"]);
                self.out.push_str(literal);
            }
            3 => self.string(),
            4 | 5 => self.object(depth + 1, None),
            _ => {
                self.out.push('[');
                for i in 0..self.rng.below(4) {
                    if i > 0 {
                        self.out.push(',');
                    }
                    self.blank();
                    self.value(depth + 1);
                    self.blank();
                }
                self.out.push(']');
            }
        }
    }

    /// What `write` writes, apart.
    fn apart(&mut self, write: impl FnOnce(&mut Self)) -> String {
        let outer = std::mem::take(&mut self.out);
        write(self);
        std::mem::replace(&mut self.out, outer)
    }

    fn member(&mut self, key: &str, value: impl FnOnce(&mut Self)) {
        self.blank();
        self.out.push('"');
        self.out.push_str(key);
        self.out.push('"');
        self.blank();
        self.out.push(':');
        self.blank();
        value(self);
        self.blank();
    }

    /// An object; `usage` (the value's text) is its member at a random place.
    fn object(&mut self, depth: usize, usage: Option<&str>) {
        let mut members = Vec::new();
        for _ in 0..self.rng.below(5) {
            // Below the top, `usage` is an ordinary key.
            let key = if depth > 0 && self.rng.below(3) == 0 {
                "usage"
            } else {
                self.rng.pick(KEYS)
            };
            let nested = depth > 0 && self.rng.below(4) == 0;
            members.push(self.apart(|g| {
                g.member(key, |g| {
                    if nested {
                        let v = g.usage_value();
                        g.out.push_str(&v);
                    } else {
                        g.value(depth);
                    }
                })
            }));
        }
        if let Some(usage) = usage {
            let at = self.rng.below(members.len() + 1);
            let member = self.apart(|g| g.member("usage", |g| g.out.push_str(usage)));
            members.insert(at, member);
        }
        self.out.push('{');
        if members.is_empty() {
            self.blank();
        }
        self.out.push_str(&members.join(","));
        self.out.push('}');
    }

    /// A `usage` value: mostly the usual shape, members in any order, sometimes extra
    /// members, odd numbers, duplicates, escaped keys, `null`, or no object at all.
    fn usage_value(&mut self) -> String {
        let mut members: Vec<String> = Vec::new();
        let count = |rng: &mut Rng| {
            rng.pick(&[
                "0",
                "5",
                "13",
                "4096",
                "18446744073709551615",
                "18446744073709551616",
                "1.0",
                "-1",
                "1e2",
                "null",
                r#""7""#,
            ])
            .to_owned()
        };
        let usual = self.rng.below(3) != 0;
        for name in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            if usual || self.rng.below(4) != 0 {
                let n = if usual {
                    (self.rng.below(5000)).to_string()
                } else {
                    count(&mut self.rng)
                };
                members.push(format!(r#""{name}":{n}"#));
            }
        }
        for _ in 0..self.rng.below(3) {
            let extra = self.rng.pick(&[
                r#""prompt_tokens_details":{"cached_tokens":0}"#,
                r#""prompt_tokens_details":null"#,
                r#""completion_tokens_details":{"reasoning_tokens":12,"x":[1,-2,{"a":"b"}]}"#,
                r#""note":"a \"usage\" note""#,
                r#""f":1.5"#,
                r#""big":123456789012345678901234567890"#,
                r#""t":true"#,
                r#""prompt\u005ftokens":3"#,
                r#""prompt_tokens":2"#,
                r#""é":"ü""#,
                r#""deep":[[[[[[[[[[1]]]]]]]]]]"#,
            ]);
            members.push(extra.to_owned());
        }
        // Shuffled.
        for i in (1..members.len()).rev() {
            members.swap(i, self.rng.below(i + 1));
        }
        let sep = self.rng.pick(&[",", ", ", " ,\n  "]);
        match self.rng.below(12) {
            0 => "null".to_owned(),
            1 => r#"[{"prompt_tokens":1}]"#.to_owned(),
            2 => r#""usage""#.to_owned(),
            _ => format!("{{{}}}", members.join(sep)),
        }
    }
}

/// A valid JSON document and the usage the scanner must find in it: `usage_from_json`'s,
/// or none when the usage value is too long to be read.
fn document(seed: u64) -> (String, Option<Usage>) {
    let mut g = Gen {
        rng: Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
        out: String::new(),
    };
    let mut usage = (g.rng.below(5) != 0).then(|| g.usage_value());
    // Sometimes around the longest value read: padded to that length exactly, one byte
    // shorter or one longer.
    if usage.is_some() && g.rng.below(12) == 0 {
        let shape = format!(r#"{{"pad":"","prompt_tokens":{}}}"#, g.rng.below(100));
        let len = MAX_USAGE_VALUE + 1 - g.rng.below(3);
        let pad = "p".repeat(len - shape.len());
        let padded = shape.replacen(r#""pad":"""#, &format!(r#""pad":"{pad}""#), 1);
        assert_eq!(padded.len(), len);
        usage = Some(padded);
    }
    g.blank();
    g.object(0, usage.as_deref());
    g.blank();
    let doc = g.out;
    serde_json::from_str::<serde_json::Value>(&doc).expect("the generator writes JSON");
    let too_long = usage.is_some_and(|u| u.len() > MAX_USAGE_VALUE);
    let want = if too_long {
        None
    } else {
        usage_from_json(doc.as_bytes())
    };
    (doc, want)
}

/// The scanner's usage for every split in two, a few random splits in more pieces, and
/// byte by byte.
fn check_splits(doc: &[u8], want: Option<Usage>, rng: &mut Rng) {
    let show = || String::from_utf8_lossy(doc).into_owned();
    assert_eq!(scan_json(&[doc]), want, "{}", show());
    for i in 0..=doc.len() {
        assert_eq!(
            scan_json(&[&doc[..i], &doc[i..]]),
            want,
            "split at {i}: {}",
            show()
        );
    }
    for _ in 0..4 {
        let mut cuts: Vec<usize> = (0..1 + rng.below(8))
            .map(|_| rng.below(doc.len() + 1))
            .collect();
        cuts.sort_unstable();
        let mut pieces = Vec::new();
        let mut from = 0;
        for cut in cuts {
            pieces.push(&doc[from..cut]);
            from = cut;
        }
        pieces.push(&doc[from..]);
        assert_eq!(scan_json(&pieces), want, "pieces {pieces:?}");
    }
    let bytes: Vec<&[u8]> = doc.chunks(1).collect();
    assert_eq!(scan_json(&bytes), want, "byte by byte: {}", show());
}

#[test]
fn json_scanner_agrees_with_serde_at_every_split() {
    let mut rng = Rng(7);
    let mut found = 0;
    for seed in 0..300 {
        let (doc, want) = document(seed);
        found += usize::from(want.is_some());
        check_splits(doc.as_bytes(), want, &mut rng);
    }
    // The generator is not degenerate.
    assert!(found > 100, "{found}");
    let usage = r#"{"prompt_tokens":5,"completion_tokens":8,"total_tokens":13}"#;
    let content = "tok \\\"usage\\\" \\\\".repeat(40);
    for doc in [
        BODY.to_owned(),
        format!(r#"{{"usage":{usage}}}"#),
        format!(r#"  {{ "usage" : {usage} , "x" : 1 }}  "#),
        format!(r#"{{"a":"{content}","b":["usage",{{"usage":{usage}}}],"usage":{usage}}}"#),
        format!(r#"{{"usage":{usage},"a":"{content}","c":{{"usage":{{"prompt_tokens":1}}}}}}"#),
        r#"{"a":"usage","b":"\"usage\"","usage":null}"#.to_owned(),
        format!(r#"{{"a":{{"b":"}}]\"\\"}},"usage":{usage}}}"#),
        format!(r#"{{"🚀":"é","usage":{{"prompt_tokens":1,"x":"{content}"}}}}"#),
    ] {
        let want = usage_from_json(doc.as_bytes());
        check_splits(doc.as_bytes(), want, &mut rng);
    }
}

#[test]
fn usage_values_read_by_hand_as_serde_reads_them() {
    let mut g = Gen {
        rng: Rng(11),
        out: String::new(),
    };
    for _ in 0..3000 {
        let mut v = g.usage_value().into_bytes();
        // Some broken: a byte changed or dropped.
        if g.rng.below(3) == 0 && !v.is_empty() {
            let at = g.rng.below(v.len());
            if g.rng.below(2) == 0 {
                v.remove(at);
            } else {
                v[at] = b"{}[]\":,0-. e\\x"[g.rng.below(14)];
            }
        }
        let serde = serde_json::from_slice::<UsageProbe>(&v)
            .ok()
            .map(Usage::from);
        assert_eq!(usage_value(&v), serde, "{}", String::from_utf8_lossy(&v));
    }
}

#[test]
fn json_split_usage_value_is_bounded() {
    let long = format!(
        r#"{{"usage":{{"prompt_tokens":1,"pad":"{}"}},"x":1}}"#,
        "x".repeat(3 * MAX_USAGE_VALUE)
    );
    for size in [1, 7, 100, 1000] {
        let mut s = JsonUsageScanner::new();
        for c in long.as_bytes().chunks(size) {
            s.feed(c);
            assert!(s.value.capacity() <= 2 * MAX_USAGE_VALUE);
        }
        assert_eq!(s.usage(), None);
    }
    // The scanner reads the last top-level usage it can (serde refuses duplicate keys).
    let doc = format!(
        r#"{{"usage":{{"prompt_tokens":1,"pad":"{}"}},"x":1,"usage":{{"prompt_tokens":2}}}}"#,
        "x".repeat(3 * MAX_USAGE_VALUE)
    );
    let mut s = JsonUsageScanner::new();
    for c in doc.as_bytes().chunks(100) {
        s.feed(c);
    }
    assert_eq!(s.usage().map(|u| u.prompt_tokens), Some(2));
}

#[test]
fn include_usage_is_added_after_the_opening_brace() {
    let body = br#" {"model":"m","stream":true,"messages":[]}"#;
    assert!(
        crate::route::read_json_request(body)
            .unwrap()
            .streamed_without_options
    );
    let out = add_include_usage(body).unwrap();
    assert_eq!(
        out,
        br#" {"stream_options":{"include_usage":true},"model":"m","stream":true,"messages":[]}"#
    );
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["stream_options"]["include_usage"], true);
    assert_eq!(add_include_usage(b"[]"), None);
    assert_eq!(add_include_usage(b"  "), None);
}
