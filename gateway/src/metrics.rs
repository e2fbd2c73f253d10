//! Prometheus metrics, written by hand (a few atomics per request, text rendered on scrape).
//!
//! Model labels only ever come from routing snapshots (a request for an unknown model is
//! counted under `model=""`), so a client cannot grow the label set.

use std::borrow::Borrow;
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use dashmap::DashMap;

use crate::error::ErrorKind;
use crate::policy::Reason;
use crate::route::Api;
use crate::usage::Usage;
use net::events::{ConnectionEvents, HandshakeFailure};
use net::hash::FastBuild;

/// Histogram bucket bounds, in seconds.
const BUCKETS: [f64; 17] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1800.0,
];

/// A histogram over `N` fixed bounds; the sum is kept in units of `1 / scale` (micro-seconds
/// for durations, whole tokens for token counts).
#[derive(Debug)]
struct Hist<const N: usize> {
    buckets: [AtomicU64; N],
    count: AtomicU64,
    sum: AtomicU64,
}

/// faden's own latency histograms, over [`BUCKETS`].
type Histogram = Hist<{ BUCKETS.len() }>;

impl<const N: usize> Default for Hist<N> {
    fn default() -> Self {
        Self {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    fn observe(&self, d: Duration) {
        self.record(d.as_secs_f64(), &BUCKETS, 1e6);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        self.render_with(out, name, labels, &BUCKETS, 1e6);
    }
}

impl<const N: usize> Hist<N> {
    fn record(&self, value: f64, bounds: &[f64; N], scale: f64) {
        if let Some(i) = bounds.iter().position(|b| value <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        // A float to integer `as` saturates (and maps NaN to 0).
        self.sum
            .fetch_add((value * scale).round() as u64, Ordering::Relaxed);
    }

    fn absorb(&self, other: &Self) {
        for (mine, theirs) in self.buckets.iter().zip(&other.buckets) {
            mine.fetch_add(theirs.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        self.count
            .fetch_add(other.count.load(Ordering::Relaxed), Ordering::Relaxed);
        self.sum
            .fetch_add(other.sum.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn render_with(
        &self,
        out: &mut String,
        name: &str,
        labels: &str,
        bounds: &[f64; N],
        scale: f64,
    ) {
        let mut cumulative = 0;
        for (i, bound) in bounds.iter().enumerate() {
            cumulative += self.buckets[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let sum = self.sum.load(Ordering::Relaxed) as f64 / scale;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

/// Bounds of `gen_ai.server.request.duration` (the semantic conventions' advice), seconds.
const GENAI_DURATION: [f64; 14] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];
/// Bounds of `gen_ai.server.time_to_first_token`, seconds.
const GENAI_TTFT: [f64; 16] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];
/// Bounds of `gen_ai.server.time_per_output_token`, seconds.
const GENAI_TPOT: [f64; 13] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
];
/// Bounds of `gen_ai.client.token.usage`, tokens.
const GENAI_TOKENS: [f64; 14] = [
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
    16777216.0, 67108864.0,
];

/// The OpenTelemetry GenAI histograms of one model and API.
#[derive(Debug, Default)]
pub struct GenAiSeries {
    duration: Hist<14>,
    ttft: Hist<16>,
    tpot: Hist<13>,
    /// Input, output.
    tokens: [Hist<14>; 2],
}

impl GenAiSeries {
    /// The first byte of the answer, `ttft` after the request.
    pub fn first_token(&self, ttft: Duration) {
        self.ttft.record(ttft.as_secs_f64(), &GENAI_TTFT, 1e6);
    }

    /// The end of the answer: its duration and, with the usage it reported, the tokens and the
    /// time per output token after the first (`ttft` when a first byte came).
    pub fn finished(&self, duration: Duration, ttft: Option<Duration>, usage: Option<Usage>) {
        self.duration
            .record(duration.as_secs_f64(), &GENAI_DURATION, 1e6);
        let Some(usage) = usage else {
            return;
        };
        self.tokens[0].record(usage.prompt_tokens as f64, &GENAI_TOKENS, 1.0);
        self.tokens[1].record(usage.completion_tokens as f64, &GENAI_TOKENS, 1.0);
        if let Some(ttft) = ttft
            && usage.completion_tokens > 1
        {
            let per =
                duration.saturating_sub(ttft).as_secs_f64() / (usage.completion_tokens - 1) as f64;
            self.tpot.record(per, &GENAI_TPOT, 1e6);
        }
    }

    fn absorb(&self, other: &Self) {
        self.duration.absorb(&other.duration);
        self.ttft.absorb(&other.ttft);
        self.tpot.absorb(&other.tpot);
        for (mine, theirs) in self.tokens.iter().zip(&other.tokens) {
            mine.absorb(theirs);
        }
    }
}

/// The [`GenAiSeries`] of one model, per API (made on first use).
#[derive(Debug, Default)]
struct GenAiModel {
    apis: [std::sync::OnceLock<Arc<GenAiSeries>>; Api::ALL.len()],
}

/// Gateway metrics.
#[derive(Debug)]
pub struct Metrics {
    requests: DashMap<RequestKey, AtomicU64, FastBuild>,
    active_streams: AtomicI64,
    active_requests: AtomicI64,
    upstream_errors: Vec<AtomicU64>,
    retries: AtomicU64,
    client_disconnects: AtomicU64,
    tls_handshake_failures: [AtomicU64; HandshakeFailure::ALL.len()],
    framing_conflicts: AtomicU64,
    /// Refused by the total cap, by the per-source cap, closed at the head deadline.
    connections_refused: [AtomicU64; 3],
    duration: Vec<Histogram>,
    ttft: Vec<Histogram>,
    /// `faden_tokens_total` by model: prompt, completion.
    tokens: DashMap<String, [AtomicU64; 2], FastBuild>,
    /// `faden_route_decisions_total` by model, per [`Reason`] in [`Reason::ALL`]'s order.
    route_decisions: DashMap<String, [AtomicU64; Reason::ALL.len()], FastBuild>,
    /// The OpenTelemetry GenAI histograms by model.
    genai: DashMap<String, GenAiModel, FastBuild>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests: DashMap::default(),
            active_streams: AtomicI64::new(0),
            active_requests: AtomicI64::new(0),
            upstream_errors: ErrorKind::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
            retries: AtomicU64::new(0),
            client_disconnects: AtomicU64::new(0),
            tls_handshake_failures: Default::default(),
            framing_conflicts: AtomicU64::new(0),
            connections_refused: Default::default(),
            duration: Api::ALL.iter().map(|_| Histogram::default()).collect(),
            ttft: Api::ALL.iter().map(|_| Histogram::default()).collect(),
            tokens: DashMap::default(),
            route_decisions: DashMap::default(),
            genai: DashMap::default(),
        }
    }
}

/// Key of `faden_gateway_requests_total`: model, route, status.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct RequestKey {
    model: String,
    route: &'static str,
    status: u16,
}

/// A request key by reference, so that counting a response allocates nothing.
trait KeyView {
    fn view(&self) -> (&str, &str, u16);
}

impl KeyView for RequestKey {
    fn view(&self) -> (&str, &str, u16) {
        (&self.model, self.route, self.status)
    }
}

impl KeyView for (&str, &'static str, u16) {
    fn view(&self) -> (&str, &str, u16) {
        (self.0, self.1, self.2)
    }
}

impl<'a> Borrow<dyn KeyView + 'a> for RequestKey {
    fn borrow(&self) -> &(dyn KeyView + 'a) {
        self
    }
}

impl Hash for RequestKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.view().hash(state);
    }
}

impl Hash for dyn KeyView + '_ {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.view().hash(state);
    }
}

impl PartialEq for dyn KeyView + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.view() == other.view()
    }
}

