//! What the engine thread sends the poller: small `Copy` entries on the
//! command ring. A request is one all-or-nothing batch: a [`Command::Begin`]
//! followed by its handles (each followed by its block pairs) or its blocks.

use crate::ledger::{BlockId, Incarnation, Kind, PeerId, RequestId};
pub use crate::transport::BlockBytes;

/// One entry of the command ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// A new request; its plan follows in the same batch.
    Begin {
        /// The engine's id.
        id: RequestId,
        /// What it is.
        kind: Kind,
        /// [`Command::Handle`] entries that follow.
        handles: u8,
        /// [`Command::Block`] entries that follow (lends and receives).
        blocks: u32,
        /// Deadline (reads) or lease (writes, lends, receives) from now, ns.
        expires_in: u64,
        /// The incarnation the engine drew for it: a lend's or a receive
        /// 's token, or a read's or write's own nonce.
        token: Incarnation,
    },
    /// One handle of the request begun last: its peer, and how many
    /// [`Command::Pair`] entries follow.
    Handle {
        /// The remote rank.
        peer: PeerId,
        /// Pairs that follow.
        pairs: u32,
        /// The incarnation of the remote lend or receive the
        /// handle reads or writes (none for a receive's writers).
        lend: Incarnation,
    },
    /// The bytes of each block the handle that follows moves (absent:
    /// whole blocks). Comes right before its [`Command::Handle`].
    Part(BlockBytes),
    /// A local block and the remote block it moves to or from.
    Pair {
        /// Local block.
        local: BlockId,
        /// Remote block.
        remote: BlockId,
    },
    /// A lent block.
    Block(BlockId),
    /// Abort a request: it alone is affected.
    Abort(RequestId),
    /// Extend a lease to `extend_ns` from now (never shortening it).
    Heartbeat {
        /// The request.
        id: RequestId,
        /// How long from now.
        extend_ns: u64,
    },
    /// Fault injection: the poller stops for this long, as a hung rank would.
    #[cfg(feature = "fault-injection")]
    Stall {
        /// How long, ns.
        ns: u64,
    },
}

impl Command {
    /// Ring entries a read or write with these handles takes.
    pub fn entries_for_transfers(handles: usize, pairs: usize) -> usize {
        1 + handles + pairs
    }

    /// Ring entries a read or write takes whose `parts` handles move
    /// parts of blocks (one [`Command::Part`] each, on top).
    pub fn entries_for_parts(handles: usize, parts: usize, pairs: usize) -> usize {
        Self::entries_for_transfers(handles, pairs) + parts
    }
}
