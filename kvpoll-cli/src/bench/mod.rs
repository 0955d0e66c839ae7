//! The bench drivers behind `kvpoll bench` and the tool's criterion bench
//! (`kvpoll-cli/benches/e2e.rs`): each measures kvpoll next to its baseline
//! in the same run. The library's criterion benches are the root crate's
//! (`benches/`).

pub mod e2e;
pub mod engine;
pub mod ledger;
pub mod memory;
pub mod shapes;
