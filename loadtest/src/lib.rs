//! faden-loadtest: the OpenAI-aware load generator.
//!
//! - [`run`] drives a closed loop (fixed concurrency) or an open loop (fixed arrival rate,
//!   latency from the intended send time) against any OpenAI-compatible base URL and returns a
//!   serializable [`Report`]: end-to-end latency, time to first token, inter-token latency and
//!   time per output token in HDR histograms, throughput, and errors by class.
//! - [`compare`] runs the same load against two targets in alternating slices and reports the
//!   ratio B/A of each figure.
//! - [`scenario`] generates workloads that follow a model of real traffic: tenants with long
//!   shared system prompts, Zipf popularity and multi-turn conversations (prefix-cache routing).
//!   Several URLs can share one run, spread round-robin or by tenant affinity.
//! - [`cli`] is the command line of the `faden-loadtest` binary, reusable by `faden`.
//!
//! Its upstream in tests and benchmarks is the `mock-engine` crate.

pub mod cli;
pub mod client;
pub mod config;
pub mod report;
mod run;
pub mod scenario;
pub mod sse;
pub mod stats;

pub use client::ErrorClass;
pub use config::{
    Arrivals, ClientRoute, ConnectProxy, LoadModel, RunConfig, Workload, WorkloadKind,
};
pub use report::{CompareReport, Ratio, Report, TargetShare};
pub use run::{compare, run};
pub use scenario::{PrefixGenerator, PrefixScenario, Scenario};
pub use stats::{CacheCounts, ErrorCounts, Summary};
