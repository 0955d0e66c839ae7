//! The C ABI of kvpoll, declared in `kvpoll.h` (cbindgen writes it from
//! `bindings/c/src/lib.rs`, whose module docs are these paragraphs).
//!
//! Threads. An engine is an opaque `kvpoll_engine *`, made by
//! `kvpoll_engine_new` and freed by `kvpoll_engine_free`. One thread at a
//! time may call into one engine: it is the engine thread of the Rust API.
//! Different engines may be used from different threads at once. Each
//! engine runs a poller thread of its own, which never calls back into
//! the caller.
//!
//! Ownership. Every pointer the caller passes stays the caller's: kvpoll
//! copies what it keeps (metadata, block lists, the transport list) before
//! the call returns. What `kvpoll_poll` hands back (reports, block ids) is
//! the engine's and stays valid until the next `kvpoll_poll` or
//! `kvpoll_engine_free`. Memory given to `kvpoll_register_memory` must stay
//! allocated, in place, until the engine is freed.
//!
//! Errors. Every call returns a status (`KVPOLL_OK` or a `KVPOLL_ERR_*`
//! code) and, on error, writes a NUL-terminated message into the caller's
//! buffer `err` of `err_len` bytes: truncated to `err_len - 1` bytes on a
//! UTF-8 character boundary, nothing written when `err` is NULL or
//! `err_len` is 0. No Rust panic crosses the boundary: a panic becomes
//! `KVPOLL_ERR_PANIC`.
//!
//! Units. Durations are nanoseconds (`*_ns`), sizes bytes; block ids are
//! `uint32_t`, request ids `uint64_t` (the Python binding maps its string
//! ids with `kvpoll.request_id`), peer ids `uint32_t`; a lend's
//! incarnation is a `uint64_t` token, carried with its block ids.
//!
//! Versions. `KVPOLL_VERSION` is the header's version (major * 10000 +
//! minor * 100 + patch), `kvpoll_version()` the linked library's.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use kvpoll::engine::{
    BuildError, Engine, ErrorKind, IdlePolicy, Outcomes, PeerError, RegionError, SubmitError,
    Transfer,
};
use kvpoll::ledger::{BlockId, Cause, Incarnation, PeerId, RequestId};
use kvpoll::transport::ucx::ContextOptions;

/// This header's major version.
pub const KVPOLL_VERSION_MAJOR: u32 = 0;
/// This header's minor version.
pub const KVPOLL_VERSION_MINOR: u32 = 1;
/// This header's patch version.
pub const KVPOLL_VERSION_PATCH: u32 = 0;
/// This header's version: major * 10000 + minor * 100 + patch.
pub const KVPOLL_VERSION: u32 = 100;

/// Why a request or a handle failed: `kvpoll_report.cause`. Later versions
/// may add causes; treat an unknown one as a failure.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvpoll_cause {
    /// Not a failure.
    KVPOLL_CAUSE_NONE = 0,
    /// A posted transfer completed with an error (`status` says which; a
    /// forced endpoint close gives `UCS_ERR_CANCELED`).
    KVPOLL_CAUSE_TRANSFER = 1,
    /// The handle failed before any operation was posted.
    KVPOLL_CAUSE_SETUP = 2,
    /// The handle's peer was lost (endpoint error).
    KVPOLL_CAUSE_PEER_LOST = 3,
    /// The request's deadline passed before it stopped.
    KVPOLL_CAUSE_DEADLINE = 4,
    /// The request's lease expired.
    KVPOLL_CAUSE_LEASE_EXPIRED = 5,
    /// The request was aborted.
    KVPOLL_CAUSE_ABORTED = 6,
    /// The peer was judged stalled: another request on its endpoint passed
    /// its deadline or lease, and the endpoint was force-closed.
    KVPOLL_CAUSE_PEER_STALLED = 7,
    /// The engine was shut down while the request was in flight.
    KVPOLL_CAUSE_SHUTDOWN = 8,
    /// The poller thread died.
    KVPOLL_CAUSE_POLLER_DIED = 9,
    /// A lender answered that its lend was not live when the data was read
    /// (the bytes may be another request's), or a receive's
    /// writer gave up.
    KVPOLL_CAUSE_LEASE_LOST = 10,
    /// The lender holds no lend of the named incarnation covering the
    /// blocks read (another lend's blocks, blocks not lent, or an
    /// incarnation never lent): the bytes are not that lend's.
    KVPOLL_CAUSE_NOT_LENT = 11,
}

