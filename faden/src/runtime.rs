//! The process's two kinds of runtime: the request-serving cores ([`net::cores`]: a thread per
//! core, each its own event loop and listening sockets) and the control runtime (the management
//! API, tunnels' connections, sync, background work), which never delays a request.

use std::sync::OnceLock;

use net::cores::Cores;

static CORES: OnceLock<Cores> = OnceLock::new();

/// The cores `--worker-threads` asks for (default: one per available core), started once.
pub fn start_cores(threads: Option<u16>) -> std::io::Result<()> {
    let count = threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, usize::from),
        usize::from,
    );
    let cores = Cores::start(count, "faden-core")?;
    let _ = CORES.set(cores);
    Ok(())
}

/// The request-serving cores.
pub fn cores() -> &'static Cores {
    CORES.get_or_init(|| {
        // Not started by `main` (cannot happen in the binary): one core, started on first use.
        Cores::start(1, "faden-core").unwrap_or_else(|e| {
            tracing::error!(error = %e, "cannot start a serving thread");
            std::process::exit(1)
        })
    })
}

/// The control runtime for `--worker-threads`: tokio's work-stealing scheduler with that many
/// threads (one per core by default), or, for one thread, the current-thread scheduler. With a
/// single thread there is nothing to steal from, and the work-stealing scheduler's per-batch
/// bookkeeping costs instructions on every wake-up: callgrind counts 9–12 % fewer instructions
/// per request in the tunnel's processes (docs/performance.md, "Build and runtime choices").
pub fn control_runtime(threads: Option<u16>) -> tokio::runtime::Builder {
    let mut builder = match threads {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(usize::from(n));
            builder
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    builder.enable_all();
    builder
}

/// Serves a port on every core: `serve(listener)` on core `i` with socket `i` of the port
/// ([`net::cores::bind_reuseport`]). The handle (on the calling runtime) ends when every core's
/// `serve` has.
pub fn serve_on_cores<F, Fut>(
    listeners: Vec<std::net::TcpListener>,
    serve: F,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(tokio::net::TcpListener) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let serve = std::sync::Arc::new(serve);
    let served = cores().spawn_with(listeners, |i, listener| {
        let serve = serve.clone();
        // Registered with the core's own event loop: made on the core.
        async move {
            match tokio::net::TcpListener::from_std(listener) {
                Ok(listener) => serve(listener).await,
                Err(e) => tracing::error!(error = %e, core = i, "cannot listen on this core"),
            }
        }
    });
    // Ends when every core's `serve` has; its owner awaits it.
    net::task::spawn(async move {
        for core in served {
            let _ = core.await;
        }
    })
}
