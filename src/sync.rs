//! Atomics and `Arc`, from `std` normally and from `loom` under `--cfg loom`,
//! so that the ledger's lock-free protocol can be model-checked unchanged.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Arc;

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;