/// The C cause of a kvpoll cause (exhaustive: a new cause must be added
/// to `kvpoll_cause` first).
fn cause_code(cause: Cause) -> u8 {
    use kvpoll_cause::*;
    (match cause {
        Cause::Transfer => KVPOLL_CAUSE_TRANSFER,
        Cause::Setup => KVPOLL_CAUSE_SETUP,
        Cause::PeerLost => KVPOLL_CAUSE_PEER_LOST,
        Cause::Deadline => KVPOLL_CAUSE_DEADLINE,
        Cause::LeaseExpired => KVPOLL_CAUSE_LEASE_EXPIRED,
        Cause::Aborted => KVPOLL_CAUSE_ABORTED,
        Cause::PeerStalled => KVPOLL_CAUSE_PEER_STALLED,
        Cause::Shutdown => KVPOLL_CAUSE_SHUTDOWN,
        Cause::PollerDied => KVPOLL_CAUSE_POLLER_DIED,
        Cause::LeaseLost => KVPOLL_CAUSE_LEASE_LOST,
        Cause::NotLent => KVPOLL_CAUSE_NOT_LENT,
    }) as u8
}

/// Success.
pub const KVPOLL_OK: i32 = 0;
/// A bad argument: a NULL pointer, an unknown constant, a bad value.
pub const KVPOLL_ERR_ARGUMENT: i32 = 1;
/// A request was refused (duplicate id, bad pairing, block out of range,
/// not in flight...); nothing was submitted.
pub const KVPOLL_ERR_REQUEST: i32 = 2;
/// Peer metadata was refused, or the peer is not known.
pub const KVPOLL_ERR_PEER: i32 = 3;
/// A region does not fit the layout, or none is registered.
pub const KVPOLL_ERR_REGION: i32 = 4;
/// Every request slot or the command ring is full: poll, then retry.
pub const KVPOLL_ERR_BUSY: i32 = 5;
/// A UCX call failed.
pub const KVPOLL_ERR_TRANSPORT: i32 = 6;
/// The engine's configuration is invalid.
pub const KVPOLL_ERR_CONFIG: i32 = 7;
/// The engine is shut down (or its poller died).
pub const KVPOLL_ERR_SHUTDOWN: i32 = 8;
/// The output buffer is too small; the size needed was written back.
pub const KVPOLL_ERR_BUFFER_TOO_SMALL: i32 = 9;
/// An engine error of no other kind (the poller thread could not start).
pub const KVPOLL_ERR_OTHER: i32 = 10;
/// A bug: the call panicked (the message says where). The engine may be
/// unusable; free it.
pub const KVPOLL_ERR_PANIC: i32 = 11;

/// `kvpoll_config.idle`: spin, back off, then park (near-zero idle CPU).
pub const KVPOLL_IDLE_ADAPTIVE: u32 = 0;
/// `kvpoll_config.idle`: spin forever (a dedicated core only).
pub const KVPOLL_IDLE_BUSY: u32 = 1;

/// `kvpoll_config.core`: do not pin the poller.
pub const KVPOLL_NO_CORE: i64 = -1;

/// Report kind: a read (or receive) has all its data.
pub const KVPOLL_FINISHED_RECVING: u32 = 1;
/// Report kind: a read failed, after every handle stopped; its blocks
/// (`blocks_offset`, `n_blocks`) must be invalidated.
pub const KVPOLL_FAILED_RECVING: u32 = 2;
/// Report kind: a write was acknowledged, or a lend released by its
/// readers: the source blocks are free.
pub const KVPOLL_FINISHED_SENDING: u32 = 3;
/// Report kind: a write's or a lend's lease ended first: blocks free,
/// transfer not done.
pub const KVPOLL_EXPIRED: u32 = 4;
/// Report kind, informational: one handle (`handle`) failed; the request
/// is reported later.
pub const KVPOLL_HANDLE_FAILURE: u32 = 5;
/// Report kind: a write failed or was aborted, after every handle stopped
/// (`cause`, `status` say why): never done; its source blocks are free.
pub const KVPOLL_FAILED_SENDING: u32 = 6;

