//! The results of a run: serializable, and rendered as text for people.

use std::fmt::Write as _;

use serde::Serialize;

use crate::client::status_name;
use crate::stats::{CacheCounts, ErrorCounts, Recorder, Summary};

/// The results of one run against one target (or several, spread by the client).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The base URL (several: separated by spaces).
    pub target: String,
    pub model: String,
    /// The load model, e.g. `closed loop, concurrency 64`.
    pub load: String,
    /// The workloads, e.g. `chat stream body=256B max_tokens=16`, or the scenario.
    pub workloads: Vec<String>,
    /// Several URLs: how the client spread the requests (`round-robin`, `affinity`).
    pub route: Option<String>,
    /// Wall time of the measured phase, seconds.
    pub elapsed_s: f64,
    /// Requests sent, including the unfinished ones (open loop: excludes the dropped ones).
    pub sent: u64,
    /// Requests answered completely with a 2xx (streams: to a finish reason or `[DONE]`).
    pub ok: u64,
    /// Failed requests by class.
    pub errors: ErrorCounts,
    /// Sum of `errors`.
    pub error_total: u64,
    /// Requests still in flight when the run ended (cancelled; neither ok nor errors).
    pub unfinished: u64,
    /// Successful requests per second.
    pub rps: f64,
    /// Output tokens of the successful requests (usage when sent, else chunks with content).
    pub output_tokens: u64,
    /// Output tokens per second over the run.
    pub output_tokens_per_s: f64,
    /// Prompt tokens of the successful requests (`usage.prompt_tokens`).
    pub prompt_tokens: u64,
    /// Prompt tokens per second over the run.
    pub prompt_tokens_per_s: f64,
    /// Prompt tokens the engines served from their prefix cache
    /// (`usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens` (`None`: no answer reported prompt tokens).
    pub cache_hit_rate: Option<f64>,
    /// How many answers reported prompt tokens and cached tokens.
    pub cache: CacheCounts,
    /// Several URLs: the successful requests each one served.
    pub targets: Vec<TargetShare>,
    /// End-to-end latency of successful requests (open loop: from when each was due).
    pub latency: Option<Summary>,
    /// Time to first token (streams).
    pub ttft: Option<Summary>,
    /// Inter-token latency: gaps between chunks with content (streams).
    pub itl: Option<Summary>,
    /// Time per output token after the first, per request (streams).
    pub tpot: Option<Summary>,
    /// Open loop: how late the generator itself sent each request after it was due (timer
    /// resolution and scheduling; already inside `latency`). Large values mean the load
    /// generator, not the target, is saturated.
    pub send_lag: Option<Summary>,
}

/// The requests one of several URLs served.
#[derive(Clone, Debug, Serialize)]
pub struct TargetShare {
    pub url: String,
    /// Successful requests.
    pub ok: u64,
    /// Share of all successful requests (0 to 1).
    pub share: f64,
}

impl Report {
    pub(crate) fn new(
        config: &crate::RunConfig,
        rec: &Recorder,
        elapsed_s: f64,
        unfinished: u64,
    ) -> Self {
        let per_s = |n: u64| {
            if elapsed_s > 0.0 {
                n as f64 / elapsed_s
            } else {
                0.0
            }
        };
        let several = !config.more_urls.is_empty();
        let targets = if several {
            config
                .urls()
                .enumerate()
                .map(|(i, url)| {
                    let ok = rec.ok_by_target.get(i).copied().unwrap_or(0);
                    TargetShare {
                        url: url.to_owned(),
                        ok,
                        share: if rec.ok > 0 {
                            ok as f64 / rec.ok as f64
                        } else {
                            0.0
                        },
                    }
                })
                .collect()
        } else {
            Vec::new()
        };
        let mut load = config.load.to_string();
        if matches!(config.load, crate::LoadModel::Open { .. })
            && config.arrivals == crate::config::Arrivals::Poisson
        {
            load.push_str(", poisson arrivals");
        }
        Self {
            target: config.urls().collect::<Vec<_>>().join(" "),
            model: config.model.clone(),
            load,
            workloads: match &config.scenario {
                Some(s) => vec![s.to_string()],
                None => config.workloads.iter().map(ToString::to_string).collect(),
            },
            route: several.then(|| {
                match config.route {
                    crate::config::ClientRoute::RoundRobin => "round-robin",
                    crate::config::ClientRoute::Affinity => "affinity",
                }
                .to_owned()
            }),
            elapsed_s,
            sent: rec.sent + unfinished,
            ok: rec.ok,
            error_total: rec.errors.total(),
            errors: rec.errors.clone(),
            unfinished,
            rps: per_s(rec.ok),
            output_tokens: rec.output_tokens,
            output_tokens_per_s: per_s(rec.output_tokens),
            prompt_tokens: rec.cache.prompt_tokens,
            prompt_tokens_per_s: per_s(rec.cache.prompt_tokens),
            cached_tokens: rec.cache.cached_tokens,
            cache_hit_rate: rec.cache.hit_rate(),
            cache: rec.cache.clone(),
            targets,
            latency: Summary::of(&rec.latency),
            ttft: Summary::of(&rec.ttft),
            itl: Summary::of(&rec.itl),
            tpot: Summary::of(&rec.tpot),
            send_lag: Summary::of(&rec.send_lag),
        }
    }

