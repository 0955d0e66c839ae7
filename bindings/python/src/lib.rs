//! The `kvpoll._kvpoll` extension module: Python bindings of
//! [`kvpoll::engine::Engine`].
//!
//! A thin layer: every call goes to the Rust engine, nothing is
//! reimplemented. What this layer adds is what Python callers need:
//!
//! - request ids that are `str` (as in vLLM) or `int`, mapped to kvpoll's
//!   `RequestId(u64)` deterministically (so a producer and a consumer in two
//!   processes agree on them) and reported back as the very objects given;
//!   the map entry goes when the request's terminal report is delivered;
//! - one exception class per kind of kvpoll error, under `KvpollError`;
//!   bad arguments raise `TypeError` or `ValueError`, never a panic;
//! - the GIL released around every call that waits for the poller thread.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::exceptions::{PyException, PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PySet, PyString, PyTuple, PyType};

use kvpoll::engine::{
    Engine as RsEngine, IdlePolicy, Outcomes, PartTransfer, SubmitError, Transfer as RsTransfer,
};
use kvpoll::ledger::{BlockId, Incarnation, PeerId, Reason, RequestId};
use kvpoll::transport::ucx::{Context, ContextOptions};

// ---------------------------------------------------------------- errors

pyo3::create_exception!(
    kvpoll,
    KvpollError,
    PyException,
    "Base class of every error the kvpoll engine reports. The message is the engine's."
);

/// The kinds of kvpoll errors, one Python class each (all under
/// `KvpollError`); `ErrorKind::Other` is `KvpollError` itself.
use kvpoll::ErrorKind as Kind;

/// Name, whether it is also a `ValueError`, and docstring of each kind, in
/// `Kind` order.
const KINDS: [(Kind, &str, bool, &str); 7] = [
    (
        Kind::Config,
        "ConfigError",
        true,
        "The engine's settings are invalid.",
    ),
    (
        Kind::Region,
        "RegionError",
        true,
        "A region does not fit the layout, or none is registered yet.",
    ),
    (
        Kind::Request,
        "RequestError",
        true,
        "A request was refused (duplicate id, bad pairing, block out of range, \
         unknown request...). Nothing was submitted.",
    ),
    (
        Kind::Peer,
        "PeerError",
        true,
        "Peer metadata was refused, or the peer is not known.",
    ),
    (
        Kind::Busy,
        "BusyError",
        false,
        "Every request slot or the command ring is full: poll, then retry.",
    ),
    (
        Kind::Transport,
        "TransportError",
        false,
        "A UCX call failed.",
    ),
    (
        Kind::Stopped,
        "ShutdownError",
        false,
        "The engine is shut down (or its poller died).",
    ),
];

static CLASSES: GILOnceCell<Vec<Py<PyType>>> = GILOnceCell::new();

/// Builds the subclasses with `type(name, bases, dict)`: some have two
/// bases (`KvpollError` and `ValueError`), which `create_exception!` cannot
/// express.
fn classes(py: Python<'_>) -> PyResult<&Vec<Py<PyType>>> {
    CLASSES.get_or_try_init(py, || {
        let base = py.get_type::<KvpollError>();
        let value_error = py.get_type::<PyValueError>();
        let meta = py.get_type::<PyType>();
        let mut out = Vec::with_capacity(KINDS.len());
        for (_, name, is_value, doc) in KINDS {
            let bases = if is_value {
                PyTuple::new(py, [base.clone(), value_error.clone()])?
            } else {
                PyTuple::new(py, [base.clone()])?
            };
            let dict = PyDict::new(py);
            dict.set_item("__module__", "kvpoll")?;
            dict.set_item("__doc__", doc)?;
            let class = meta.call1((name, bases, dict))?;
            out.push(class.downcast_into::<PyType>()?.unbind());
        }
        Ok(out)
    })
}

fn error(py: Python<'_>, kind: Option<Kind>, msg: String) -> PyErr {
    let Some(kind) = kind else {
        return KvpollError::new_err(msg);
    };
    match classes(py) {
        Ok(all) => {
            let i = KINDS.iter().position(|k| k.0 == kind).unwrap_or(0);
            PyErr::from_type(all[i].bind(py).clone(), msg)
        }
        Err(e) => e,
    }
}

/// The class of an engine error: its kind's.
fn engine_err(py: Python<'_>, e: impl Into<kvpoll::Error>) -> PyErr {
    let e: kvpoll::Error = e.into();
    let kind = Some(e.kind()).filter(|&k| k != Kind::Other);
    error(py, kind, e.to_string())
}

/// A refused request: named by the caller's id (`'req-B'`), not by its
/// 64-bit kvpoll id.
fn request_err(py: Python<'_>, req_id: &Bound<'_, PyAny>, e: SubmitError) -> PyErr {
    let state = match e {
        SubmitError::Duplicate(_) => "already in flight",
        SubmitError::UnknownRequest(_) => "not in flight",
        _ => return engine_err(py, e),
    };
    match req_id.repr() {
        Ok(repr) => error(
            py,
            Some(Kind::Request),
            format!("request {repr} is {state}"),
        ),
        Err(_) => engine_err(py, e),
    }
}

// ------------------------------------------------------------- arguments

/// Non-negative integer arguments: `OverflowError` (negative, too large)
/// becomes `ValueError`, anything but an int (or `bool`) a `TypeError`.
fn uint<T>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<T>
where
    T: for<'py> FromPyObject<'py>,
{
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be an int, not bool"
        )));
    }
    match obj.extract::<T>() {
        Ok(v) => Ok(v),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => Err(PyValueError::new_err(
            format!("{what} is out of range: {obj}"),
        )),
        Err(_) => Err(PyTypeError::new_err(format!(
            "{what} must be an int, not {}",
            type_name(obj)
        ))),
    }
}

/// An argument that is a non-negative int, with `uint`'s errors.
#[derive(Clone, Copy)]
struct UInt<T>(T);

impl<'py, T> FromPyObject<'py> for UInt<T>
where
    T: for<'a> FromPyObject<'a>,
{
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        uint::<T>(ob, "value").map(UInt)
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn seconds(s: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a finite, non-negative number of seconds, not {s}"
        ))
    })
}

fn block(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<BlockId> {
    uint::<u32>(obj, what).map(BlockId)
}

/// Appends the block ids of a list, tuple or other iterable of ints.
fn blocks_into(obj: &Bound<'_, PyAny>, what: &str, out: &mut Vec<BlockId>) -> PyResult<()> {
    if let Ok(list) = obj.downcast::<PyList>() {
        for x in list.iter() {
            out.push(block(&x, what)?);
        }
    } else if let Ok(tuple) = obj.downcast::<PyTuple>() {
        for x in tuple.iter() {
            out.push(block(&x, what)?);
        }
    } else if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "{what}s must be a sequence of ints, not {}",
            type_name(obj)
        )));
    } else {
        let iter = obj.try_iter().map_err(|_| {
            PyTypeError::new_err(format!(
                "{what}s must be a sequence of ints, not {}",
                type_name(obj)
            ))
        })?;
        for x in iter {
            out.push(block(&x?, what)?);
        }
    }
    Ok(())
}

/// Bytes of a `bytes`, `bytearray`, `memoryview` or other buffer, copied.
fn bytes_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u8>> {
    if let Ok(b) = obj.downcast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be bytes, not str"
        )));
    }
    // Any other buffer (bytearray, memoryview, numpy...), through
    // memoryview: `bytes(12)` would make 12 zero bytes of an int.
    let view = obj
        .py()
        .import("builtins")?
        .getattr("memoryview")?
        .call1((obj,))
        .map_err(|_| {
            PyTypeError::new_err(format!("{what} must be bytes-like, not {}", type_name(obj)))
        })?;
    let copied = view.call_method0("tobytes")?;
    view.call_method0("release")?;
    Ok(copied.downcast::<PyBytes>()?.as_bytes().to_vec())
}

