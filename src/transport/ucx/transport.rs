//! The [`Transport`] over real UCX: one context, one worker, the registered
//! regions, and one endpoint per peer at a time; where shared memory may
//! carry messages, a second worker that probes whether the first still
//! hears ([`super::probe`]).
//!
//! Endpoint generations: the core names the endpoint it wants with an
//! [`Ep`]. A newer generation than the open one closes the open one and
//! connects afresh; an older one is refused with `CANCELED` (its endpoint
//! was force-closed: a flush or a post there must fail, not go to a new
//! connection). A force-closed connection — its endpoint *and* the remote
//! keys unpacked on it — is kept until UCX completed the close, so no rkey
//! is destroyed while an operation that uses it is outstanding.

use std::sync::atomic::AtomicU64;

use crate::ledger::{BlockId, Incarnation, PeerId};
use crate::transport::peer::{BlockLayout, PeerMetadata, RegionDescriptor};
use crate::transport::BlockBytes;
use crate::transport::{
    lend_word_of, Direction, Ep, LendWords, PostFailure, Transport, TransportEvent, CANCELED,
    INVALID_PARAM, IO_ERROR, NOT_LENT, NO_RESOURCE, UNSUPPORTED,
};
use crate::transport::{T_TRANSPORT, T_WORD};

use super::direct;
use super::memory::HugePages;
use super::probe::{Hearing, Step};
use super::returns::{self, Returns, RETURN_AM_ID};
use super::soft::{self, Piece, Request, PIECE, PIECE_AM_ID, REQUEST_AM_ID};
use super::{
    BlockOp, Completion, Context, ContextOptions, Endpoint, EndpointFailure, MemoryRegion,
    PackedRkey, RemoteKey, UcxError, UcxStatus, Worker, WorkerAddress,
};
use crate::ledger::Nanos;

/// The active-message id kvpoll's notifications travel on.
pub const NOTIFY_AM_ID: u16 = 0x6b76;
/// The active-message id of the probes a worker sends itself from its
/// probe worker (8 bytes: the probe's number).
const PROBE_AM_ID: u16 = 0x6b77;

/// Token bits of a soft read's request send (with [`T_TRANSPORT`]; the
/// slot above bit 32, the sequence below bit 30).
const T_SOFT_REQUEST: u64 = 1 << 63;
/// Token bit of sends whose completion nothing waits for: the pieces a
/// lender sends to answer soft reads, and return-path announcements.
const T_SOFT_PIECE: u64 = 1 << 62;

/// Lend words an engine announces: 1 MiB of UCX-allocated shared memory,
/// so that a reader on the same host reads them one-sidedly. With
/// thousands of lends live, a few per cent collide and their readers ask.
const LEND_WORDS: usize = 1 << 17;
/// Word reads in flight at most (landing cells); past it, readers ask.
const WORD_CELLS: usize = 4096;

/// The lend words' memory: UCX-allocated, zeroed when the last
/// [`LendWords`] over it goes, before it is unmapped (a reader that still
/// maps it must not find an incarnation there).
struct WordRegion(MemoryRegion);

impl Drop for WordRegion {
    fn drop(&mut self) {
        let base = self.0.as_ptr() as *const AtomicU64;
        for i in 0..self.0.len() / 8 {
            // SAFETY: inside the region, 8-aligned (UCX allocations are page
            // aligned), which is still mapped; every other user is gone.
            unsafe { (*base.add(i)).store(0, std::sync::atomic::Ordering::SeqCst) };
        }
    }
}

/// A live connection. Field order is drop order: the rkeys go before the
/// endpoint they were unpacked on.
struct Conn {
    rkeys: Vec<RemoteKey>,
    /// The peer's lend words, if it announced them.
    words: Option<RemoteKey>,
    /// A word read on this connection did not complete by the end of the
    /// first progress after it was posted: it is not one-sided here (tcp:
    /// UCX serves it from the peer's progress, behind the data of other
    /// reads on its RMA lane), and reads ask instead. (Shared memory
    /// completes a word's get when it is posted on UCX 1.13, and in the
    /// next progress on 1.22.) The connection's first word read is not
    /// judged: it may wait for the endpoint's wire-up, which a read that
    /// moved its data directly ([`super::direct`]) did not wait for.
    words_slow: std::cell::Cell<bool>,
    /// A word read on this connection completed (the next ones are judged).
    words_read: std::cell::Cell<bool>,
    /// Gets on this connection are soft reads ([`super::soft`]): UCX would
    /// emulate them over tcp in a way that can abort the lender.
    soft: bool,
    /// Direct reads of the peer ([`super::direct`]), where it offered them
    /// and runs on this host.
    direct: Option<direct::Peer>,
    /// A direct read found the peer gone: the connection failed (as UCX
    /// fails an endpoint whose `cma` transfer found its peer dead), and
    /// later direct reads on it fail at once.
    direct_lost: std::cell::Cell<bool>,
    /// Where UCX mapped each of the peer's regions into this process, by
    /// region index (`None`: not mapped, or mapped reads are off): gets of
    /// them are copies from the poller ([`ContextOptions::mapped_reads`]).
    mapped: Vec<Option<*const u8>>,
    /// Where UCX mapped the peer's lend words, likewise: a word read is a
    /// load.
    words_mapped: Option<*const AtomicU64>,
    /// This engine's return key and this connection's announcement of it
    /// (`None`: its address does not fit one message, and the peer answers
    /// it on UCX's reply endpoints).
    return_path: Option<(u64, Vec<u8>)>,
    /// The announcement went out ([`Conn::return_key`]).
    announced: std::cell::Cell<bool>,
    ep: Endpoint,
    /// The endpoint's id ([`Ep::to_u64`]), which its soft reads carry.
    id: u64,
    generation: u32,
}

impl Conn {
    /// The return key this connection's messages that want an answer
    /// carry, its announcement sent first if it has not gone out yet
    /// (`super::returns`). `None`: it could not be announced, and the peer
    /// answers on UCX's reply endpoint.
    fn return_key(&self) -> Option<u64> {
        let (key, said) = self.return_path.as_ref()?;
        if !self.announced.get() {
            // Nothing waits for its completion (`T_SOFT_PIECE`).
            let token = T_TRANSPORT | T_SOFT_PIECE;
            if let Err(e) = self.ep.send_active_message(RETURN_AM_ID, said, token) {
                tracing::debug!(error = %e, "return path not announced");
                return None;
            }
            self.announced.set(true);
        }
        Some(*key)
    }
}

/// Where the answer to reply handle `to` goes (`super::returns`): on this
/// engine's own endpoint to the sender (`Some`) where the sender announced
/// a return path, on UCX's reply endpoint (`None`) where it announced none,
/// or nowhere (`Err`) where it announced one that cannot be opened (the
/// sender is gone: UCX may already have destroyed its reply endpoint, so
/// that is no fallback).
fn answer_on<'a>(
    worker: &Worker,
    returns: &'a mut Returns,
    to: u32,
) -> Result<Option<&'a Endpoint>, ()> {
    match worker.reply_key(to) {
        Some(key) => returns.endpoint(worker, key).map(Some).ok_or(()),
        None => Ok(None),
    }
}

/// The probe worker and its endpoint to this transport's worker, made as
/// a peer's endpoint is (field order is drop order: the endpoint first).
struct Probe {
    ep: Endpoint,
    worker: Worker,
    hearing: Hearing,
    /// The probe worker's completions, dropped.
    done: Vec<Completion>,
}

impl Probe {
    fn new(context: &Context, to: &Worker) -> Result<Self, UcxError> {
        let worker = Worker::new(context)?;
        let ep = Endpoint::connect(&worker, &to.address()?, u64::MAX)?;
        Ok(Probe {
            ep,
            worker,
            hearing: Hearing::default(),
            done: Vec::with_capacity(4),
        })
    }

