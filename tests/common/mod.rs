//! A tiny driver for ledger tests: the owner half, the shared slots, and the
//! events and cancels they produced, in order.
#![allow(dead_code)]

pub mod pattern;

use kvpoll::ledger::*;
use std::sync::Arc;

pub struct Harness {
    pub ledger: Ledger,
    pub slots: Arc<Slots>,
    pub events: Vec<Event>,
    pub cancels: Vec<Cancel>,
}

pub fn hk(key: RequestKey, h: u8) -> HandleKey {
    HandleKey::new(key, h).unwrap()
}

pub fn err(status: i8) -> Result<(), Reason> {
    Err(Reason::new(Cause::Transfer, status))
}

pub fn peers(n: u32) -> Vec<PeerId> {
    (0..n).map(PeerId).collect()
}

pub fn blocks(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().copied().map(BlockId).collect()
}

impl Harness {
    pub fn new(slots: u32) -> Self {
        let ledger = Ledger::new(LedgerConfig {
            slots,
            max_blocks: 8,
        })
        .unwrap();
        Harness {
            slots: ledger.slots().clone(),
            ledger,
            events: Vec::new(),
            cancels: Vec::new(),
        }
    }

    pub fn try_begin(
        &mut self,
        id: u64,
        kind: Kind,
        peers: &[PeerId],
        blocks: &[BlockId],
        expires: u64,
    ) -> Result<Begun, BeginError> {
        let req = Request {
            id: RequestId(id),
            kind,
            peers,
            blocks,
            expires: Nanos(expires),
        };
        let events = &mut self.events;
        self.ledger.begin(&req, &mut |e| events.push(e))
    }

    /// Begins request `id` and claims every handle for posting.
    pub fn begin_posted(
        &mut self,
        id: u64,
        kind: Kind,
        n: u32,
        blocks: &[BlockId],
        expires: u64,
    ) -> RequestKey {
        let key = self.begin(id, kind, n, blocks, expires);
        for h in 0..n as u8 {
            self.slots.posting(hk(key, h)).unwrap();
        }
        key
    }

    /// Begins request `id` without posting anything.
    pub fn begin(
        &mut self,
        id: u64,
        kind: Kind,
        n: u32,
        blocks: &[BlockId],
        expires: u64,
    ) -> RequestKey {
        match self
            .try_begin(id, kind, &peers(n), blocks, expires)
            .unwrap()
        {
            Begun::Tracked(key) => key,
            Begun::Untracked => panic!("untracked"),
        }
    }

    pub fn complete(&mut self, key: RequestKey, h: u8, result: Result<(), Reason>) {
        let events = &mut self.events;
        self.slots
            .completed(hk(key, h), result, &mut |e| events.push(e))
            .unwrap();
    }

    pub fn notify(&mut self, id: u64, count: u32) -> Result<(), NotifyError> {
        let events = &mut self.events;
        self.ledger
            .notify(RequestId(id), count, &mut |e| events.push(e))
    }

    pub fn advance(&mut self, now: u64) {
        let (events, cancels) = (&mut self.events, &mut self.cancels);
        self.ledger
            .advance(Nanos(now), &mut |e| events.push(e), &mut |c| {
                cancels.push(c)
            });
    }

    pub fn abort(&mut self, id: u64) -> Result<Option<Cancel>, AbortError> {
        let events = &mut self.events;
        self.ledger.abort(RequestId(id), &mut |e| events.push(e))
    }

    /// The terminal events so far.
    pub fn reports(&self) -> Vec<Event> {
        self.events
            .iter()
            .copied()
            .filter(|e| e.outcome.is_terminal())
            .collect()
    }

    /// The outcomes of the terminal events of request `id` so far.
    pub fn reports_of(&self, id: u64) -> Vec<Outcome> {
        self.reports()
            .into_iter()
            .filter(|e| e.id == RequestId(id))
            .map(|e| e.outcome)
            .collect()
    }

    pub fn notices_of(&self, id: u64) -> usize {
        self.events
            .iter()
            .filter(|e| e.id == RequestId(id) && !e.outcome.is_terminal())
            .count()
    }