// ----------------------------------------------------------- request ids

/// Set on every id made from a `str`; ints must stay below it.
const STR_FLAG: u64 = 1 << 63;

fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// kvpoll's id of a Python request id: an int in `0..2**63` is itself; a
/// str is the FNV-1a hash of its UTF-8 bytes with the top bit set. The same
/// in every process, so a producer's lend and a consumer's read of "req-7"
/// name one request.
fn request_key(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(s) = obj.downcast::<PyString>() {
        let text = s.to_cow()?;
        return Ok(STR_FLAG | (fnv1a64(text.as_bytes()) & !STR_FLAG));
    }
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(
            "a request id is a str or an int, not bool",
        ));
    }
    if obj.is_instance_of::<PyInt>() {
        return match obj.extract::<u64>() {
            Ok(v) if v < STR_FLAG => Ok(v),
            _ => Err(PyValueError::new_err(format!(
                "an int request id must be in 0..2**63, not {obj}"
            ))),
        };
    }
    Err(PyTypeError::new_err(format!(
        "a request id is a str or an int, not {}",
        type_name(obj)
    )))
}

/// kvpoll's 64-bit request id for a Python request id (`str` or `int`): what
/// a Rust or C peer must use to name the same request.
#[pyfunction]
fn request_id(req_id: &Bound<'_, PyAny>) -> PyResult<u64> {
    request_key(req_id)
}