/// Engine settings; start from `kvpoll_config_default()`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvpoll_config {
    /// Bytes per block (default 16384).
    pub block_size: u64,
    /// CPU to pin the poller to, or `KVPOLL_NO_CORE` (default).
    pub core: i64,
    /// `KVPOLL_IDLE_ADAPTIVE` (default) or `KVPOLL_IDLE_BUSY`.
    pub idle: u32,
    /// Requests tracked at once (default 1024).
    pub slots: u32,
    /// Local blocks one request may name (default 512).
    pub max_blocks: u32,
    /// A read still in flight after this fails (default 30 s).
    pub read_deadline_ns: u64,
    /// UCX transport list (`UCX_TLS`, e.g. "tcp"), or NULL to let UCX choose.
    pub tls: *const c_char,
    /// The secret the deployment's engines share (at least 16 bytes), or
    /// NULL (default) for none: with one, metadata and notifications are
    /// tagged, and a peer without it, or with another, is refused by
    /// `kvpoll_add_peer` (`KVPOLL_ERR_PEER`). The bytes are read once, by
    /// `kvpoll_engine_new`.
    pub auth_key: *const u8,
    /// Bytes of `auth_key`.
    pub auth_key_len: usize,
}

/// One handle of a read or write: `n_blocks` local blocks paired with as
/// many remote blocks of one peer.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvpoll_transfer {
    /// The peer, from `kvpoll_add_peer`.
    pub peer: u32,
    /// `n_blocks` local block ids.
    pub local: *const u32,
    /// `n_blocks` remote block ids.
    pub remote: *const u32,
    /// Blocks in this handle.
    pub n_blocks: usize,
    /// The incarnation of the remote lend (a read) or receive (a
    /// write): what the remote engine's `kvpoll_lend` or `kvpoll_receive` gave back, carried
    /// with the block ids. 0 only for a read with confirmation off.
    pub lend: u64,
}

/// One report of `kvpoll_poll`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct kvpoll_report {
    /// The request.
    pub id: u64,
    /// `KVPOLL_FINISHED_RECVING`, `KVPOLL_FAILED_RECVING`, ...
    pub kind: u32,
    /// For failures: a `kvpoll_cause`; else `KVPOLL_CAUSE_NONE`.
    pub cause: u8,
    /// For failures: the transport's status code (0 when none).
    pub status: i8,
    /// For `KVPOLL_HANDLE_FAILURE`: the handle's index in the request.
    pub handle: u8,
    /// For `KVPOLL_FAILED_RECVING`: where its invalid blocks start in the
    /// poll's block array.
    pub blocks_offset: usize,
    /// For `KVPOLL_FAILED_RECVING`: how many.
    pub n_blocks: usize,
}

/// An engine (opaque).
pub struct kvpoll_engine {
    inner: Engine,
    out: Outcomes,
    reports: Vec<kvpoll_report>,
    blocks: Vec<u32>,
    locals: Vec<BlockId>,
    remotes: Vec<BlockId>,
    spans: Vec<(PeerId, usize, usize, Incarnation)>,
}

/// An error inside a call: status and message.
struct Fail(i32, String);

fn arg(msg: impl Into<String>) -> Fail {
    Fail(KVPOLL_ERR_ARGUMENT, msg.into())
}

/// The status of an engine error: its kind's.
impl From<kvpoll::Error> for Fail {
    fn from(e: kvpoll::Error) -> Self {
        let status = match e.kind() {
            ErrorKind::Config => KVPOLL_ERR_CONFIG,
            ErrorKind::Region => KVPOLL_ERR_REGION,
            ErrorKind::Request => KVPOLL_ERR_REQUEST,
            ErrorKind::Peer => KVPOLL_ERR_PEER,
            ErrorKind::Busy => KVPOLL_ERR_BUSY,
            ErrorKind::Transport => KVPOLL_ERR_TRANSPORT,
            ErrorKind::Stopped => KVPOLL_ERR_SHUTDOWN,
            ErrorKind::Other => KVPOLL_ERR_OTHER,
        };
        Fail(status, e.to_string())
    }
}

/// Each phase's error, through `?`.
macro_rules! fail_from {
    ($($phase:ty),*) => {$(
        impl From<$phase> for Fail {
            fn from(e: $phase) -> Self {
                kvpoll::Error::from(e).into()
            }
        }
    )*};
}
fail_from!(BuildError, RegionError, PeerError, SubmitError);

/// Writes `msg` into the caller's buffer, truncated on a UTF-8 boundary
/// and NUL-terminated.
///
/// # Safety
/// `err` is NULL or valid for `err_len` bytes.
unsafe fn write_err(err: *mut c_char, err_len: usize, msg: &str) {
    if err.is_null() || err_len == 0 {
        return;
    }
    let mut n = msg.len().min(err_len - 1);
    while !msg.is_char_boundary(n) {
        n -= 1;
    }
    // SAFETY: err is valid for err_len > n bytes (caller's contract).
    unsafe {
        std::ptr::copy_nonoverlapping(msg.as_ptr(), err.cast::<u8>(), n);
        *err.add(n) = 0;
    }
}