    /// Progresses the probe worker (its send, its wire-up), dropping what
    /// completed.
    fn progress(&mut self) {
        self.worker.progress();
        self.worker.take_completions(&mut self.done);
        self.done.clear();
    }
}

struct Peer {
    meta: PeerMetadata,
    conn: Option<Conn>,
    /// The newest generation seen: older ones are closed.
    newest: u32,
}

/// The UCX transport. Single-threaded: it lives on the poller thread.
pub struct UcxTransport {
    // Drop order: the probe, connections (live, then closing), regions,
    // worker, context.
    /// `None` where no shared-memory transport may carry messages.
    probe: Option<Probe>,
    peers: Vec<Option<Peer>>,
    /// Force-closed connections waiting for their close to complete, by
    /// close token.
    closing: Vec<(u64, Conn)>,
    /// The endpoints this engine answers its askers on ([`super::returns`]).
    returns: Returns,
    /// This engine's return key and its worker's address, which each
    /// connection announces ([`Conn::return_key`]).
    return_path: (u64, WorkerAddress),
    /// The serial of the last connection opened (each announces its own).
    conn_serial: u32,
    regions: Vec<MemoryRegion>,
    /// Each region's (base, length), which soft-read requests are checked
    /// against without walking the regions on the poller's path.
    spans: Vec<(usize, usize)>,
    /// Whether a region is device memory: soft reads copy with the CPU,
    /// so they neither land in nor answer from one.
    device_regions: bool,
    region_rkeys: Vec<PackedRkey>,
    region_blocks: u64,
    block_size: u64,
    worker: Worker,
    context: Context,
    completions: Vec<Completion>,
    failures: Vec<EndpointFailure>,
    ops: Vec<BlockOp>,
    close_seq: u64,
    /// The worker's event fd (`None` without `UCP_FEATURE_WAKEUP`).
    event_fd: Option<std::os::fd::RawFd>,
    /// This engine's lend words (the core writes them) and their rkey.
    words: Option<(LendWords, PackedRkey)>,
    /// Where word reads land (registered, 8 bytes a cell), the free cells,
    /// and the reads in flight (token, cell, connection, the progress
    /// count when it was posted).
    cells: MemoryRegion,
    free_cells: Vec<u32>,
    word_reads: Vec<(u64, u32, Ep, u64)>,
    /// Progress calls so far.
    progresses: u64,
    /// What registered device memory needs until the context is gone.
    owners: Vec<Box<dyn std::any::Any>>,
    /// Read requests received in this drain (their reply handles: taken
    /// once answered), served as the messages were taken or once the core
    /// decided ([`Transport::serve_read`]).
    requests: Vec<(Request, Option<u32>)>,
    /// The lend of the handle being posted ([`Transport::post_lent`]):
    /// what its soft reads name.
    post_lend: Incarnation,
    /// This engine's side of direct reads and of the liveness check of
    /// peers on this host (`None`: no peer on this host is possible, or
    /// `/proc` does not tell the host), the ids of its regions it offers,
    /// and what its direct reads left for the next drain.
    direct: Option<direct::Local>,
    /// Whether this engine reads peers' offered regions directly (its
    /// transport list may use `cma`, direct reads on): without it, a
    /// peer's offer only serves the liveness check.
    reads_directly: bool,
    /// When the peers on this host were last checked alive
    /// ([`ALIVE_EVERY`]).
    alive_at: Option<Nanos>,
    /// Gets of a peer's regions UCX mapped here are copies
    /// ([`ContextOptions::mapped_reads`]).
    mapped_reads: bool,
    direct_regions: Vec<u32>,
    direct_out: DirectOut,
}

/// What direct reads made since the last drain — their completions and
/// the connections they found failed — and the scratch lists of their
/// system calls (kept for their capacity).
#[derive(Default)]
struct DirectOut {
    /// Direct reads posted and not read yet, in post order: one system
    /// call reads a run of them from one connection
    /// ([`UcxTransport::read_directly`]).
    pending: Vec<PendingRead>,
    /// Their operations, each read's a range.
    pending_ops: Vec<direct::Op>,
    done: Vec<Completion>,
    /// Lend words loaded from a mapping: (token, word).
    words: Vec<(u64, u64)>,
    lost: Vec<EndpointFailure>,
    iov: (Vec<libc::iovec>, Vec<libc::iovec>),
}

/// A post's direct reads of one region, waiting for the connection's
/// next system call.
struct PendingRead {
    peer: PeerId,
    /// The connection's id ([`Ep::to_u64`]) when it was posted.
    conn: u64,
    token: u64,
    ops: std::ops::Range<usize>,
    /// Bytes its operations read.
    bytes: usize,
}

/// Caller memory to register: host memory at an address, or CUDA device
/// memory at a device address (registered as `UCS_MEMORY_TYPE_CUDA`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UserMemory {
    /// Host memory.
    Host(usize),
    /// CUDA device memory.
    Cuda(u64),
}

impl UcxTransport {
    /// The metadata peer `peer` was added with, if it is known.
    pub fn peer_metadata(&self, peer: PeerId) -> Option<&PeerMetadata> {
        self.peers
            .get(peer.0 as usize)
            .and_then(|p| p.as_ref())
            .map(|p| &p.meta)
    }

    /// A context and worker with `options`, listening for notifications,
    /// whose regions peers may write into.
    pub fn new(options: &ContextOptions, block_size: u64) -> Result<Self, UcxError> {
        Self::with_remote_write(options, block_size, true)
    }

