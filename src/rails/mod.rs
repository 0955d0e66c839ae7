//! Rails: one engine per network device ("rail"), each with its own poller
//! (pinned where its builder says), its own UCX context bound to that
//! device and its own ledger, under one engine-thread façade that stripes
//! reads across them and reports each request once.
//!
//! # Shape
//!
//! - **Memory** is registered once per rail over the same bytes: a lend on
//!   any rail lends the same blocks, and a read on any rail lands in the
//!   same blocks.
//! - **Metadata** ([`Rails::local_metadata`]) is every rail's engine
//!   metadata in one frame. [`Rails::add_peer`] pairs this side's rail `i`
//!   with the peer's rail `i` where both exist and the rail's engine takes
//!   the peer (each rail checks its own metadata: layout, key, tag); a rail
//!   that takes it is a *link*. A peer no rail reaches is refused; one
//!   engine's metadata ([`Engine::local_metadata`]) is a peer of one rail,
//!   linked to rail 0.
//! - **A lend** is lent on every rail under one incarnation
//!   ([`Engine::lend_with`]), so a reader confirms against whichever rail
//!   it reads through. The blocks are free — the lend reported — only once
//!   every rail's lend ended: finished if any rail's readers all reported
//!   (each reader notifies every rail it did not read through, when its read
//!   is reported), expired otherwise. A rail's lend still out
//!   [`RailsBuilder::sibling_grace`] after another rail's finished is ended
//!   (a reader with fewer rails, or cut from one, never reports there).
//! - **A read** of at least [`RailsBuilder::stripe_above`] bytes is
//!   striped: each handle's blocks are read as byte ranges, one range of
//!   every block per live link of its peer ([`Engine::read_parts`]), so
//!   each rail's read names all of the lend's blocks and confirms
//!   one-sidedly like an unstriped one. A smaller read goes whole to the
//!   least loaded live link (requests in flight on its engine, then turns).
//! - **Exactly once, held back:** a read is reported once every rail's part
//!   of it was reported by that rail's engine — itself only after all of its
//!   handles stopped — so a failure on one rail is reported after the
//!   siblings on the others stopped, and a request is reported once. The
//!   façade runs on the engine thread and is the only reader of the rails'
//!   reports: no lock, and no shared state between pollers.
//! - **A rail that fails** fails only the parts on it. A link whose part
//!   failed for a reason of the link (transfer error, a post the link could
//!   not take, deadline, stalled or lost peer) is left out of new reads for [`RailsBuilder::relink_after`]
//!   while another link to that peer is not (a peer whose every link is
//!   left out is read through them all); a lost peer is added again to
//!   that rail then, from the metadata it gave. A failed part is not
//!   retried on another rail. For a striped handle it could not be: its
//!   lender's lend there ended on this read's own note (its part there
//!   finished). For whole handles it would be safe (the lend on the other
//!   rail is untouched and confirms like any read) but is not built
//!   (docs/design.md §3).
//!
//! Only reads and lends go over rails; writes and receives are one engine's
//! ([`Engine`]).

mod fold;

use std::time::{Duration, Instant};

use thiserror::Error;

use crate::engine::{
    BuildError, Engine, EngineBuilder, Outcomes, PartTransfer, PeerError, PollerStats, RegionError,
    SubmitError, Transfer,
};
use crate::ledger::{BlockId, Cause, Incarnation, PeerId, Reason, RequestId};
use crate::metrics::{MetricsSnapshot, RequestOutcomes};
use fold::{Fold, LendEnd, LendReport, Read, Took};

/// Most rails one engine drives.
pub const MAX_RAILS: usize = 16;
const MAGIC: [u8; 2] = *b"KR";
const VERSION: u8 = 1;
/// Most bytes one rail's metadata may take in the frame.
const MAX_RAIL_METADATA: usize = 1 << 20;
/// Byte ranges of a striped block start on this boundary.
const STRIPE_ALIGN: u64 = 64;

/// Whether `metadata` is a rails frame ([`Rails::local_metadata`]) rather
/// than one engine's.
pub fn is_frame(metadata: &[u8]) -> bool {
    metadata.starts_with(&MAGIC)
}

/// Rail 0's engine metadata in a rails frame, checked as
/// [`Rails::add_peer`] checks the frame: what one engine adds to reach a
/// peer of several rails through its rail 0. Fit for an engine that only
/// lends to that peer (a reader of several rails reads a lender of one
/// engine through its rail 0); an engine that reads through it would
/// leave each of the peer's lends out on its other rails for
/// [`RailsBuilder::sibling_grace`] after every read.
pub fn rail_0_metadata(frame: &[u8]) -> Result<&[u8], RailsError> {
    Ok(split_frame(frame)?[0])
}

