//! OpenTelemetry spans of inference requests, exported over OTLP (http/protobuf) when
//! configured: one server span per request with the GenAI attributes
//! (`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.usage.input_tokens`,
//! `gen_ai.usage.output_tokens`), the instance and path it went to and its status.
//!
//! Without a [`Telemetry`] the gateway builds no span: the request path checks an `Option`.
//! With one, ended spans go into a bounded queue (a full queue drops the span and counts it)
//! that one task empties in batches, on a timer or when a whole batch waits, and once more at
//! [`Telemetry::shutdown`]. The request path never waits on the exporter.
//!
//! The standard variables apply: `OTEL_EXPORTER_OTLP_ENDPOINT`,
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (and `_HEADERS`, `_TIMEOUT`), `OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG` (read by the
//! SDK), `OTEL_BSP_MAX_QUEUE_SIZE`, `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`, `OTEL_BSP_SCHEDULE_DELAY`,
//! and `OTEL_SDK_DISABLED` / `OTEL_TRACES_EXPORTER=none` to turn it off.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use control_client::model::ProxyMode;
use control_client::routing::Endpoint;
use http::HeaderMap;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanKind, Status, TraceContextExt as _, Tracer as _,
    TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, SpanData, SpanExporter as _};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::route::Api;
use crate::trace_context;
use crate::usage::Usage;

/// How spans are exported.
#[derive(Clone, Debug)]
pub struct TelemetryConfig {
    /// The collector's base URL (`/v1/traces` is appended unless the path already ends so);
    /// `None` leaves it to `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`
    /// (the SDK's default, `http://localhost:4318`, when neither is set).
    pub endpoint: Option<String>,
    /// Ended spans waiting for export; more are dropped (and counted).
    pub max_queue: usize,
    /// Spans per export request.
    pub max_batch: usize,
    /// Longest wait before a partial batch is sent.
    pub delay: Duration,
    /// Longest wait for one export request.
    pub timeout: Duration,
}

impl Default for TelemetryConfig {
    /// The OpenTelemetry defaults (queue 2048, batch 512, delay 5 s, timeout 10 s).
    fn default() -> Self {
        Self {
            endpoint: None,
            max_queue: 2048,
            max_batch: 512,
            delay: Duration::from_secs(5),
            timeout: Duration::from_secs(10),
        }
    }
}

impl TelemetryConfig {
    /// The configuration when exporting is asked for: by `endpoint` (a flag, which wins) or by
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`, unless
    /// `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. Queue, batch, delay and
    /// timeout from the `OTEL_BSP_*` and `OTEL_EXPORTER_OTLP_*TIMEOUT` variables.
    pub fn from_env(endpoint: Option<String>) -> Option<Self> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
            || var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim().eq_ignore_ascii_case("none"))
        {
            return None;
        }
        let endpoint = endpoint.filter(|e| !e.trim().is_empty());
        if endpoint.is_none()
            && var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none()
            && var("OTEL_EXPORTER_OTLP_ENDPOINT").is_none()
        {
            return None;
        }
        let number = |name: &str| var(name).and_then(|v| v.trim().parse::<u64>().ok());
        let mut config = Self {
            endpoint,
            ..Self::default()
        };
        if let Some(n) = number("OTEL_BSP_MAX_QUEUE_SIZE").filter(|n| *n > 0) {
            config.max_queue = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Some(n) = number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE").filter(|n| *n > 0) {
            config.max_batch = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Some(ms) = number("OTEL_BSP_SCHEDULE_DELAY") {
            config.delay = Duration::from_millis(ms);
        }
        if let Some(ms) = number("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
            .or_else(|| number("OTEL_EXPORTER_OTLP_TIMEOUT"))
            .filter(|ms| *ms > 0)
        {
            config.timeout = Duration::from_millis(ms);
        }
        Some(config)
    }
}

/// The exporter could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// Counts of the export, for `/metrics`.
#[derive(Debug, Default)]
struct ExportStats {
    exported: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
}

