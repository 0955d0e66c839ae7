//! Transports: real UCX, and a deterministic simulator.
pub mod sim;
pub mod ucx;