impl Eq for dyn KeyView + '_ {}

/// One inference request in `faden_gateway_active_requests`, from its arrival until this drops.
/// Held by the request's future and then by its answer's body, so that every exit (an answer
/// sent to its end, an error, a client gone before or during the answer) counts it out once.
#[derive(Debug)]
pub struct ActiveRequest {
    metrics: Arc<Metrics>,
}

impl ActiveRequest {
    /// The metrics it is counted in.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        self.metrics.active_requests.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The status counted for a request whose client left before its answer's head (nginx's 499,
/// "client closed request"): such a request is in `faden_gateway_requests_total` too.
pub const CLIENT_CLOSED_REQUEST: u16 = 499;

/// Label of requests that are not inference calls.
pub const ROUTE_OTHER: &str = "other";

impl Metrics {
    /// Counts a response (at the time its head is sent).
    pub fn request(&self, model: &str, route: &'static str, status: u16) {
        // Looked up by reference: the label is only copied the first time it is seen.
        let view: &dyn KeyView = &(model, route, status);
        if let Some(c) = self.requests.get(view) {
            c.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.requests
            .entry(RequestKey {
                model: model.to_owned(),
                route,
                status,
            })
            .or_default()
            .fetch_add(1, Ordering::Relaxed);
    }

    pub fn upstream_error(&self, kind: ErrorKind) {
        if let Some(i) = ErrorKind::ALL.iter().position(|k| *k == kind) {
            self.upstream_errors[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn retry(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    pub fn client_disconnect(&self) {
        self.client_disconnects.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stream_started(&self) {
        self.active_streams.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stream_ended(&self) {
        self.active_streams.fetch_sub(1, Ordering::Relaxed);
    }

    /// Counts an inference request in `faden_gateway_active_requests` until the returned guard
    /// drops: at the end of its answer's body, or wherever else the request ends.
    pub fn request_arrived(self: &Arc<Self>) -> ActiveRequest {
        self.active_requests.fetch_add(1, Ordering::Relaxed);
        ActiveRequest {
            metrics: Arc::clone(self),
        }
    }

    pub fn duration(&self, api: Api, d: Duration) {
        self.duration[api.index()].observe(d);
    }

    pub fn ttft(&self, api: Api, d: Duration) {
        self.ttft[api.index()].observe(d);
    }

    /// Counts the tokens of one answer, as its engine reported them.
    pub fn tokens(&self, model: &str, usage: Usage) {
        let add = |c: &[AtomicU64; 2]| {
            c[0].fetch_add(usage.prompt_tokens, Ordering::Relaxed);
            c[1].fetch_add(usage.completion_tokens, Ordering::Relaxed);
        };
        if let Some(c) = self.tokens.get(model) {
            add(&c);
            return;
        }
        add(&self.tokens.entry(model.to_owned()).or_default());
    }

    /// Counts a routing decision for `model`.
    pub fn route_decision(&self, model: &str, reason: Reason) {
        let i = Reason::ALL.iter().position(|r| *r == reason).unwrap_or(0);
        if let Some(c) = self.route_decisions.get(model) {
            c[i].fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.route_decisions.entry(model.to_owned()).or_default()[i]
            .fetch_add(1, Ordering::Relaxed);
    }

    /// The GenAI histograms of `model` and `api`, to record an answer in.
    pub fn genai(&self, model: &str, api: Api) -> Arc<GenAiSeries> {
        let pick = |m: &GenAiModel| m.apis[api.index()].get_or_init(Arc::default).clone();
        if let Some(m) = self.genai.get(model) {
            return pick(&m);
        }
        pick(&self.genai.entry(model.to_owned()).or_default())
    }

    /// Streams in flight.
    pub fn active_streams(&self) -> i64 {
        self.active_streams.load(Ordering::Relaxed)
    }

    /// Requests in flight (inference only).
    pub fn active_requests(&self) -> i64 {
        self.active_requests.load(Ordering::Relaxed)
    }

    /// The sum of several cores' metrics ([`net::cores`]: each core counts its own), to render.
    pub fn sum<'a>(all: impl IntoIterator<Item = &'a Metrics>) -> Metrics {
        let sum = Metrics::default();
        for m in all {
            sum.absorb(m);
        }
        sum
    }

    /// Adds `other`'s counts to these.
    fn absorb(&self, other: &Metrics) {
        let add = |mine: &AtomicU64, theirs: &AtomicU64| {
            mine.fetch_add(theirs.load(Ordering::Relaxed), Ordering::Relaxed);
        };
        for e in other.requests.iter() {
            add(
                &self.requests.entry(e.key().clone()).or_default(),
                e.value(),
            );
        }
        self.active_streams
            .fetch_add(other.active_streams(), Ordering::Relaxed);
        self.active_requests
            .fetch_add(other.active_requests(), Ordering::Relaxed);
        for (mine, theirs) in self.upstream_errors.iter().zip(&other.upstream_errors) {
            add(mine, theirs);
        }
        add(&self.retries, &other.retries);
        add(&self.client_disconnects, &other.client_disconnects);
        for (mine, theirs) in self
            .tls_handshake_failures
            .iter()
            .zip(&other.tls_handshake_failures)
        {
            add(mine, theirs);
        }
        add(&self.framing_conflicts, &other.framing_conflicts);
        for (mine, theirs) in self
            .connections_refused
            .iter()
            .zip(&other.connections_refused)
        {
            add(mine, theirs);
        }
        for (mine, theirs) in self.duration.iter().zip(&other.duration) {
            mine.absorb(theirs);
        }
        for (mine, theirs) in self.ttft.iter().zip(&other.ttft) {
            mine.absorb(theirs);
        }
        for e in other.tokens.iter() {
            let mine = self.tokens.entry(e.key().clone()).or_default();
            for (m, t) in mine.iter().zip(e.value()) {
                add(m, t);
            }
        }
        for e in other.genai.iter() {
            let mine = self.genai.entry(e.key().clone()).or_default();
            for (m, t) in mine.apis.iter().zip(&e.value().apis) {
                if let Some(t) = t.get() {
                    m.get_or_init(Arc::default).absorb(t);
                }
            }
        }
        for e in other.route_decisions.iter() {
            let mine = self.route_decisions.entry(e.key().clone()).or_default();
            for (m, t) in mine.iter().zip(e.value()) {
                add(m, t);
            }
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(8 * 1024);
        out.push_str(
            "# HELP faden_gateway_requests_total Responses sent, by model, route and status.\n",
        );
        out.push_str("# TYPE faden_gateway_requests_total counter\n");
        let mut rows: Vec<_> = self
            .requests
            .iter()
            .map(|e| (e.key().clone(), e.value().load(Ordering::Relaxed)))
            .collect();
        rows.sort();
        for (
            RequestKey {
                model,
                route,
                status,
            },
            n,
        ) in rows
        {
            let _ = writeln!(
                out,
                "faden_gateway_requests_total{{model=\"{}\",route=\"{route}\",status=\"{status}\"}} {n}",
                escape_label(&model)
            );
        }
        out.push_str("# HELP faden_gateway_active_requests Inference requests in flight.\n");
        out.push_str("# TYPE faden_gateway_active_requests gauge\n");
        let _ = writeln!(
            out,
            "faden_gateway_active_requests {}",
            self.active_requests()
        );
        out.push_str("# HELP faden_gateway_active_streams Response bodies being streamed.\n");
        out.push_str("# TYPE faden_gateway_active_streams gauge\n");
        let _ = writeln!(
            out,
            "faden_gateway_active_streams {}",
            self.active_streams()
        );
        out.push_str("# HELP faden_gateway_upstream_errors_total Upstream failures by kind.\n");
        out.push_str("# TYPE faden_gateway_upstream_errors_total counter\n");
        for (kind, n) in ErrorKind::ALL.iter().zip(&self.upstream_errors) {
            if kind.source() == crate::error::ErrorSource::Downstream {
                continue;
            }
            let _ = writeln!(
                out,
                "faden_gateway_upstream_errors_total{{kind=\"{}\"}} {}",
                kind.code(),
                n.load(Ordering::Relaxed)
            );
        }
        out.push_str("# HELP faden_gateway_retries_total Requests retried on another instance.\n");
        out.push_str("# TYPE faden_gateway_retries_total counter\n");
        let _ = writeln!(
            out,
            "faden_gateway_retries_total {}",
            self.retries.load(Ordering::Relaxed)
        );
        out.push_str("# HELP faden_gateway_client_disconnects_total Clients gone before the end of their response.\n");
        out.push_str("# TYPE faden_gateway_client_disconnects_total counter\n");
        let _ = writeln!(
            out,
            "faden_gateway_client_disconnects_total {}",
            self.client_disconnects.load(Ordering::Relaxed)
        );
        out.push_str("# HELP faden_gateway_tls_handshake_failures_total Client TLS handshakes that failed, by reason.\n");
        out.push_str("# TYPE faden_gateway_tls_handshake_failures_total counter\n");
        for (reason, n) in HandshakeFailure::ALL
            .iter()
            .zip(&self.tls_handshake_failures)
        {
            let _ = writeln!(
                out,
                "faden_gateway_tls_handshake_failures_total{{reason=\"{}\"}} {}",
                reason.label(),
                n.load(Ordering::Relaxed)
            );
        }
        out.push_str("# HELP faden_gateway_framing_conflicts_total HTTP/1 requests refused (400) for carrying both Content-Length and Transfer-Encoding.\n");
        out.push_str("# TYPE faden_gateway_framing_conflicts_total counter\n");
        let _ = writeln!(
            out,
            "faden_gateway_framing_conflicts_total {}",
            self.framing_conflicts.load(Ordering::Relaxed)
        );
        out.push_str("# HELP faden_gateway_connections_refused_total Connections refused by a pending-connection cap or closed before a complete request head, by reason.\n");
        out.push_str("# TYPE faden_gateway_connections_refused_total counter\n");
        for (reason, n) in ["pending_total", "pending_per_source", "head_timeout"]
            .iter()
            .zip(&self.connections_refused)
        {
            let _ = writeln!(
                out,
                "faden_gateway_connections_refused_total{{reason=\"{reason}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
        out.push_str("# HELP faden_tokens_total Tokens of answered requests, by model and kind, as the engines reported them in `usage`.\n");
        out.push_str("# TYPE faden_tokens_total counter\n");
        let mut tokens: Vec<_> = self
            .tokens
            .iter()
            .map(|e| {
                let [p, c] = e.value();
                (
                    e.key().clone(),
                    p.load(Ordering::Relaxed),
                    c.load(Ordering::Relaxed),
                )
            })
            .collect();
        tokens.sort();
        for (model, prompt, completion) in tokens {
            let model = escape_label(&model);
            let _ = writeln!(
                out,
                "faden_tokens_total{{model=\"{model}\",kind=\"prompt\"}} {prompt}"
            );
            let _ = writeln!(
                out,
                "faden_tokens_total{{model=\"{model}\",kind=\"completion\"}} {completion}"
            );
        }
        out.push_str("# HELP faden_route_decisions_total Instances chosen by the routing policy, by model and reason.\n");
        out.push_str("# TYPE faden_route_decisions_total counter\n");
        let mut decisions: Vec<_> = self
            .route_decisions
            .iter()
            .map(|e| {
                let counts: Vec<u64> = e
                    .value()
                    .iter()
                    .map(|c| c.load(Ordering::Relaxed))
                    .collect();
                (e.key().clone(), counts)
            })
            .collect();
        decisions.sort();
        for (model, counts) in decisions {
            let model = escape_label(&model);
            for (reason, n) in Reason::ALL.iter().zip(counts) {
                let _ = writeln!(
                    out,
                    "faden_route_decisions_total{{model=\"{model}\",reason=\"{}\"}} {n}",
                    reason.label()
                );
            }
        }
        for (name, help, hists) in [
            (
                "faden_gateway_request_duration_seconds",
                "Time from request to the end of the response body.",
                &self.duration,
            ),
            (
                "faden_gateway_ttft_seconds",
                "Time from request to the first response body byte.",
                &self.ttft,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} histogram");
            for (api, h) in Api::ALL.iter().zip(hists.iter()) {
                if h.count.load(Ordering::Relaxed) == 0 {
                    continue;
                }
                h.render(&mut out, name, &format!("route=\"{}\"", api.suffix()));
            }
        }
        self.render_genai(&mut out);
        out
    }

    /// The OpenTelemetry GenAI metrics, named as the OpenTelemetry-to-Prometheus conversion
    /// names them (dots to underscores, the unit as a suffix).
    fn render_genai(&self, out: &mut String) {
        let mut rows: Vec<(String, Api, Arc<GenAiSeries>)> = Vec::new();
        for e in self.genai.iter() {
            for (api, series) in Api::ALL.iter().zip(&e.value().apis) {
                if let Some(series) = series.get() {
                    rows.push((e.key().clone(), *api, series.clone()));
                }
            }
        }
        rows.sort_by(|a, b| (&a.0, a.1.index()).cmp(&(&b.0, b.1.index())));
        let labels = |model: &str, api: Api| {
            format!(
                "gen_ai_operation_name=\"{}\",gen_ai_request_model=\"{}\"",
                escape_label(crate::telemetry::operation_name(api)),
                escape_label(model)
            )
        };
        let head = |out: &mut String, name: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} histogram");
        };
        let name = "gen_ai_server_request_duration_seconds";
        head(
            out,
            name,
            "GenAI: time from request to the end of the answer, by model.",
        );
        for (model, api, s) in &rows {
            s.duration
                .render_with(out, name, &labels(model, *api), &GENAI_DURATION, 1e6);
        }
        let name = "gen_ai_server_time_to_first_token_seconds";
        head(
            out,
            name,
            "GenAI: time from request to the first byte of the answer, by model.",
        );
        for (model, api, s) in &rows {
            if s.ttft.count.load(Ordering::Relaxed) > 0 {
                s.ttft
                    .render_with(out, name, &labels(model, *api), &GENAI_TTFT, 1e6);
            }
        }
        let name = "gen_ai_server_time_per_output_token_seconds";
        head(
            out,
            name,
            "GenAI: time per output token after the first, by model.",
        );
        for (model, api, s) in &rows {
            if s.tpot.count.load(Ordering::Relaxed) > 0 {
                s.tpot
                    .render_with(out, name, &labels(model, *api), &GENAI_TPOT, 1e6);
            }
        }
        let name = "gen_ai_client_token_usage";
        head(
            out,
            name,
            "GenAI: tokens per answer, as the engine reported them, by model and token type.",
        );
        for (model, api, s) in &rows {
            for (kind, h) in ["input", "output"].iter().zip(&s.tokens) {
                if h.count.load(Ordering::Relaxed) > 0 {
                    let labels = format!("{},gen_ai_token_type=\"{kind}\"", labels(model, *api));
                    h.render_with(out, name, &labels, &GENAI_TOKENS, 1.0);
                }
            }
        }
    }
}

impl ConnectionEvents for Metrics {
    fn tls_handshake_failed(&self, reason: HandshakeFailure) {
        if let Some(i) = HandshakeFailure::ALL.iter().position(|r| *r == reason) {
            self.tls_handshake_failures[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    fn framing_conflict(&self) {
        self.framing_conflicts.fetch_add(1, Ordering::Relaxed);
    }

    fn connection_refused(&self, reason: net::admission::Refusal) {
        let i = match reason {
            net::admission::Refusal::Total => 0,
            net::admission::Refusal::PerSource => 1,
        };
        self.connections_refused[i].fetch_add(1, Ordering::Relaxed);
    }

    fn head_timeout(&self) {
        self.connections_refused[2].fetch_add(1, Ordering::Relaxed);
    }
}

/// The `faden_gateway_snapshot_age_seconds` gauge: time since the last byte from the
/// management API (`+Inf` while never synced), so an alert can fire before `/readyz` fails.
pub fn snapshot_age(age: Duration) -> String {
    let value = if age == Duration::MAX {
        "+Inf".to_owned()
    } else {
        format!("{:.3}", age.as_secs_f64())
    };
    format!(
        "# HELP faden_gateway_snapshot_age_seconds Time since the routing snapshot was last confirmed by the management API.\n\
         # TYPE faden_gateway_snapshot_age_seconds gauge\n\
         faden_gateway_snapshot_age_seconds {value}\n"
    )
}

/// One `faden_engine_*` gauge's value of a reading, at a time.
type EngineGauge = fn(&control_client::engine_load::Reading, tokio::time::Instant) -> Option<f64>;

/// The engines' own load readings: `faden_engine_requests_waiting`, `_running`,
/// `faden_engine_kv_cache_usage` and `faden_engine_reading_age_seconds` by instance (readings
/// older than the policy takes are left out).
pub fn engine_loads(loads: &control_client::engine_load::EngineLoads) -> String {
    let now = tokio::time::Instant::now();
    let mut rows: Vec<_> = loads
        .all()
        .iter()
        .filter(|(_, r)| r.is_fresh(now))
        .map(|(id, r)| (*id, *r))
        .collect();
    rows.sort_unstable_by_key(|(id, _)| *id);
    let mut out = String::new();
    let gauges: [(&str, &str, EngineGauge); 4] = [
        (
            "faden_engine_requests_waiting",
            "Requests the engine reports queued.",
            |r, _| Some(f64::from(r.load.waiting)),
        ),
        (
            "faden_engine_requests_running",
            "Requests the engine reports running.",
            |r, _| Some(f64::from(r.load.running)),
        ),
        (
            "faden_engine_kv_cache_usage",
            "Share of the engine's KV cache in use, as it reports it.",
            |r, _| r.load.kv_usage.map(f64::from),
        ),
        (
            "faden_engine_reading_age_seconds",
            "Age of the engine's last load reading.",
            |r, now| Some(now.saturating_duration_since(r.taken).as_secs_f64()),
        ),
    ];
    for (name, help, value) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        for (id, r) in &rows {
            if let Some(v) = value(r, now) {
                let _ = writeln!(out, "{name}{{instance=\"{id}\"}} {v}");
            }
        }
    }
    out
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histograms() {
        let m = Metrics::default();
        m.request("llama", "chat/completions", 200);
        m.request("llama", "chat/completions", 200);
        m.upstream_error(ErrorKind::UpstreamConnect);
        m.duration(Api::ChatCompletions, Duration::from_millis(30));
        let text = m.render();
        assert!(text.contains(
            "faden_gateway_requests_total{model=\"llama\",route=\"chat/completions\",status=\"200\"} 2"
        ));
        assert!(text.contains("faden_gateway_upstream_errors_total{kind=\"upstream_connect\"} 1"));
        assert!(text.contains(
            "faden_gateway_request_duration_seconds_bucket{route=\"chat/completions\",le=\"0.05\"} 1"
        ));
        assert!(text.contains(
            "faden_gateway_request_duration_seconds_bucket{route=\"chat/completions\",le=\"0.025\"} 0"
        ));
        assert!(!text.contains("faden_tokens_total{"));
        let usage = |p, c| Usage {
            prompt_tokens: p,
            completion_tokens: c,
            total_tokens: p + c,
        };
        m.tokens("llama", usage(10, 5));
        m.tokens("llama", usage(1, 2));
        m.tokens("e\"5", usage(4, 0));
        let text = m.render();
        assert!(text.contains("faden_tokens_total{model=\"llama\",kind=\"prompt\"} 11\n"));
        assert!(text.contains("faden_tokens_total{model=\"llama\",kind=\"completion\"} 7\n"));
        assert!(text.contains("faden_tokens_total{model=\"e\\\"5\",kind=\"prompt\"} 4\n"));
    }

    #[test]
    fn renders_the_genai_histograms_summed_over_cores() {
        let cores = [Metrics::default(), Metrics::default()];
        let usage = Usage {
            prompt_tokens: 10,
            completion_tokens: 5,
            total_tokens: 15,
        };
        for m in &cores {
            let series = m.genai("llama", Api::ChatCompletions);
            series.first_token(Duration::from_millis(30));
            series.finished(
                Duration::from_millis(230),
                Some(Duration::from_millis(30)),
                Some(usage),
            );
        }
        cores[0]
            .genai("e5", Api::Embeddings)
            .finished(Duration::from_millis(5), None, None);
        let text = Metrics::sum(&cores).render();
        let chat = "gen_ai_operation_name=\"chat\",gen_ai_request_model=\"llama\"";
        for line in [
            format!("gen_ai_server_request_duration_seconds_bucket{{{chat},le=\"0.32\"}} 2\n"),
            format!("gen_ai_server_request_duration_seconds_count{{{chat}}} 2\n"),
            format!("gen_ai_server_time_to_first_token_seconds_bucket{{{chat},le=\"0.04\"}} 2\n"),
            // (230 - 30) ms over 4 tokens after the first.
            format!("gen_ai_server_time_per_output_token_seconds_bucket{{{chat},le=\"0.05\"}} 2\n"),
            format!("gen_ai_server_time_per_output_token_seconds_sum{{{chat}}} 0.1\n"),
            format!("gen_ai_client_token_usage_bucket{{{chat},gen_ai_token_type=\"input\",le=\"16\"}} 2\n"),
            format!("gen_ai_client_token_usage_sum{{{chat},gen_ai_token_type=\"output\"}} 10\n"),
            "gen_ai_server_request_duration_seconds_count{gen_ai_operation_name=\"embeddings\",gen_ai_request_model=\"e5\"} 1\n".to_owned(),
            "# TYPE gen_ai_client_token_usage histogram\n".to_owned(),
        ] {
            assert!(text.contains(&line), "{line}\n{text}");
        }
        assert!(!text.contains(
            "gen_ai_server_time_to_first_token_seconds_count{gen_ai_operation_name=\"embeddings\""
        ));
    }

    #[test]
    fn renders_the_snapshot_age() {
        assert!(
            snapshot_age(Duration::from_millis(1500))
                .ends_with("\nfaden_gateway_snapshot_age_seconds 1.500\n")
        );
        assert!(snapshot_age(Duration::MAX).ends_with("faden_gateway_snapshot_age_seconds +Inf\n"));
    }
}