/// Why the rails refused something. Nothing changed.
#[derive(Debug, Error)]
pub enum RailsError {
    /// No rail was given, or more than [`MAX_RAILS`].
    #[error("{0} rails given: 1 to {MAX_RAILS} are accepted")]
    RailCount(usize),
    /// A rail's builder names another block size than rail 0's.
    #[error("rail {rail} has block size {theirs}, rail 0 has {ours}")]
    BlockSizes {
        /// The rail.
        rail: usize,
        /// Rail 0's block size.
        ours: u64,
        /// This rail's.
        theirs: u64,
    },
    /// A rail's engine did not start.
    #[error("rail {rail}: {error}")]
    Build {
        /// The rail.
        rail: usize,
        /// Why.
        error: BuildError,
    },
    /// The memory could not be registered on a rail.
    #[error("rail {rail}: {error}")]
    Region {
        /// The rail.
        rail: usize,
        /// Why.
        error: RegionError,
    },
    /// No memory for a region of this many bytes.
    #[error("cannot allocate a region of {0} bytes")]
    NoMemory(usize),
    /// A rail could not say its metadata.
    #[error("rail {rail}: {error}")]
    Metadata {
        /// The rail.
        rail: usize,
        /// Why.
        error: PeerError,
    },
    /// The rails frame of a peer's metadata is malformed.
    #[error("rails metadata: {0}")]
    BadFrame(&'static str),
    /// No rail of this side took the peer's metadata for its own rail.
    #[error("no rail reaches the peer: {}", describe(.0))]
    Unreachable(Vec<(usize, PeerError)>),
    /// A handle names a peer [`Rails::add_peer`] did not give out.
    #[error("handle {handle}: unknown peer {}", .peer.0)]
    UnknownPeer {
        /// The handle.
        handle: usize,
        /// The peer named.
        peer: PeerId,
    },
    /// No rail reaches a handle's peer now: every link to it was lost,
    /// and none was added again yet.
    #[error("handle {handle}: no rail reaches peer {} now", .peer.0)]
    NoLiveRail {
        /// The handle.
        handle: usize,
        /// The peer.
        peer: PeerId,
    },
    /// A handle is malformed (as [`Engine::read`] says); nothing was sent.
    #[error("{0}")]
    Handle(SubmitError),
    /// A read names no handle.
    #[error("no handles given: a read moves at least one")]
    NoHandles,
    /// No request of this id is in flight on the rails.
    #[error("request {} is not in flight", .0.0)]
    UnknownRequest(RequestId),
    /// A request of this id is in flight on the rails.
    #[error("request {} is already in flight", .0.0)]
    Duplicate(RequestId),
    /// A rail's engine refused its part (a lend's, or a read's); the parts
    /// other rails took are aborted, and the request is not reported. Its
    /// id stays taken until those parts are reported to [`Rails::poll`].
    #[error("rail {rail}: {error}")]
    Submit {
        /// The rail.
        rail: usize,
        /// Why.
        error: SubmitError,
    },
}

fn describe(errors: &[(usize, PeerError)]) -> String {
    if errors.is_empty() {
        return "the peer announces no rail this side has".into();
    }
    let parts: Vec<String> = errors
        .iter()
        .map(|(r, e)| format!("rail {r}: {e}"))
        .collect();
    parts.join("; ")
}

/// Builds [`Rails`]: one [`EngineBuilder`] per rail.
#[derive(Debug, Clone)]
pub struct RailsBuilder {
    rails: Vec<(Option<String>, EngineBuilder)>,
    stripe_above: u64,
    relink_after: Duration,
    sibling_grace: Duration,
}

impl Default for RailsBuilder {
    fn default() -> Self {
        Self {
            rails: Vec::new(),
            stripe_above: 4 << 20,
            relink_after: Duration::from_secs(1),
            sibling_grace: Duration::from_secs(5),
        }
    }
}

impl RailsBuilder {
    /// Adds a rail: an engine built from `engine` (its core, idle policy,
    /// UCX options, …), its UCX context bound to network device `device`
    /// (`UCX_NET_DEVICES`, e.g. `"mlx5_0:1"` or `"eth1"`) where given.
    /// Every rail must have the same block size.
    pub fn rail(mut self, device: Option<&str>, engine: EngineBuilder) -> Self {
        self.rails.push((device.map(str::to_owned), engine));
        self
    }

    /// One rail per poller of a core map ([`crate::placement::CoreMap`]):
    /// an engine built from `engine`, its poller pinned to the entry's
    /// core with the entry's idle policy, its UCX context bound to the
    /// entry's devices (its `workers`, joined as `UCX_NET_DEVICES` lists
    /// them; `all`: UCX chooses).
    pub fn from_core_map(map: &crate::placement::CoreMap, engine: EngineBuilder) -> Self {
        let mut b = Self::default();
        for p in map.pollers() {
            let devices = p.workers.join(",");
            let device =
                (!devices.is_empty() && !p.workers.iter().any(|w| w == "all")).then_some(devices);
            b = b.rail(
                device.as_deref(),
                engine.clone().core(Some(p.core)).idle(p.idle),
            );
        }
        b
    }

    /// Reads of at least this many bytes are striped across every live
    /// link of each handle's peer; smaller ones go whole to one link.
    /// Default 4 MiB.
    pub fn stripe_above(mut self, bytes: u64) -> Self {
        self.stripe_above = bytes;
        self
    }

    /// How long a link whose part of a read failed for a reason of the link
    /// is left out of new reads while its peer has another link that is
    /// not (and when a lost peer is added again to it). Default 1 s.
    pub fn relink_after(mut self, d: Duration) -> Self {
        self.relink_after = d;
        self
    }

    /// How long a lend stays out on its other rails once one rail's lend
    /// of it finished (every reader reported through that rail) before it
    /// is ended there: a reader with fewer rails, or whose link to one is
    /// cut, never reports through the others, and the blocks would be
    /// held to the lease's end. A reader that striped its read and whose
    /// part on another rail is still running then fails that part (its
    /// confirmation finds the lend gone), never reads other bytes.
    /// Default 5 s.
    pub fn sibling_grace(mut self, d: Duration) -> Self {
        self.sibling_grace = d;
        self
    }

    /// Starts every rail's engine (and poller).
    pub fn build(self) -> Result<Rails, RailsError> {
        let n = self.rails.len();
        if n == 0 || n > MAX_RAILS {
            return Err(RailsError::RailCount(n));
        }
        let ours = self.rails[0].1.block_size_of();
        let mut rails = Vec::with_capacity(n);
        for (i, (device, builder)) in self.rails.into_iter().enumerate() {
            let theirs = builder.block_size_of();
            if theirs != ours {
                return Err(RailsError::BlockSizes {
                    rail: i,
                    ours,
                    theirs,
                });
            }
            let builder = match &device {
                Some(d) => builder.net_device(d),
                None => builder,
            };
            let engine = builder
                .build()
                .map_err(|error| RailsError::Build { rail: i, error })?;
            rails.push(Rail {
                engine,
                device,
                counters: RailCounters::default(),
            });
        }
        Ok(Rails {
            rails,
            peers: Vec::new(),
            fold: Fold::default(),
            requests: RequestOutcomes::default(),
            scratch: Outcomes::default(),
            stripe_above: self.stripe_above,
            relink_after: self.relink_after,
            sibling_grace: self.sibling_grace,
            graces: std::collections::VecDeque::new(),
            block_size: ours,
            turn: 0,
            woken: std::sync::Arc::default(),
            memory: Vec::new(),
        })
    }
}

/// What one rail did, for an operator: its device, its poller's counters,
/// and the façade's count of its parts and links.
#[derive(Debug, Clone)]
pub struct RailStats {
    /// The rail's network device (`None`: UCX chose).
    pub device: Option<String>,
    /// The core its poller is pinned to, if it is.
    pub core: Option<usize>,
    /// Its poller's counters (bytes moved, operations, …).
    pub poller: PollerStats,
    /// Parts of reads this rail carried that ended well.
    pub parts_finished: u64,
    /// Parts of reads this rail carried that failed.
    pub parts_failed: u64,
    /// Links of this rail left out after a failure of the link.
    pub links_down: u64,
    /// Lost peers added again to this rail.
    pub relinks: u64,
    /// Links of this rail usable now.
    pub links_up: usize,
}

#[derive(Debug, Default, Clone, Copy)]
struct RailCounters {
    parts_finished: u64,
    parts_failed: u64,
    links_down: u64,
    relinks: u64,
}

struct Rail {
    engine: Engine,
    device: Option<String>,
    counters: RailCounters,
}

/// One peer's rail on this side.
struct Link {
    /// The peer's id on this rail's engine; `None` once lost (added again
    /// at `down_until`).
    peer: Option<PeerId>,
    /// The peer's metadata for this rail, to add it again.
    metadata: Vec<u8>,
    /// Left out of new reads until then.
    down_until: Option<Instant>,
    /// Failures of the link since it last carried a read that ended well
    /// (0: healthy). Each doubles its time out, up to 32 times
    /// `relink_after`.
    strikes: u32,
    /// A read is out on the link as its probe: past its time out, a
    /// failed link carries one read at a time until one ends well.
    probe: bool,
}

impl Link {
    fn new(peer: PeerId, metadata: Vec<u8>) -> Self {
        Link {
            peer: Some(peer),
            metadata,
            down_until: None,
            strikes: 0,
            probe: false,
        }
    }