/// `Cause::PeerLost` -> "peer_lost"; new causes get their names the same way.
fn cause_name(reason: &Reason) -> String {
    let debug = format!("{:?}", reason.cause);
    let mut out = String::with_capacity(debug.len() + 4);
    for (i, c) in debug.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// A fresh lend incarnation (64 random bits from the kernel's CSPRNG, never
/// 0), for a serving engine that hands out a lend's block ids before it
/// lends them: pass it to ``Engine.lend(..., incarnation=)``.
#[pyfunction]
fn draw_incarnation() -> u64 {
    Incarnation::draw().0
}

// -------------------------------------------------------------- Transfer

/// One handle of a read or write: the blocks moved with one remote rank.
///
/// ``local[i]`` pairs with ``remote[i]``; ``lend`` is the incarnation the
/// remote engine's ``lend`` returned (0 only for reads with confirmation
/// off). ``local_bytes`` and ``remote_bytes``, ``(start, end)`` byte
/// ranges within each block, move only that part of every block (the
/// heads one tensor-parallel rank holds); give both or neither. A plain
/// tuple ``(peer, local, remote, lend)`` or ``(peer, local, remote, lend,
/// local_bytes, remote_bytes)`` works everywhere a ``Transfer`` does.
#[pyclass(module = "kvpoll", frozen)]
struct Transfer {
    /// The remote rank, as returned by ``Engine.add_peer``.
    #[pyo3(get)]
    peer: u32,
    local: Vec<BlockId>,
    remote: Vec<BlockId>,
    /// The remote lend's (or receive's) incarnation.
    #[pyo3(get)]
    lend: u64,
    /// The bytes of each local and remote block moved (whole blocks if none).
    #[pyo3(get)]
    local_bytes: Option<(u64, u64)>,
    #[pyo3(get)]
    remote_bytes: Option<(u64, u64)>,
}

/// A ``(start, end)`` byte range of a block.
fn byte_range(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<(u64, u64)> {
    let Ok(t) = obj.downcast::<PyTuple>() else {
        return Err(PyTypeError::new_err(format!(
            "{what} is a (start, end) tuple of byte offsets, not {}",
            type_name(obj)
        )));
    };
    if t.len() != 2 {
        return Err(PyValueError::new_err(format!(
            "{what} is a (start, end) tuple of byte offsets; got {} items",
            t.len()
        )));
    }
    let start = uint::<u64>(&t.get_item(0)?, what)?;
    let end = uint::<u64>(&t.get_item(1)?, what)?;
    if end < start {
        return Err(PyValueError::new_err(format!(
            "{what} ({start}, {end}) ends before it starts"
        )));
    }
    Ok((start, end))
}

/// Both byte ranges or neither.
fn parts_of(
    local: Option<&Bound<'_, PyAny>>,
    remote: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<((u64, u64), (u64, u64))>> {
    match (local, remote) {
        (None, None) => Ok(None),
        (Some(l), Some(r)) if l.is_none() && r.is_none() => Ok(None),
        (Some(l), Some(r)) if !l.is_none() && !r.is_none() => Ok(Some((
            byte_range(l, "local_bytes")?,
            byte_range(r, "remote_bytes")?,
        ))),
        _ => Err(PyValueError::new_err(
            "give both local_bytes and remote_bytes, or neither",
        )),
    }
}

#[pymethods]
impl Transfer {
    #[new]
    #[pyo3(signature = (peer, local, remote, lend=UInt(0), local_bytes=None, remote_bytes=None))]
    fn new(
        peer: &Bound<'_, PyAny>,
        local: &Bound<'_, PyAny>,
        remote: &Bound<'_, PyAny>,
        lend: UInt<u64>,
        local_bytes: Option<&Bound<'_, PyAny>>,
        remote_bytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let peer = uint::<u32>(peer, "peer")?;
        let (mut l, mut r) = (Vec::new(), Vec::new());
        blocks_into(local, "local block id", &mut l)?;
        blocks_into(remote, "remote block id", &mut r)?;
        let part = parts_of(local_bytes, remote_bytes)?;
        Ok(Transfer {
            peer,
            local: l,
            remote: r,
            lend: lend.0,
            local_bytes: part.map(|p| p.0),
            remote_bytes: part.map(|p| p.1),
        })
    }

    /// Local block ids.
    #[getter]
    fn local(&self) -> Vec<u32> {
        self.local.iter().map(|b| b.0).collect()
    }

    /// Remote block ids, as many as local ones.
    #[getter]
    fn remote(&self) -> Vec<u32> {
        self.remote.iter().map(|b| b.0).collect()
    }

    fn __repr__(&self) -> String {
        let part = match (self.local_bytes, self.remote_bytes) {
            (Some(l), Some(r)) => format!(", local_bytes={l:?}, remote_bytes={r:?}"),
            _ => String::new(),
        };
        format!(
            "Transfer(peer={}, local={:?}, remote={:?}, lend={:#x}{part})",
            self.peer,
            self.local(),
            self.remote(),
            self.lend
        )
    }
}

// ------------------------------------------------------------ PollResult

/// What one ``Engine.poll()`` reported. Each request appears in exactly one
/// of ``finished_recving``, ``finished_sending``, ``failed_recving`` and
/// ``expired``, once over the engine's life; ``handle_failures`` is
/// informational (the request is reported later, when every sibling
/// handle stopped). ``len(result)`` counts the reports; an empty result is
/// false.
///
/// A poll with nothing new returns one shared empty result, whose
/// attributes are new empty containers at every access.
#[pyclass(module = "kvpoll", frozen)]
#[derive(Default)]
struct PollResult {
    recving: Vec<PyObject>,
    sending: Vec<PyObject>,
    expired: Vec<PyObject>,
    failed: Vec<(PyObject, Vec<u32>, Reason)>,
    failed_send: Vec<(PyObject, Reason)>,
    handle_failures: Vec<(PyObject, u8, Reason)>,
    /// The Python objects handed out, built on first access (so that
    /// `r.finished_recving is r.finished_recving`).
    cache: [OnceLock<PyObject>; 7],
}

impl PollResult {
    fn cached(
        &self,
        py: Python<'_>,
        slot: usize,
        make: impl FnOnce(&Self, Python<'_>) -> PyResult<PyObject>,
    ) -> PyResult<PyObject> {
        if self.count() == 0 {
            return make(self, py);
        }
        if let Some(o) = self.cache[slot].get() {
            return Ok(o.clone_ref(py));
        }
        let o = make(self, py)?;
        // Another thread may have filled the slot meanwhile: hand out the
        // one that stays.
        Ok(match self.cache[slot].set(o.clone_ref(py)) {
            Ok(()) => o,
            Err(_) => self.cache[slot].get().map_or(o, |kept| kept.clone_ref(py)),
        })
    }

    fn set_of(py: Python<'_>, ids: &[PyObject]) -> PyResult<PyObject> {
        Ok(PySet::new(py, ids)?.into_any().unbind())
    }

    fn count(&self) -> usize {
        self.recving.len()
            + self.sending.len()
            + self.expired.len()
            + self.failed.len()
            + self.failed_send.len()
            + self.handle_failures.len()
    }
}

#[pymethods]
impl PollResult {
    /// Reads (and receives) whose data is all here: ``set`` of ids.
    #[getter]
    fn finished_recving(&self, py: Python<'_>) -> PyResult<PyObject> {
        self.cached(py, 0, |s, py| Self::set_of(py, &s.recving))
    }

    /// Writes every consumer acknowledged, and lends every reader notified:
    /// their source blocks are free. ``set`` of ids.
    #[getter]
    fn finished_sending(&self, py: Python<'_>) -> PyResult<PyObject> {
        self.cached(py, 1, |s, py| Self::set_of(py, &s.sending))
    }

    /// Writes and lends whose lease ended first: their blocks are free, the
    /// transfer is not done. ``set`` of ids.
    #[getter]
    fn expired(&self, py: Python<'_>) -> PyResult<PyObject> {
        self.cached(py, 2, |s, py| Self::set_of(py, &s.expired))
    }

    /// Receives that failed, reported once every handle stopped: ``dict``
    /// of id -> list of local block ids whose contents are invalid.
    #[getter]
    fn failed_recving(&self, py: Python<'_>) -> PyResult<PyObject> {
        self.cached(py, 3, |s, py| {
            let d = PyDict::new(py);
            for (id, blocks, _) in &s.failed {
                d.set_item(id, blocks)?;
            }
            Ok(d.into_any().unbind())
        })
    }

    /// Writes that failed or were aborted, reported once every handle
    /// stopped (never done; their source blocks are free): ``dict`` of id ->
    /// ``(cause, status)``.
    #[getter]
    fn failed_sending(&self, py: Python<'_>) -> PyResult<PyObject> {
        self.cached(py, 6, |s, py| {
            let d = PyDict::new(py);
            for (id, reason) in &s.failed_send {
                d.set_item(id, (cause_name(reason), reason.status.code()))?;
            }
            Ok(d.into_any().unbind())
        })
    }

    /// Why each of ``failed_recving`` failed: ``dict`` of id ->
    /// ``(cause, status)``, the first failure's cause (``"setup"``,
    /// ``"transfer"``, ``"peer_lost"``, ``"deadline"``, ``"aborted"``...) and
    /// the transport's status code (0 when none).
    #[getter]
    fn failure_reasons(&self, py: Python<'_>) -> PyResult<PyObject> {
        self.cached(py, 4, |s, py| {
            let d = PyDict::new(py);
            for (id, _, reason) in &s.failed {
                d.set_item(id, (cause_name(reason), reason.status.code()))?;
            }
            Ok(d.into_any().unbind())
        })
    }

    /// Informational: ``list`` of ``(id, handle, cause, status)``, one per
    /// failed handle (its index in the request's handles). The request
    /// itself is reported later, once every sibling handle stopped.
    #[getter]
    fn handle_failures(&self, py: Python<'_>) -> PyResult<PyObject> {
        self.cached(py, 5, |s, py| {
            let l = PyList::empty(py);
            for (id, handle, reason) in &s.handle_failures {
                l.append((id, *handle, cause_name(reason), reason.status.code()))?;
            }
            Ok(l.into_any().unbind())
        })
    }

    fn __len__(&self) -> usize {
        self.count()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let parts = [
            ("finished_recving", self.finished_recving(py)?),
            ("finished_sending", self.finished_sending(py)?),
            ("failed_recving", self.failed_recving(py)?),
            ("failed_sending", self.failed_sending(py)?),
            ("expired", self.expired(py)?),
            ("handle_failures", self.handle_failures(py)?),
        ];
        let mut s = String::from("PollResult(");
        for (i, (name, v)) in parts.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            s.push_str(name);
            s.push('=');
            s.push_str(&v.bind(py).repr()?.to_cow()?);
        }
        s.push(')');
        Ok(s)
    }
}

// ---------------------------------------------------------------- Engine

/// The Rust engine, reachable only through `&mut`: it is `Send` but not
/// `Sync` (its rings' ends are single-owner), and a pyclass must be both.
/// Without any `&self` access to the engine, sharing `&Exclusive` between
/// threads can reach nothing, so it is `Sync` (the `SyncWrapper` pattern).
struct Exclusive<T>(T);

// SAFETY: no method gives access to the inner value through `&self`.
unsafe impl<T: Send> Sync for Exclusive<T> {}

impl<T> Exclusive<T> {
    fn get(&mut self) -> &mut T {
        &mut self.0
    }
}

/// One handle as parsed: peer and its ranges in the scratch block lists.
#[derive(Clone, Copy)]
struct Span {
    peer: PeerId,
    local: (usize, usize),
    remote: (usize, usize),
    lend: Incarnation,
    /// The local and remote byte ranges of each block, if a part.
    part: Option<((u64, u64), (u64, u64))>,
}

/// A kvpoll engine: one poller thread that owns the UCX worker, moving
/// KV-cache blocks to and from peers, and reporting each request exactly
/// once through ``poll()``.
///
/// - ``block_size``: bytes per block in every region (one region per KV
///   layer); peers must agree on it.
/// - ``core``: pin the poller to this CPU (``None``: not pinned).
/// - ``idle``: ``"adaptive"`` (spin, back off, park: near-zero idle CPU) or
///   ``"busy"`` (spin forever, for a dedicated core only).
/// - ``read_deadline_s``: a read still in flight after this fails.
/// - ``lend_grace_s``: how long a read whose data landed waits for a lend
///   its lender has not taken yet (the lender answered its response
///   before its worker lent), and how long a lender holds a word that came
///   before its lend; ``None``: the engine's default (5 s).
/// - ``tls``: UCX transport list (``UCX_TLS``), e.g. ``"tcp"``; ``None``
///   lets UCX choose.
/// - ``slots``, ``max_blocks``: requests tracked at once, local blocks per
///   request.
/// - ``confirm_reads``: a read finishes only once each lender confirmed its
///   lend was live for the whole read (default); ``False`` only for reads
///   of memory no lend guards.
/// - ``remote_write``: whether peers may write into this engine's blocks
///   (default ``True``). Only a push destination needs it; ``False`` for a
///   pull-only prefill or decode: ``receive`` is then refused
///   (``ConfigError``), and over ``tls="tcp"`` alone peers' writes are
///   refused and the engine cannot ``write`` either.
/// - ``auth_key``: the secret (``bytes``, at least 16) the deployment's
///   engines share: metadata and notifications are then tagged with it,
///   ``add_peer`` refuses a peer without it or with another (``PeerError``)
///   and notifications without it are dropped; each is counted
///   (``poller_stats()``). ``None`` (default): no key (unless the test
///   hook ``KVPOLL_TEST_AUTH_KEY`` gives one, so that a test suite runs
///   keyed); a keyed peer's metadata is refused. It authenticates, it
///   does not encrypt.
///
/// Request ids are ``str`` or ``int``; reports give back the same objects.
/// Use it as a context manager (``with Engine(...) as e:``) or call
/// ``shutdown()``. Methods that wait for the poller release the GIL;
/// ``poll()`` and submits do not need to.
#[pyclass(module = "kvpoll")]
struct Engine {
    // Dropped first (its Drop shuts the poller down), before the buffers
    // registered from Python are released.
    inner: Exclusive<RsEngine>,
    block_size: u64,
    out: Outcomes,
    ids: HashMap<u64, PyObject>,
    locals: Vec<BlockId>,
    remotes: Vec<BlockId>,
    spans: Vec<Span>,
    keys: Vec<RequestId>,
    shut_down: bool,
    /// What a poll with nothing new returns (no allocation).
    empty: Py<PollResult>,
    /// ctypes views of buffers registered with `register_buffer`: each
    /// holds its buffer exported (so it cannot move or be freed) until the
    /// engine is gone.
    views: Vec<PyObject>,
}

fn transfers<'a>(
    spans: &[Span],
    locals: &'a [BlockId],
    remotes: &'a [BlockId],
) -> Vec<RsTransfer<'a>> {
    spans
        .iter()
        .map(|s| RsTransfer {
            peer: s.peer,
            local: &locals[s.local.0..s.local.1],
            remote: &remotes[s.remote.0..s.remote.1],
            lend: s.lend,
        })
        .collect()
}

/// The handles as part transfers when any of them is one (the others
/// whole blocks of `block_size` on both sides); `None` when none is.
fn part_transfers<'a>(
    spans: &[Span],
    t: &[RsTransfer<'a>],
    block_size: u64,
) -> Option<Vec<PartTransfer<'a>>> {
    spans.iter().any(|s| s.part.is_some()).then(|| {
        spans
            .iter()
            .zip(t)
            .map(|(s, &t)| {
                let ((l0, l1), (r0, r1)) = s.part.unwrap_or(((0, block_size), (0, block_size)));
                t.part(l0..l1, r0..r1)
            })
            .collect()
    })
}

