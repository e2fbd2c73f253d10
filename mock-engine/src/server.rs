//! Starting an engine, its accept loop, and the handle that tests hold.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::MockEngineConfig;
use crate::engine::{Controls, Engine, model_stats};
use crate::perf::{Model, ModelStats};
use crate::stats::MockStats;

/// The mock engine.
#[derive(Debug)]
pub struct MockEngine;

/// A running mock engine. Dropping it stops the engine.
#[derive(Debug)]
pub struct MockEngineHandle {
    /// The bound address (`127.0.0.1:<ephemeral>`).
    pub addr: SocketAddr,
    /// Counters and recorded requests.
    pub stats: Arc<MockStats>,
    /// Cancelling it stops the engine and drops its connections.
    pub shutdown: CancellationToken,
    controls: Arc<Controls>,
    model: Option<Arc<Model>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl MockEngineHandle {
    /// Makes every inference call answer `status` with an OpenAI error body (`None`: normal).
    pub fn set_fail_status(&self, status: Option<u16>) {
        self.controls
            .fail_status
            .store(status.unwrap_or(0), Ordering::Relaxed);
    }

    /// Makes streams abort their connection after `tokens` tokens (`None`: never).
    pub fn set_abort_after_tokens(&self, tokens: Option<usize>) {
        self.controls
            .abort_after_tokens
            .store(tokens.unwrap_or(usize::MAX), Ordering::Relaxed);
    }

    /// The engine's port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Stalls the engine (performance model only): nothing is admitted, prefilled or generated,
    /// so the queue grows, until [`MockEngineHandle::resume`].
    pub fn stall(&self) {
        if let Some(model) = &self.model {
            model.stall();
        }
    }

    /// Ends a stall; the schedules of the requests in progress shift by its length.
    pub fn resume(&self) {
        if let Some(model) = &self.model {
            model.resume();
        }
    }

    /// Forgets the prefix cache, as an engine restart does (performance model only).
    pub fn clear_cache(&self) {
        if let Some(model) = &self.model {
            model.clear_cache();
        }
    }

    /// The engine's figures (those `GET /metrics` shows).
    pub fn model_stats(&self) -> ModelStats {
        model_stats(self.model.as_deref(), &self.stats).0
    }

    /// Waits until `done` holds for the engine's figures, and returns them.
    pub async fn wait_model_stats(&self, mut done: impl FnMut(&ModelStats) -> bool) -> ModelStats {
        let mut changes = self.stats.changes.subscribe();
        loop {
            let stats = self.model_stats();
            if done(&stats) {
                return stats;
            }
            // The sender lives as long as `self.stats`: `changed` cannot fail here.
            let _ = changes.changed().await;
        }
    }

    /// Stops the engine and waits for it.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for MockEngineHandle {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl MockEngine {
    /// Starts an engine on `127.0.0.1:0`.
    pub async fn start(config: MockEngineConfig) -> std::io::Result<MockEngineHandle> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        Self::start_on(listener, config)
    }

    /// Starts an engine on a bound listener (for `faden mock-engine --listen ...`).
    pub fn start_on(
        listener: TcpListener,
        config: MockEngineConfig,
    ) -> std::io::Result<MockEngineHandle> {
        let addr = listener.local_addr()?;
        let stats = Arc::new(MockStats::new(config.record_limit));
        let controls = Arc::new(Controls {
            fail_status: AtomicU16::new(config.fail_status.unwrap_or(0)),
            abort_after_tokens: AtomicUsize::new(config.abort_after_tokens.unwrap_or(usize::MAX)),
        });
        let shutdown = CancellationToken::new();
        let engine = Arc::new(Engine::new(config, stats.clone(), controls.clone()));
        let model = engine.model.clone();
        // Ends at `shutdown`; the handle keeps the task and aborts it when dropped.
        #[allow(clippy::disallowed_methods)]
        let task = tokio::spawn(accept_loop(listener, engine, shutdown.clone()));
        Ok(MockEngineHandle {
            addr,
            stats,
            shutdown,
            controls,
            model,
            task: Some(task),
        })
    }
}

async fn accept_loop(listener: TcpListener, engine: Arc<Engine>, shutdown: CancellationToken) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                engine.stats.connections.fetch_add(1, Ordering::Relaxed);
                let engine = engine.clone();
                conns.spawn(async move {
                    let service = service_fn(move |req| {
                        let engine = engine.clone();
                        async move { Ok::<_, Infallible>(engine.handle(req).await) }
                    });
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        }
    }
    // Dropping the set aborts every connection: the engine stops at once, like a killed process.
    conns.shutdown().await;
}
