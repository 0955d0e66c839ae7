//! Names of things the ledger tracks: request ids, slot keys, handle keys,
//! peers, blocks and time.

/// The serving engine's id of a request (e.g. a hash of vLLM's request id).
///
/// Unique among the requests the ledger tracks at one time.
///
/// ```
/// use kvpoll::ledger::RequestId;
/// assert_eq!(RequestId(7).0, 7);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// One incarnation of a lend or a receive: a token its owner's
/// engine draws (64 bits from the operating system's CSPRNG) when
/// [`crate::Engine::lend`] is called, carried to the other side with the
/// block ids, and named by every notification about it. A note naming an
/// incarnation that is not live never touches another one, even of the same
/// [`RequestId`]. Unguessable, so it is also the capability to read or
/// write those blocks.
///
/// Reads and writes draw one of their own too (the attempt's nonce), so
/// that an answer to an earlier attempt under the same id is refused.
///
/// ```
/// use kvpoll::ledger::Incarnation;
/// assert!(Incarnation::NONE.is_none());
/// assert!(!Incarnation(7).is_none());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Incarnation(pub u64);

impl Incarnation {
    /// No incarnation: a read of memory no lend guards (reads with
    /// confirmation off).
    pub const NONE: Incarnation = Incarnation(0);

    /// Whether this is [`Incarnation::NONE`].
    pub fn is_none(self) -> bool {
        self.0 == 0
    }
}

/// A remote rank (one endpoint) that handles transfer to or from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u32);

/// A local KV-cache block id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// A point in time in nanoseconds, on a clock of the driver's choice.
///
/// The ledger never reads a clock: every time it knows was given to it.
///
/// ```
/// use kvpoll::ledger::Nanos;
/// assert!(Nanos(5) < Nanos(6));
/// assert_eq!(Nanos(5).saturating_add(Nanos(u64::MAX)), Nanos(u64::MAX));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Nanos(pub u64);

impl Nanos {
    /// The time `d` later, saturating at the end of time.
    pub fn saturating_add(self, d: Nanos) -> Nanos {
        Nanos(self.0.saturating_add(d.0))
    }
}

/// A slot of the ledger and the generation it had when a request began in it.
///
/// Packs the slot index (low 32 bits) and the generation (high 32 bits) in a
/// `u64`. The generation changes when the slot is retired, so a key that
/// outlived its request is refused ([`crate::ledger::InputError::Stale`]) and
/// can never touch the request that reuses the slot.
///
/// ```
/// use kvpoll::ledger::RequestKey;
/// let k = RequestKey::new(3, 9);
/// assert_eq!((k.slot(), k.generation()), (3, 9));
/// assert_eq!(RequestKey::from_u64(k.to_u64()), k);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RequestKey(u64);

impl RequestKey {
    /// The key of `slot` at `generation`.
    pub fn new(slot: u32, generation: u32) -> Self {
        RequestKey(u64::from(generation) << 32 | u64::from(slot))
    }
    /// The slot index.
    pub fn slot(self) -> u32 {
        self.0 as u32
    }
    /// The slot's generation when the request began.
    pub fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
    /// The packed form.
    pub fn to_u64(self) -> u64 {
        self.0
    }
    /// Unpacks [`RequestKey::to_u64`]. Any value is a key; a wrong one is
    /// refused as stale by the ledger.
    pub fn from_u64(v: u64) -> Self {
        RequestKey(v)
    }
}

/// The most handles one request can have: one bit each in a `u64` bitmap.
pub const MAX_HANDLES: usize = 64;

/// The most slots a ledger can have, so that a [`HandleKey`] fits in a `u64`.
pub const MAX_SLOTS: u32 = 1 << 24;

/// One handle of one request: what a transfer's completion carries back.
///
/// [`HandleKey::to_u64`] packs generation (32 bits), slot (26 bits) and handle
/// index (6 bits), to travel as a UCX request's user data: mapping a
/// completion to its request needs no lookup.
///
/// ```
/// use kvpoll::ledger::{HandleKey, RequestKey};
/// let h = HandleKey::new(RequestKey::new(1_000_000, 42), 63).unwrap();
/// assert_eq!(HandleKey::from_u64(h.to_u64()), h);
/// assert!(HandleKey::new(RequestKey::new(0, 0), 64).is_none());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HandleKey {
    key: RequestKey,
    handle: u8,
}

impl HandleKey {
    /// Handle `handle` (0..64) of the request `key`; `None` when out of range.
    pub fn new(key: RequestKey, handle: u8) -> Option<Self> {
        (usize::from(handle) < MAX_HANDLES && key.slot() < MAX_SLOTS)
            .then_some(HandleKey { key, handle })
    }
    /// The request.
    pub fn key(self) -> RequestKey {
        self.key
    }
    /// The handle's index in the request's plan.
    pub fn handle(self) -> u8 {
        self.handle
    }
    /// The handle's bit in the request's bitmaps.
    pub fn bit(self) -> u64 {
        1 << self.handle
    }
    /// Packs generation, slot and handle in a `u64`.
    pub fn to_u64(self) -> u64 {
        u64::from(self.key.generation()) << 32
            | u64::from(self.key.slot()) << 6
            | u64::from(self.handle)
    }
    /// Unpacks [`HandleKey::to_u64`].
    pub fn from_u64(v: u64) -> Self {
        let slot = ((v >> 6) as u32) & (MAX_SLOTS * 4 - 1);
        HandleKey {
            key: RequestKey::new(slot, (v >> 32) as u32),
            handle: (v & 63) as u8,
        }
    }
}