/// Runs `f`, turning errors and panics into a status and a message.
///
/// # Safety
/// As `write_err`.
unsafe fn guard(err: *mut c_char, err_len: usize, f: impl FnOnce() -> Result<(), Fail>) -> i32 {
    let (status, msg) = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => return KVPOLL_OK,
        Ok(Err(Fail(status, msg))) => (status, msg),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            (KVPOLL_ERR_PANIC, format!("kvpoll panicked: {what}"))
        }
    };
    // SAFETY: forwarded contract.
    unsafe { write_err(err, err_len, &msg) };
    status
}

/// The engine behind a caller's pointer.
///
/// # Safety
/// `e` is NULL or from `kvpoll_engine_new`, not freed, used by one thread.
unsafe fn engine<'a>(e: *mut kvpoll_engine) -> Result<&'a mut kvpoll_engine, Fail> {
    // SAFETY: caller's contract.
    unsafe { e.as_mut() }.ok_or_else(|| arg("engine is NULL"))
}

/// `n` items at `p`; NULL is allowed only for `n == 0`.
///
/// # Safety
/// `p` is NULL or valid for `n` reads of `T`.
unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], Fail> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(arg(format!("{what} is NULL with {n} items")));
    }
    // SAFETY: caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// # Safety
/// `out` is NULL or valid for a write.
unsafe fn put<T>(out: *mut T, v: T, what: &str) -> Result<(), Fail> {
    if out.is_null() {
        return Err(arg(format!("{what} is NULL")));
    }
    // SAFETY: caller's contract.
    unsafe { out.write(v) };
    Ok(())
}

/// The default settings.
#[no_mangle]
pub extern "C" fn kvpoll_config_default() -> kvpoll_config {
    kvpoll_config {
        block_size: 16 * 1024,
        core: KVPOLL_NO_CORE,
        idle: KVPOLL_IDLE_ADAPTIVE,
        slots: 1024,
        max_blocks: 512,
        read_deadline_ns: 30_000_000_000,
        tls: std::ptr::null(),
        auth_key: std::ptr::null(),
        auth_key_len: 0,
    }
}

/// Starts an engine (its poller thread) and stores it in `*out`.
///
/// # Safety
/// `config` is NULL (the defaults) or valid; its `tls` is NULL or a
/// NUL-terminated string; its `auth_key` NULL or valid for
/// `auth_key_len` bytes; `out` is valid for a write; `err` is NULL or
/// valid for `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_engine_new(
    config: *const kvpoll_config,
    out: *mut *mut kvpoll_engine,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: the caller's contract, item by item below.
    unsafe {
        guard(err, err_len, || {
            if out.is_null() {
                return Err(arg("out is NULL"));
            }
            let c = match config.as_ref() {
                Some(c) => *c,
                None => kvpoll_config_default(),
            };
            let idle = match c.idle {
                KVPOLL_IDLE_ADAPTIVE => IdlePolicy::Adaptive,
                KVPOLL_IDLE_BUSY => IdlePolicy::Busy,
                other => return Err(arg(format!("unknown idle policy {other}"))),
            };
            let core = match c.core {
                KVPOLL_NO_CORE => None,
                n => Some(usize::try_from(n).map_err(|_| arg(format!("bad core {n}")))?),
            };
            let ucx = if c.tls.is_null() {
                ContextOptions::default()
            } else {
                let tls = CStr::from_ptr(c.tls)
                    .to_str()
                    .map_err(|_| arg("tls is not UTF-8"))?;
                ContextOptions::with_transports(tls)
            };
            let auth = if c.auth_key.is_null() {
                None
            } else {
                let secret = std::slice::from_raw_parts(c.auth_key, c.auth_key_len);
                Some(
                    kvpoll::auth::AuthKey::from_secret(secret)
                        .map_err(|e| Fail(KVPOLL_ERR_CONFIG, e.to_string()))?,
                )
            };
            let mut builder = Engine::builder()
                .block_size(c.block_size)
                .core(core)
                .idle(idle)
                .ledger(c.slots, c.max_blocks)
                .read_deadline(Duration::from_nanos(c.read_deadline_ns))
                .ucx(ucx);
            // Without one, the library's test hook may give it the test
            // suite's key (KVPOLL_TEST_AUTH_KEY).
            if auth.is_some() {
                builder = builder.auth_key(auth);
            }
            let inner = builder.build()?;
            let e = Box::new(kvpoll_engine {
                inner,
                out: Outcomes::default(),
                reports: Vec::new(),
                blocks: Vec::new(),
                locals: Vec::new(),
                remotes: Vec::new(),
                spans: Vec::new(),
            });
            out.write(Box::into_raw(e));
            Ok(())
        })
    }
}