    /// Healthy: added, and no failure since its last read that ended well.
    fn healthy(&self) -> Option<PeerId> {
        self.peer.filter(|_| self.strikes == 0)
    }

    /// Failed, past its time out, and no probe out: the next read may go.
    fn probe_ready(&self, now: Instant) -> Option<PeerId> {
        let over = self.down_until.is_none_or(|t| t <= now);
        self.peer
            .filter(|_| self.strikes > 0 && over && !self.probe)
    }

    /// A part on the link failed for a reason of the link: left out for
    /// `relink_after` doubled per strike (32 times at most). A strike is
    /// counted for a healthy link's first failure and for a failed probe;
    /// the other parts that were out on it when it failed end as they end,
    /// and count for nothing more. Whether it had been healthy.
    fn strike(&mut self, now: Instant, relink_after: Duration) -> bool {
        let was = self.strikes == 0;
        if !was && !self.probe {
            return false;
        }
        self.strikes = self.strikes.saturating_add(1);
        self.probe = false;
        self.down_until = Some(now + relink_after * (1 << (self.strikes - 1).min(5)));
        was
    }
}

struct RailPeer {
    /// By rail index; `None`: the rail does not reach the peer.
    links: Vec<Option<Link>>,
    /// Removed ([`Rails::remove_peer`]): its id names nothing any more.
    removed: bool,
}

impl RailPeer {
    fn link(&self, rail: usize) -> Option<&Link> {
        self.links.get(rail)?.as_ref()
    }

    /// Whether the link on `rail` is usable now: healthy, or past its time
    /// out.
    fn live(&self, rail: usize, now: Instant) -> bool {
        self.link(rail).is_some_and(|l| {
            l.healthy().is_some() || (l.peer.is_some() && l.down_until.is_none_or(|t| t <= now))
        })
    }

    /// The peer's id on rail `rail`'s engine, left out or not.
    fn on(&self, rail: usize) -> Option<PeerId> {
        self.link(rail)?.peer
    }

    /// The rails `f` holds for, as a mask.
    fn mask(&self, f: impl Fn(&Link) -> bool) -> u32 {
        (0..self.links.len())
            .filter(|&r| self.link(r).is_some_and(&f))
            .fold(0u32, |m, r| m | 1 << r)
    }
}

/// Wakes the engine thread out of [`Rails::wait`]: wakes every rail's
/// engine ([`crate::EngineWaker`]), so whichever one it waits in returns.
#[derive(Clone, Debug)]
pub struct RailsWaker {
    woken: std::sync::Arc<std::sync::atomic::AtomicBool>,
    engines: Vec<crate::engine::EngineWaker>,
}

impl RailsWaker {
    /// Wakes the engine thread if it waits; otherwise its next wait
    /// returns without blocking.
    pub fn wake(&self) {
        // Release: pairs with the waiter's swap.
        self.woken.store(true, std::sync::atomic::Ordering::Release);
        for w in &self.engines {
            w.wake();
        }
    }
}

/// Caller memory this façade allocated and registered on every rail;
/// freed after the rails' engines are gone.
struct Region {
    base: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: the region is plain heap memory owned by this value; the engines
// that use it are dropped before it (field order in `Rails`).
unsafe impl Send for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `Rails::register`.
        unsafe { std::alloc::dealloc(self.base, self.layout) };
    }
}

/// Several engines, one per rail, behind one engine-thread API for reads
/// and lends. See the module documentation.
pub struct Rails {
    // Field order is drop order: the engines (and their pollers) go before
    // the memory they registered.
    rails: Vec<Rail>,
    peers: Vec<RailPeer>,
    fold: Fold,
    /// Whole requests reported, by outcome.
    requests: RequestOutcomes,
    scratch: Outcomes,
    stripe_above: u64,
    relink_after: Duration,
    sibling_grace: Duration,
    /// Lends with a rail's lend finished and others still out: when to end
    /// those, oldest first.
    graces: std::collections::VecDeque<(Instant, RequestId, Incarnation)>,
    block_size: u64,
    turn: usize,
    /// Set by a [`RailsWaker`]: the next wait returns.
    woken: std::sync::Arc<std::sync::atomic::AtomicBool>,
    memory: Vec<Region>,
}

impl Rails {
    /// A builder with no rail yet.
    pub fn builder() -> RailsBuilder {
        RailsBuilder::default()
    }

    /// How many rails.
    pub fn rails(&self) -> usize {
        self.rails.len()
    }

    /// The block size (every rail's).
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// One rail's engine (its metrics, its poller's core).
    pub fn rail(&self, i: usize) -> Option<&Engine> {
        self.rails.get(i).map(|r| &r.engine)
    }

    /// Allocates `blocks` zeroed blocks and registers them on every rail
    /// as one region. Returns the region's index.
    pub fn register(&mut self, blocks: u64) -> Result<usize, RailsError> {
        let len = blocks
            .checked_mul(self.block_size)
            .and_then(|l| usize::try_from(l).ok())
            .filter(|&l| l > 0)
            .ok_or(RailsError::NoMemory(0))?;
        let layout = std::alloc::Layout::from_size_align(len, 4096)
            .map_err(|_| RailsError::NoMemory(len))?;
        // SAFETY: `len` is not zero.
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        if base.is_null() {
            return Err(RailsError::NoMemory(len));
        }
        // Kept whatever registering it does: a rail that took it before
        // another refused it still maps it.
        self.memory.push(Region { base, layout });
        // SAFETY: the region stays allocated, in place, until after every
        // engine is dropped (`Rails`' field order).
        unsafe { self.register_memory(base, len) }
    }

