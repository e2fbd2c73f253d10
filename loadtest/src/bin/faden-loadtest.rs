//! `faden-loadtest`: see `faden-loadtest --help` and docs/loadtest.md.

use clap::Parser as _;
use faden_loadtest::cli::{Cli, execute};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    execute(Cli::parse()).await
}