    /// [`UcxTransport::new`]; `remote_write`: whether peers may write into
    /// its regions ([`Context::allows_remote_write`]).
    pub(crate) fn with_remote_write(
        options: &ContextOptions,
        block_size: u64,
        remote_write: bool,
    ) -> Result<Self, UcxError> {
        let context = Context::open(options, remote_write)?;
        let worker = Worker::new(&context)?;
        worker.listen_active_messages(NOTIFY_AM_ID)?;
        // Both sides of soft reads, whatever this UCX: a reader on an older
        // one may ask.
        worker.listen_active_messages(REQUEST_AM_ID)?;
        worker.listen_pieces(PIECE_AM_ID)?;
        worker.listen_active_messages(RETURN_AM_ID)?;
        let key = direct::random_word().max(1);
        let return_path = (key, worker.address()?);
        let event_fd = worker.event_fd();
        let words = Self::allocate_words(&context)?;
        let cells = MemoryRegion::allocate(&context, WORD_CELLS * 8)?;
        let probe = if options.may_use_shared_memory() {
            worker.listen_active_messages(PROBE_AM_ID)?;
            match Probe::new(&context, &worker) {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::warn!(error = %e, "no deafness probe: a stopped receive queue goes unnoticed");
                    None
                }
            }
        } else {
            None
        };
        Ok(UcxTransport {
            probe,
            peers: Vec::new(),
            closing: Vec::new(),
            returns: Returns::default(),
            return_path,
            conn_serial: 0,
            regions: Vec::new(),
            spans: Vec::new(),
            device_regions: false,
            region_rkeys: Vec::new(),
            region_blocks: 0,
            block_size,
            worker,
            context,
            completions: Vec::with_capacity(4096),
            failures: Vec::with_capacity(16),
            ops: Vec::with_capacity(1024),
            close_seq: 0,
            event_fd,
            words,
            cells,
            free_cells: (0..WORD_CELLS as u32).rev().collect(),
            word_reads: Vec::with_capacity(WORD_CELLS),
            progresses: 0,
            owners: Vec::new(),
            requests: Vec::with_capacity(64),
            post_lend: Incarnation::NONE,
            direct: (options.reads_directly() || options.may_use_shared_memory())
                .then(direct::Local::new)
                .flatten(),
            reads_directly: options.reads_directly(),
            alive_at: None,
            mapped_reads: options.mapped_reads,
            direct_regions: Vec::new(),
            direct_out: DirectOut {
                pending: Vec::with_capacity(64),
                pending_ops: Vec::with_capacity(1024),
                done: Vec::with_capacity(1024),
                words: Vec::with_capacity(64),
                lost: Vec::new(),
                iov: (Vec::with_capacity(1024), Vec::with_capacity(1024)),
            },
        })
    }

    /// The lend words: UCX-allocated (so one-sided over shared memory),
    /// zeroed. `None` when UCX cannot allocate them (readers then ask).
    fn allocate_words(context: &Context) -> Result<Option<(LendWords, PackedRkey)>, UcxError> {
        let region = match MemoryRegion::allocate(context, LEND_WORDS * 8) {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, "no lend words: readers will ask");
                return Ok(None);
            }
        };
        let rkey = region.pack_rkey()?;
        let base = region.as_ptr() as *mut u64;
        let len = (region.len() / 8).min(LEND_WORDS);
        if len != LEND_WORDS || base as usize % 8 != 0 {
            return Ok(None);
        }
        let owner: std::rc::Rc<dyn std::any::Any> = std::rc::Rc::new(WordRegion(region));
        // SAFETY: the region is `len` words long, aligned (checked), mapped
        // until `owner` drops, and this process touches it only through
        // these words.
        let words = unsafe { LendWords::new(base, len, owner) };
        words.clear_all();
        Ok(Some((words, rkey)))
    }

    /// How many of `peer`'s regions its open connection reads by copying
    /// from UCX's mapping of them here ([`ContextOptions::mapped_reads`]),
    /// and whether it loads the peer's lend words so; `(0, false)` before
    /// the connection is made (at the first operation on it).
    pub fn mapped_reads_of(&self, peer: PeerId) -> (usize, bool) {
        let conn = self
            .peers
            .get(peer.0 as usize)
            .and_then(|p| p.as_ref())
            .and_then(|p| p.conn.as_ref());
        conn.map_or((0, false), |c| {
            (
                c.mapped.iter().filter(|m| m.is_some()).count(),
                c.words_mapped.is_some(),
            )
        })
    }

    /// Registers a region of `blocks` blocks: UCX-allocated memory, or the
    /// caller's at `user` (`len` bytes). Returns its base and length.
    ///
    /// # Safety
    /// With `user`, the range must stay valid, writable and in place for the
    /// transport's lifetime; device memory must be valid in the CUDA
    /// context current on this thread.
    pub unsafe fn register(
        &mut self,
        blocks: u64,
        len: usize,
        user: Option<UserMemory>,
    ) -> Result<(usize, usize), UcxError> {
        let region = match user {
            // SAFETY: the caller's promise, passed on.
            Some(UserMemory::Host(base)) => unsafe {
                MemoryRegion::map(&self.context, base as *mut u8, len)?
            },
            // SAFETY: the caller's promise (device memory, its context
            // current here), passed on.
            Some(UserMemory::Cuda(base)) => unsafe {
                MemoryRegion::map_device(&self.context, base, len)?
            },
            // Where cma carries one-sided operations, pages it pins fast
            // beat UCX's shared-memory segments, which nothing maps then.
            None if self.context.reads_by_cma() => {
                let pages = HugePages::map(len).map_err(|e| UcxError::Allocate {
                    len,
                    why: e.to_string(),
                })?;
                // SAFETY: the mapping is kept in `owners`, which drop after
                // the regions.
                let region = unsafe { MemoryRegion::map(&self.context, pages.as_ptr(), len)? };
                self.owners.push(Box::new(pages));
                region
            }
            None => MemoryRegion::allocate(&self.context, len)?,
        };
        let rkey = region.pack_rkey()?;
        let out = (region.as_ptr() as usize, region.len());
        // Host memory UCX did not allocate is offered to direct readers
        // (UCX reads its own shared-memory segments with a plain copy).
        let not_ucx_shm = matches!(user, Some(UserMemory::Host(_)))
            || user.is_none() && self.context.reads_by_cma();
        if not_ucx_shm {
            self.direct_regions.push(self.regions.len() as u32);
        }
        self.region_blocks = blocks;
        self.device_regions |= matches!(user, Some(UserMemory::Cuda(_)));
        self.spans.push(out);
        self.regions.push(region);
        self.region_rkeys.push(rkey);
        Ok(out)
    }

    /// Whether this transport's UCX can register and move CUDA memory.
    pub fn supports_cuda(&self) -> Result<bool, UcxError> {
        self.context.supports_cuda()
    }

    /// Keeps `owner` (what device memory needs while registered: its CUDA
    /// context) until the regions, worker and context are gone.
    pub fn keep_until_drop(&mut self, owner: Box<dyn std::any::Any>) {
        self.owners.push(owner);
    }

    /// Regions registered.
    pub fn regions(&self) -> usize {
        self.regions.len()
    }

    /// This engine's metadata for its peers, encoded (untagged).
    pub fn metadata(&self, instance: u64) -> Result<Vec<u8>, UcxError> {
        Ok(self.describe(instance)?.encode())
    }

    /// This engine's metadata for its peers.
    pub fn describe(&self, instance: u64) -> Result<PeerMetadata, UcxError> {
        let meta = PeerMetadata {
            instance,
            layout: BlockLayout {
                block_size: self.block_size,
            },
            worker: self.worker.address()?,
            regions: self
                .region_rkeys
                .iter()
                .enumerate()
                .map(|(i, rkey)| RegionDescriptor {
                    id: i as u32,
                    blocks: self.region_blocks,
                    rkey: rkey.clone(),
                })
                .collect(),
            words: self.words.as_ref().map(|(_, k)| k.clone()),
            // Announced with no region too: a peer on this host then
            // checks that this process lives (`check_alive`).
            direct: self
                .direct
                .as_ref()
                .filter(|_| !self.device_regions)
                .map(|d| {
                    let offered = if self.reads_directly {
                        self.direct_regions.clone()
                    } else {
                        Vec::new()
                    };
                    d.announce(offered)
                }),
        };
        Ok(meta)
    }

    /// The open connection for `ep`, connecting if `ep` is newer than what
    /// is open. `Err` with a status: `CANCELED` for a closed generation, or
    /// why connecting failed.
    fn conn(&mut self, ep: Ep) -> Result<&Conn, i8> {
        self.connect(ep)?;
        self.open(ep).ok_or(INVALID_PARAM)
    }

    /// The open connection of generation `ep`, if there is one.
    fn open(&self, ep: Ep) -> Option<&Conn> {
        let p = self.peers.get(ep.peer.0 as usize)?.as_ref()?;
        p.conn
            .as_ref()
            .filter(|c| c.generation == ep.generation && !c.ep.is_closed())
    }

    fn connect(&mut self, ep: Ep) -> Result<(), i8> {
        let Some(Some(p)) = self.peers.get_mut(ep.peer.0 as usize) else {
            return Err(INVALID_PARAM);
        };
        if ep.generation < p.newest {
            return Err(CANCELED);
        }
        let stale = match &p.conn {
            Some(c) => c.generation != ep.generation || c.ep.is_closed(),
            None => true,
        };
        if stale {
            if let Some(c) = &p.conn {
                if c.generation == ep.generation {
                    // This generation's endpoint was closed under us (it
                    // failed): it stays closed.
                    return Err(CANCELED);
                }
            }
            if let Some(old) = p.conn.take() {
                if !old.ep.is_closed() {
                    self.close_seq += 1;
                    let token = T_TRANSPORT | self.close_seq;
                    let _ = old.ep.force_close(token);
                    self.closing.push((token, old));
                }
            }
            p.newest = ep.generation;
            let ep_conn = Endpoint::connect(&self.worker, &p.meta.worker, ep.to_u64())
                .map_err(|e| status_of(&e))?;
            let mut rkeys = Vec::with_capacity(p.meta.regions.len());
            for r in &p.meta.regions {
                rkeys.push(RemoteKey::unpack(&ep_conn, &r.rkey).map_err(|e| status_of(&e))?);
            }
            let words = match &p.meta.words {
                Some(k) => Some(RemoteKey::unpack(&ep_conn, k).map_err(|e| status_of(&e))?),
                None => None,
            };
            // Where UCX mapped each key's memory here (the regions', then
            // the words'), and the length the peer claims for it. A mapped
            // key must lie in the segment UCX mapped: UCX's own gets and
            // puts and kvpoll's mapped reads copy at base + offset without
            // a bound, and the length is the peer's word (`super::maps`).
            let at: Vec<(Option<*mut u8>, u64)> = rkeys
                .iter()
                .chain(&words)
                .map(|k| (k.mapped(), k.remote_len()))
                .collect();
            if let Some(region) = claimed_past_segment(&at) {
                tracing::warn!(
                    peer = ep.peer.0,
                    region,
                    "the peer's metadata claims more than the shared memory it packed: refused"
                );
                return Err(INVALID_PARAM);
            }
            // UCX's emulated get over tcp can abort the lender when its
            // reader dies, on every release kvpoll supports (`super::soft`).
            // Device memory keeps UCX's gets (soft reads copy with the CPU).
            let soft = !self.device_regions && soft::gets_ride_tcp_messages(&ep_conn.describe());
            if soft {
                tracing::debug!(
                    peer = ep.peer.0,
                    "gets over tcp are soft reads: the lender answers with sends of its own"
                );
            }
            // Device memory here: direct reads land with the CPU, so no.
            let direct = match (&self.direct, &p.meta.direct) {
                (Some(ours), Some(theirs)) if !self.device_regions => {
                    let ids: Vec<u32> = p.meta.regions.iter().map(|r| r.id).collect();
                    let spans: Vec<(u64, u64)> =
                        p.meta.regions.iter().map(|r| r.rkey.span()).collect();
                    let mut d = direct::Peer::connect(&ours.host, theirs, &ids, &spans);
                    if !self.reads_directly {
                        // Its regions go through UCX; its process is still
                        // checked.
                        for r in d.iter_mut().flat_map(|d| d.regions.iter_mut()) {
                            *r = None;
                        }
                    }
                    d
                }
                _ => None,
            };
            if direct
                .as_ref()
                .is_some_and(|d| d.regions.iter().any(Option::is_some))
            {
                tracing::debug!(
                    peer = ep.peer.0,
                    "the peer runs on this host: its offered regions are read with process_vm_readv"
                );
            }
            // Device memory here: a copy lands with the CPU, so no. Over
            // tcp UCX maps nothing.
            let may_map = self.mapped_reads && !self.device_regions && !soft;
            let mapped: Vec<Option<*const u8>> = at[..rkeys.len()]
                .iter()
                .map(|&(p, _)| p.filter(|_| may_map).map(|p| p as *const u8))
                .collect();
            // Words are loaded only where no read of the connection goes
            // through UCX: every region mapped or read directly. Beside
            // UCX's own gets (UCX 1.22's `cma` lane, direct reads off), a
            // reader whose words were loaded aborted in UCX when its
            // worker was destroyed after a force-close (`arbiter.c:36`,
            // the discarded `cma` endpoint's flush never ran); with its
            // words got through UCX it did not.
            let bypassed = mapped.iter().enumerate().all(|(i, m)| {
                m.is_some()
                    || direct
                        .as_ref()
                        .is_some_and(|d| d.regions.get(i).is_some_and(|r| r.is_some()))
            });
            let words_mapped = at
                .get(rkeys.len())
                .and_then(|&(p, _)| p)
                .filter(|p| {
                    may_map && bypassed && (*p as usize) % std::mem::align_of::<AtomicU64>() == 0
                })
                .map(|p| p as *const AtomicU64);
            if mapped.iter().any(|m| m.is_some()) {
                tracing::debug!(
                    peer = ep.peer.0,
                    "UCX mapped the peer's shared memory here: its gets are copies from the poller"
                );
            }
            self.conn_serial = self.conn_serial.wrapping_add(1);
            let (key, address) = &self.return_path;
            let return_path =
                returns::announcement(*key, self.conn_serial, address).map(|a| (*key, a));
            p.conn = Some(Conn {
                rkeys,
                words,
                words_slow: std::cell::Cell::new(false),
                words_read: std::cell::Cell::new(false),
                soft,
                direct,
                direct_lost: std::cell::Cell::new(false),
                mapped,
                words_mapped,
                return_path,
                announced: std::cell::Cell::new(false),
                ep: ep_conn,
                id: ep.to_u64(),
                generation: ep.generation,
            });
            // A soft connection's reads are answered on the lender's return
            // endpoint: announced as it opens, so that that endpoint pairs
            // with it (`super::returns`). Others announce before their
            // first message that wants an answer: announcing as a
            // shared-memory connection opens held its gets back until the
            // peer progressed (`tests/ucx_transport.rs`).
            if let Some(c) = p.conn.as_ref().filter(|c| c.soft) {
                c.return_key();
            }
        }
        Ok(())
    }

    /// Force-closes the open connection of `peer` if it is of generation
    /// `generation` (or any, with `None`), keeping it until the close
    /// completed.
    fn close_conn(&mut self, peer: PeerId, generation: Option<u32>) {
        self.close_conn_as(peer, generation, false);
    }

    /// [`UcxTransport::close_conn`], gracefully with `flush` (see
    /// [`Endpoint::flush_close`]).
    fn close_conn_as(&mut self, peer: PeerId, generation: Option<u32>, flush: bool) {
        let Some(Some(p)) = self.peers.get_mut(peer.0 as usize) else {
            return;
        };
        if let Some(g) = generation {
            p.newest = p.newest.max(g.wrapping_add(1));
        }
        let matches = p
            .conn
            .as_ref()
            .is_some_and(|c| generation.is_none_or(|g| c.generation == g));
        if !matches {
            return;
        }
        if let Some(c) = p.conn.take() {
            if c.ep.is_closed() {
                return;
            }
            self.close_seq += 1;
            let token = T_TRANSPORT | self.close_seq;
            let _ = if flush {
                c.ep.flush_close(token)
            } else {
                c.ep.force_close(token)
            };
            self.closing.push((token, c));
        }
    }
}

