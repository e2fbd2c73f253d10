//! faden gateway: the OpenAI-compatible front of the data plane.
//!
//! Filled in by the gateway issue; it reads routing snapshots published by `control::sync`.