    /// The report for people.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "target   {}  model={}", self.target, self.model);
        let _ = writeln!(s, "load     {}", self.load);
        for w in &self.workloads {
            let _ = writeln!(s, "workload {w}");
        }
        if let Some(route) = &self.route {
            let _ = writeln!(s, "route    {route} over {} URLs", self.targets.len());
        }
        let attempted = self.ok + self.error_total;
        let pct = if attempted > 0 {
            100.0 * self.error_total as f64 / attempted as f64
        } else {
            0.0
        };
        let _ = writeln!(
            s,
            "elapsed  {:.2} s   sent {}   ok {}   errors {} ({pct:.2}%)   unfinished {}",
            self.elapsed_s, self.sent, self.ok, self.error_total, self.unfinished
        );
        let _ = writeln!(
            s,
            "rate     {:.1} req/s   output {} tokens, {:.1} tok/s",
            self.rps, self.output_tokens, self.output_tokens_per_s
        );
        if let Some(rate) = self.cache_hit_rate {
            let c = &self.cache;
            let _ = writeln!(
                s,
                "prompt   {} tokens, {:.1} tok/s   prefix cache hit rate {:.1}% ({} cached; {} of {} answers reported cached_tokens)",
                self.prompt_tokens,
                self.prompt_tokens_per_s,
                100.0 * rate,
                self.cached_tokens,
                c.cached_reported,
                c.prompt_reported
            );
        }
        if !self.targets.is_empty() {
            let shares: Vec<String> = self
                .targets
                .iter()
                .map(|t| format!("{} {:.1}%", t.url, 100.0 * t.share))
                .collect();
            let _ = writeln!(s, "targets  {}", shares.join("   "));
        }
        let _ = writeln!(
            s,
            "{:<10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
            "(ms)", "p50", "p90", "p99", "p99.9", "max", "mean", "count"
        );
        for (name, summary) in [
            ("latency", &self.latency),
            ("ttft", &self.ttft),
            ("itl", &self.itl),
            ("tpot", &self.tpot),
            ("send lag", &self.send_lag),
        ] {
            if let Some(m) = summary {
                let _ = writeln!(
                    s,
                    "{name:<10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
                    ms(m.p50_ms),
                    ms(m.p90_ms),
                    ms(m.p99_ms),
                    ms(m.p999_ms),
                    ms(m.max_ms),
                    ms(m.mean_ms),
                    m.count
                );
            }
        }
        if let Some(t) = &self.tpot
            && t.p50_ms > 0.0
        {
            let _ = writeln!(
                s,
                "decode   {:.1} tok/s per request (p50)",
                1000.0 / t.p50_ms
            );
        }
        if self.error_total > 0 {
            let e = &self.errors;
            let mut parts = Vec::new();
            for (name, n) in [
                ("connect", e.connect),
                ("io", e.io),
                ("timeout", e.timeout),
                ("stream broken", e.stream_broken),
                ("dropped", e.dropped),
            ] {
                if n > 0 {
                    parts.push(format!("{name} {n}"));
                }
            }
            for (code, n) in &e.http_status {
                parts.push(format!("HTTP {} {n}", status_name(*code)));
            }
            let _ = writeln!(s, "errors   {}", parts.join(", "));
        }
        s
    }
}