impl Engine {
    /// A lend (pull) or receive (push) of ``n`` remote engines.
    #[allow(clippy::too_many_arguments)]
    fn expose(
        &mut self,
        py: Python<'_>,
        req_id: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        n: u32,
        receive: bool,
        lease_s: f64,
        incarnation: Option<UInt<u64>>,
    ) -> PyResult<u64> {
        let key = request_key(req_id)?;
        let lease = seconds(lease_s, "lease_s")?;
        self.check_unique(py, req_id, key)?;
        self.locals.clear();
        blocks_into(blocks, "block id", &mut self.locals)?;
        let inc = match incarnation {
            Some(UInt(0)) => {
                return Err(PyValueError::new_err(
                    "incarnation 0 names no lend: draw one with kvpoll.draw_incarnation()",
                ))
            }
            Some(UInt(i)) => Incarnation(i),
            None => Incarnation::draw(),
        };
        let engine = self.inner.get();
        let (id, blocks) = (RequestId(key), &self.locals);
        if receive {
            engine.receive_with(id, blocks, n, lease, inc)
        } else {
            engine.lend_with(id, blocks, n, lease, inc)
        }
        .map_err(|e| request_err(py, req_id, e))?;
        self.ids.insert(key, req_id.clone().unbind());
        Ok(inc.0)
    }

    /// Parses `handles` into the scratch lists.
    fn parse_handles(&mut self, handles: &Bound<'_, PyAny>) -> PyResult<()> {
        self.locals.clear();
        self.remotes.clear();
        self.spans.clear();
        if handles.is_instance_of::<PyString>() || handles.is_instance_of::<PyBytes>() {
            return Err(PyTypeError::new_err(
                "handles must be a sequence of Transfer or (peer, local, remote, lend) tuples",
            ));
        }
        let iter = handles.try_iter().map_err(|_| {
            PyTypeError::new_err(format!(
                "handles must be a sequence of Transfer or (peer, local, remote, lend) tuples, not {}",
                type_name(handles)
            ))
        })?;
        for h in iter {
            let h = h?;
            let (l0, r0) = (self.locals.len(), self.remotes.len());
            let (peer, lend, part) = if let Ok(t) = h.downcast::<Transfer>() {
                let t = t.get();
                self.locals.extend_from_slice(&t.local);
                self.remotes.extend_from_slice(&t.remote);
                (t.peer, t.lend, t.local_bytes.zip(t.remote_bytes))
            } else if let Ok(tuple) = h.downcast::<PyTuple>() {
                if !matches!(tuple.len(), 3 | 4 | 6) {
                    return Err(PyValueError::new_err(format!(
                        "a handle tuple is (peer, local_blocks, remote_blocks), (peer, local_blocks, remote_blocks, lend) or (peer, local_blocks, remote_blocks, lend, local_bytes, remote_bytes); got {} items",
                        tuple.len()
                    )));
                }
                let peer = uint::<u32>(&tuple.get_item(0)?, "peer")?;
                blocks_into(&tuple.get_item(1)?, "local block id", &mut self.locals)?;
                blocks_into(&tuple.get_item(2)?, "remote block id", &mut self.remotes)?;
                let lend = match tuple.len() {
                    3 => 0,
                    _ => uint::<u64>(&tuple.get_item(3)?, "lend incarnation")?,
                };
                let part = match tuple.len() {
                    6 => parts_of(Some(&tuple.get_item(4)?), Some(&tuple.get_item(5)?))?,
                    _ => None,
                };
                (peer, lend, part)
            } else {
                return Err(PyTypeError::new_err(format!(
                    "a handle is a Transfer or a (peer, local_blocks, remote_blocks, lend) tuple, not {}",
                    type_name(&h)
                )));
            };
            self.spans.push(Span {
                peer: PeerId(peer),
                local: (l0, self.locals.len()),
                remote: (r0, self.remotes.len()),
                lend: Incarnation(lend),
                part,
            });
        }
        Ok(())
    }

