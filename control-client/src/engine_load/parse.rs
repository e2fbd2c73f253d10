//! An engine's Prometheus text page, read for the few series that tell its load.
//!
//! vLLM and SGLang name them differently; several series of one name (labels `engine`,
//! `model_name`, one per data-parallel rank) are combined: request counts and KV blocks are
//! summed, the KV-cache usage is averaged (the ranks hold caches of one size, so the mean is the
//! share of the whole), the block size and the process start time are the largest seen.
//!
//! | what | vLLM | SGLang (`sglang_…` since 0.5.4, `sglang:…` before) |
//! |---|---|---|
//! | waiting | `vllm:num_requests_waiting` | `num_queue_reqs` |
//! | running | `vllm:num_requests_running` | `num_running_reqs` |
//! | KV-cache usage (0..1) | `vllm:kv_cache_usage_perc`, older `vllm:gpu_cache_usage_perc` | `token_usage` |
//! | cache size | `vllm:cache_config_info{block_size,num_gpu_blocks}` | `max_total_num_tokens` (blocks of one token) |
//! | restart signs | `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:prefix_cache_queries_total`, `process_start_time_seconds` | `prompt_tokens_total`, `generation_tokens_total` |
//!
//! Written here rather than taken from a crate: the one maintained Rust parser of this format
//! on crates.io reads metric names as `\w+`, which leaves out every vLLM name (`vllm:…`).
//! The reader is line by line and allocation-free; a line it cannot read is skipped and
//! counted. Its fuzz target is `fuzz/fuzz_targets/engine_metrics.rs`.

use std::borrow::Cow;

/// Largest page read (the worker stops reading there). vLLM's page for one model is about
/// 60 KiB, most of it histograms.
pub const MAX_PAGE_BYTES: usize = 4 << 20;

/// Counters that only grow while an engine process lives: one going back means a new process.
const COUNTERS: usize = 3;

/// What one page says of the engine's load.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineMetrics {
    /// Requests queued (summed over the series).
    pub waiting: Option<u32>,
    /// Requests running (summed).
    pub running: Option<u32>,
    /// Share of the KV cache in use, 0 to 1 (the mean of the series).
    pub kv_usage: Option<f32>,
    /// Tokens per KV block.
    pub block_size: Option<u32>,
    /// KV blocks in all (summed over the series: one cache per data-parallel rank).
    pub num_blocks: Option<u64>,
    /// `process_start_time_seconds`.
    pub start_time: Option<f64>,
    /// Tokens processed: prompt, generation, prefix-cache queries (summed).
    pub counters: [Option<f64>; COUNTERS],
    /// Lines of a known series that could not be read.
    pub skipped: usize,
}

impl EngineMetrics {
    /// Whether the page said anything of the engine's load: it has a waiting or a running count.
    pub fn has_load(&self) -> bool {
        self.waiting.is_some() || self.running.is_some()
    }

    /// Whether the engine is another process than the one `before` was read from: its start
    /// time changed, or a counter went back.
    pub fn restarted_since(&self, before: &EngineMetrics) -> bool {
        if let (Some(now), Some(then)) = (self.start_time, before.start_time)
            && now != then
        {
            return true;
        }
        self.counters
            .iter()
            .zip(&before.counters)
            .any(|(now, then)| matches!((now, then), (Some(n), Some(t)) if n < t))
    }
}

/// The series read, by what they tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Series {
    Waiting,
    Running,
    KvUsage,
    /// vLLM's `cache_config_info`: the value is 1, the labels tell.
    CacheConfig,
    /// SGLang's token pool: blocks of one token.
    CacheTokens,
    StartTime,
    Counter(usize),
}

