//! The bench drivers behind `kvpoll bench` and the criterion benches in
//! `kvpoll-cli/benches/`: each measures kvpoll next to its baseline in the
//! same run.

pub mod e2e;
pub mod engine;
pub mod ledger;
pub mod memory;
pub mod shapes;
