//! The performance model's command-line flags, shared by `faden-mock-engine` and
//! `faden mock-engine`.

use std::time::Duration;

use clap::builder::TypedValueParser as _;

use crate::PerfModel;

/// Flags of the performance model (off unless `--kv-blocks` > 0).
#[derive(Clone, Debug, clap::Args)]
pub struct PerfModelArgs {
    /// KV-cache blocks of the performance model (prefix cache, queue, serialized prefill);
    /// 0 turns the model off.
    #[arg(long, env = "FADEN_MOCK_KV_BLOCKS", default_value_t = 0)]
    pub kv_blocks: usize,
    /// Tokens per KV-cache block (a token is 4 bytes of the rendered prompt).
    #[arg(long, env = "FADEN_MOCK_BLOCK_TOKENS", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize))]
    pub block_tokens: usize,
    /// Requests running at once (prefill or decode); more wait in a FIFO queue.
    #[arg(long, env = "FADEN_MOCK_MAX_RUNNING", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize))]
    pub max_running: usize,
    /// Prefill time per uncached prompt token (one prefill at a time; --ttft is its fixed part).
    #[arg(long, env = "FADEN_MOCK_PREFILL_PER_TOKEN", default_value = "50us",
          value_parser = humantime::parse_duration)]
    pub prefill_per_token: Duration,
    /// Time added to each inter-token delay (--itl) per running request.
    #[arg(long, env = "FADEN_MOCK_ITL_PER_RUNNING", default_value = "0s",
          value_parser = humantime::parse_duration)]
    pub itl_per_running: Duration,
}

impl PerfModelArgs {
    /// The model these flags ask for (`None`: off).
    pub fn model(&self) -> Option<PerfModel> {
        (self.kv_blocks > 0).then_some(PerfModel {
            kv_blocks: self.kv_blocks,
            block_tokens: self.block_tokens,
            max_running: self.max_running,
            prefill_per_token: self.prefill_per_token,
            itl_per_running: self.itl_per_running,
        })
    }
}