fn series(name: &[u8]) -> Option<Series> {
    let sglang = name
        .strip_prefix(b"sglang:")
        .or_else(|| name.strip_prefix(b"sglang_"));
    if let Some(rest) = sglang {
        return match rest {
            b"num_queue_reqs" => Some(Series::Waiting),
            b"num_running_reqs" => Some(Series::Running),
            b"token_usage" => Some(Series::KvUsage),
            b"max_total_num_tokens" => Some(Series::CacheTokens),
            b"prompt_tokens_total" => Some(Series::Counter(0)),
            b"generation_tokens_total" => Some(Series::Counter(1)),
            _ => None,
        };
    }
    match name {
        b"vllm:num_requests_waiting" => Some(Series::Waiting),
        b"vllm:num_requests_running" => Some(Series::Running),
        b"vllm:kv_cache_usage_perc" | b"vllm:gpu_cache_usage_perc" => Some(Series::KvUsage),
        b"vllm:cache_config_info" => Some(Series::CacheConfig),
        b"process_start_time_seconds" => Some(Series::StartTime),
        b"vllm:prompt_tokens_total" => Some(Series::Counter(0)),
        b"vllm:generation_tokens_total" => Some(Series::Counter(1)),
        b"vllm:prefix_cache_queries_total" => Some(Series::Counter(2)),
        _ => None,
    }
}

/// Sums as they are read.
#[derive(Default)]
struct Totals {
    waiting: Option<f64>,
    running: Option<f64>,
    usage_sum: f64,
    usage_n: u32,
    block_size: Option<u32>,
    num_blocks: Option<u64>,
    start_time: Option<f64>,
    counters: [Option<f64>; COUNTERS],
    skipped: usize,
}

fn add(total: &mut Option<f64>, v: f64) {
    *total = Some(total.unwrap_or(0.0) + v);
}

/// A count as a gauge gives it (a float): `None` unless finite and not negative.
fn count(v: f64) -> Option<f64> {
    (v.is_finite() && v >= 0.0).then_some(v)
}

fn to_u32(v: f64) -> u32 {
    // Saturating: `as` clamps to the type's range.
    v.round() as u32
}

impl Totals {
    fn add(&mut self, series: Series, sample: &Sample<'_>) {
        let v = sample.value;
        match series {
            Series::Waiting => count(v).into_iter().for_each(|v| add(&mut self.waiting, v)),
            Series::Running => count(v).into_iter().for_each(|v| add(&mut self.running, v)),
            Series::KvUsage => {
                if v.is_finite() {
                    self.usage_sum += v.clamp(0.0, 1.0);
                    self.usage_n += 1;
                }
            }
            Series::CacheConfig => {
                let (mut size, mut blocks) = (None, None);
                sample.each_label(|name, value| match name {
                    "block_size" => size = value.trim().parse::<u32>().ok(),
                    "num_gpu_blocks" => blocks = value.trim().parse::<u64>().ok(),
                    _ => {}
                });
                if let (Some(size), Some(blocks)) = (size.filter(|s| *s > 0), blocks) {
                    self.block_size = Some(self.block_size.map_or(size, |b| b.max(size)));
                    self.num_blocks = Some(self.num_blocks.unwrap_or(0).saturating_add(blocks));
                }
            }
            Series::CacheTokens => {
                if let Some(tokens) = count(v) {
                    self.block_size = Some(self.block_size.unwrap_or(1));
                    let tokens = tokens.round() as u64;
                    self.num_blocks = Some(self.num_blocks.unwrap_or(0).saturating_add(tokens));
                }
            }
            Series::StartTime => {
                if v.is_finite() {
                    self.start_time = Some(self.start_time.map_or(v, |t| t.max(v)));
                }
            }
            Series::Counter(i) => {
                if let Some(v) = count(v) {
                    add(&mut self.counters[i], v);
                }
            }
        }
    }

    fn finish(self) -> EngineMetrics {
        EngineMetrics {
            waiting: self.waiting.map(to_u32),
            running: self.running.map(to_u32),
            kv_usage: (self.usage_n > 0).then(|| (self.usage_sum / f64::from(self.usage_n)) as f32),
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            start_time: self.start_time,
            counters: self.counters,
            skipped: self.skipped,
        }
    }
}

