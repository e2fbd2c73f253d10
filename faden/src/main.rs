//! The `faden` command: CLI → configuration → run → graceful shutdown.

#![deny(unsafe_code)] // `alloc` alone allows it, to implement `GlobalAlloc`.

#[cfg(feature = "mimalloc")]
mod alloc;
mod cli;
mod gateway_cmd;
mod limits;
mod mock_cmd;
mod server_cmd;
mod up_cmd;
mod worker_cmd;
mod worker_metrics;

use clap::Parser;

/// mimalloc: fewer instructions per allocation than glibc's malloc on the request path and less
/// fragmentation across many mostly idle connections (see docs/benchmarks.md), called through
/// its plain functions where they give the alignment asked for (`alloc`).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: alloc::Mimalloc = alloc::Mimalloc;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    cli::init_tracing(&cli.log);
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if let Some(threads) = cli.worker_threads {
        builder.worker_threads(usize::from(threads));
    }
    let runtime = match builder.build() {
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