/// Shuts the engine down (if it is not yet) and frees it. NULL is a no-op.
///
/// # Safety
/// `e` is NULL or from `kvpoll_engine_new` and not yet freed; it is not
/// used after this.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_engine_free(e: *mut kvpoll_engine) {
    if e.is_null() {
        return;
    }
    // SAFETY: caller's contract: e came from Box::into_raw.
    let e = unsafe { Box::from_raw(e) };
    // Dropping shuts the poller down; a panic there must not unwind into C.
    let _ = catch_unwind(AssertUnwindSafe(move || drop(e)));
}

/// Registers a region of `n_blocks` blocks (one KV layer) in host memory
/// the engine allocates (UCX's shared memory, or huge pages where UCX
/// moves one-sided operations through cma); writes its index to `*region`.
///
/// # Safety
/// `e` from `kvpoll_engine_new`; `region` valid for a write; `err` NULL or
/// valid for `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_register(
    e: *mut kvpoll_engine,
    n_blocks: u64,
    region: *mut usize,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            let e = engine(e)?;
            let r = e.inner.register(n_blocks)?;
            put(region, r, "region")
        })
    }
}

/// Registers caller memory `base..base+len` (a whole number of blocks) as
/// a region; writes its index to `*region`.
///
/// # Safety
/// As `kvpoll_register`, and `base..base+len` is writable host memory that
/// stays allocated until the engine is freed.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_register_memory(
    e: *mut kvpoll_engine,
    base: *mut u8,
    len: usize,
    region: *mut usize,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            let e = engine(e)?;
            let r = e.inner.register_memory(base, len)?;
            put(region, r, "region")
        })
    }
}

/// Copies this engine's metadata (for its peers' `kvpoll_add_peer`) into
/// `buf` of `cap` bytes and its length into `*len`. When `cap` is too
/// small, returns `KVPOLL_ERR_BUFFER_TOO_SMALL` with the length needed in
/// `*len` (`buf` may then be NULL).
///
/// # Safety
/// `e` from `kvpoll_engine_new`; `buf` NULL or valid for `cap` bytes; `len`
/// valid for a write; `err` NULL or valid for `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_local_metadata(
    e: *mut kvpoll_engine,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            let e = engine(e)?;
            let meta = e.inner.local_metadata()?;
            put(len, meta.len(), "len")?;
            if cap < meta.len() || buf.is_null() {
                return Err(Fail(
                    KVPOLL_ERR_BUFFER_TOO_SMALL,
                    format!("metadata needs {} bytes, buffer has {cap}", meta.len()),
                ));
            }
            std::ptr::copy_nonoverlapping(meta.as_ptr(), buf, meta.len());
            Ok(())
        })
    }
}

/// Adds a peer from its metadata; writes its id to `*peer`. Bad metadata
/// gives `KVPOLL_ERR_PEER` and changes nothing.
///
/// # Safety
/// `e` from `kvpoll_engine_new`; `meta` valid for `len` bytes; `peer` valid
/// for a write; `err` NULL or valid for `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_add_peer(
    e: *mut kvpoll_engine,
    meta: *const u8,
    len: usize,
    peer: *mut u32,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            let e = engine(e)?;
            let meta = slice(meta, len, "meta")?;
            let p = e.inner.add_peer(meta)?;
            put(peer, p.0, "peer")
        })
    }
}

/// Removes a peer: its handles in flight fail (reported as usual).
///
/// # Safety
/// `e` from `kvpoll_engine_new`; `err` NULL or valid for `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_remove_peer(
    e: *mut kvpoll_engine,
    peer: u32,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            engine(e)?.inner.remove_peer(PeerId(peer))?;
            Ok(())
        })
    }
}

/// Copies the caller's handles into the engine's scratch lists.
///
/// # Safety
/// `handles` valid for `n` items, each with valid block arrays.
unsafe fn load_handles(
    e: &mut kvpoll_engine,
    handles: *const kvpoll_transfer,
    n: usize,
) -> Result<(), Fail> {
    // SAFETY: caller's contract.
    let hs = unsafe { slice(handles, n, "handles")? };
    e.locals.clear();
    e.remotes.clear();
    e.spans.clear();
    for (i, h) in hs.iter().enumerate() {
        // SAFETY: caller's contract.
        let (l, r) = unsafe {
            (
                slice(h.local, h.n_blocks, &format!("handles[{i}].local"))?,
                slice(h.remote, h.n_blocks, &format!("handles[{i}].remote"))?,
            )
        };
        let start = e.locals.len();
        e.locals.extend(l.iter().map(|&b| BlockId(b)));
        e.remotes.extend(r.iter().map(|&b| BlockId(b)));
        e.spans
            .push((PeerId(h.peer), start, e.locals.len(), Incarnation(h.lend)));
    }
    Ok(())
}

