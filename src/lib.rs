//! kvpoll: moves KV-cache blocks between prefill and decode ranks over UCX and
//! reports, exactly once and without locks, which requests finished and which
//! failed.
#![warn(missing_docs)]

#[cfg(feature = "cuda")]
pub mod gpu;
pub mod pattern;
pub mod placement;
pub mod transport;
pub mod wire;