    /// Registers caller memory on every rail as one region
    /// ([`Engine::register_memory`]). Refused, changing nothing, once a
    /// peer was added (peers hold the rails' keys). A rail that refuses it
    /// after others took it (a UCX failure) leaves them with it: build the
    /// rails again.
    ///
    /// # Safety
    /// As [`Engine::register_memory`], for the lifetime of these rails.
    pub unsafe fn register_memory(
        &mut self,
        base: *mut u8,
        len: usize,
    ) -> Result<usize, RailsError> {
        if !self.peers.is_empty() {
            return Err(RailsError::Region {
                rail: 0,
                error: RegionError::Frozen,
            });
        }
        let mut index = 0;
        for (i, rail) in self.rails.iter_mut().enumerate() {
            // SAFETY: the caller's guarantee.
            index = unsafe { rail.engine.register_memory(base, len) }
                .map_err(|error| RailsError::Region { rail: i, error })?;
        }
        Ok(index)
    }

    /// Writes block `block` of region `region` (the same bytes on every
    /// rail).
    pub fn write_block(
        &self,
        region: usize,
        block: BlockId,
        data: &[u8],
    ) -> Result<(), RegionError> {
        self.rails[0].engine.write_block(region, block, data)
    }

    /// Reads block `block` of region `region`.
    pub fn read_block(
        &self,
        region: usize,
        block: BlockId,
        out: &mut [u8],
    ) -> Result<(), RegionError> {
        self.rails[0].engine.read_block(region, block, out)
    }

    /// Every rail's metadata in one frame, for the peers' [`Rails::add_peer`]:
    ///
    /// ```text
    /// 2  magic "KR"
    /// 1  version (1)
    /// 1  rails (1 to MAX_RAILS)
    /// then per rail: u32 length (little endian), that rail's engine metadata
    /// ```
    pub fn local_metadata(&self) -> Result<Vec<u8>, RailsError> {
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(self.rails.len() as u8);
        for (i, rail) in self.rails.iter().enumerate() {
            let m = rail
                .engine
                .local_metadata()
                .map_err(|error| RailsError::Metadata { rail: i, error })?;
            out.extend_from_slice(&(m.len() as u32).to_le_bytes());
            out.extend_from_slice(&m);
        }
        Ok(out)
    }

    /// Adds a peer from its [`Rails::local_metadata`]: this side's rail `i`
    /// links to the peer's rail `i` where both exist and this rail's engine
    /// takes that rail's metadata. Metadata that is not a rails frame is
    /// taken as one engine's ([`Engine::local_metadata`]: a peer of one
    /// rail, linked to rail 0). Refused, changing nothing, when a rails
    /// frame is malformed or no rail takes the peer.
    pub fn add_peer(&mut self, metadata: &[u8]) -> Result<PeerId, RailsError> {
        let theirs = if is_frame(metadata) {
            split_frame(metadata)?
        } else {
            vec![metadata]
        };
        let mut links = Vec::with_capacity(self.rails.len());
        let mut refused = Vec::new();
        for (i, rail) in self.rails.iter_mut().enumerate() {
            let Some(m) = theirs.get(i) else {
                links.push(None);
                continue;
            };
            match rail.engine.add_peer(m) {
                Ok(peer) => links.push(Some(Link::new(peer, m.to_vec()))),
                Err(e) => {
                    refused.push((i, e));
                    links.push(None);
                }
            }
        }
        if links.iter().all(Option::is_none) {
            return Err(RailsError::Unreachable(refused));
        }
        for (i, e) in &refused {
            tracing::warn!(rail = i, error = %e, "a rail does not reach the peer");
        }
        // The same metadata again (a peer reconnecting over its control
        // channel) is the same peer: each rail's engine gave the same id,
        // and two ids sharing an engine's peer would let removing one cut
        // the other. A link of it that was lost takes the id just given.
        let same = |p: &RailPeer| {
            !p.removed
                && p.links.len() == links.len()
                && p.links.iter().zip(&links).all(|(a, b)| match (a, b) {
                    (Some(a), Some(b)) => a.metadata == b.metadata,
                    (None, None) => true,
                    _ => false,
                })
        };
        if let Some(i) = self.peers.iter().position(same) {
            for (old, new) in self.peers[i].links.iter_mut().zip(links) {
                if let (Some(old), Some(new)) = (old, new) {
                    if old.peer.is_none() {
                        old.peer = new.peer;
                    }
                }
            }
            return Ok(PeerId(i as u32));
        }
        self.peers.push(RailPeer {
            links,
            removed: false,
        });
        Ok(PeerId(self.peers.len() as u32 - 1))
    }

    /// Removes a peer from every rail ([`Engine::remove_peer`]): its parts
    /// in flight fail (deferred, as always) and its id names nothing any
    /// more. Removing it again is fine; an id never given out is
    /// [`RailsError::UnknownPeer`].
    pub fn remove_peer(&mut self, peer: PeerId) -> Result<(), RailsError> {
        let p = self
            .peers
            .get_mut(peer.0 as usize)
            .ok_or(RailsError::UnknownPeer { handle: 0, peer })?;
        p.removed = true;
        for (r, link) in p.links.iter_mut().enumerate() {
            if let Some(on) = link.take().and_then(|l| l.peer) {
                let _ = self.rails[r].engine.remove_peer(on);
            }
        }
        Ok(())
    }

    /// Whether a rail's engine was found deaf ([`Engine::is_deaf`]): build
    /// the rails again and give the peers the new metadata.
    pub fn is_deaf(&self) -> bool {
        self.rails.iter().any(|r| r.engine.is_deaf())
    }