fn transfers<'a>(
    spans: &[(PeerId, usize, usize, Incarnation)],
    locals: &'a [BlockId],
    remotes: &'a [BlockId],
) -> Vec<Transfer<'a>> {
    spans
        .iter()
        .map(|&(peer, a, b, lend)| Transfer {
            peer,
            local: &locals[a..b],
            remote: &remotes[a..b],
            lend,
        })
        .collect()
}

/// Pull: reads `n` handles as request `id`. Reported as
/// `KVPOLL_FINISHED_RECVING`, or `KVPOLL_FAILED_RECVING` (with the blocks to
/// invalidate) once every handle stopped. `n == 0`: a full prefix hit,
/// finished at once.
///
/// # Safety
/// `e` from `kvpoll_engine_new`; `handles` valid for `n` items whose block
/// arrays are valid for `n_blocks` each; `err` NULL or valid for `err_len`
/// bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_read(
    e: *mut kvpoll_engine,
    id: u64,
    handles: *const kvpoll_transfer,
    n: usize,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            let e = engine(e)?;
            load_handles(e, handles, n)?;
            let t = transfers(&e.spans, &e.locals, &e.remotes);
            e.inner.read(RequestId(id), &t)?;
            Ok(())
        })
    }
}

/// Push: writes `n` handles into blocks the consumers lent to writers.
/// `KVPOLL_FINISHED_SENDING` only after every write completed and
/// `expected_acks` acknowledgements arrived; else `KVPOLL_EXPIRED` when
/// `lease_ns` ends.
///
/// # Safety
/// As `kvpoll_read`.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_write(
    e: *mut kvpoll_engine,
    id: u64,
    handles: *const kvpoll_transfer,
    n: usize,
    expected_acks: u32,
    lease_ns: u64,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            let e = engine(e)?;
            load_handles(e, handles, n)?;
            let t = transfers(&e.spans, &e.locals, &e.remotes);
            e.inner.write(
                RequestId(id),
                &t,
                expected_acks,
                Duration::from_nanos(lease_ns),
            )?;
            Ok(())
        })
    }
}

/// Pull: lends `n` local blocks to `readers` remote engines until each of
/// them read and notified, or `lease_ns` ends. Writes the lend's
/// incarnation to `*incarnation` (if not NULL): hand it to the readers
/// with the block ids (`kvpoll_transfer.lend`).
///
/// # Safety
/// `e` from `kvpoll_engine_new`; `blocks` valid for `n` items;
/// `incarnation` NULL or valid for one write; `err` NULL or valid for
/// `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_lend(
    e: *mut kvpoll_engine,
    id: u64,
    blocks: *const u32,
    n: usize,
    readers: u32,
    lease_ns: u64,
    incarnation: *mut u64,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    let lease = Duration::from_nanos(lease_ns);
    // SAFETY: caller's contract.
    unsafe {
        expose(e, blocks, n, incarnation, err, err_len, |e, b| {
            e.lend(RequestId(id), b, readers, lease)
        })
    }
}

/// Push: opens a receive, `n` local blocks that `writers` remote engines
/// write into and notify, until all did or `lease_ns` ends. Writes the
/// receive's incarnation to `*incarnation` (if not NULL): hand it to the
/// writers with the block ids (`kvpoll_transfer.lend`).
///
/// # Safety
/// As for `kvpoll_lend`.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_receive(
    e: *mut kvpoll_engine,
    id: u64,
    blocks: *const u32,
    n: usize,
    writers: u32,
    lease_ns: u64,
    incarnation: *mut u64,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    let lease = Duration::from_nanos(lease_ns);
    // SAFETY: caller's contract.
    unsafe {
        expose(e, blocks, n, incarnation, err, err_len, |e, b| {
            e.receive(RequestId(id), b, writers, lease)
        })
    }
}