impl UcxTransport {
    /// Posts `part` of each block pair, remote blocks `remote_bs` bytes.
    fn post_ops(
        &mut self,
        ep: Ep,
        dir: Direction,
        pairs: &[(BlockId, BlockId)],
        token: u64,
        remote_bs: u64,
        part: BlockBytes,
    ) -> Result<u32, PostFailure> {
        let bs = self.block_size;
        let mut ops = std::mem::take(&mut self.ops);
        let mut out = std::mem::take(&mut self.direct_out);
        let connected = self.connect(ep);
        let result = match connected.and_then(|()| self.open(ep).ok_or(INVALID_PARAM)) {
            Err(status) => Err(PostFailure { posted: 0, status }),
            Ok(conn) => {
                let mut posted = 0u32;
                let mut failure = None;
                // Whole blocks of the same size on both sides: a run of
                // pairs consecutive on both sides is one operation (one
                // `process_vm_readv` over cma, one get request over tcp).
                let whole = part.local_offset == 0
                    && part.remote_offset == 0
                    && part.len == bs
                    && remote_bs == bs;
                for (i, (region, rkey)) in self.regions.iter().zip(&conn.rkeys).enumerate() {
                    ops.clear();
                    let mut last: Option<(BlockId, BlockId)> = None;
                    for &(l, r) in pairs {
                        let follows = last.is_some_and(|(pl, pr)| {
                            pl.0.checked_add(1) == Some(l.0) && pr.0.checked_add(1) == Some(r.0)
                        });
                        last = Some((l, r));
                        if whole && follows {
                            if let Some(op) = ops.last_mut() {
                                op.len += part.len as usize;
                                continue;
                            }
                        }
                        ops.push(BlockOp {
                            local_offset: u64::from(l.0) * bs + part.local_offset,
                            remote_offset: u64::from(r.0) * remote_bs + part.remote_offset,
                            len: part.len as usize,
                            token,
                        });
                    }
                    // Device memory here: direct reads land with the CPU.
                    let direct = conn.direct.as_ref().filter(|d| {
                        dir == Direction::Get
                            && !self.device_regions
                            && d.regions.get(i).is_some_and(|r| r.is_some())
                    });
                    if let Some(d) = direct {
                        // Read at a progress, after the connection's
                        // other direct reads posted before it (one system
                        // call for those a progress reads); a completion
                        // a run, as UCX's path counts them. Bytes outside
                        // either region are refused now, before any is
                        // read.
                        if conn.direct_lost.get() {
                            let c = Completion {
                                token,
                                status: UcxStatus(CONNECTION_RESET),
                            };
                            out.done.extend(std::iter::repeat_n(c, ops.len()));
                        } else {
                            let start = out.pending_ops.len();
                            if let Err(status) =
                                direct_ops(d, i, region, &ops, &mut out.pending_ops)
                            {
                                out.pending_ops.truncate(start);
                                failure = Some(status);
                                break;
                            }
                            out.pending.push(PendingRead {
                                peer: ep.peer,
                                conn: conn.id,
                                token,
                                ops: start..out.pending_ops.len(),
                                bytes: ops.iter().map(|o| o.len).sum(),
                            });
                        }
                        posted += ops.len() as u32;
                        continue;
                    }
                    let mapped = conn.mapped.get(i).copied().flatten();
                    if let Some(src) =
                        mapped.filter(|_| dir == Direction::Get && !self.device_regions)
                    {
                        // Copied now, done when this returns; a completion
                        // a run, as UCX's path counts them. Bytes outside
                        // either region are refused before any is copied.
                        match copy_mapped(src, rkey.remote_len(), region, &ops) {
                            Ok(()) => {
                                let c = Completion {
                                    token,
                                    status: UcxStatus(0),
                                };
                                out.done.extend(std::iter::repeat_n(c, ops.len()));
                                posted += ops.len() as u32;
                                continue;
                            }
                            Err(status) => {
                                failure = Some(status);
                                break;
                            }
                        }
                    }
                    let soft_get = dir == Direction::Get && conn.soft;
                    if !soft_get && !self.context.has_rma() {
                        // Its engine refuses writes; device memory over
                        // tcp would need UCX's gets (`UNSUPPORTED`).
                        failure = Some(UNSUPPORTED);
                        break;
                    }
                    let res = match dir {
                        Direction::Get if conn.soft => {
                            let lend = self.post_lend;
                            soft_get_batch(&self.worker, conn, region, &self.regions, &ops, lend)
                        }
                        Direction::Get => conn.ep.get_batch(region, rkey, &ops),
                        Direction::Put => conn.ep.put_batch(region, rkey, &ops),
                    };
                    match res {
                        Ok(()) => posted += ops.len() as u32,
                        Err(e) => {
                            posted += e.posted as u32;
                            failure = Some(status_of(&e.error));
                            break;
                        }
                    }
                }
                match failure {
                    None => Ok(posted),
                    Some(status) => Err(PostFailure { posted, status }),
                }
            }
        };
        self.ops = ops;
        self.direct_out = out;
        result
    }
}

