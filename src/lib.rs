//! kvpoll: moves KV-cache blocks between prefill and decode ranks over UCX and
//! reports, exactly once and without locks, which requests finished and which
//! failed.
#![warn(missing_docs)]

pub mod pattern;
pub mod placement;
pub mod transport;
pub mod wire;
