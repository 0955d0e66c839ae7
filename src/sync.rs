//! Atomics from `std` normally and from `loom` under `--cfg loom`, so that
//! the ledger's lock-free protocol is model-checked unchanged. (`Arc` stays
//! `std`'s: loom need not model the reference count, and the public API keeps
//! one type.)

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
