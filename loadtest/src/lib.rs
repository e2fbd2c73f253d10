//! faden-loadtest: the OpenAI-aware load generator and the mock inference engine.
//!
//! - [`mock_engine`]: an OpenAI-compatible engine with deterministic, timed output, used as the
//!   upstream of the gateway's integration tests and of benchmarks.

pub mod mock_engine;
