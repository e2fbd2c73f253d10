//! The `faden` command.
fn main() {}