/// `kvpoll_lend` and `kvpoll_receive`: `f` lends or opens the receive of
/// the blocks.
///
/// # Safety
/// As for `kvpoll_lend`.
unsafe fn expose(
    e: *mut kvpoll_engine,
    blocks: *const u32,
    n: usize,
    incarnation: *mut u64,
    err: *mut c_char,
    err_len: usize,
    f: impl FnOnce(&mut Engine, &[BlockId]) -> Result<Incarnation, SubmitError>,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            let e = engine(e)?;
            let b = slice(blocks, n, "blocks")?;
            e.locals.clear();
            e.locals.extend(b.iter().map(|&b| BlockId(b)));
            let inc = f(&mut e.inner, &e.locals)?;
            if !incarnation.is_null() {
                // SAFETY: caller's contract: valid for one write.
                *incarnation = inc.0;
            }
            Ok(())
        })
    }
}

/// Extends the leases of these writes or lends to `extend_ns` from now.
/// Unknown ids are ignored.
///
/// # Safety
/// `e` from `kvpoll_engine_new`; `ids` valid for `n` items; `err` NULL or
/// valid for `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_heartbeat(
    e: *mut kvpoll_engine,
    ids: *const u64,
    n: usize,
    extend_ns: u64,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            let e = engine(e)?;
            let ids: Vec<RequestId> = slice(ids, n, "ids")?
                .iter()
                .map(|&i| RequestId(i))
                .collect();
            e.inner.heartbeat(&ids, Duration::from_nanos(extend_ns))?;
            Ok(())
        })
    }
}

/// Aborts a request in flight: reported failed (`KVPOLL_CAUSE_ABORTED`) once its
/// operations were cancelled.
///
/// # Safety
/// `e` from `kvpoll_engine_new`; `err` NULL or valid for `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_abort(
    e: *mut kvpoll_engine,
    id: u64,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            engine(e)?.inner.abort(RequestId(id))?;
            Ok(())
        })
    }
}

/// Collects what happened since the last poll: `*reports` points at
/// `*n_reports` reports, `*blocks` at the `*n_blocks` invalid block ids
/// that `KVPOLL_FAILED_RECVING` reports index. Both stay valid until the
/// next `kvpoll_poll` or `kvpoll_engine_free`. Each request is reported
/// once (`KVPOLL_HANDLE_FAILURE` reports are informational).
///
/// # Safety
/// `e` from `kvpoll_engine_new`; the four outputs valid for a write; `err`
/// NULL or valid for `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_poll(
    e: *mut kvpoll_engine,
    reports: *mut *const kvpoll_report,
    n_reports: *mut usize,
    blocks: *mut *const u32,
    n_blocks: *mut usize,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            let e = engine(e)?;
            if reports.is_null() || n_reports.is_null() || blocks.is_null() || n_blocks.is_null() {
                return Err(arg("an output of kvpoll_poll is NULL"));
            }
            e.out.clear();
            e.reports.clear();
            e.blocks.clear();
            e.inner.poll(&mut e.out);
            let plain = |id: RequestId, kind| kvpoll_report {
                id: id.0,
                kind,
                ..Default::default()
            };
            for &(id, handle, reason) in &e.out.handle_failures {
                e.reports.push(kvpoll_report {
                    cause: cause_code(reason.cause),
                    status: reason.status.code(),
                    handle,
                    ..plain(id, KVPOLL_HANDLE_FAILURE)
                });
            }
            for &id in &e.out.finished_recving {
                e.reports.push(plain(id, KVPOLL_FINISHED_RECVING));
            }
            for &id in &e.out.finished_sending {
                e.reports.push(plain(id, KVPOLL_FINISHED_SENDING));
            }
            for &id in &e.out.expired {
                e.reports.push(plain(id, KVPOLL_EXPIRED));
            }
            for f in &e.out.failed_sending {
                e.reports.push(kvpoll_report {
                    cause: cause_code(f.reason.cause),
                    status: f.reason.status.code(),
                    ..plain(f.id, KVPOLL_FAILED_SENDING)
                });
            }
            for f in &e.out.failed_recving {
                let start = e.blocks.len();
                e.blocks.extend(e.out.blocks_of(f).iter().map(|b| b.0));
                e.reports.push(kvpoll_report {
                    cause: cause_code(f.reason.cause),
                    status: f.reason.status.code(),
                    blocks_offset: start,
                    n_blocks: e.blocks.len() - start,
                    ..plain(f.id, KVPOLL_FAILED_RECVING)
                });
            }
            reports.write(e.reports.as_ptr());
            n_reports.write(e.reports.len());
            blocks.write(e.blocks.as_ptr());
            n_blocks.write(e.blocks.len());
            Ok(())
        })
    }
}

