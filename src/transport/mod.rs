//! Transports: real UCX, and a deterministic simulator.
pub mod ucx;