/// The span exporter of a gateway (all its cores): cheap to clone.
#[derive(Clone, Debug)]
pub struct Telemetry {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    tracer: SdkTracer,
    /// Kept so that the tracer's processor lives as long as this.
    _provider: SdkTracerProvider,
    stats: Arc<ExportStats>,
    /// Cancelled by [`Telemetry::shutdown`]: the export task sends what is queued and ends.
    stop: CancellationToken,
    task: parking_lot::Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Telemetry {
    /// Builds the OTLP exporter and starts its task on the current runtime.
    pub fn start(config: TelemetryConfig) -> Result<Self, TelemetryError> {
        let resource = resource();
        let client =
            opentelemetry_http::hyper::HyperClient::new(https_connector(), config.timeout, None);
        let mut builder = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_http_client(client)
            .with_timeout(config.timeout);
        if let Some(endpoint) = &config.endpoint {
            builder = builder.with_endpoint(traces_url(endpoint));
        }
        let mut exporter = builder.build()?;
        exporter.set_resource(&resource);

        let stats = Arc::new(ExportStats::default());
        let (tx, rx) = mpsc::channel(config.max_queue.max(1));
        let batch_ready = Arc::new(Notify::new());
        let provider = SdkTracerProvider::builder()
            .with_span_processor(QueueProcessor {
                queue: tx,
                stats: stats.clone(),
                batch_ready: batch_ready.clone(),
                max_batch: config.max_batch.max(1),
            })
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("faden");
        let stop = CancellationToken::new();
        // Ends at `stop` (after one last export): `shutdown` cancels it and awaits the task,
        // and the last clone of this handle cancels it as it drops.
        let task = net::task::spawn(export_loop(
            exporter,
            rx,
            config,
            stats.clone(),
            batch_ready,
            stop.clone(),
        ));
        Ok(Self {
            inner: Arc::new(Inner {
                tracer,
                _provider: provider,
                stats,
                stop,
                task: parking_lot::Mutex::new(Some(task)),
            }),
        })
    }

    /// Sends what is queued and stops exporting, waiting at most `timeout`. Spans ended after
    /// this are dropped.
    pub async fn shutdown(&self, timeout: Duration) {
        self.inner.stop.cancel();
        let task = self.inner.task.lock().take();
        if let Some(task) = task
            && tokio::time::timeout(timeout, task).await.is_err()
        {
            tracing::warn!(?timeout, "spans not all exported before shutdown");
        }
    }

    /// Spans exported, dropped on a full queue, and lost in failed export requests.
    pub fn counts(&self) -> (u64, u64, u64) {
        let s = &self.inner.stats;
        (
            s.exported.load(Ordering::Relaxed),
            s.dropped.load(Ordering::Relaxed),
            s.failed.load(Ordering::Relaxed),
        )
    }

    /// The `faden_otel_*` counters, in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        let (exported, dropped, failed) = self.counts();
        for (name, help, n) in [
            (
                "faden_otel_spans_exported_total",
                "Spans sent to the OTLP collector.",
                exported,
            ),
            (
                "faden_otel_spans_dropped_total",
                "Spans dropped because the export queue was full.",
                dropped,
            ),
            (
                "faden_otel_spans_failed_total",
                "Spans lost in export requests that failed.",
                failed,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {n}");
        }
    }

    /// The span of one inference request, under the client's `traceparent` when it sent a
    /// valid one.
    pub(crate) fn request_span(&self, headers: &HeaderMap, api: Api) -> RequestSpan {
        let cx = match trace_context::extract(headers) {
            Some(parent) => Context::new().with_remote_span_context(parent),
            None => Context::new(),
        };
        let operation = operation_name(api);
        let tracer = &self.inner.tracer;
        let builder = tracer
            .span_builder(operation)
            .with_kind(SpanKind::Server)
            .with_attributes([KeyValue::new("gen_ai.operation.name", operation)]);
        RequestSpan {
            span: tracer.build_with_context(builder, &cx),
        }
    }
}

/// The GenAI operation name of an API (the semantic conventions' names where they have one,
/// else faden's route).
pub fn operation_name(api: Api) -> &'static str {
    match api {
        Api::ChatCompletions | Api::Responses => "chat",
        Api::Completions => "text_completion",
        Api::Embeddings => "embeddings",
        other => other.suffix(),
    }
}

/// The path of a proxy mode, as the span and the logs name it.
fn path_name(mode: ProxyMode) -> &'static str {
    match mode {
        ProxyMode::Direct => "direct",
        ProxyMode::Worker => "worker",
        ProxyMode::Tunnel => "tunnel",
    }
}

/// One request's span; ends when dropped (with what was recorded by then).
#[derive(Debug)]
pub struct RequestSpan {
    span: opentelemetry_sdk::trace::Span,
}

impl RequestSpan {
    /// Its context: what goes upstream as `traceparent` (sampled or not, per the sampler).
    pub fn context(&self) -> &SpanContext {
        self.span.span_context()
    }

    /// The model the request names: the span is named `{operation} {model}`.
    pub fn model(&mut self, api: Api, model: &str) {
        self.span
            .update_name(format!("{} {model}", operation_name(api)));
        self.span
            .set_attribute(KeyValue::new("gen_ai.request.model", model.to_owned()));
    }

    /// The instance that answered, and by which path.
    pub fn instance(&mut self, endpoint: &Endpoint) {
        self.span.set_attributes([
            KeyValue::new("faden.instance.id", endpoint.instance_id),
            KeyValue::new("faden.worker.id", endpoint.worker_id),
            KeyValue::new("faden.path", path_name(endpoint.proxy_mode)),
        ]);
    }

    /// The status sent to the client (an error status for 5xx).
    pub fn status(&mut self, status: u16) {
        self.span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        if status >= 500 {
            self.span.set_status(Status::error(""));
        }
    }