/// Stops the poller: requests in flight are cancelled and reported by the
/// next `kvpoll_poll`. Idempotent; later submits give
/// `KVPOLL_ERR_SHUTDOWN`.
///
/// # Safety
/// `e` from `kvpoll_engine_new`; `err` NULL or valid for `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_shutdown(
    e: *mut kvpoll_engine,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            engine(e)?.inner.shutdown();
            Ok(())
        })
    }
}

/// Copies `len` bytes (at most a block) into block `block` of `region`.
///
/// # Safety
/// `e` from `kvpoll_engine_new`; `data` valid for `len` bytes; `err` NULL
/// or valid for `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_write_block(
    e: *mut kvpoll_engine,
    region: usize,
    block: u32,
    data: *const u8,
    len: usize,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            let e = engine(e)?;
            let data = slice(data, len, "data")?;
            e.inner.write_block(region, BlockId(block), data)?;
            Ok(())
        })
    }
}

/// Copies the first `len` bytes (at most a block) of block `block` of
/// `region` into `out`.
///
/// # Safety
/// `e` from `kvpoll_engine_new`; `out` valid for `len` bytes; `err` NULL
/// or valid for `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_read_block(
    e: *mut kvpoll_engine,
    region: usize,
    block: u32,
    out: *mut u8,
    len: usize,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            let e = engine(e)?;
            let buf: &mut [u8] = if len == 0 {
                &mut []
            } else if out.is_null() {
                return Err(arg("out is NULL"));
            } else {
                std::slice::from_raw_parts_mut(out, len)
            };
            e.inner.read_block(region, BlockId(block), buf)?;
            Ok(())
        })
    }
}

/// Requests submitted and not yet reported, into `*n`.
///
/// # Safety
/// `e` from `kvpoll_engine_new`; `n` valid for a write; `err` NULL or
/// valid for `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpoll_in_flight(
    e: *mut kvpoll_engine,
    n: *mut usize,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: caller's contract.
    unsafe {
        guard(err, err_len, || {
            let e = engine(e)?;
            put(n, e.inner.in_flight(), "n")
        })
    }
}

/// A message for a status code (a static string).
#[no_mangle]
pub extern "C" fn kvpoll_status_name(status: i32) -> *const c_char {
    let s: &'static CStr = match status {
        KVPOLL_OK => c"ok",
        KVPOLL_ERR_ARGUMENT => c"bad argument",
        KVPOLL_ERR_REQUEST => c"request refused",
        KVPOLL_ERR_PEER => c"peer error",
        KVPOLL_ERR_REGION => c"region error",
        KVPOLL_ERR_BUSY => c"busy: poll, then retry",
        KVPOLL_ERR_TRANSPORT => c"transport error",
        KVPOLL_ERR_CONFIG => c"invalid configuration",
        KVPOLL_ERR_SHUTDOWN => c"engine is shut down",
        KVPOLL_ERR_BUFFER_TOO_SMALL => c"buffer too small",
        KVPOLL_ERR_OTHER => c"engine error",
        KVPOLL_ERR_PANIC => c"internal panic",
        _ => c"unknown status",
    };
    s.as_ptr()
}

/// The linked library's version, as `KVPOLL_VERSION` gives the header's:
/// a program can check that the two agree.
#[no_mangle]
pub extern "C" fn kvpoll_version() -> u32 {
    KVPOLL_VERSION
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_macros_are_the_crate_version() {
        let v = |s: &str| s.parse::<u32>().unwrap();
        assert_eq!(KVPOLL_VERSION_MAJOR, v(env!("CARGO_PKG_VERSION_MAJOR")));
        assert_eq!(KVPOLL_VERSION_MINOR, v(env!("CARGO_PKG_VERSION_MINOR")));
        assert_eq!(KVPOLL_VERSION_PATCH, v(env!("CARGO_PKG_VERSION_PATCH")));
        assert_eq!(
            KVPOLL_VERSION,
            KVPOLL_VERSION_MAJOR * 10_000 + KVPOLL_VERSION_MINOR * 100 + KVPOLL_VERSION_PATCH
        );
    }

    #[test]
    fn every_c_cause_is_the_engines_cause_number() {
        for c in [
            Cause::Transfer,
            Cause::Setup,
            Cause::PeerLost,
            Cause::Deadline,
            Cause::LeaseExpired,
            Cause::Aborted,
            Cause::PeerStalled,
            Cause::Shutdown,
            Cause::PollerDied,
            Cause::LeaseLost,
            Cause::NotLent,
        ] {
            assert_eq!(cause_code(c), c as u8, "{c:?}");
        }
    }
}