/// Reads an engine's metrics page (Prometheus text 0.0.4 or OpenMetrics): what it says of the
/// engine's load. Never fails: a page without the series gives [`EngineMetrics::has_load`]
/// false.
pub fn parse(page: &[u8]) -> EngineMetrics {
    let mut totals = Totals::default();
    for line in page.split(|b| *b == b'\n') {
        let line = line.trim_ascii();
        if line.first().is_none_or(|b| *b == b'#') {
            continue;
        }
        let Some(series) = series(&line[..name_len(line)]) else {
            continue;
        };
        match Sample::read(line) {
            Some(sample) => totals.add(series, &sample),
            None => totals.skipped += 1,
        }
    }
    totals.finish()
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

fn name_len(line: &[u8]) -> usize {
    line.iter()
        .position(|b| !is_name_byte(*b))
        .unwrap_or(line.len())
}

fn is_space(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

/// One sample line: `name{label="value",…} value [timestamp]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sample<'a> {
    pub(crate) name: &'a str,
    /// Between the braces, checked by [`scan_labels`].
    labels: &'a [u8],
    pub(crate) value: f64,
}

impl<'a> Sample<'a> {
    /// Reads a sample line (without its line end); `None` if it is not one.
    pub(crate) fn read(line: &'a [u8]) -> Option<Self> {
        let line = line.trim_ascii();
        let name_end = name_len(line);
        if name_end == 0 || line[0].is_ascii_digit() {
            return None;
        }
        // Name bytes are ASCII.
        let name = std::str::from_utf8(&line[..name_end]).ok()?;
        let after_name = &line[name_end..];
        let braced = after_name.trim_ascii_start();
        let (labels, rest) = if braced.first() == Some(&b'{') {
            let close = scan_labels(braced, |_, _| {})?;
            (&braced[1..close], &braced[close + 1..])
        } else if after_name.first().is_some_and(|b| is_space(*b)) {
            (&[][..], after_name)
        } else {
            return None;
        };
        let rest = rest.trim_ascii_start();
        let end = rest.iter().position(|b| is_space(*b)).unwrap_or(rest.len());
        let value = parse_value(&rest[..end])?;
        // A timestamp (or an OpenMetrics exemplar) may follow; the load does not use it.
        Some(Self {
            name,
            labels,
            value,
        })
    }

    /// Calls `each` with every label's name and (unescaped) value, in order.
    pub(crate) fn each_label(&self, mut each: impl FnMut(&str, Cow<'_, str>)) {
        let mut braced = Vec::with_capacity(self.labels.len() + 2);
        braced.push(b'{');
        braced.extend_from_slice(self.labels);
        braced.push(b'}');
        let _ = scan_labels(&braced, |name, raw| each(name, unescape(raw)));
    }
}

/// Checks the label set that `text` starts with (`{…}`) and calls `each` with each label's name
/// and raw value; returns the index of the closing brace. A trailing comma is allowed.
fn scan_labels(text: &[u8], mut each: impl FnMut(&str, &[u8])) -> Option<usize> {
    let mut i = 1;
    let skip_space = |i: &mut usize| {
        while text.get(*i).is_some_and(|b| is_space(*b)) {
            *i += 1;
        }
    };
    loop {
        skip_space(&mut i);
        if *text.get(i)? == b'}' {
            return Some(i);
        }
        let start = i;
        while text
            .get(i)
            .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
        {
            i += 1;
        }
        if i == start || text[start].is_ascii_digit() {
            return None;
        }
        let name = std::str::from_utf8(&text[start..i]).ok()?;
        skip_space(&mut i);
        if *text.get(i)? != b'=' {
            return None;
        }
        i += 1;
        skip_space(&mut i);
        if *text.get(i)? != b'"' {
            return None;
        }
        i += 1;
        let value_start = i;
        loop {
            match *text.get(i)? {
                b'\\' => i += 2,
                b'"' => break,
                _ => i += 1,
            }
        }
        each(name, &text[value_start..i]);
        i += 1;
        skip_space(&mut i);
        match *text.get(i)? {
            b',' => i += 1,
            b'}' => return Some(i),
            _ => return None,
        }
    }
}

/// A label value with `\\`, `\"` and `\n` undone (any other backslash is kept).
fn unescape(raw: &[u8]) -> Cow<'_, str> {
    if !raw.contains(&b'\\') {
        return String::from_utf8_lossy(raw);
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut bytes = raw.iter();
    while let Some(&b) = bytes.next() {
        if b != b'\\' {
            out.push(b);
            continue;
        }
        match bytes.next() {
            Some(b'n') => out.push(b'\n'),
            Some(&c @ (b'\\' | b'"')) => out.push(c),
            Some(&c) => out.extend_from_slice(&[b'\\', c]),
            None => out.push(b'\\'),
        }
    }
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

/// A sample value: a float as Go writes it (`1.5e+09`, `NaN`, `+Inf`, `-Inf`).
fn parse_value(text: &[u8]) -> Option<f64> {
    let text = std::str::from_utf8(text).ok()?;
    match text {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        // Rust reads `inf`, `nan` and `infinity` in any case too; Go writes none of them, and
        // they mean the same.
        _ => text.parse().ok(),
    }
}

/// The parser behind a small surface, for the fuzz target. Not an API.
#[doc(hidden)]
pub mod fuzzing {
    use std::fmt::Write as _;

    /// A sample line as read: name, labels (unescaped) and value.
    pub type Read = (String, Vec<(String, String)>, f64);

    /// Reads one line as the page reader does.
    pub fn read_sample(line: &[u8]) -> Option<Read> {
        let sample = super::Sample::read(line)?;
        let mut labels = Vec::new();
        sample.each_label(|name, value| labels.push((name.to_owned(), value.into_owned())));
        Some((sample.name.to_owned(), labels, sample.value))
    }

    /// Checks what the fuzz target and the property test hold of any page: the figures are
    /// what a worker may send (a usage in 0..1, a block size above 0, at most as many skipped
    /// lines as lines); `\r\n` line ends read as `\n` do; every line read as a sample, written
    /// back with its label values escaped, reads the same.
    pub fn check(page: &[u8]) {
        let m = super::parse(page);
        if let Some(usage) = m.kv_usage {
            assert!((0.0..=1.0).contains(&usage), "usage {usage}");
        }
        assert!(m.block_size.is_none_or(|b| b > 0));
        assert!(m.skipped <= page.split(|b| *b == b'\n').count());
        let crlf: Vec<u8> = page
            .iter()
            .flat_map(|b| match b {
                b'\n' => &b"\r\n"[..],
                b => std::slice::from_ref(b),
            })
            .copied()
            .collect();
        assert_eq!(super::parse(&crlf), m, "CRLF line ends");
        for line in page.split(|b| *b == b'\n') {
            let Some(read) = read_sample(line) else {
                continue;
            };
            let written = write_sample(&read);
            let again = read_sample(written.as_bytes());
            assert!(again.is_some(), "{written:?} does not read back");
            if let Some(again) = again {
                assert_eq!((&again.0, &again.1), (&read.0, &read.1));
                assert!(
                    again.2.to_bits() == read.2.to_bits() || (again.2.is_nan() && read.2.is_nan()),
                    "{} read back as {}",
                    read.2,
                    again.2
                );
            }
        }
    }

    /// Writes a sample back in the text format, label values escaped.
    pub fn write_sample((name, labels, value): &Read) -> String {
        let mut out = name.clone();
        if !labels.is_empty() {
            out.push('{');
            for (i, (label, v)) in labels.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let escaped = v
                    .replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n");
                let _ = write!(out, "{label}=\"{escaped}\"");
            }
            out.push('}');
        }
        let _ = write!(out, " {value:?}");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &[u8] = include_bytes!("../../../tests/vllm/fixtures/vllm-metrics.txt");

    #[test]
    fn reads_the_recorded_vllm_page() {
        let m = parse(VLLM);
        assert_eq!(m.waiting, Some(1));
        assert_eq!(m.running, Some(1));
        let usage = m.kv_usage.unwrap();
        assert!((usage - 0.133_333_33).abs() < 1e-6, "{usage}");
        assert_eq!(m.block_size, Some(128));
        assert_eq!(m.num_blocks, Some(16));
        assert_eq!(m.start_time, Some(1.79640548025e9));
        assert_eq!(m.counters, [Some(3948.0), Some(41.0), Some(3948.0)]);
        assert_eq!(m.skipped, 0);
        assert!(m.has_load());
    }

    #[test]
    fn reads_sglang_under_both_prefixes() {
        let old = br#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
sglang:max_total_num_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 161721.0
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
sglang:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.557572e+06
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
"#;
        let m = parse(old);
        assert_eq!((m.waiting, m.running), (Some(3), Some(7)));
        assert_eq!(m.kv_usage, Some(0.28));
        assert_eq!((m.block_size, m.num_blocks), (Some(1), Some(161_721)));
        assert_eq!(m.counters, [Some(8_128_902.0), Some(7_557_572.0), None]);
        // 0.5.4 on: the same names with `_`; one series per data-parallel rank.
        let new = br#"sglang_num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0",dp_rank="0"} 2
sglang_num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0",dp_rank="1"} 5
sglang_num_running_reqs{model_name="m",dp_rank="0"} 1
sglang_num_running_reqs{model_name="m",dp_rank="1"} 4
sglang_token_usage{model_name="m",dp_rank="0"} 0.2
sglang_token_usage{model_name="m",dp_rank="1"} 0.6
"#;
        let m = parse(new);
        assert_eq!((m.waiting, m.running), (Some(7), Some(5)));
        assert!(
            (m.kv_usage.unwrap() - 0.4).abs() < 1e-6,
            "the mean of the ranks"
        );
    }

    #[test]
    fn data_parallel_ranks_add_up() {
        let page = br#"vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 1.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0
"#;
        let m = parse(page);
        assert_eq!((m.waiting, m.running), (Some(3), Some(7)));
        assert_eq!(m.kv_usage, Some(0.75));
        assert_eq!((m.block_size, m.num_blocks), (Some(16), Some(200)));
    }

    #[test]
    fn odd_but_valid_text_is_read() {
        let page = "# a comment {with braces}\r\n\
            #TYPE without a space\n\
            \n\
            vllm:num_requests_waiting{model_name=\"a \\\"quoted\\\" } name\\\\\",engine=\"0\",} 4 1700000000000\r\n\
            vllm:num_requests_running\t{ model_name = \"x\" }\t 2.5e0\n\
            vllm:kv_cache_usage_perc NaN\n\
            vllm:kv_cache_usage_perc{engine=\"1\"} +Inf\n\
            vllm:kv_cache_usage_perc{engine=\"2\"} 2e-1\n\
            process_start_time_seconds 1.7e+09\n\
            # EOF\n";
        let m = parse(page.as_bytes());
        assert_eq!(m.waiting, Some(4));
        assert_eq!(m.running, Some(3), "2.5 rounds to the nearest");
        // NaN and infinities are left out.
        assert_eq!(m.kv_usage, Some(0.2));
        assert_eq!(m.start_time, Some(1.7e9));
        assert_eq!(m.skipped, 0);
    }

    #[test]
    fn broken_lines_are_skipped_and_counted() {
        let page = b"vllm:num_requests_waiting{engine=\"0\" 3\n\
            vllm:num_requests_waiting{engine=\"0\"} three\n\
            vllm:num_requests_waiting{engine=\"0\"}\n\
            vllm:num_requests_waiting{engine=0} 3\n\
            vllm:num_requests_waiting -1\n\
            vllm:num_requests_running 2\n\
            vllm:num_requests_waiting_by_reason{reason=\"capacity\"} 9\n";
        let m = parse(page);
        assert_eq!(m.skipped, 4);
        assert_eq!(m.waiting, None, "a negative count is left out");
        assert_eq!(m.running, Some(2));
    }

    #[test]
    fn a_page_without_the_series_says_nothing() {
        for page in [
            &b""[..],
            b"<html>not found</html>",
            b"\xff\xfe\x00",
            b"up 1\n",
        ] {
            let m = parse(page);
            assert!(!m.has_load(), "{page:?}");
        }
        let m = parse(b"vllm:num_requests_waiting 1e30\n");
        assert_eq!(m.waiting, Some(u32::MAX), "saturates");
    }

    #[test]
    fn a_restart_shows_in_counters_or_start_time() {
        let before = parse(b"vllm:prompt_tokens_total 100\nprocess_start_time_seconds 5\n");
        let same = parse(b"vllm:prompt_tokens_total 120\nprocess_start_time_seconds 5\n");
        assert!(!same.restarted_since(&before));
        let back = parse(b"vllm:prompt_tokens_total 20\nprocess_start_time_seconds 5\n");
        assert!(back.restarted_since(&before));
        let started = parse(b"vllm:prompt_tokens_total 120\nprocess_start_time_seconds 6\n");
        assert!(started.restarted_since(&before));
        // A counter that is gone says nothing.
        let gone = parse(b"process_start_time_seconds 5\n");
        assert!(!gone.restarted_since(&before));
    }

    proptest::proptest! {
        /// The fuzz target's invariants over pages made of the format's own pieces.
        #[test]
        fn any_page_keeps_the_invariants(pieces in proptest::collection::vec(
            proptest::sample::select(vec![
                "vllm:num_requests_waiting", "vllm:cache_config_info", "sglang_token_usage",
                "process_start_time_seconds", "block_size", "num_gpu_blocks", "{", "}", "=",
                "\"", "\\", ",", " ", "\t", "\n", "\r", "#", "a", "7", "-1", ".5e3", "NaN",
                "+Inf", "é", "\u{0}",
            ]),
            0..60,
        )) {
            fuzzing::check(pieces.concat().as_bytes());
        }

        /// The same over pages of sample lines, label values of any text.
        #[test]
        fn any_page_of_samples_keeps_the_invariants(lines in proptest::collection::vec(
            (
                proptest::sample::select(vec!["vllm:num_requests_running", "vllm:cache_config_info", "x_y:z"]),
                proptest::collection::vec(
                    (proptest::sample::select(vec!["engine", "block_size", "num_gpu_blocks"]), ".{0,8}"),
                    0..4,
                ),
                proptest::sample::select(vec![" 1", " 16", "  2.5e1 123", "\t-0.0", " NaN", " 1e400", ""]),
            ),
            0..8,
        )) {
            let mut page = String::new();
            for (name, labels, value) in &lines {
                page.push_str(name);
                if !labels.is_empty() {
                    let labels: Vec<String> = labels
                        .iter()
                        .map(|(l, v)| format!("{l}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")))
                        .collect();
                    page.push_str(&format!("{{{}}}", labels.join(",")));
                }
                page.push_str(value);
                page.push('\n');
            }
            fuzzing::check(page.as_bytes());
        }
    }

    #[test]
    fn samples_written_back_read_the_same() {
        for line in [
            &b"a:b_c{x=\"1\",y=\"q\\\"\\\\\\n\"} 1.5e-3 123"[..],
            b"m -Inf",
            b"m{} 0",
        ] {
            let read = fuzzing::read_sample(line).unwrap();
            let again = fuzzing::read_sample(fuzzing::write_sample(&read).as_bytes()).unwrap();
            assert_eq!(read.0, again.0);
            assert_eq!(read.1, again.1);
            assert_eq!(read.2.to_bits(), again.2.to_bits());
        }
    }
}