    /// What failed (`error.type`, faden's error code).
    pub fn error(&mut self, code: &'static str) {
        self.span.set_attribute(KeyValue::new("error.type", code));
    }

    /// Ends the span with the answer's token usage, when it carried one.
    pub fn finish(mut self, usage: Option<Usage>) {
        if let Some(u) = usage {
            self.span.set_attributes([
                KeyValue::new(
                    "gen_ai.usage.input_tokens",
                    i64::try_from(u.prompt_tokens).unwrap_or(i64::MAX),
                ),
                KeyValue::new(
                    "gen_ai.usage.output_tokens",
                    i64::try_from(u.completion_tokens).unwrap_or(i64::MAX),
                ),
            ]);
        }
        self.span.end();
    }
}

/// The resource: `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES`, else `service.name=faden`.
fn resource() -> Resource {
    let detected = Resource::builder().build();
    let named = detected
        .get(&opentelemetry::Key::from_static_str("service.name"))
        .is_some_and(|v| !v.as_str().starts_with("unknown_service"));
    let mut builder = Resource::builder()
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    if !named {
        builder = builder.with_service_name("faden");
    }
    builder.build()
}

/// `endpoint` with the traces path, as `OTEL_EXPORTER_OTLP_ENDPOINT` is read.
fn traces_url(endpoint: &str) -> String {
    let base = endpoint.trim().trim_end_matches('/');
    if base.ends_with("/v1/traces") {
        base.to_owned()
    } else {
        format!("{base}/v1/traces")
    }
}

/// `http://` and `https://` (rustls, the system's roots) collectors.
fn https_connector()
-> hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector> {
    let builder = hyper_rustls::HttpsConnectorBuilder::new();
    let builder = match builder.with_native_roots() {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "no system CA roots: https OTLP endpoints will fail");
            hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(
                rustls::ClientConfig::builder()
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth(),
            )
        }
    };
    builder.https_or_http().enable_http1().build()
}

/// Puts ended spans on the export queue, never waiting: a full queue drops the span. The
/// export task is woken only when a whole batch waits (or by its timer): a wake-up per span
/// cost more CPU than the span itself.
#[derive(Debug)]
struct QueueProcessor {
    queue: mpsc::Sender<SpanData>,
    stats: Arc<ExportStats>,
    batch_ready: Arc<Notify>,
    max_batch: usize,
}

impl opentelemetry_sdk::trace::SpanProcessor for QueueProcessor {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if self.queue.try_send(span).is_err() {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        } else if self.queue.max_capacity() - self.queue.capacity() >= self.max_batch {
            self.batch_ready.notify_one();
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// The shortest pause between two exports of partial batches.
const MIN_DELAY: Duration = Duration::from_millis(10);

/// Empties the queue in batches of at most `max_batch`, each time `delay` passed or a whole
/// batch waits; at `stop`, what is queued leaves at once and the loop ends.
async fn export_loop(
    exporter: opentelemetry_otlp::SpanExporter,
    mut queue: mpsc::Receiver<SpanData>,
    config: TelemetryConfig,
    stats: Arc<ExportStats>,
    batch_ready: Arc<Notify>,
    stop: CancellationToken,
) {
    let max = config.max_batch.max(1);
    let delay = config.delay.max(MIN_DELAY);
    let mut stopping = false;
    while !stopping {
        tokio::select! {
            () = stop.cancelled() => stopping = true,
            () = batch_ready.notified() => {}
            () = tokio::time::sleep(delay) => {}
        }
        if stopping {
            queue.close();
        }
        // What is queued now, batch after batch.
        loop {
            let mut batch = Vec::with_capacity(max.min(queue.len()));
            while batch.len() < max {
                match queue.try_recv() {
                    Ok(span) => batch.push(span),
                    Err(_) => break,
                }
            }
            if batch.is_empty() {
                break;
            }
            let n = batch.len() as u64;
            match exporter.export(batch).await {
                Ok(()) => stats.exported.fetch_add(n, Ordering::Relaxed),
                Err(e) => {
                    tracing::warn!(error = %e, spans = n, "OTLP export failed");
                    stats.failed.fetch_add(n, Ordering::Relaxed)
                }
            };
            if (n as usize) < max {
                break;
            }
        }
    }
    let _ = exporter.shutdown();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_url_appends_the_path_once() {
        assert_eq!(
            traces_url("http://c:4318"),
            "http://c:4318/v1/traces".to_owned()
        );
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            traces_url("https://c/otlp/v1/traces"),
            "https://c/otlp/v1/traces"
        );
    }

    #[test]
    fn operation_names_follow_the_conventions() {
        assert_eq!(operation_name(Api::ChatCompletions), "chat");
        assert_eq!(operation_name(Api::Completions), "text_completion");
        assert_eq!(operation_name(Api::Embeddings), "embeddings");
        assert_eq!(operation_name(Api::Rerank), "rerank");
    }
}
