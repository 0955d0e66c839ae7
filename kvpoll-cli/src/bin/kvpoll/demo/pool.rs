//! A rank's block pool, as a serving engine's allocator keeps it, plus what
//! each held block is expected to contain, so that a late write from an old
//! request into a reused block is caught.

use kvpoll::ledger::BlockId;

/// What a block should hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Free, or allocated and not yet written: no claim on its content.
    Nothing,
    /// Holds block `index` of the pattern of `(req, rank)` in every layer.
    Pattern { req: u64, rank: u32, index: u32 },
}

pub struct Pool {
    /// LIFO: the block freed last is reused first, as allocators with hot
    /// caches do — which is also what exposes a late write fastest.
    free: Vec<BlockId>,
    expect: Vec<Expect>,
    total: u32,
}

impl Pool {
    pub fn new(total: u32) -> Self {
        Self {
            free: (0..total).rev().map(BlockId).collect(),
            expect: vec![Expect::Nothing; total as usize],
            total,
        }
    }

    pub fn alloc(&mut self, n: usize, out: &mut Vec<BlockId>) -> bool {
        if self.free.len() < n {
            return false;
        }
        for _ in 0..n {
            if let Some(b) = self.free.pop() {
                self.expect[b.0 as usize] = Expect::Nothing;
                out.push(b);
            }
        }
        true
    }

    pub fn release(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            self.expect[b.0 as usize] = Expect::Nothing;
            self.free.push(b);
        }
    }

    pub fn set_expect(&mut self, b: BlockId, e: Expect) {
        self.expect[b.0 as usize] = e;
    }

    pub fn expect(&self, b: BlockId) -> Expect {
        self.expect[b.0 as usize]
    }

    pub fn free(&self) -> u32 {
        self.free.len() as u32
    }

    pub fn total(&self) -> u32 {
        self.total
    }
}

/// The pattern seed of layer `layer` of request `req` on rank `rank`.
pub fn seed(req: u64, layer: usize, rank: u32) -> u64 {
    req.wrapping_mul(1_000_003) ^ ((layer as u64) << 48) ^ (u64::from(rank) << 32)
}