/// The index of the first key in `keys` (where UCX mapped its memory
/// here, and the length its peer claims) whose claimed length runs past
/// the mapping UCX made, or `None` when every mapped key lies inside its
/// segment (or none is mapped: `/proc/self/maps` is read only then; a
/// process that cannot read it trusts the lengths, as UCX does).
fn claimed_past_segment(keys: &[(Option<*mut u8>, u64)]) -> Option<usize> {
    let mut maps = None;
    for (i, &(at, len)) in keys.iter().enumerate() {
        let Some(at) = at else { continue };
        let maps = maps.get_or_insert_with(|| {
            super::maps::Maps::read()
                .map_err(|e| {
                    tracing::warn!(error = %e, "/proc/self/maps unreadable: peers' region lengths are not checked against their segments")
                })
                .ok()
        });
        let Some(maps) = maps else { return None };
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if !maps.covers(at as usize, len) {
            return Some(i);
        }
    }
    None
}

/// Copies `ops` from a peer's region that UCX mapped here at `src`
/// (`len` bytes) into `local`, or `Err(INVALID_PARAM)`, with nothing
/// copied, for bytes outside either region.
fn copy_mapped(src: *const u8, len: u64, local: &MemoryRegion, ops: &[BlockOp]) -> Result<(), i8> {
    let inside = |op: &BlockOp| {
        op.remote_offset
            .checked_add(op.len as u64)
            .is_some_and(|end| end <= len)
            && local.range_ptr(op.local_offset, op.len).is_ok()
    };
    if !ops.iter().all(inside) {
        return Err(INVALID_PARAM);
    }
    for op in ops {
        let Ok(dest) = local.range_ptr(op.local_offset, op.len) else {
            return Err(INVALID_PARAM);
        };
        // SAFETY: `dest..+len` lies in this engine's region, which the
        // core keeps for the read; `src + remote_offset..+len` lies in the
        // peer's region as UCX mapped it here (checked above against its
        // length, whose two ends `RemoteKey::mapped` found mapped), which
        // stays mapped while the connection's key lives. `copy`, not
        // `copy_nonoverlapping`: an engine that is its own peer maps its
        // own segment, and a read may name the block it lands in.
        unsafe {
            std::ptr::copy(src.add(op.remote_offset as usize), dest, op.len);
        }
    }
    Ok(())
}

/// Appends `ops` of region `i`, read from `d`'s peer into `local`, to
/// `dops`, or `Err(INVALID_PARAM)` for bytes outside either region (as UCX
/// refuses such a get when it is posted).
fn direct_ops(
    d: &direct::Peer,
    i: usize,
    local: &MemoryRegion,
    ops: &[BlockOp],
    dops: &mut Vec<direct::Op>,
) -> Result<(), i8> {
    for op in ops {
        let (Ok(dest), Some(remote)) = (
            local.range_ptr(op.local_offset, op.len),
            d.remote(i, op.remote_offset, op.len),
        ) else {
            return Err(INVALID_PARAM);
        };
        dops.push(direct::Op {
            local: dest,
            remote,
            len: op.len,
        });
    }
    Ok(())
}

