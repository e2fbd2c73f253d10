//! An engine's Prometheus page as the worker reads it (`control_client::engine_load::parse`).
//! Invariants (`parse::fuzzing::check`): the figures are what the worker may send (a usage in
//! 0..1, a block size above 0, at most as many skipped lines as lines); `\r\n` line ends read
//! as `\n` do; every line read as a sample, written back with its label values escaped, reads
//! the same.
#![no_main]

use control_client::engine_load::parse::fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|page: &[u8]| fuzzing::check(page));
