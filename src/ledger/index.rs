//! The owner's map from request id to slot: a `HashMap` sized at construction
//! so that it never grows, with a cheap hasher for engine-chosen `u64` ids.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::key::RequestId;

/// A multiply-shift hash of one `u64` (request ids are not adversarial: the
/// engine makes them).
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, v: u64) {
        let x = (self.0 ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = x ^ (x >> 29);
    }
}

/// Request id → slot. Holds at most one entry per slot (an entry is removed
/// when its slot is taken again), so with room for twice the slots it never
/// reallocates: deletions are rehashed in place.
pub(crate) type IdIndex = HashMap<RequestId, u32, BuildHasherDefault<IdHasher>>;

pub(crate) fn with_slots(slots: u32) -> IdIndex {
    IdIndex::with_capacity_and_hasher(2 * slots as usize, Default::default())
}