    /// What the engine does with a report: takes the blocks to invalidate,
    /// hands the key back; the owner retires it.
    pub fn retire(&mut self, key: RequestKey) -> Vec<BlockId> {
        let mut v = Vec::new();
        self.slots.blocks_to_invalidate(key, &mut v).unwrap();
        self.ledger.retire(key).unwrap();
        v
    }
}

/// One handle of a read or write: `local` paired with `remote` of `peer`,
/// in the lend (or receive) of incarnation `lend`
/// (`Incarnation::NONE`: memory no lend guards, for unconfirmed reads).
pub fn one<'a>(
    peer: PeerId,
    local: &'a [BlockId],
    remote: &'a [BlockId],
    lend: Incarnation,
) -> [kvpoll::Transfer<'a>; 1] {
    [kvpoll::Transfer {
        peer,
        local,
        remote,
        lend,
    }]
}

/// Whether `o` reports request `id`, in any list.
pub fn reported(o: &kvpoll::Outcomes, id: RequestId) -> bool {
    o.finished_recving.contains(&id)
        || o.failed_recving.iter().any(|f| f.id == id)
        || o.finished_sending.contains(&id)
        || o.failed_sending.iter().any(|f| f.id == id)
        || o.expired.contains(&id)
}

/// Polls `e` (appending to `out`) until `done(out)`; whether that came
/// within `guard`.
pub fn try_wait(
    e: &mut kvpoll::Engine,
    out: &mut kvpoll::Outcomes,
    guard: std::time::Duration,
    done: impl Fn(&kvpoll::Outcomes) -> bool,
) -> bool {
    let t = std::time::Instant::now();
    loop {
        e.poll(out);
        if done(out) {
            return true;
        }
        if t.elapsed() >= guard {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Fills block `block` of region 0 of `e` with `seed`'s pattern.
pub fn fill_block(e: &kvpoll::Engine, seed: u64, block: u32) {
    let mut buf = vec![0u8; e.block_size() as usize];
    pattern::fill(seed, u64::from(block), &mut buf);
    e.write_block(0, BlockId(block), &buf).unwrap();
}

/// Whether block `block` of region 0 of `e` holds `seed`'s block `remote`.
pub fn holds_block(e: &kvpoll::Engine, block: u32, seed: u64, remote: u32) -> bool {
    let mut buf = vec![0u8; e.block_size() as usize];
    e.read_block(0, BlockId(block), &mut buf).unwrap();
    pattern::check(seed, u64::from(remote), &buf)
}

/// An engine over transports `tls` with `blocks` registered blocks of
/// `block_size` bytes and a read-before-lend grace period of `grace`.
pub fn engine_with_grace(
    tls: &str,
    grace: std::time::Duration,
    block_size: u64,
    blocks: u64,
) -> kvpoll::Engine {
    let mut e = kvpoll::Engine::builder()
        .block_size(block_size)
        .ucx(kvpoll::transport::ucx::ContextOptions::with_transports(tls))
        .lend_grace(grace)
        .build()
        .expect("engine");
    e.register(blocks).unwrap();
    e
}

/// What a test that speaks the notification wire itself (a raw UCX worker
/// playing a peer) sends: the message as given, or, when the suite runs
/// keyed (`KVPOLL_TEST_AUTH_KEY` set: every engine built without a key of
/// its own takes that one), the message
/// sealed with that key for receiver `to`, so that the engine judges
/// what the test sends by its contents rather than dropping it untagged.
pub struct RawSeal(Option<kvpoll::notification::Sealer>);

impl RawSeal {
    pub fn new() -> Self {
        let secret = std::env::var(kvpoll::engine::TEST_AUTH_ENV)
            .ok()
            .filter(|s| !s.is_empty());
        RawSeal(secret.map(|s| {
            let key = kvpoll::auth::AuthKey::from_secret(s.trim().as_bytes()).expect("test key");
            kvpoll::notification::Sealer::new(key)
        }))
    }

    /// `message` as it goes to the engine of instance `to`.
    pub fn wrap(&mut self, to: u64, message: &[u8]) -> Vec<u8> {
        let mut out = message.to_vec();
        if let Some(s) = self.0.as_mut() {
            out.extend_from_slice(&s.seal(to, message));
        }
        out
    }
}

impl Default for RawSeal {
    fn default() -> Self {
        Self::new()
    }
}