impl UcxTransport {
    /// Reads the direct reads posted and not read yet, in post order, until
    /// `budget` bytes were read (a call at least): each run of them on one
    /// connection with one `process_vm_readv` (a call per 1 023 runs, each
    /// ending with the probe word), and completes them: `0`,
    /// `CONNECTION_RESET` where the call found the peer gone (the
    /// connection fails, once), `IO_ERROR` where it failed for itself;
    /// `CANCELED` for reads whose connection closed since they were posted.
    /// What the budget left waits for the next progress.
    ///
    /// Why a budget: a read completes, and is confirmed and reported, in
    /// the turn that read its last bytes. Read all at once, the second of
    /// two 8 MiB requests in flight was copied before the first was
    /// reported, so both ended together and the engine's next two began
    /// only after its wake-up: a gap in every pair, with the copy done
    /// (`process_vm_readv` took as long per byte as one call a request).
    fn read_directly(&mut self, budget: usize) {
        let out = &mut self.direct_out;
        if out.pending.is_empty() {
            return;
        }
        let mut pending = std::mem::take(&mut out.pending);
        let mut at = 0;
        let mut read = 0usize;
        while at < pending.len() && read < budget {
            let first = &pending[at];
            read += first.bytes;
            let mut end = at + 1;
            while end < pending.len()
                && read < budget
                && pending[end].conn == first.conn
                && pending[end].ops.start == pending[end - 1].ops.end
            {
                read += pending[end].bytes;
                end += 1;
            }
            let run = &pending[at..end];
            let ops = &out.pending_ops[first.ops.start..run[run.len() - 1].ops.end];
            let conn = self
                .peers
                .get(first.peer.0 as usize)
                .and_then(|p| p.as_ref())
                .and_then(|p| p.conn.as_ref())
                .filter(|c| c.id == first.conn);
            let status = match conn {
                None => CANCELED,
                Some(c) if c.direct_lost.get() => CONNECTION_RESET,
                Some(c) => match c.direct.as_ref() {
                    None => CANCELED,
                    Some(d) => match d.read(ops, &mut out.iov.0, &mut out.iov.1) {
                        Ok(()) => 0,
                        Err(e) => {
                            tracing::debug!(error = %e, "a direct read failed");
                            if e.lost {
                                CONNECTION_RESET
                            } else {
                                IO_ERROR
                            }
                        }
                    },
                },
            };
            if let Some(c) = conn {
                if status == CONNECTION_RESET && !c.direct_lost.replace(true) {
                    out.lost.push(EndpointFailure {
                        endpoint: c.id,
                        status: UcxStatus(status),
                    });
                }
            }
            for r in run {
                let c = Completion {
                    token: r.token,
                    status: UcxStatus(status),
                };
                out.done.extend(std::iter::repeat_n(c, r.ops.len()));
            }
            at = end;
        }
        if at == pending.len() {
            out.pending_ops.clear();
            pending.clear();
        } else {
            // The rest keeps its operations, moved to the front.
            let from = pending[at].ops.start;
            out.pending_ops.drain(..from);
            pending.drain(..at);
            for r in &mut pending {
                r.ops = r.ops.start - from..r.ops.end - from;
            }
        }
        out.pending = pending;
    }
}

impl UcxTransport {
    /// Reads the probe word of every peer on this host that announced one
    /// (`super::direct`): a peer whose process is gone fails its
    /// connection at the next drain, as a direct read that found it gone
    /// does. UCX's own keepalive check does not always find such a death:
    /// a destination that stopped draining its shared-memory queue and
    /// then died left writes whose flush waited behind that queue, and the
    /// writer's source blocks held, for as long as it missed it
    /// (docs/design.md §4).
    fn check_alive(&mut self) {
        let out = &mut self.direct_out;
        let conns = self.peers.iter().flatten().filter_map(|p| p.conn.as_ref());
        for c in conns {
            let Some(d) = c.direct.as_ref().filter(|_| !c.direct_lost.get()) else {
                continue;
            };
            if let Err(e) = d.read(&[], &mut out.iov.0, &mut out.iov.1) {
                if e.lost {
                    tracing::debug!(error = %e, "a peer on this host is gone");
                    c.direct_lost.set(true);
                    out.lost.push(EndpointFailure {
                        endpoint: c.id,
                        status: UcxStatus(CONNECTION_RESET),
                    });
                }
            }
        }
    }

    /// The soft reads asked in this drain: one that names a lend goes to
    /// the core ([`TransportEvent::ReadAsked`]), which answers through
    /// [`Transport::serve_read`] before the next progress; any other is
    /// served (or refused, outside every region) now.
    fn ask_requests(&mut self, sink: &mut dyn FnMut(TransportEvent<'_>)) {
        for i in 0..self.requests.len() {
            let req = self.requests[i].0;
            // Bytes inside a region (so at least one, and no wrap), of
            // host memory, under a lend: the core decides.
            let inside = soft::source(&req, &self.spans).is_some() && !self.device_regions;
            if req.lend == 0 || !inside {
                self.serve(i, true);
                continue;
            }
            let bs = self.block_size.max(1);
            let (first, last) = (req.offset / bs, (req.offset + (req.len - 1)) / bs);
            let (Ok(first), Ok(last)) = (u32::try_from(first), u32::try_from(last)) else {
                self.serve(i, false);
                continue;
            };
            sink(TransportEvent::ReadAsked {
                request: i as u32,
                lend: Incarnation(req.lend),
                first: BlockId(first),
                last: BlockId(last),
            });
        }
    }

    /// Answers soft read `i` of this drain (once): its bytes in pieces if
    /// `lent`, or a refusal — [`NOT_LENT`], or for a request that names no
    /// region or bytes outside it, `INVALID_PARAM`. A piece that cannot be
    /// sent ends the answer (the reader's endpoint failed: it learns so).
    fn serve(&mut self, i: usize, lent: bool) {
        let Some((req, reply)) = self.requests.get_mut(i).map(|r| (r.0, r.1.take())) else {
            return;
        };
        let Some(to) = reply else {
            return; // answered already, or unanswerable
        };
        let Self {
            returns,
            worker,
            spans,
            device_regions,
            ..
        } = self;
        let Ok(own) = answer_on(worker, returns, to) else {
            // Unanswerable (its reader is gone): its read ends with the
            // reader's deadline, if the reader lives.
            return;
        };
        // SAFETY: the caller's promise, passed on.
        let send = |header: &[u8], data: *const u8, len: usize| unsafe {
            let token = T_TRANSPORT | T_SOFT_PIECE;
            match own {
                Some(ep) => ep.send_with_data(PIECE_AM_ID, header, data, len, token),
                None => worker.reply_with_data(to, PIECE_AM_ID, header, data, len, token),
            }
        };
        let mut piece = Piece {
            slot: req.slot,
            seq: req.seq,
            offset: 0,
            status: 0,
        };
        let found = soft::source(&req, spans).filter(|_| !*device_regions && lent);
        let Some((base, len)) = found else {
            piece.status = if *device_regions {
                UNSUPPORTED
            } else if !lent {
                NOT_LENT
            } else {
                INVALID_PARAM
            };
            let _ = send(&piece.encode(), std::ptr::null(), 0);
            return;
        };
        let mut off = 0usize;
        while off < len {
            let n = PIECE.min(len - off);
            piece.offset = off as u64;
            // base + off .. + n lies inside a registered region (checked
            // by `source`), mapped until the transport drops, after the
            // worker last progresses.
            if send(&piece.encode(), (base + off) as *const u8, n).is_err() {
                break;
            }
            off += n;
        }
    }
}

/// Asks `conn`'s peer for each of `ops` as a soft read ([`super::soft`])
/// into `local` (one of `regions`, whose index names the peer's region of
/// the same place).
fn soft_get_batch(
    worker: &Worker,
    conn: &Conn,
    local: &MemoryRegion,
    regions: &[MemoryRegion],
    ops: &[BlockOp],
    lend: Incarnation,
) -> Result<(), super::PostError> {
    let region = regions
        .iter()
        .position(|r| std::ptr::eq(r, local))
        .unwrap_or(0) as u32;
    let key = conn.return_key();
    for (i, op) in ops.iter().enumerate() {
        let fail = |error| Err(super::PostError { posted: i, error });
        let dest = match local.range_ptr(op.local_offset, op.len) {
            Ok(p) => p,
            Err(e) => return fail(e),
        };
        // SAFETY: dest..dest + len lies in a registered region, mapped
        // until the transport drops; the core does not reuse it before the
        // operation's completion.
        let (slot, seq) = unsafe { worker.open_soft_read(dest, op.len, op.token, conn.id) };
        let req = Request {
            slot,
            seq,
            region,
            offset: op.remote_offset,
            len: op.len as u64,
            lend: lend.0,
        };
        let token = T_TRANSPORT | T_SOFT_REQUEST | u64::from(slot) << 32 | u64::from(seq);
        let sent = match key {
            Some(key) => {
                conn.ep
                    .send_active_message_answerable(REQUEST_AM_ID, &req.encode(), key, token)
            }
            None => conn
                .ep
                .send_active_message_with_reply(REQUEST_AM_ID, &req.encode(), token),
        };
        if let Err(e) = sent {
            // Not posted: the slot ends here, not through a completion.
            worker.forget_soft_read(slot, seq);
            return fail(e);
        }
    }
    Ok(())
}

impl Transport for UcxTransport {
    fn add_peer(&mut self, peer: PeerId, meta: &PeerMetadata) -> Result<(), i8> {
        let i = peer.0 as usize;
        if self.peers.len() <= i {
            self.peers.resize_with(i + 1, || None);
        }
        self.peers[i] = Some(Peer {
            meta: meta.clone(),
            conn: None,
            newest: 0,
        });
        Ok(())
    }

