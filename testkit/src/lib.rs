//! Test helpers shared by faden's integration tests.