    /// Refuses a new request whose kvpoll id is held by another, unequal
    /// Python id still in flight (two strings with one hash). An equal one
    /// is left to the engine, which refuses the duplicate.
    fn check_unique(&self, py: Python<'_>, req_id: &Bound<'_, PyAny>, key: u64) -> PyResult<()> {
        if let Some(prev) = self.ids.get(&key) {
            let prev = prev.bind(py);
            if !prev.eq(req_id)? {
                return Err(error(
                    py,
                    Some(Kind::Request),
                    format!(
                        "request id {} maps to kvpoll id {key:#x}, held by {} which is still in flight",
                        req_id.repr()?,
                        prev.repr()?
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The Python id of a terminal report, forgetting it.
    fn take_id(&mut self, py: Python<'_>, id: RequestId) -> PyResult<PyObject> {
        match self.ids.remove(&id.0) {
            Some(o) => Ok(o),
            None => Ok(id.0.into_pyobject(py)?.into_any().unbind()),
        }
    }

    fn peek_id(&self, py: Python<'_>, id: RequestId) -> PyResult<PyObject> {
        match self.ids.get(&id.0) {
            Some(o) => Ok(o.clone_ref(py)),
            None => Ok(id.0.into_pyobject(py)?.into_any().unbind()),
        }
    }

    #[cfg(feature = "cuda")]
    fn register_device(&mut self, py: Python<'_>, addr: u64, len: usize) -> PyResult<usize> {
        let inner = self.inner.get();
        // SAFETY: the object exporting the device memory is kept by the
        // engine (views) until it is dropped, so the memory stays allocated.
        py.allow_threads(move || unsafe { inner.register_device_memory(addr, len) })
            .map_err(|e| engine_err(py, e))
    }

    #[cfg(not(feature = "cuda"))]
    fn register_device(&mut self, py: Python<'_>, addr: u64, len: usize) -> PyResult<usize> {
        // device_memory_refusal refuses every CUDA array without the feature.
        let _ = (addr, len);
        Err(error(
            py,
            Some(Kind::Region),
            "built without the cuda feature".into(),
        ))
    }

    fn register_raw(&mut self, py: Python<'_>, addr: usize, len: usize) -> PyResult<usize> {
        let inner = self.inner.get();
        // SAFETY: the caller of register_buffer vouches for addr..addr+len
        // (a tuple), or it is the exported buffer of a Python object that
        // a ctypes view keeps exported until the engine is dropped.
        py.allow_threads(move || unsafe { inner.register_memory(addr as *mut u8, len) })
            .map_err(|e| engine_err(py, e))
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (block_size=UInt(16384), *, core=None, idle="adaptive", read_deadline_s=30.0, lend_grace_s=None, tls=None, slots=UInt(1024), max_blocks=UInt(512), confirm_reads=true, remote_write=true, auth_key=None))]
    #[pyo3(
        text_signature = "(block_size=16384, *, core=None, idle=\"adaptive\", read_deadline_s=30.0, lend_grace_s=None, tls=None, slots=1024, max_blocks=512, confirm_reads=True, remote_write=True, auth_key=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        block_size: UInt<u64>,
        core: Option<UInt<usize>>,
        idle: &str,
        read_deadline_s: f64,
        lend_grace_s: Option<f64>,
        tls: Option<String>,
        slots: UInt<u32>,
        max_blocks: UInt<u32>,
        confirm_reads: bool,
        remote_write: bool,
        auth_key: Option<Vec<u8>>,
    ) -> PyResult<Self> {
        let auth = match auth_key {
            None => None,
            Some(secret) => Some(
                kvpoll::auth::AuthKey::from_secret(&secret)
                    .map_err(|e| PyValueError::new_err(format!("auth_key: {e}")))?,
            ),
        };
        let block_size = block_size.0;
        let core = core.map(|c| c.0);
        let idle = match idle {
            "adaptive" => IdlePolicy::Adaptive,
            "busy" => IdlePolicy::Busy,
            other => {
                return Err(PyValueError::new_err(format!(
                    "idle must be \"adaptive\" or \"busy\", not {other:?}"
                )))
            }
        };
        let deadline = seconds(read_deadline_s, "read_deadline_s")?;
        let grace = lend_grace_s
            .map(|g| seconds(g, "lend_grace_s"))
            .transpose()?;
        let (slots, max_blocks) = (slots.0, max_blocks.0);
        let ucx = match tls {
            Some(t) => ContextOptions::with_transports(&t),
            None => ContextOptions::default(),
        };
        let mut builder = RsEngine::builder()
            .block_size(block_size)
            .core(core)
            .idle(idle)
            .read_deadline(deadline)
            .confirm_reads(confirm_reads)
            .remote_write(remote_write)
            .ledger(slots, max_blocks)
            .ucx(ucx);
        if let Some(grace) = grace {
            builder = builder.lend_grace(grace);
        }
        // Without one, the library's test hook may give it the test
        // suite's key (KVPOLL_TEST_AUTH_KEY).
        if let Some(key) = auth {
            builder = builder.auth_key(Some(key));
        }
        let inner = py
            .allow_threads(move || builder.build())
            .map_err(|e| engine_err(py, e))?;
        Ok(Engine {
            inner: Exclusive(inner),
            block_size,
            out: Outcomes::default(),
            ids: HashMap::new(),
            locals: Vec::new(),
            remotes: Vec::new(),
            spans: Vec::new(),
            keys: Vec::new(),
            shut_down: false,
            empty: Py::new(py, PollResult::default())?,
            views: Vec::new(),
        })
    }

    /// Registers a region of ``n_blocks`` blocks (one KV layer), allocated
    /// by UCX in host memory. Every region must hold the same number of
    /// blocks. Returns the region's index.
    #[pyo3(signature = (n_blocks))]
    fn register(&mut self, py: Python<'_>, n_blocks: &Bound<'_, PyAny>) -> PyResult<usize> {
        let n = uint::<u64>(n_blocks, "n_blocks")?;
        let inner = self.inner.get();
        py.allow_threads(move || inner.register(n))
            .map_err(|e| engine_err(py, e))
    }

    /// Registers memory the caller owns as a region (one KV layer) of
    /// ``nbytes / block_size`` blocks. ``obj`` is either
    ///
    /// - a writable, C-contiguous object with the buffer protocol (a numpy
    ///   array, a ``bytearray``): the engine keeps it exported, so it can
    ///   neither move nor be freed while the engine lives; or
    /// - a ``(ptr, nbytes)`` tuple, e.g. ``(t.data_ptr(), t.numel() *
    ///   t.element_size())`` for a torch tensor in host memory: the caller
    ///   must keep that memory allocated until the engine is shut down.
    ///
    /// - a contiguous CUDA tensor or array (torch, or anything with
    ///   ``__cuda_array_interface__``): registered as device memory, so UCX
    ///   moves it over its CUDA transports; the engine keeps the object.
    ///   Refused with ``RegionError``, naming what is missing, unless this
    ///   build has the cuda feature, the CUDA driver loads and the loaded
    ///   UCX has CUDA transports (``device_memory()``).
    ///
    /// Returns the region's index.
    #[pyo3(signature = (obj))]
    fn register_buffer(&mut self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<usize> {
        if is_cuda_object(obj) {
            // A malformed array is refused as such first, on any machine.
            let (addr, len) = cuda_range(obj)?;
            if let Some(why) = device_memory_refusal(py) {
                return Err(error(
                    py,
                    Some(Kind::Region),
                    format!("a CUDA array cannot be registered: {why}"),
                ));
            }
            let region = self.register_device(py, addr, len)?;
            self.views.push(obj.clone().unbind());
            return Ok(region);
        }
        if let Ok(t) = obj.downcast::<PyTuple>() {
            if t.len() != 2 {
                return Err(PyValueError::new_err(
                    "a raw region is a (ptr, nbytes) tuple",
                ));
            }
            let addr = uint::<usize>(&t.get_item(0)?, "ptr")?;
            let len = uint::<usize>(&t.get_item(1)?, "nbytes")?;
            if addr == 0 || len == 0 {
                return Err(PyValueError::new_err(format!(
                    "a raw region needs a non-null ptr and nbytes > 0, got ({addr:#x}, {len})"
                )));
            }
            return self.register_raw(py, addr, len);
        }
        // The buffer protocol is not in the stable ABI before 3.11: go
        // through memoryview (checks) and ctypes (address, kept exported).
        let view = py
            .import("builtins")?
            .getattr("memoryview")?
            .call1((obj,))
            .map_err(|_| {
                PyTypeError::new_err(format!(
                    "register_buffer takes a buffer (numpy array, bytearray...) or a (ptr, nbytes) tuple, not {}",
                    type_name(obj)
                ))
            })?;
        let readonly: bool = view.getattr("readonly")?.extract()?;
        let contiguous: bool = view.getattr("c_contiguous")?.extract()?;
        let nbytes: usize = view.getattr("nbytes")?.extract()?;
        view.call_method0("release")?;
        if readonly {
            return Err(PyValueError::new_err("the buffer is read-only"));
        }
        if !contiguous {
            return Err(PyValueError::new_err("the buffer is not C-contiguous"));
        }
        if nbytes == 0 {
            return Err(PyValueError::new_err("the buffer is empty"));
        }
        let ctypes = py.import("ctypes")?;
        let array_type = ctypes
            .getattr("c_char")?
            .call_method1("__mul__", (nbytes,))?;
        let exported = array_type.call_method1("from_buffer", (obj,))?;
        let addr: usize = ctypes
            .getattr("addressof")?
            .call1((&exported,))?
            .extract()?;
        let region = self.register_raw(py, addr, nbytes)?;
        self.views.push(exported.unbind());
        Ok(region)
    }

    /// This engine's metadata for its peers (worker address, region keys,
    /// layout), versioned and checksummed: ``bytes`` to hand to
    /// ``add_peer`` on the other side.
    fn local_metadata(&mut self, py: Python<'_>) -> PyResult<Py<PyBytes>> {
        let inner = self.inner.get();
        let meta = py
            .allow_threads(move || inner.local_metadata())
            .map_err(|e| engine_err(py, e))?;
        Ok(PyBytes::new(py, &meta).unbind())
    }

    /// Adds a peer from its ``local_metadata()`` bytes; returns its peer id
    /// (an ``int``) for handles. Bad metadata raises ``PeerError`` and
    /// changes nothing.
    ///
    /// ``any_block_size=True`` accepts a peer whose blocks are of another
    /// size (a tensor-parallel rank holding another share of the heads):
    /// only handles with ``local_bytes``/``remote_bytes`` reach it then.
    #[pyo3(signature = (metadata, any_block_size=false))]
    fn add_peer(
        &mut self,
        py: Python<'_>,
        metadata: &Bound<'_, PyAny>,
        any_block_size: bool,
    ) -> PyResult<u32> {
        let meta = bytes_of(metadata, "metadata")?;
        let inner = self.inner.get();
        py.allow_threads(move || {
            if any_block_size {
                inner.add_peer_any_block_size(&meta)
            } else {
                inner.add_peer(&meta)
            }
        })
        .map(|p| p.0)
        .map_err(|e| engine_err(py, e))
    }

    /// Removes a peer: its handles in flight fail (reported as usual, once
    /// every sibling stopped), its endpoint is closed.
    #[pyo3(signature = (peer))]
    fn remove_peer(&mut self, py: Python<'_>, peer: &Bound<'_, PyAny>) -> PyResult<()> {
        let peer = PeerId(uint::<u32>(peer, "peer")?);
        let inner = self.inner.get();
        py.allow_threads(move || inner.remove_peer(peer))
            .map_err(|e| engine_err(py, e))
    }

    /// Pull: reads ``handles`` (``Transfer`` or ``(peer, local_blocks,
    /// remote_blocks)``, one per remote rank). Reported in
    /// ``finished_recving``, or in ``failed_recving`` with the blocks to
    /// invalidate once every handle stopped. On success each producer is
    /// notified (releasing its lend of the same id). No handles: a full
    /// prefix hit, finished at once. ``deadline_s`` overrides the engine's
    /// read deadline for this read.
    #[pyo3(signature = (req_id, handles, deadline_s=None))]
    fn read(
        &mut self,
        py: Python<'_>,
        req_id: &Bound<'_, PyAny>,
        handles: &Bound<'_, PyAny>,
        deadline_s: Option<f64>,
    ) -> PyResult<()> {
        let key = request_key(req_id)?;
        let deadline = deadline_s.map(|d| seconds(d, "deadline_s")).transpose()?;
        self.check_unique(py, req_id, key)?;
        self.parse_handles(handles)?;
        let t = transfers(&self.spans, &self.locals, &self.remotes);
        let engine = self.inner.get();
        let parts = part_transfers(&self.spans, &t, engine.block_size());
        match (parts, deadline) {
            (Some(p), d) => engine.read_parts(RequestId(key), &p, d),
            (None, Some(d)) => engine.read_with_deadline(RequestId(key), &t, d),
            (None, None) => engine.read(RequestId(key), &t),
        }
        .map_err(|e| request_err(py, req_id, e))?;
        self.ids.insert(key, req_id.clone().unbind());
        Ok(())
    }

    /// Push: writes ``handles`` into remote blocks the consumers lent with
    /// ``receive(..., writers=n)``. Reported in ``finished_sending`` only after
    /// every write completed and ``expected_acks`` acknowledgements
    /// arrived; else ``expired`` when ``lease_s`` ends.
    #[pyo3(signature = (req_id, handles, expected_acks=UInt(1), lease_s=30.0))]
    #[pyo3(text_signature = "($self, req_id, handles, expected_acks=1, lease_s=30.0)")]
    fn write(
        &mut self,
        py: Python<'_>,
        req_id: &Bound<'_, PyAny>,
        handles: &Bound<'_, PyAny>,
        expected_acks: UInt<u32>,
        lease_s: f64,
    ) -> PyResult<()> {
        let key = request_key(req_id)?;
        let acks = expected_acks.0;
        let lease = seconds(lease_s, "lease_s")?;
        self.check_unique(py, req_id, key)?;
        self.parse_handles(handles)?;
        let t = transfers(&self.spans, &self.locals, &self.remotes);
        let engine = self.inner.get();
        match part_transfers(&self.spans, &t, engine.block_size()) {
            Some(p) => engine.write_parts(RequestId(key), &p, acks, lease),
            None => engine.write(RequestId(key), &t, acks, lease),
        }
        .map_err(|e| request_err(py, req_id, e))?;
        self.ids.insert(key, req_id.clone().unbind());
        Ok(())
    }

    /// Pull: lends local ``blocks`` until ``readers`` remote engines read
    /// them and notified (then ``finished_sending``), or ``lease_s`` ends
    /// (then ``expired``).
    ///
    /// Returns the lend's incarnation (an int): hand it to the readers with
    /// the block ids; their handles name it. ``incarnation`` lends under
    /// one drawn earlier with ``kvpoll.draw_incarnation()`` (and perhaps
    /// handed out already: a read may then arrive first).
    #[pyo3(signature = (req_id, blocks, *, readers, lease_s=30.0, incarnation=None))]
    fn lend(
        &mut self,
        py: Python<'_>,
        req_id: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        readers: &Bound<'_, PyAny>,
        lease_s: f64,
        incarnation: Option<UInt<u64>>,
    ) -> PyResult<u64> {
        let n = uint::<u32>(readers, "readers")?;
        self.expose(py, req_id, blocks, n, false, lease_s, incarnation)
    }

    /// Push: opens a receive, local ``blocks`` that ``writers`` remote
    /// engines write into and notify; when all did, the data is here
    /// (``finished_recving``); otherwise ``failed_recving`` names them.
    ///
    /// Returns the receive's incarnation (an int): hand it to the writers
    /// with the block ids. ``incarnation`` as for :meth:`lend`.
    #[pyo3(signature = (req_id, blocks, *, writers, lease_s=30.0, incarnation=None))]
    fn receive(
        &mut self,
        py: Python<'_>,
        req_id: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        writers: &Bound<'_, PyAny>,
        lease_s: f64,
        incarnation: Option<UInt<u64>>,
    ) -> PyResult<u64> {
        let n = uint::<u32>(writers, "writers")?;
        self.expose(py, req_id, blocks, n, true, lease_s, incarnation)
    }

    /// Nothing to read (a full prefix hit), but each of ``producers``
    /// (``(peer, lend incarnation)`` pairs) lent blocks for ``req_id``: each
    /// is told once, so it releases them at once. Nothing is reported here.
    #[pyo3(signature = (req_id, producers))]
    fn notify_only(
        &mut self,
        py: Python<'_>,
        req_id: &Bound<'_, PyAny>,
        producers: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let key = request_key(req_id)?;
        let mut peers = Vec::new();
        for p in producers.try_iter()? {
            let p = p?;
            let pair = p
                .downcast::<PyTuple>()
                .ok()
                .filter(|t| t.len() == 2)
                .ok_or_else(|| {
                    PyTypeError::new_err(format!(
                        "a producer is a (peer, lend incarnation) pair, not {}",
                        type_name(&p)
                    ))
                })?;
            peers.push((
                PeerId(uint::<u32>(&pair.get_item(0)?, "producer")?),
                Incarnation(uint::<u64>(&pair.get_item(1)?, "lend incarnation")?),
            ));
        }
        self.inner
            .get()
            .notify_only(RequestId(key), &peers)
            .map_err(|e| request_err(py, req_id, e))
    }

    /// Extends the leases of these writes or lends to ``extend_s`` from now
    /// (never shortening). Unknown ids are ignored.
    #[pyo3(signature = (ids, extend_s))]
    fn heartbeat(&mut self, py: Python<'_>, ids: &Bound<'_, PyAny>, extend_s: f64) -> PyResult<()> {
        let extend = seconds(extend_s, "extend_s")?;
        if ids.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(
                "heartbeat takes a sequence of request ids, not one str",
            ));
        }
        self.keys.clear();
        let iter = ids.try_iter().map_err(|_| {
            PyTypeError::new_err(format!(
                "heartbeat takes a sequence of request ids, not {}",
                type_name(ids)
            ))
        })?;
        for id in iter {
            self.keys.push(RequestId(request_key(&id?)?));
        }
        self.inner
            .get()
            .heartbeat(&self.keys, extend)
            .map_err(|e| engine_err(py, e))
    }

    /// Aborts a request. It alone is affected: what is not posted is
    /// cancelled, what is posted completes or fails on its own (past the
    /// request's deadline its peers are judged stalled), and it is reported
    /// failed (cause ``"aborted"``) once quiescent. ``RequestError`` if it is
    /// not in flight.
    #[pyo3(signature = (req_id))]
    fn abort(&mut self, py: Python<'_>, req_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let key = request_key(req_id)?;
        self.inner
            .get()
            .abort(RequestId(key))
            .map_err(|e| request_err(py, req_id, e))
    }

    /// Collects what happened since the last poll (see ``PollResult``).
    /// Cheap when nothing happened: call it every engine step.
    fn poll(&mut self, py: Python<'_>) -> PyResult<Py<PollResult>> {
        self.out.clear();
        self.inner.get().poll(&mut self.out);
        if self.out.is_empty() {
            return Ok(self.empty.clone_ref(py));
        }
        let mut r = PollResult::default();
        let out = std::mem::take(&mut self.out);
        // Informational first: a request may fail and be reported in the
        // same poll, after which its id is forgotten.
        for &(id, handle, reason) in &out.handle_failures {
            r.handle_failures
                .push((self.peek_id(py, id)?, handle, reason));
        }
        for &id in &out.finished_recving {
            r.recving.push(self.take_id(py, id)?);
        }
        for &id in &out.finished_sending {
            r.sending.push(self.take_id(py, id)?);
        }
        for &id in &out.expired {
            r.expired.push(self.take_id(py, id)?);
        }
        for f in &out.failed_recving {
            let blocks = out.blocks_of(f).iter().map(|b| b.0).collect();
            r.failed.push((self.take_id(py, f.id)?, blocks, f.reason));
        }
        for f in &out.failed_sending {
            r.failed_send.push((self.take_id(py, f.id)?, f.reason));
        }
        self.out = out;
        Py::new(py, r)
    }

    /// Stops the poller: requests in flight are cancelled and reported by
    /// the next ``poll()``; every endpoint, region and the worker are
    /// released. Idempotent. Later submits raise ``ShutdownError``.
    fn shutdown(&mut self, py: Python<'_>) {
        let inner = self.inner.get();
        py.allow_threads(move || inner.shutdown());
        self.shut_down = true;
    }

    /// Copies ``data`` (at most ``block_size`` bytes) into block ``block``
    /// of region ``region``. For tests and for filling KV by hand.
    #[pyo3(signature = (region, block, data))]
    fn write_block(
        &mut self,
        py: Python<'_>,
        region: &Bound<'_, PyAny>,
        block: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let region = uint::<usize>(region, "region")?;
        let b = self::block(block, "block")?;
        let data = bytes_of(data, "data")?;
        self.inner
            .get()
            .write_block(region, b, &data)
            .map_err(|e| engine_err(py, e))
    }

    /// The ``block_size`` bytes of block ``block`` of region ``region``.
    #[pyo3(signature = (region, block))]
    fn read_block(
        &mut self,
        py: Python<'_>,
        region: &Bound<'_, PyAny>,
        block: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyBytes>> {
        let region = uint::<usize>(region, "region")?;
        let b = self::block(block, "block")?;
        let len = usize::try_from(self.block_size)
            .map_err(|_| PyValueError::new_err("block size does not fit in memory"))?;
        let mut buf = vec![0u8; len];
        self.inner
            .get()
            .read_block(region, b, &mut buf)
            .map_err(|e| engine_err(py, e))?;
        Ok(PyBytes::new(py, &buf).unbind())
    }

    /// Bytes per block.
    #[getter]
    fn block_size(&self) -> u64 {
        self.block_size
    }

    /// Requests submitted and not yet reported.
    #[getter]
    fn in_flight(&mut self) -> usize {
        self.inner.get().in_flight()
    }

    /// Whether the poller found the engine's UCX worker deaf: it receives
    /// no message again (a peer killed inside a shared-memory send to it).
    /// New requests then fail with the ``Stopped`` kind's error; what is in
    /// flight is still reported as it ends. Build a new engine.
    #[getter]
    fn is_deaf(&mut self) -> bool {
        self.inner.get().is_deaf()
    }

    /// Whether ``shutdown()`` was called.
    #[getter]
    fn is_shut_down(&self) -> bool {
        self.shut_down
    }

    /// The poller's counters, a ``dict`` of ``str`` -> ``int``: among
    /// them what was refused as unauthenticated (``unauthenticated_peers``,
    /// ``unauthenticated_notifications``, ``replayed_notifications``).
    fn poller_stats(&mut self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let s = self.inner.get().poller_stats();
        let d = PyDict::new(py);
        for (k, v) in [
            ("busy_iterations", s.busy_iterations),
            ("idle_iterations", s.idle_iterations),
            ("busy_ns", s.busy_ns),
            ("idle_ns", s.idle_ns),
            ("malformed_notifications", s.malformed_notifications),
            ("rejected_notifications", s.rejected_notifications),
            ("refused_reads", s.refused_reads),
            ("reads_not_lent", s.reads_not_lent),
            ("refused_writes", s.refused_writes),
            ("writes_not_lent", s.writes_not_lent),
            ("ops_posted", s.ops_posted),
            ("ops_completed", s.ops_completed),
            ("bytes_moved", s.bytes_moved),
            ("notifications_sent", s.notifications_sent),
            ("notification_messages", s.notification_messages),
            ("unauthenticated_peers", s.unauthenticated_peers),
            (
                "unauthenticated_notifications",
                s.unauthenticated_notifications,
            ),
            ("replayed_notifications", s.replayed_notifications),
            ("word_confirmations", s.word_confirmations),
            ("word_misses", s.word_misses),
            ("lend_word_collisions", s.lend_word_collisions),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d.unbind())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Shuts the engine down (see ``shutdown``); exceptions propagate.
    #[pyo3(signature = (exc_type=None, exc=None, tb=None))]
    fn __exit__(
        &mut self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        exc: Option<&Bound<'_, PyAny>>,
        tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        let _ = (exc_type, exc, tb);
        self.shutdown(py);
        false
    }

    fn __repr__(&mut self) -> String {
        format!(
            "Engine(block_size={}, in_flight={}{})",
            self.block_size,
            self.inner.get().in_flight(),
            if self.shut_down { ", shut down" } else { "" }
        )
    }
}

/// kvpoll: KV-cache block transfers between prefill and decode engines over
/// UCX, each request reported exactly once. See ``Engine``.
/// Whether the UCX loaded can register CUDA memory (its context lists the
/// CUDA memory type: a UCX built with CUDA, its CUDA transports loaded,
/// a driver present).
fn ucx_has_cuda() -> Result<bool, String> {
    Context::new(&ContextOptions::default())
        .and_then(|c| c.supports_cuda())
        .map_err(|e| e.to_string())
}

/// Whether `obj` is device memory: a torch tensor on a CUDA device, or
/// an object with `__cuda_array_interface__` (cupy, numba, torch). An
/// interface that raises when read (torch's for bfloat16) still says so.
fn is_cuda_object(obj: &Bound<'_, PyAny>) -> bool {
    let on_cuda = obj
        .getattr("is_cuda")
        .and_then(|v| v.extract::<bool>())
        .unwrap_or(false);
    on_cuda || obj.hasattr("__cuda_array_interface__").unwrap_or(true)
}

/// The device address and length of a CUDA array: a torch tensor's
/// `data_ptr()` and size (whatever its dtype), or what
/// `__cuda_array_interface__` (version 2 or 3) describes. It must be
/// contiguous, writable and not empty.
fn cuda_range(obj: &Bound<'_, PyAny>) -> PyResult<(u64, usize)> {
    let bad = |why: String| PyValueError::new_err(format!("a CUDA array: {why}"));
    if obj.hasattr("data_ptr")? && obj.hasattr("element_size")? {
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(bad("the tensor is not contiguous".into()));
        }
        let addr: u64 = obj.call_method0("data_ptr")?.extract()?;
        let numel: usize = obj.call_method0("numel")?.extract()?;
        let size: usize = obj.call_method0("element_size")?.extract()?;
        let len = numel
            .checked_mul(size)
            .ok_or_else(|| bad("its size overflows".into()))?;
        if addr == 0 || len == 0 {
            return Err(bad("the tensor is empty".into()));
        }
        return Ok((addr, len));
    }
    let iface = obj.getattr("__cuda_array_interface__")?;
    let item = |k: &str| iface.get_item(k);
    let (addr, readonly): (u64, bool) = item("data")?
        .extract()
        .map_err(|_| bad("'data' is not a (ptr, readonly) pair".into()))?;
    if readonly {
        return Err(bad("it is read-only".into()));
    }
    let shape: Vec<usize> = item("shape")?
        .extract()
        .map_err(|_| bad("'shape' is not a tuple of sizes".into()))?;
    let typestr: String = item("typestr")?.extract()?;
    let itemsize: usize = typestr
        .get(2..)
        .and_then(|n| n.parse().ok())
        .filter(|&n| n > 0)
        .ok_or_else(|| bad(format!("typestr {typestr:?} names no item size")))?;
    let mut len = itemsize;
    for &d in &shape {
        len = len
            .checked_mul(d)
            .ok_or_else(|| bad("its size overflows".into()))?;
    }
    // C order: each stride is the product of the item size and the sizes
    // after it (strides None means exactly that).
    if let Ok(strides) = item("strides") {
        if !strides.is_none() {
            let strides: Vec<usize> = strides
                .extract()
                .map_err(|_| bad("'strides' is not a tuple of byte strides".into()))?;
            let mut expect = itemsize;
            for (i, &d) in shape.iter().enumerate().rev() {
                if d > 1 && strides.get(i) != Some(&expect) {
                    return Err(bad("it is not C-contiguous".into()));
                }
                expect *= d;
            }
        }
    }
    if addr == 0 || len == 0 {
        return Err(bad("it is empty".into()));
    }
    Ok((addr, len))
}

/// Whether the CUDA driver library loads (only asked in a cuda build).
fn cuda_driver_present() -> bool {
    #[cfg(feature = "cuda")]
    return kvpoll::gpu::driver_present();
    #[cfg(not(feature = "cuda"))]
    return false;
}

/// Why a CUDA array cannot be registered here, naming every missing
/// piece: this build's cuda feature, the CUDA driver, the loaded UCX's
/// CUDA transports. `None` when all are there.
fn device_memory_refusal(py: Python<'_>) -> Option<String> {
    let mut missing = Vec::new();
    if !cfg!(feature = "cuda") {
        missing.push(
            "this kvpoll was built without the cuda feature (the wheel from `make wheel` has it; \
             from source: pip install ./bindings/python, whose build turns it on)"
                .to_owned(),
        );
    } else if !cuda_driver_present() {
        missing.push("no CUDA driver on this machine (libcuda.so cannot be loaded)".to_owned());
    }
    let ucx = ucx_sys::Version::runtime();
    match py.allow_threads(ucx_has_cuda) {
        Ok(true) => {}
        Ok(false) => missing.push(format!(
            "the loaded UCX {ucx} has no CUDA memory type: no CUDA transports \
             (cuda_copy, cuda_ipc) loaded, or no driver for them"
        )),
        Err(e) => missing.push(format!(
            "UCX {ucx} could not be asked about CUDA memory: {e}"
        )),
    }
    (!missing.is_empty()).then(|| missing.join("; "))
}

/// Whether CUDA tensors can be registered here: ``cuda_build`` (the
/// extension has the cuda feature), ``driver`` (the CUDA driver loads; only
/// asked in a cuda build), ``ucx_cuda`` (the loaded UCX has CUDA
/// transports) and ``refusal`` (why ``register_buffer`` refuses a CUDA
/// array, naming what is missing; ``None`` when it accepts them).
#[pyfunction]
fn device_memory(py: Python<'_>) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("cuda_build", cfg!(feature = "cuda"))?;
    d.set_item("driver", cuda_driver_present())?;
    d.set_item("ucx_cuda", py.allow_threads(ucx_has_cuda).unwrap_or(false))?;
    d.set_item("refusal", device_memory_refusal(py))?;
    Ok(d.unbind())
}

/// The UCX in use: ``loaded`` (the version the loaded library reports),
/// ``built`` (the one the extension was built against), ``source``
/// (``pkg-config``, ``prefix`` or ``wheel``), ``libdir`` (where it was
/// linked from), ``compatible`` (whether engines can start on it) and
/// ``cuda`` (whether it can register CUDA memory).
#[pyfunction]
fn ucx_version(py: Python<'_>) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("loaded", ucx_sys::Version::runtime().to_string())?;
    d.set_item("built", ucx_sys::BUILT_VERSION)?;
    d.set_item("source", ucx_sys::BUILT_SOURCE)?;
    d.set_item("libdir", ucx_sys::BUILT_LIBDIR)?;
    d.set_item(
        "compatible",
        kvpoll::transport::ucx::check_version().is_ok(),
    )?;
    d.set_item("cuda", py.allow_threads(ucx_has_cuda).unwrap_or(false))?;
    Ok(d.unbind())
}

#[pymodule]
fn _kvpoll(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Engine>()?;
    m.add_class::<Transfer>()?;
    m.add_function(wrap_pyfunction!(draw_incarnation, m)?)?;
    m.add_class::<PollResult>()?;
    m.add_function(wrap_pyfunction!(request_id, m)?)?;
    m.add_function(wrap_pyfunction!(ucx_version, m)?)?;
    m.add_function(wrap_pyfunction!(device_memory, m)?)?;
    m.add("KvpollError", py.get_type::<KvpollError>())?;
    for ((_, name, _, _), class) in KINDS.iter().zip(classes(py)?) {
        m.add(*name, class.bind(py))?;
    }
    Ok(())
}