    /// Nothing to read, but each of `producers` lent blocks for request
    /// `id` and awaits this side's word: each is notified on every rail
    /// that reaches it ([`Engine::notify_only`]), so every rail's lend
    /// ends at once. The first rail that refused is returned, after every
    /// rail was tried.
    pub fn notify_only(
        &mut self,
        id: RequestId,
        producers: &[(PeerId, Incarnation)],
    ) -> Result<(), RailsError> {
        for (h, &(peer, _)) in producers.iter().enumerate() {
            if self.peers.get(peer.0 as usize).is_none_or(|p| p.removed) {
                return Err(RailsError::UnknownPeer { handle: h, peer });
            }
        }
        let mut first = None;
        for (r, rail) in self.rails.iter_mut().enumerate() {
            let on: Vec<(PeerId, Incarnation)> = producers
                .iter()
                .filter_map(|&(p, lend)| Some((self.peers[p.0 as usize].on(r)?, lend)))
                .collect();
            if on.is_empty() {
                continue;
            }
            if let Err(error) = rail.engine.notify_only(id, &on) {
                first.get_or_insert(RailsError::Submit { rail: r, error });
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// A handle that wakes the engine thread out of [`Rails::wait`], from
    /// any thread.
    pub fn waker(&self) -> RailsWaker {
        RailsWaker {
            woken: self.woken.clone(),
            engines: self.rails.iter().map(|r| r.engine.waker()).collect(),
        }
    }

    /// Fault injection: every rail's poller stops progressing for `d`
    /// ([`Engine::stall`]).
    #[cfg(feature = "fault-injection")]
    pub fn stall(&mut self, d: Duration) -> Result<(), RailsError> {
        for (r, rail) in self.rails.iter_mut().enumerate() {
            rail.engine
                .stall(d)
                .map_err(|error| RailsError::Submit { rail: r, error })?;
        }
        Ok(())
    }

    /// Whether rail `rail` links to `peer` and is not left out now.
    pub fn link_up(&self, peer: PeerId, rail: usize) -> bool {
        self.peers
            .get(peer.0 as usize)
            .is_some_and(|p| p.live(rail, Instant::now()))
    }

    /// Lends `blocks` on every rail under one incarnation ([`Engine::lend`]):
    /// hand it to the readers with the block ids. Reported (in
    /// `finished_sending`, or `expired`) once every rail's lend ended.
    pub fn lend(
        &mut self,
        id: RequestId,
        blocks: &[BlockId],
        readers: u32,
        lease: Duration,
    ) -> Result<Incarnation, RailsError> {
        let token = Incarnation::draw();
        self.lend_with(id, blocks, readers, lease, token)?;
        Ok(token)
    }

    /// [`Rails::lend`] under an incarnation the caller drew
    /// ([`Engine::lend_with`]).
    pub fn lend_with(
        &mut self,
        id: RequestId,
        blocks: &[BlockId],
        readers: u32,
        lease: Duration,
        token: Incarnation,
    ) -> Result<(), RailsError> {
        if self.fold.busy(id) {
            return Err(RailsError::Duplicate(id));
        }
        let mut outstanding = 0u32;
        for (i, rail) in self.rails.iter_mut().enumerate() {
            if let Err(error) = rail.engine.lend_with(id, blocks, readers, lease, token) {
                // The rails that took it give it back; their reports are
                // taken without a report of the whole.
                for r in bits(outstanding) {
                    let _ = self.rails[r].engine.abort(id);
                }
                self.fold.begin_lend(id, token, outstanding, true);
                return Err(RailsError::Submit { rail: i, error });
            }
            outstanding |= 1 << i;
        }
        self.fold.begin_lend(id, token, outstanding, false);
        Ok(())
    }

    /// Reads `handles` (peers from [`Rails::add_peer`], incarnations from
    /// the lender's [`Rails::lend`]) under each rail engine's read
    /// deadline: striped across live links at or above
    /// [`RailsBuilder::stripe_above`] bytes, whole on the least loaded live
    /// link below. Reported once, in `finished_recving` or
    /// `failed_recving`, after every rail's part was.
    pub fn read(&mut self, id: RequestId, handles: &[Transfer<'_>]) -> Result<(), RailsError> {
        if handles.is_empty() {
            return Err(RailsError::NoHandles);
        }
        if self.fold.busy(id) {
            return Err(RailsError::Duplicate(id));
        }
        let now = Instant::now();
        let n = self.rails.len();
        let mut live = Vec::with_capacity(handles.len());
        for (h, t) in handles.iter().enumerate() {
            if t.local.len() != t.remote.len() || t.local.is_empty() {
                return Err(RailsError::Handle(SubmitError::BadPairing {
                    handle: h,
                    local: t.local.len(),
                    remote: t.remote.len(),
                }));
            }
            let peer = self
                .peers
                .get(t.peer.0 as usize)
                .filter(|p| !p.removed)
                .ok_or(RailsError::UnknownPeer {
                    handle: h,
                    peer: t.peer,
                })?;
            let mask = peer.mask(|l| l.peer.is_some());
            if mask == 0 {
                return Err(RailsError::NoLiveRail {
                    handle: h,
                    peer: t.peer,
                });
            }
            live.push(mask);
        }
        let bs = self.block_size;
        let bytes: u64 = handles.iter().map(|t| t.local.len() as u64 * bs).sum();
        // Striped over healthy links only: a failed link past its time out
        // carries one whole read at a time, its probe, until one ends well.
        let healthy: Vec<u32> = handles
            .iter()
            .map(|t| self.peers[t.peer.0 as usize].mask(|l| l.healthy().is_some()))
            .collect();
        let stripe = bytes >= self.stripe_above && healthy.iter().any(|m| m.count_ones() > 1);
        // The links (peer, rail) this read probes.
        let mut probes: Vec<(PeerId, usize)> = Vec::new();
        let mut map = vec![Vec::new(); n];
        let mut whole: Vec<Vec<Transfer<'_>>> = vec![Vec::new(); n];
        let mut parts: Vec<Vec<PartTransfer<'_>>> = vec![Vec::new(); n];
        let mut load: Vec<usize> = self.rails.iter().map(|r| r.engine.in_flight()).collect();
        let mut lenders: Vec<(PeerId, Incarnation, u32)> = Vec::new();
        for (h, t) in handles.iter().enumerate() {
            let peer = &self.peers[t.peer.0 as usize];
            let probing = probes
                .iter()
                .filter(|p| p.0 == t.peer)
                .fold(0u32, |m, p| m | 1 << p.1);
            let ready = peer.mask(|l| l.probe_ready(now).is_some()) & !probing;
            let chosen = if stripe && healthy[h].count_ones() > 1 {
                healthy[h]
            } else if ready != 0 {
                // A failed link past its time out: this read is its probe.
                let r = bits(ready).next().expect("a rail");
                probes.push((t.peer, r));
                1 << r
            } else {
                // The least loaded healthy link; with none, any (leaving a
                // link out is a preference, never a refusal).
                let pool = match healthy[h] {
                    0 => live[h],
                    m => m,
                };
                let r = (0..n)
                    .map(|k| (self.turn + k) % n)
                    .filter(|&r| pool & 1 << r != 0)
                    .min_by_key(|&r| load[r])
                    .expect("a rail the peer is on");
                load[r] += 1;
                1 << r
            };
            let k = u64::from(chosen.count_ones());
            let chunk = bs.div_ceil(k).next_multiple_of(STRIPE_ALIGN);
            let mut used = 0u32;
            for (j, r) in bits(chosen).enumerate() {
                let sub = Transfer {
                    peer: peer.on(r).expect("a rail the peer is on"),
                    ..*t
                };
                if stripe {
                    let lo = (j as u64 * chunk).min(bs);
                    let hi = (lo + chunk).min(bs);
                    if lo >= hi {
                        continue;
                    }
                    parts[r].push(sub.part(lo..hi, lo..hi));
                } else {
                    whole[r].push(sub);
                }
                map[r].push(h as u8);
                used |= 1 << r;
            }
            match lenders.iter_mut().find(|l| l.0 == t.peer && l.1 == t.lend) {
                Some(l) => l.2 |= used,
                None => lenders.push((t.peer, t.lend, used)),
            }
        }
        self.turn = (self.turn + 1) % n;
        let mut outstanding = 0u32;
        for r in 0..n {
            let engine = &mut self.rails[r].engine;
            let submitted = if stripe {
                if parts[r].is_empty() {
                    continue;
                }
                engine.read_parts(id, &parts[r], None)
            } else {
                if whole[r].is_empty() {
                    continue;
                }
                engine.read(id, &whole[r])
            };
            if let Err(error) = submitted {
                for q in bits(outstanding) {
                    let _ = self.rails[q].engine.abort(id);
                }
                self.fold
                    .begin_read(id, Read::new(outstanding, map, lenders, true));
                return Err(RailsError::Submit { rail: r, error });
            }
            outstanding |= 1 << r;
        }
        for (peer, r) in probes {
            if let Some(Some(link)) = self.peers[peer.0 as usize].links.get_mut(r) {
                link.probe = true;
            }
        }
        self.fold
            .begin_read(id, Read::new(outstanding, map, lenders, false));
        Ok(())
    }

    /// Aborts request `id` (a read or a lend) on every rail it is still in
    /// flight on; it is reported as its parts are.
    pub fn abort(&mut self, id: RequestId) -> Result<(), RailsError> {
        let mask = self
            .fold
            .outstanding(id)
            .ok_or(RailsError::UnknownRequest(id))?;
        for r in bits(mask) {
            // A part its rail already reported is not in flight there.
            let _ = self.rails[r].engine.abort(id);
        }
        Ok(())
    }

    /// Requests submitted on the rails and not yet reported.
    pub fn in_flight(&self) -> usize {
        self.fold.len()
    }

    /// Collects what the rails reported since the last poll into `out`
    /// (appended), each request once, after all of its parts were
    /// reported. Returns the number of reports added. Also adds lost peers
    /// again to their rails once [`RailsBuilder::relink_after`] passed.
    ///
    /// A peer appears in `peers_lost` when its last live link was lost;
    /// it is added again on every rail from the metadata it gave (a peer
    /// that restarted must be added again with its new metadata).
    pub fn poll(&mut self, out: &mut Outcomes) -> usize {
        let before = reports(out);
        let now = Instant::now();
        for r in 0..self.rails.len() {
            self.scratch.clear();
            if self.rails[r].engine.poll(&mut self.scratch) == 0 {
                continue;
            }
            let scratch = std::mem::take(&mut self.scratch);
            self.take(r, &scratch, out, now);
            self.scratch = scratch;
        }
        self.end_graces(now);
        self.relink(now);
        reports(out) - before
    }

    /// [`Rails::poll`], waiting up to `timeout` for something to report or
    /// a [`RailsWaker`]'s wake: blocks in the busiest rail's
    /// [`Engine::wait`] a millisecond at a time, polling every rail in
    /// between.
    pub fn wait(&mut self, out: &mut Outcomes, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let before = reports(out);
        loop {
            self.poll(out);
            let left = deadline.saturating_duration_since(Instant::now());
            // Acquire: what the waker's thread did before waking is seen.
            let woken = self.woken.swap(false, std::sync::atomic::Ordering::Acquire);
            if reports(out) > before || left.is_zero() || woken {
                return reports(out) - before;
            }
            let r = (0..self.rails.len())
                .max_by_key(|&r| self.rails[r].engine.in_flight())
                .unwrap_or(0);
            self.scratch.clear();
            if self.rails[r]
                .engine
                .wait(&mut self.scratch, left.min(Duration::from_millis(1)))
                > 0
            {
                let scratch = std::mem::take(&mut self.scratch);
                self.take(r, &scratch, out, Instant::now());
                self.scratch = scratch;
            }
        }
    }

    /// Stops every rail's engine ([`Engine::shutdown`]); poll after it for
    /// the last reports.
    pub fn shutdown(&mut self) {
        for rail in &mut self.rails {
            rail.engine.shutdown();
        }
    }

    /// Per rail: its device, poller counters, parts and links.
    pub fn stats(&self) -> Vec<RailStats> {
        let now = Instant::now();
        self.rails
            .iter()
            .enumerate()
            .map(|(r, rail)| RailStats {
                device: rail.device.clone(),
                core: rail.engine.poller_core(),
                poller: rail.engine.poller_stats(),
                parts_finished: rail.counters.parts_finished,
                parts_failed: rail.counters.parts_failed,
                links_down: rail.counters.links_down,
                relinks: rail.counters.relinks,
                links_up: self.peers.iter().filter(|p| p.live(r, now)).count(),
            })
            .collect()
    }

    /// Every rail's engine's metrics, rail `i` as poller `i` (its bytes,
    /// operations, rings; refused inputs, slots, release failures summed;
    /// handle failures and latencies are of the rails' parts), with the
    /// whole requests these rails reported, by outcome.
    pub fn metrics(&self) -> MetricsSnapshot {
        let mut m = MetricsSnapshot::default();
        for rail in &self.rails {
            m.absorb(&rail.engine.metrics());
        }
        m.requests = self.requests;
        m
    }

    /// One rail's reports, folded into the whole requests'.
    fn take(&mut self, r: usize, s: &Outcomes, out: &mut Outcomes, now: Instant) {
        for &(id, h, reason) in &s.handle_failures {
            if let Some(h) = self.fold.handle(r, id, h) {
                out.handle_failures.push((id, h, reason));
            }
        }
        for &id in &s.finished_recving {
            self.part_ended(r, id, None, &[], out, now);
        }
        for f in &s.failed_recving {
            self.part_ended(r, f.id, Some(f.reason), s.blocks_of(f), out, now);
        }
        for &id in &s.finished_sending {
            self.lend_ended(r, id, LendEnd::Finished, out);
        }
        for f in &s.failed_sending {
            self.lend_ended(r, f.id, LendEnd::Failed(f.reason), out);
        }
        for &id in &s.expired {
            self.lend_ended(r, id, LendEnd::Expired, out);
        }
        for &(peer, reason) in &s.peers_lost {
            self.link_lost(r, peer, reason, out, now);
        }
    }

    /// Rail `r` reported its part of read `id`.
    fn part_ended(
        &mut self,
        r: usize,
        id: RequestId,
        failure: Option<Reason>,
        blocks: &[BlockId],
        out: &mut Outcomes,
        now: Instant,
    ) {
        if self.fold.outstanding(id).is_none_or(|m| m & 1 << r == 0) {
            // Not a part out on that rail: a repeat, or not this façade's.
            return;
        }
        // What the part says of its links to the read's lenders: a failure
        // of the link leaves them out for a while; a part that ended well
        // makes them healthy; either ends a probe.
        let counters = &mut self.rails[r].counters;
        for &(peer, _, used) in self.fold.lenders(id) {
            if used & 1 << r == 0 {
                continue;
            }
            let Some(Some(link)) = self.peers[peer.0 as usize].links.get_mut(r) else {
                continue;
            };
            match failure {
                Some(f) if of_the_link(f.cause) => {
                    if link.strike(now, self.relink_after) {
                        counters.links_down += 1;
                    }
                }
                Some(_) => link.probe = false,
                None => {
                    link.strikes = 0;
                    link.probe = false;
                    link.down_until = None;
                }
            }
        }
        let read = match self.fold.part_ended(r, id, failure, blocks) {
            Took::Nothing => return,
            Took::Part => None,
            Took::Read(read) => Some(read),
        };
        let counters = &mut self.rails[r].counters;
        match failure {
            None => counters.parts_finished += 1,
            Some(_) => counters.parts_failed += 1,
        }
        let Some(read) = read.filter(|read| !read.withdrawn) else {
            return;
        };
        // Each lender's lend on a rail this read did not go through waits
        // for this reader's word there: give it, so its blocks go free now
        // rather than at its lease's end.
        for &(peer, lend, used) in &read.lenders {
            for (q, link) in self.peers[peer.0 as usize].links.iter().enumerate() {
                let Some(to) = link.as_ref().and_then(|l| l.peer) else {
                    continue;
                };
                if used & 1 << q == 0 {
                    let _ = self.rails[q].engine.notify_only(id, &[(to, lend)]);
                }
            }
        }
        match read.failure {
            None => {
                self.requests.finished_recving += 1;
                out.finished_recving.push(id);
            }
            Some(reason) => {
                self.requests.failed_recving += 1;
                let start = out.invalid_blocks.len();
                out.invalid_blocks.extend(read.invalid);
                out.failed_recving.push(crate::engine::FailedRecv {
                    id,
                    reason,
                    blocks: start..out.invalid_blocks.len(),
                });
            }
        }
    }

    /// Rail `r` reported its lend of `id`.
    fn lend_ended(&mut self, r: usize, id: RequestId, end: LendEnd, out: &mut Outcomes) {
        let counts = &mut self.requests;
        match self.fold.lend_ended(r, id, end) {
            None => {
                // Its readers all reported through rail `r`: the rails
                // still out end it after the grace.
                if let (LendEnd::Finished, Some((token, _))) = (end, self.fold.finished_out(id)) {
                    self.graces
                        .push_back((Instant::now() + self.sibling_grace, id, token));
                }
            }
            Some(LendReport::Finished) => {
                counts.finished_sending += 1;
                out.finished_sending.push(id);
            }
            Some(LendReport::Failed(reason)) => {
                counts.failed_sending += 1;
                out.failed_sending
                    .push(crate::engine::FailedSend { id, reason });
            }
            Some(LendReport::Expired) => {
                counts.expired += 1;
                out.expired.push(id);
            }
        }
    }

    /// Rail `r`'s engine lost `lost`: the link is down until it is added
    /// again; the peer is reported lost when no link of it is left.
    fn link_lost(
        &mut self,
        r: usize,
        lost: PeerId,
        reason: Reason,
        out: &mut Outcomes,
        now: Instant,
    ) {
        for (p, peer) in self.peers.iter_mut().enumerate() {
            let Some(Some(link)) = peer.links.get_mut(r) else {
                continue;
            };
            if link.peer != Some(lost) {
                continue;
            }
            link.peer = None;
            if link.strike(now, self.relink_after) {
                self.rails[r].counters.links_down += 1;
            }
            if peer.links.iter().flatten().all(|l| l.peer.is_none()) {
                out.peers_lost.push((PeerId(p as u32), reason));
            }
            return;
        }
    }

    /// Lends whose grace after a rail's finish passed are ended on the
    /// rails still out (reported as those rails report them).
    fn end_graces(&mut self, now: Instant) {
        while let Some(&(at, id, token)) = self.graces.front() {
            if at > now {
                break;
            }
            self.graces.pop_front();
            match self.fold.finished_out(id) {
                Some((t, mask)) if t == token => {
                    for r in bits(mask) {
                        let _ = self.rails[r].engine.abort(id);
                    }
                }
                _ => {}
            }
        }
    }

    /// Links whose time out is over are used again; a lost peer is added
    /// again to its rail first.
    fn relink(&mut self, now: Instant) {
        for peer in &mut self.peers {
            for (r, link) in peer.links.iter_mut().enumerate() {
                let Some(link) = link else {
                    continue;
                };
                if link.peer.is_some() || link.down_until.is_some_and(|t| t > now) {
                    continue;
                }
                match self.rails[r].engine.add_peer(&link.metadata) {
                    Ok(p) => {
                        // Added again: its next read is its probe.
                        link.peer = Some(p);
                        self.rails[r].counters.relinks += 1;
                    }
                    Err(e) => {
                        tracing::debug!(rail = r, error = %e, "adding a lost peer again");
                        link.down_until = Some(now + self.relink_after);
                    }
                }
            }
        }
    }
}

/// Whether a part that failed so says something of its link (rather than
/// of the lend, the caller or the engine).
fn of_the_link(cause: Cause) -> bool {
    // `Setup`: the rail's engine could not post on the link at all (its
    // endpoint to the peer could not be made, or is still closing after a
    // forced close).
    matches!(
        cause,
        Cause::Transfer | Cause::Setup | Cause::PeerLost | Cause::Deadline | Cause::PeerStalled
    )
}

/// The reports in `out` (every list but the invalid blocks).
fn reports(out: &Outcomes) -> usize {
    out.finished_recving.len()
        + out.failed_recving.len()
        + out.finished_sending.len()
        + out.failed_sending.len()
        + out.expired.len()
        + out.handle_failures.len()
        + out.peers_lost.len()
}

/// The set bits of `mask`, lowest first.
fn bits(mask: u32) -> impl Iterator<Item = usize> {
    (0..32).filter(move |i| mask & 1 << i != 0)
}

/// Each rail's metadata in a rails frame ([`Rails::local_metadata`]),
/// checked: nothing is taken from a frame that is not whole.
fn split_frame(bytes: &[u8]) -> Result<Vec<&[u8]>, RailsError> {
    let bad = RailsError::BadFrame;
    if bytes.len() < 4 {
        return Err(bad("shorter than its header"));
    }
    if bytes[0..2] != MAGIC {
        return Err(bad("not a rails frame"));
    }
    if bytes[2] != VERSION {
        return Err(bad("of an unknown version"));
    }
    let n = usize::from(bytes[3]);
    if n == 0 || n > MAX_RAILS {
        return Err(bad("rail count out of range"));
    }
    let mut rest = &bytes[4..];
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let Some((len, tail)) = rest.split_first_chunk::<4>() else {
            return Err(bad("truncated in a rail's length"));
        };
        let len = u32::from_le_bytes(*len) as usize;
        if len == 0 || len > MAX_RAIL_METADATA {
            return Err(bad("a rail's metadata length is out of range"));
        }
        if tail.len() < len {
            return Err(bad("truncated in a rail's metadata"));
        }
        out.push(&tail[..len]);
        rest = &tail[len..];
    }
    if !rest.is_empty() {
        return Err(bad("bytes after the last rail"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(rails: &[&[u8]]) -> Vec<u8> {
        let mut out = vec![b'K', b'R', VERSION, rails.len() as u8];
        for r in rails {
            out.extend_from_slice(&(r.len() as u32).to_le_bytes());
            out.extend_from_slice(r);
        }
        out
    }

    #[test]
    fn a_frame_splits_into_its_rails() {
        let f = frame(&[b"abc", b"de"]);
        assert_eq!(split_frame(&f).unwrap(), vec![&b"abc"[..], &b"de"[..]]);
    }

    #[test]
    fn every_damaged_frame_is_refused_with_why() {
        let good = frame(&[b"abc", b"de"]);
        let mut cases: Vec<(Vec<u8>, &str)> = vec![
            (good[..3].to_vec(), "header"),
            (good[..good.len() - 1].to_vec(), "truncated"),
            ([&good[..], b"x"].concat(), "after the last rail"),
            (frame(&[]), "rail count"),
            (frame(&[b""]), "length"),
        ];
        let mut magic = good.clone();
        magic[0] = b'X';
        cases.push((magic, "not a rails frame"));
        let mut version = good.clone();
        version[2] = 9;
        cases.push((version, "version"));
        let mut count = good.clone();
        count[3] = 3;
        cases.push((count, "truncated"));
        let mut huge = good.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        cases.push((huge, "length"));
        cases.push((frame(&vec![&b"a"[..]; MAX_RAILS + 1]), "rail count"));
        for (bytes, why) in cases {
            match split_frame(&bytes) {
                Err(RailsError::BadFrame(w)) => assert!(w.contains(why), "{w} for {why}"),
                other => panic!("{why}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_core_map_gives_one_rail_per_poller_bound_to_its_devices() {
        let map = crate::placement::CoreMap::parse(
            "[engine]\ncores = [0]\n\
             [[poller]]\ncore = 1\nworkers = [\"mlx5_0:1\"]\nidle = \"busy\"\n\
             [[poller]]\ncore = 2\nworkers = [\"eth1\", \"eth2\"]\nidle = \"adaptive\"\n\
             [[poller]]\ncore = 3\nworkers = [\"all\"]\nidle = \"adaptive\"\n",
            "test",
        )
        .unwrap();
        let b = RailsBuilder::from_core_map(&map, Engine::builder());
        let devices: Vec<_> = b.rails.iter().map(|r| r.0.as_deref()).collect();
        assert_eq!(devices, [Some("mlx5_0:1"), Some("eth1,eth2"), None]);
    }

    #[test]
    fn a_link_is_struck_once_per_failure_and_per_failed_probe_and_its_time_out_doubles() {
        let (now, base) = (Instant::now(), Duration::from_millis(100));
        let mut l = Link::new(PeerId(3), Vec::new());
        assert_eq!(l.healthy(), Some(PeerId(3)));
        assert!(l.strike(now, base), "it was healthy");
        assert_eq!((l.strikes, l.down_until), (1, Some(now + base)));
        // The other parts out on it when it failed count for nothing more.
        for _ in 0..5 {
            assert!(!l.strike(now, base));
        }
        assert_eq!((l.strikes, l.down_until), (1, Some(now + base)));
        assert_eq!(l.probe_ready(now), None, "within its time out");
        let later = now + base;
        assert_eq!(l.probe_ready(later), Some(PeerId(3)));
        l.probe = true;
        assert_eq!(l.probe_ready(later), None, "one probe at a time");
        assert!(
            !l.strike(later, base),
            "a failed probe is not a first failure"
        );
        assert_eq!(
            (l.strikes, l.down_until, l.probe),
            (2, Some(later + 2 * base), false)
        );
        for _ in 0..10 {
            l.probe = true;
            l.strike(later, base);
        }
        assert_eq!(l.down_until, Some(later + 32 * base), "32 times at most");
        assert_eq!(l.healthy(), None);
    }

    #[test]
    fn bits_are_listed_lowest_first() {
        assert_eq!(bits(0b1010_0001).collect::<Vec<_>>(), vec![0, 5, 7]);
        assert_eq!(bits(0).count(), 0);
    }
}