fn ms(v: f64) -> String {
    if v < 10.0 {
        format!("{v:.3}")
    } else if v < 1000.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

/// One figure of a comparison.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Ratio {
    /// E.g. `rps`, `latency_p99` (ms), `output_tokens_per_s`.
    pub figure: String,
    pub a: Option<f64>,
    pub b: Option<f64>,
    /// B/A (`None` when A is zero or a figure is missing).
    pub ratio: Option<f64>,
}

/// Two targets measured in alternating slices, and the ratio B/A of each figure.
#[derive(Clone, Debug, Serialize)]
pub struct CompareReport {
    /// Slices per target.
    pub slices: u32,
    /// Length of one slice, seconds.
    pub slice_s: f64,
    pub a: Report,
    pub b: Report,
    /// Each figure of A and B and their ratio, in a fixed order.
    pub ratios: Vec<Ratio>,
}

impl CompareReport {
    pub(crate) fn new(slices: u32, slice_s: f64, a: Report, b: Report) -> Self {
        let mut ratios = Vec::new();
        let mut put = |figure: &str, fa: Option<f64>, fb: Option<f64>| {
            let ratio = match (fa, fb) {
                (Some(x), Some(y)) if x > 0.0 => Some(y / x),
                _ => None,
            };
            ratios.push(Ratio {
                figure: figure.to_owned(),
                a: fa,
                b: fb,
                ratio,
            });
        };
        put("rps", Some(a.rps), Some(b.rps));
        put(
            "output_tokens_per_s",
            Some(a.output_tokens_per_s),
            Some(b.output_tokens_per_s),
        );
        let err_rate = |r: &Report| {
            let n = r.ok + r.error_total;
            (n > 0).then(|| r.error_total as f64 / n as f64)
        };
        put("error_rate", err_rate(&a), err_rate(&b));
        for (name, sa, sb) in [
            ("latency", &a.latency, &b.latency),
            ("ttft", &a.ttft, &b.ttft),
            ("itl", &a.itl, &b.itl),
            ("tpot", &a.tpot, &b.tpot),
        ] {
            if sa.is_none() && sb.is_none() {
                continue;
            }
            for (q, f) in [
                ("p50", (|m: &Summary| m.p50_ms) as fn(&Summary) -> f64),
                ("p90", |m| m.p90_ms),
                ("p99", |m| m.p99_ms),
                ("p99.9", |m| m.p999_ms),
                ("mean", |m| m.mean_ms),
            ] {
                put(
                    &format!("{name}_{q}"),
                    sa.as_ref().map(f),
                    sb.as_ref().map(f),
                );
            }
        }
        Self {
            slices,
            slice_s,
            a,
            b,
            ratios,
        }
    }

    /// The ratio B/A of a figure.
    pub fn ratio(&self, figure: &str) -> Option<f64> {
        self.ratios
            .iter()
            .find(|r| r.figure == figure)
            .and_then(|r| r.ratio)
    }

    /// The comparison for people: both reports, then the ratios.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        for (name, r) in [("A", &self.a), ("B", &self.b)] {
            let _ = writeln!(
                s,
                "== {name} ({} slices of {:.2} s)\n{}",
                self.slices,
                self.slice_s,
                r.to_text()
            );
        }
        let _ = writeln!(
            s,
            "== B/A   (above 1: B is higher; for latencies (ms), B is slower)"
        );
        let _ = writeln!(s, "{:<22}{:>12}{:>12}{:>8}", "", "A", "B", "B/A");
        let num = |v: Option<f64>, prec: usize| {
            v.map_or_else(|| "-".to_owned(), |v| format!("{v:.prec$}"))
        };
        for r in &self.ratios {
            let _ = writeln!(
                s,
                "{:<22}{:>12}{:>12}{:>8}",
                r.figure,
                num(r.a, 3),
                num(r.b, 3),
                num(r.ratio, 3)
            );
        }
        s
    }
}