    fn forget_peer(&mut self, peer: PeerId, drain: bool) {
        // Reads posted before are read before the connection changes.
        self.read_directly(usize::MAX);
        // A peer removed with gets of ours in flight is closed gracefully:
        // it serves them and then drops its side of the connection,
        // instead of finding it cut under get requests it is still
        // answering (UCX 1.13 then aborts in ucp_get_req_handler, or leaves
        // requests out at ucp_worker_destroy). A lost peer's endpoint, or
        // an idle one, is force-closed: a graceful close would wait on a
        // peer that may not answer.
        self.close_conn_as(peer, None, drain);
        if let Some(slot) = self.peers.get_mut(peer.0 as usize) {
            *slot = None;
        }
    }

    fn post(
        &mut self,
        ep: Ep,
        dir: Direction,
        pairs: &[(BlockId, BlockId)],
        token: u64,
    ) -> Result<u32, PostFailure> {
        let bs = self.block_size;
        self.post_ops(
            ep,
            dir,
            pairs,
            token,
            bs,
            BlockBytes {
                local_offset: 0,
                remote_offset: 0,
                len: bs,
            },
        )
    }

    fn post_part(
        &mut self,
        ep: Ep,
        dir: Direction,
        pairs: &[(BlockId, BlockId)],
        part: BlockBytes,
        token: u64,
    ) -> Result<u32, PostFailure> {
        // Remote blocks are the peer's size (the engine checked the part
        // lies inside both).
        let remote_bs = match self.peers.get(ep.peer.0 as usize) {
            Some(Some(p)) => p.meta.layout.block_size,
            _ => {
                return Err(PostFailure {
                    posted: 0,
                    status: INVALID_PARAM,
                })
            }
        };
        self.post_ops(ep, dir, pairs, token, remote_bs, part)
    }

    fn post_lent(
        &mut self,
        ep: Ep,
        dir: Direction,
        pairs: &[(BlockId, BlockId)],
        part: Option<BlockBytes>,
        lend: Incarnation,
        token: u64,
    ) -> Result<u32, PostFailure> {
        self.post_lend = lend;
        let r = self.post_whole_or_part(ep, dir, pairs, part, token);
        self.post_lend = Incarnation::NONE;
        r
    }

    fn serve_read(&mut self, request: u32, lent: bool) {
        self.serve(request as usize, lent);
    }

    fn flush(&mut self, ep: Ep, token: u64) -> Result<(), i8> {
        // Completes once the reads posted before it are read.
        self.read_directly(usize::MAX);
        // Never connects: a flush on a generation that is not the open one
        // would flush nothing of what it must cover.
        match self.open(ep) {
            Some(c) => c.ep.flush(token).map_err(|e| status_of(&e)),
            None => Err(CANCELED),
        }
    }

    fn send(&mut self, ep: Ep, payload: &[u8], token: u64, want_reply: bool) -> Result<(), i8> {
        let conn = self.conn(ep)?;
        let key = if want_reply { conn.return_key() } else { None };
        let sent = match key {
            Some(key) if want_reply => {
                conn.ep
                    .send_active_message_answerable(NOTIFY_AM_ID, payload, key, token)
            }
            None if want_reply => {
                conn.ep
                    .send_active_message_with_reply(NOTIFY_AM_ID, payload, token)
            }
            _ => conn.ep.send_active_message(NOTIFY_AM_ID, payload, token),
        };
        sent.map_err(|e| status_of(&e))
    }

    fn reply(&mut self, to: u32, payload: &[u8], token: u64) -> Result<(), i8> {
        let own = answer_on(&self.worker, &mut self.returns, to).map_err(|()| CANCELED)?;
        match own {
            Some(ep) => ep.send_active_message(NOTIFY_AM_ID, payload, token),
            // No return path: UCX's reply endpoint (`super::returns`).
            None => self.worker.reply(to, NOTIFY_AM_ID, payload, token),
        }
        .map_err(|e| status_of(&e))
    }

    fn read_word(&mut self, ep: Ep, inc: Incarnation, token: u64) -> Result<(), i8> {
        self.connect(ep)?;
        if let Some(conn) = self.open(ep) {
            if let (Some(words), Some(rkey)) = (conn.words_mapped, conn.words.as_ref()) {
                let count = (rkey.remote_len() / 8) as usize;
                let i = lend_word_of(inc, count).ok_or(UNSUPPORTED)?;
                // The data this read decides about was read before (its
                // copies or gets completed): keep those loads before the
                // word's.
                std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
                // SAFETY: `i < count`, the mapping's words (checked aligned
                // when the connection was made), mapped while its key lives.
                let word = unsafe { (*words.add(i)).load(std::sync::atomic::Ordering::Acquire) };
                self.direct_out.words.push((token, word));
                return Ok(());
            }
        }
        let Some(&cell) = self.free_cells.last() else {
            return Err(NO_RESOURCE);
        };
        let conn = self.open(ep).ok_or(INVALID_PARAM)?;
        // Soft reads have no one-sided word read: readers ask.
        let Some(rkey) = conn
            .words
            .as_ref()
            .filter(|_| !conn.words_slow.get() && !conn.soft)
        else {
            return Err(UNSUPPORTED);
        };
        let count = (rkey.remote_len() / 8) as usize;
        let word = lend_word_of(inc, count).ok_or(UNSUPPORTED)?;
        let op = BlockOp {
            local_offset: u64::from(cell) * 8,
            remote_offset: word as u64 * 8,
            len: 8,
            token,
        };
        // The data this read decides about was read before (its gets
        // completed): keep those loads before the word's.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        conn.ep
            .get_batch(&self.cells, rkey, &[op])
            .map_err(|e| status_of(&e.error))?;
        self.free_cells.pop();
        self.word_reads.push((token, cell, ep, self.progresses));
        Ok(())
    }

    fn lend_words(&self) -> Option<LendWords> {
        self.words.as_ref().map(|(w, _)| w.clone())
    }

    fn close(&mut self, ep: Ep) {
        // Reads posted before are read before the connection changes.
        self.read_directly(usize::MAX);
        self.close_conn(ep.peer, Some(ep.generation));
    }

    fn progress(&mut self) -> u32 {
        self.read_directly(DIRECT_BYTES_PER_PROGRESS);
        self.progresses += 1;
        let events = self.worker.progress();
        if let Some(p) = self.probe.as_mut().filter(|p| p.hearing.waiting()) {
            // A probe in flight may wait in the probe worker's queue (the
            // FIFO was full): retried here, not only at the next check.
            p.progress();
        }
        events
    }

