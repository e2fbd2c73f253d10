//! The `faden` command: CLI → configuration → run → graceful shutdown.

mod cli;
mod gateway_cmd;
mod limits;
mod mock_cmd;
mod probe_cmd;
mod runtime;
mod server_cmd;
mod server_tls;
mod shutdown;
mod up_cmd;
mod worker_cmd;

use clap::Parser;

/// mimalloc: fewer instructions per allocation than glibc's malloc on the request path
/// (docs/performance.md, "Build and runtime choices").
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    cli::init_tracing(&cli.log);
    let started = runtime::control_runtime(cli.worker_threads)
        .build()
        .and_then(|rt| runtime::start_cores(cli.worker_threads).map(|()| rt));
    let runtime = match started {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use tokio::runtime::RuntimeFlavor;

    use super::runtime::control_runtime as runtime_builder;

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
