//! The `faden` command: CLI → configuration → run → graceful shutdown.

#![deny(unsafe_code)] // `alloc` alone allows it, to implement `GlobalAlloc`.

#[cfg(feature = "mimalloc")]
mod alloc;
mod cli;
mod gateway_cmd;
mod limits;
mod mock_cmd;
mod probe_cmd;
mod server_cmd;
mod server_tls;
mod shutdown;
mod up_cmd;
mod worker_cmd;

use clap::Parser;

/// mimalloc: fewer instructions per allocation than glibc's malloc on the request path
/// (docs/performance.md, "Build and runtime choices"), called through its plain functions where
/// they give the alignment asked for (`alloc`).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: alloc::Mimalloc = alloc::Mimalloc;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    cli::init_tracing(&cli.log);
    let runtime = match runtime_builder(cli.worker_threads).build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("faden: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The runtime for `--worker-threads`: tokio's work-stealing scheduler with that many threads
/// (one per core by default), or, for one thread, the current-thread scheduler. With a single
/// thread there is nothing to steal from, and the work-stealing scheduler's per-batch
/// bookkeeping (two clock reads and a `powf` for its poll-time average), its run-queue atomics
/// and the hand-off between the `block_on` thread and its worker cost instructions on every
/// wake-up: callgrind counts 9–12 % fewer instructions per request in the tunnel's processes
/// and a third fewer L1i misses (docs/performance.md, "Build and runtime choices").
fn runtime_builder(threads: Option<u16>) -> tokio::runtime::Builder {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use tokio::runtime::RuntimeFlavor;

    use super::runtime_builder;

    #[test]
    fn one_thread_runs_the_current_thread_scheduler() {
        let flavor = |threads| {
            let runtime = runtime_builder(threads).build().unwrap();
            (
                runtime.handle().runtime_flavor(),
                runtime.metrics().num_workers(),
            )
        };
        assert_eq!(flavor(Some(1)), (RuntimeFlavor::CurrentThread, 1));
        assert_eq!(flavor(Some(2)), (RuntimeFlavor::MultiThread, 2));
        assert_eq!(flavor(None).0, RuntimeFlavor::MultiThread);
    }
}