    fn drain(&mut self, sink: &mut dyn FnMut(TransportEvent<'_>)) {
        self.failures.append(&mut self.direct_out.lost);
        self.worker.take_endpoint_failures(&mut self.failures);
        if self
            .failures
            .iter()
            .any(|f| returns::is_return_id(f.endpoint))
        {
            // A return endpoint's failure is this transport's own: it
            // closes, and the next answer opens another.
            let (returns, seq) = (&mut self.returns, &mut self.close_seq);
            self.failures.retain(|f| {
                if !returns::is_return_id(f.endpoint) {
                    return true;
                }
                *seq += 1;
                returns.failed(f.endpoint, T_TRANSPORT | *seq);
                false
            });
        }
        for f in &self.failures {
            // Its soft reads end with it (their completions come below).
            self.worker.fail_soft_reads_of(f.endpoint, f.status);
        }
        // Words loaded from a mapping were read when they were posted.
        for (token, word) in self.direct_out.words.drain(..) {
            sink(TransportEvent::Word {
                token,
                status: 0,
                word,
            });
        }
        // Direct reads completed when they were read (above, or when
        // posted, for a connection already lost).
        self.completions.append(&mut self.direct_out.done);
        self.worker.take_completions(&mut self.completions);
        // Completions may add completions (a close ends its soft reads):
        // taken until none is left, so none waits for the next progress.
        let mut i = 0;
        loop {
            if i == self.completions.len() {
                self.worker.take_completions(&mut self.completions);
                if i == self.completions.len() {
                    break;
                }
            }
            let c = self.completions[i];
            i += 1;
            if c.token & T_TRANSPORT == T_TRANSPORT {
                if c.token & T_SOFT_REQUEST != 0 {
                    if c.status.0 != 0 {
                        // The request never reached the lender.
                        let slot = ((c.token & !T_SOFT_REQUEST) >> 32) as u32;
                        let seq = (c.token & 0x3fff_ffff) as u32;
                        self.worker.fail_soft_read(slot, seq, c.status);
                    }
                } else if c.token & T_SOFT_PIECE == 0 {
                    // A close completed: now its rkeys and endpoint may go,
                    // and the soft reads still asked on it end.
                    if let Some(pos) = self.closing.iter().position(|(t, _)| *t == c.token) {
                        let (_, conn) = self.closing.swap_remove(pos);
                        self.worker.fail_soft_reads_of(conn.id, UcxStatus(CANCELED));
                    } else {
                        self.returns.closed(c.token);
                    }
                }
                continue;
            }
            let pos = if c.token & T_TRANSPORT == T_WORD {
                self.word_reads.iter().position(|&(t, ..)| t == c.token)
            } else {
                None
            };
            if let Some(pos) = pos {
                let (_, cell, ep, posted) = self.word_reads.swap_remove(pos);
                let slow = self.progresses > posted + 1;
                if let Some(conn) = self.open(ep) {
                    if slow && conn.words_read.get() {
                        // Not one-sided on this connection. This read goes
                        // on; the next ones ask (measured over tcp: a
                        // word's get waits behind other reads' data, and
                        // 64-block requests ran at half the rate of asking,
                        // whose answers coalesce).
                        conn.words_slow.set(true);
                    }
                    conn.words_read.set(true);
                }
                self.free_cells.push(cell);
                let ok = c.status.0 == 0;
                // The get completed: its bytes are in the cell.
                let mut word = [0u8; 8];
                if ok {
                    // In range: the cell is one of the region's.
                    let _ = self.cells.read(u64::from(cell) * 8, &mut word);
                }
                let word = u64::from_ne_bytes(word);
                sink(TransportEvent::Word {
                    token: c.token,
                    status: c.status.0,
                    word,
                });
                continue;
            }
            sink(TransportEvent::Completion {
                token: c.token,
                status: c.status.0,
            });
        }
        self.completions.clear();
        let probe = &mut self.probe;
        // The last drain's reads were all answered in its execution.
        self.requests.clear();
        let requests = &mut self.requests;
        let (returns, seq) = (&mut self.returns, &mut self.close_seq);
        self.worker.take_active_messages(|m| {
            if m.id == RETURN_AM_ID {
                // Outside bytes: a malformed announcement is dropped.
                returns.announce(m.payload, &mut || {
                    *seq += 1;
                    T_TRANSPORT | *seq
                });
                return;
            }
            if m.id == REQUEST_AM_ID {
                // Outside bytes: a request of another length is dropped.
                if let Some(r) = Request::decode(m.payload) {
                    requests.push((r, m.reply));
                }
                return;
            }
            if m.id == PROBE_AM_ID {
                if let (Some(p), Ok(seq)) = (probe.as_mut(), <[u8; 8]>::try_from(m.payload)) {
                    p.hearing.heard(u64::from_le_bytes(seq));
                }
                return;
            }
            sink(TransportEvent::Message {
                payload: m.payload,
                reply: m.reply,
            })
        });
        let seq = &mut self.close_seq;
        self.returns.open_announced(&self.worker, &mut || {
            *seq += 1;
            T_TRANSPORT | *seq
        });
        self.ask_requests(sink);
        for f in self.failures.drain(..) {
            sink(TransportEvent::EndpointFailed {
                ep: Ep::from_u64(f.endpoint),
                status: f.status.0,
            });
        }
    }

    fn closing(&self) -> bool {
        !self.closing.is_empty()
    }

    fn wait_fd(&mut self) -> Option<std::os::fd::RawFd> {
        self.event_fd
    }

    fn hearing(&mut self, now: Nanos) -> bool {
        if self
            .alive_at
            .is_none_or(|t| now.0.saturating_sub(t.0) >= ALIVE_EVERY.0)
        {
            self.alive_at = Some(now);
            self.check_alive();
        }
        let Some(p) = self.probe.as_mut() else {
            return true;
        };
        match p.hearing.step(now, self.progresses) {
            Step::Wait => true,
            Step::Send(seq) => {
                if let Err(e) = p.ep.send_active_message(PROBE_AM_ID, &seq.to_le_bytes(), 0) {
                    tracing::debug!(error = %e, "deafness probe not sent");
                    p.hearing.unsent();
                }
                p.progress();
                true
            }
            Step::Deaf => false,
        }
    }

    fn ready(&self) -> bool {
        !(self.direct_out.done.is_empty()
            && self.direct_out.words.is_empty()
            && self.direct_out.lost.is_empty())
    }

    fn arm(&mut self) -> bool {
        // An arm that fails outright (not BUSY) is treated as "do not
        // block": the poller then naps on a timer, as without the fd.
        // Direct reads (posted, or completed) and loaded words wait for
        // the next progress or drain, not an event.
        self.direct_out.done.is_empty()
            && self.direct_out.pending.is_empty()
            && self.direct_out.words.is_empty()
            && self.direct_out.lost.is_empty()
            && self.event_fd.is_some()
            && self.worker.arm().unwrap_or(false)
    }
}

/// Bytes of direct reads one progress reads at most (a whole run of one
/// post's reads of a region, at least): 64 reads of 16 KiB are one call,
/// an 8 MiB request of 32 layers two ([`UcxTransport::read_directly`]).
const DIRECT_BYTES_PER_PROGRESS: usize = 4 << 20;

/// How often the peers on this host are checked alive
/// ([`UcxTransport::check_alive`]): as often as kvpoll has UCX run its
/// keepalive check where only transports within one host may be used.
const ALIVE_EVERY: Nanos = Nanos(1_000_000_000);

/// `UCS_ERR_CONNECTION_RESET`: what a direct read that found its peer
/// gone completes with (as UCX's `cma` does).
const CONNECTION_RESET: i8 = -25;

/// The status to record for a failed UCX call; `UCS_ERR_INVALID_PARAM`
/// when kvpoll refused the operation before UCX saw it.
pub(crate) fn status_of(e: &UcxError) -> i8 {
    e.status().map_or(INVALID_PARAM, |s| s.0)
}
