//! `GET /metrics`: the engine's figures in Prometheus text, under vLLM's names and labels.

use std::fmt::Write as _;

use crate::perf::{ModelStats, TTFT_BUCKETS, TtftHistogram};

/// What the page shows besides the figures.
pub(crate) struct Page<'a> {
    pub(crate) model: &'a str,
    pub(crate) block_tokens: usize,
    /// Whether the performance model (and so the prefix cache) is on.
    pub(crate) prefix_caching: bool,
}

/// A label value escaped for the text format.
fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A number as Python's client writes it (`3.0`).
fn number(v: f64) -> String {
    format!("{v:?}")
}

pub(crate) fn render(page: &Page<'_>, stats: &ModelStats, ttft: &TtftHistogram) -> String {
    let labels = format!(r#"model_name="{}",engine="0""#, escape(page.model));
    let mut out = String::with_capacity(4096);
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = write!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {v}\n",
            v = number(value)
        );
    };
    let usage = if stats.kv_blocks == 0 {
        0.0
    } else {
        stats.used_blocks as f64 / stats.kv_blocks as f64
    };
    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        stats.running as f64,
    );
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        stats.waiting as f64,
    );
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        usage,
    );
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        stats.prefix_cache_queries as f64,
    );
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        stats.prefix_cache_hits as f64,
    );
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        stats.prompt_tokens as f64,
    );
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        stats.generation_tokens as f64,
    );
    let _ = write!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{bs}\",enable_prefix_caching=\"{pc}\",{labels},num_gpu_blocks=\"{n}\"}} 1.0\n",
        bs = page.block_tokens,
        pc = if page.prefix_caching { "True" } else { "False" },
        n = stats.kv_blocks,
    );
    let name = "vllm:time_to_first_token_seconds";
    let _ = write!(
        out,
        "# HELP {name} Histogram of time to first token in seconds.\n# TYPE {name} histogram\n"
    );
    let mut cumulative = 0;
    for (le, n) in TTFT_BUCKETS.iter().zip(ttft.buckets) {
        cumulative += n;
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels},le=\"{le}\"}} {v}",
            le = number(*le),
            v = number(cumulative as f64)
        );
    }
    let _ = write!(
        out,
        "{name}_bucket{{{labels},le=\"+Inf\"}} {c}\n{name}_count{{{labels}}} {c}\n{name}_sum{{{labels}}} {s}\n",
        c = number(ttft.count as f64),
        s = number(ttft.sum.as_secs_f64()),
    );
    out
}
