//! The `kvpoll` tool's own library: the bench drivers and the checkable
//! block pattern that the tool, its criterion benches and its integration
//! tests share. Not for embedding: a serving engine needs only the `kvpoll`
//! crate.
#![warn(missing_docs)]

pub mod bench;
pub mod control;
pub mod pattern;

/// Whether this build's engines carry the `fault-injection` test hooks
/// (the bench says so next to its figures).
pub const FAULT_INJECTION: bool = cfg!(feature = "fault-injection");
