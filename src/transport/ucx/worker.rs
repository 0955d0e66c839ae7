use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::ptr;
use std::rc::Rc;

use ucx_sys as sys;

use super::context::Context;
use super::error::{check, UcxError, UcxStatus};
use super::layout;
use super::soft::{Landed, Piece, Slots};
use super::MAX_AM_PAYLOAD;
use crate::wire::{self, Kind};

/// One finished operation: the caller's token and how it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The token given when the operation was posted.
    pub token: u64,
    /// `UcxStatus::OK`, or why it failed (`CANCELED` after a forced close).
    pub status: UcxStatus,
}

/// An endpoint that UCX declared failed (peer gone, link down).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointFailure {
    /// The id given when the endpoint was created.
    pub endpoint: u64,
    /// Why it failed.
    pub status: UcxStatus,
}

/// A received active message, borrowed until the next progress.
#[derive(Debug, Clone, Copy)]
pub struct ActiveMessage<'a> {
    /// The active-message id it was sent to.
    pub id: u16,
    /// Its payload.
    pub payload: &'a [u8],
    /// Where to answer it with [`Worker::reply`], if the sender asked for
    /// answers: valid until the next [`Worker::progress`].
    pub reply: Option<u32>,
    /// The sender's return key, if it sent one (an 8-byte header): the
    /// path its answers go on (`super::returns`).
    pub from: Option<u64>,
}

/// Where callbacks leave what they saw. One per worker, boxed so that its
/// address (given to UCX as callback argument) never moves.
///
/// Callbacks run on the worker's thread inside UCX calls; no `RefCell`
/// borrow is ever held across a UCX call, so the borrows below never clash.
pub(crate) struct Sink {
    completions: RefCell<Vec<Completion>>,
    failures: RefCell<Vec<EndpointFailure>>,
    am_bytes: RefCell<Vec<u8>>,
    am_index: RefCell<Vec<AmEntry>>,
    /// Reply endpoints of the messages received since the last progress
    /// (UCX's own endpoints; a handle is never kept past the next progress,
    /// which could destroy it), with each sender's return key (0: none).
    am_reply: RefCell<Vec<(sys::ucp_ep_h, u64)>>,
    /// Bumped at every progress: reply handles carry it, so a stale one is
    /// refused instead of reaching a destroyed endpoint.
    am_epoch: Cell<u16>,
    am_rejected: Cell<u64>,
    // Boxed: UCX keeps each handler's address as its callback argument, so
    // it must not move when the list grows.
    #[allow(clippy::vec_box)]
    am_handlers: RefCell<Vec<Box<AmHandler>>>,
    send_buffers: RefCell<Vec<Box<[u8]>>>,
    free_buffers: RefCell<Vec<u32>>,
    /// Reads answered by the lender's own messages, in flight
    /// ([`super::soft`]).
    soft: RefCell<Slots>,
}

/// A received message in the sink: its id, where its bytes are in
/// `am_bytes` (start, length), its reply handle and its sender's return
/// key.
type AmEntry = (u16, usize, usize, Option<u32>, Option<u64>);

pub(crate) struct AmHandler {
    sink: *const Sink,
    id: u16,
}

impl Sink {
    pub(crate) fn complete(&self, token: u64, status: UcxStatus, am_buffer: u32) {
        self.completions
            .borrow_mut()
            .push(Completion { token, status });
        if am_buffer != 0 {
            self.free_buffers.borrow_mut().push(am_buffer - 1);
        }
    }

    pub(crate) fn endpoint_failed(&self, endpoint: u64, status: UcxStatus) {
        self.failures
            .borrow_mut()
            .push(EndpointFailure { endpoint, status });
    }

    /// Makes room for one more endpoint failure so that the error callback
    /// never allocates.
    pub(crate) fn reserve_failure(&self) {
        self.failures.borrow_mut().reserve(1);
    }

    /// Copies `header` then `payload` into a send buffer that lives until
    /// the send completes (room for a return key's header and the
    /// largest payload); returns its index + 1 (the request area's
    /// encoding) and where the copy starts.
    pub(crate) fn take_send_buffer(&self, header: &[u8], payload: &[u8]) -> (u32, *const u8) {
        let mut bufs = self.send_buffers.borrow_mut();
        let idx = match self.free_buffers.borrow_mut().pop() {
            Some(i) => i,
            None => {
                bufs.push(vec![0u8; MAX_AM_PAYLOAD + 8].into_boxed_slice());
                (bufs.len() - 1) as u32
            }
        };
        let buf = &mut bufs[idx as usize];
        buf[..header.len()].copy_from_slice(header);
        buf[header.len()..header.len() + payload.len()].copy_from_slice(payload);
        (idx + 1, buf.as_ptr())
    }

    /// Gives back a send buffer whose send was never posted.
    pub(crate) fn return_send_buffer(&self, encoded: u32) {
        self.free_buffers.borrow_mut().push(encoded - 1);
    }
}

unsafe extern "C" fn am_callback(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::Status {
    // SAFETY: arg is the boxed AmHandler registered with this worker, alive
    // as long as the worker; param is valid for the duration of the call.
    unsafe {
        let handler = &*(arg as *const AmHandler);
        let sink = &*handler.sink;
        let attr = (*param).recv_attr;
        if attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0 {
            // kvpoll only sends small eager messages; a rendezvous one is
            // foreign. Count it and return UCS_OK without receiving: UCX
            // then answers the sender and releases the descriptor itself
            // (ucp_am_rndv_process_rts). Releasing it here as well would
            // free it twice.
            sink.am_rejected.set(sink.am_rejected.get() + 1);
            return sys::ucs_status_t::UCS_OK;
        }
        // The only header kvpoll sends is a return key (8 bytes).
        let from = match header_length {
            0 => None,
            8 if !header.is_null() => {
                let mut key = [0u8; 8];
                key.copy_from_slice(std::slice::from_raw_parts(header as *const u8, 8));
                Some(u64::from_le_bytes(key)).filter(|&k| k != 0)
            }
            _ => {
                sink.am_rejected.set(sink.am_rejected.get() + 1);
                return sys::ucs_status_t::UCS_OK;
            }
        };
        if length > MAX_AM_PAYLOAD || (length > 0 && data.is_null()) {
            sink.am_rejected.set(sink.am_rejected.get() + 1);
            return sys::ucs_status_t::UCS_OK;
        }
        let bytes = std::slice::from_raw_parts(data as *const u8, length);
        let mut store = sink.am_bytes.borrow_mut();
        let start = store.len();
        store.extend_from_slice(bytes);
        let reply = if attr & u64::from(sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0
            && !(*param).reply_ep.is_null()
        {
            let mut eps = sink.am_reply.borrow_mut();
            eps.push(((*param).reply_ep, from.unwrap_or(0)));
            Some(u32::from(sink.am_epoch.get()) << 16 | (eps.len() - 1) as u32)
        } else {
            None
        };
        sink.am_index
            .borrow_mut()
            .push((handler.id, start, length, reply, from));
        // UCS_OK: we copied the data, UCX may release it.
        sys::ucs_status_t::UCS_OK
    }
}

/// Lands a piece of an answer to one of this worker's soft reads
/// ([`super::soft`]): the header names the read, the data is its bytes.
unsafe extern "C" fn piece_callback(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::Status {
    // SAFETY: arg is the boxed AmHandler registered with this worker, alive
    // as long as the worker; header, data and param are valid for the
    // duration of the call (UCX's), for the lengths given.
    unsafe {
        let handler = &*(arg as *const AmHandler);
        let sink = &*handler.sink;
        let attr = (*param).recv_attr;
        let piece = (attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64 == 0
            && !header.is_null()
            && (length == 0 || !data.is_null()))
        .then(|| {
            Piece::decode(std::slice::from_raw_parts(
                header as *const u8,
                header_length,
            ))
        })
        .flatten();
        let Some(piece) = piece else {
            // Not an answer kvpoll sends (see am_callback on rendezvous).
            sink.am_rejected.set(sink.am_rejected.get() + 1);
            return sys::ucs_status_t::UCS_OK;
        };
        let bytes = if length == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(data as *const u8, length)
        };
        // SAFETY: every live slot's destination is registered memory the
        // read owns until its slot ends (Worker::open_soft_read's promise).
        let landed = sink.soft.borrow_mut().land(piece, bytes);
        match landed {
            // A dropped piece was for no read in flight: nothing to do.
            Landed::Partly | Landed::Dropped => {}
            Landed::Ended { token, status } => sink.complete(token, UcxStatus(status), 0),
        }
        sys::ucs_status_t::UCS_OK
    }
}

pub(crate) struct WorkerInner {
    pub(crate) handle: sys::ucp_worker_h,
    pub(crate) sink: Box<Sink>,
    _context: Context,
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        // SAFETY: every endpoint and rkey holds an Rc to this inner, so none
        // is left; the sink (callback argument) is freed after this returns.
        unsafe { sys::ucp_worker_destroy(self.handle) }
    }
}

/// A UCP worker in single-thread mode. Only the thread that created it may
/// use it (the type is neither `Send` nor `Sync`).
pub struct Worker {
    pub(crate) inner: Rc<WorkerInner>,
}

impl Worker {
    /// Creates a worker on `context`.
    pub fn new(context: &Context) -> Result<Self, UcxError> {
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut handle = ptr::null_mut();
        // SAFETY: the context is live; handle receives the worker.
        check("ucp_worker_create", unsafe {
            sys::ucp_worker_create(context.inner.handle, &params, &mut handle)
        })?;
        let sink = Box::new(Sink {
            completions: RefCell::new(Vec::with_capacity(1024)),
            failures: RefCell::new(Vec::new()),
            am_bytes: RefCell::new(Vec::with_capacity(16 * 1024)),
            am_index: RefCell::new(Vec::with_capacity(256)),
            am_reply: RefCell::new(Vec::with_capacity(256)),
            am_epoch: Cell::new(0),
            am_rejected: Cell::new(0),
            am_handlers: RefCell::new(Vec::new()),
            send_buffers: RefCell::new(Vec::new()),
            free_buffers: RefCell::new(Vec::new()),
            soft: RefCell::new(Slots::default()),
        });
        Ok(Self {
            inner: Rc::new(WorkerInner {
                handle,
                sink,
                _context: context.clone(),
            }),
        })
    }

    /// This worker's address, framed for a peer's [`WorkerAddress::from_bytes`].
    pub fn address(&self) -> Result<WorkerAddress, UcxError> {
        let mut addr = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: the worker is live; UCX allocates the address, released below.
        check("ucp_worker_get_address", unsafe {
            sys::ucp_worker_get_address(self.inner.handle, &mut addr, &mut len)
        })?;
        // SAFETY: UCX returned `len` readable bytes at `addr`.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
        let framed = wire::encode(Kind::WorkerAddress, bytes);
        // SAFETY: releasing the address obtained above, once.
        unsafe { sys::ucp_worker_release_address(self.inner.handle, addr) };
        Ok(WorkerAddress(framed))
    }

    /// Progresses UCX communication; returns the number of events processed
    /// (0 means nothing happened). Completion callbacks run in here.
    #[inline]
    pub fn progress(&self) -> u32 {
        let sink = &self.inner.sink;
        if !sink.am_reply.borrow().is_empty() {
            sink.am_reply.borrow_mut().clear();
            sink.am_epoch.set(sink.am_epoch.get().wrapping_add(1));
        }
        // SAFETY: the worker is live and used only from this thread.
        unsafe { sys::ucp_worker_progress(self.inner.handle) }
    }

    /// UCX's endpoint behind reply handle `to`, if no progress ran since
    /// its message arrived (a later progress may have destroyed it).
    ///
    /// Not a guarantee that it is alive: UCX destroys an endpoint it made
    /// for a peer's connection inside the progress that finds the peer
    /// failed (`ucp_ep_set_failed`), which can be the progress that brought
    /// the message. A reply then goes to a freed endpoint (docs/design.md
    /// §4, return paths): the transport answers here only senders that
    /// announced no return path (`super::returns`); the handle's epoch only refuses
    /// handles older than the last progress.
    fn reply_endpoint(&self, to: u32) -> Result<sys::ucp_ep_h, UcxError> {
        let sink = &self.inner.sink;
        let eps = sink.am_reply.borrow();
        let fresh = (to >> 16) as u16 == sink.am_epoch.get();
        match eps.get((to & 0xffff) as usize) {
            Some(&(ep, _)) if fresh => Ok(ep),
            _ => Err(UcxError::EndpointClosed(None)),
        }
    }

    /// The return key the sender of reply handle `to`'s message sent, if
    /// it sent one and no progress ran since.
    pub(crate) fn reply_key(&self, to: u32) -> Option<u64> {
        let sink = &self.inner.sink;
        let fresh = (to >> 16) as u16 == sink.am_epoch.get();
        let eps = sink.am_reply.borrow();
        eps.get((to & 0xffff) as usize)
            .filter(|_| fresh)
            .map(|&(_, key)| key)
            .filter(|&k| k != 0)
    }

    /// Answers a message received since the last progress (its
    /// [`ActiveMessage::reply`]) with an eager active message to `id`.
    pub fn reply(&self, to: u32, id: u16, payload: &[u8], token: u64) -> Result<(), UcxError> {
        let ep = self.reply_endpoint(to)?;
        // The endpoint is UCX's, alive unless the progress that brought the
        // message also found its peer failed (`reply_endpoint`).
        super::endpoint::send_am_on(
            &self.inner,
            ep,
            id,
            (&[], payload),
            token,
            sys::UCP_AM_SEND_FLAG_EAGER,
        )
    }

    /// Answers a message received since the last progress (its
    /// [`ActiveMessage::reply`]) with an eager active message to `id` whose
    /// header is `header` (copied) and whose data are the `len` bytes at
    /// `data`, which UCX copies as it sends them (never zero-copy).
    ///
    /// # Safety
    /// `data..data + len` stays readable until the send completes.
    pub(crate) unsafe fn reply_with_data(
        &self,
        to: u32,
        id: u16,
        header: &[u8],
        data: *const u8,
        len: usize,
        token: u64,
    ) -> Result<(), UcxError> {
        let ep = self.reply_endpoint(to)?;
        // SAFETY: the endpoint is UCX's, alive unless the progress that
        // brought the message also found its peer failed (`reply_endpoint`:
        // used only where the sender announced no return path); the data's promise is the
        // caller's.
        unsafe { super::endpoint::send_am_with_data(&self.inner, ep, id, header, data, len, token) }
    }

    /// Takes a slot for a soft read of `len` bytes into `dest`, completing
    /// with `token`, asked on the endpoint of id `ep`. Returns (slot, seq)
    /// for its request.
    ///
    /// # Safety
    /// `dest..dest + len` stays writable until the read's completion is
    /// taken ([`Worker::take_completions`]).
    pub(crate) unsafe fn open_soft_read(
        &self,
        dest: *mut u8,
        len: usize,
        token: u64,
        ep: u64,
    ) -> (u32, u32) {
        self.inner.sink.soft.borrow_mut().open(dest, len, token, ep)
    }

    /// Ends soft read (slot, seq) with `status` if it is still in flight
    /// (its request failed), completing it.
    pub(crate) fn fail_soft_read(&self, slot: u32, seq: u32, status: UcxStatus) {
        let sink = &self.inner.sink;
        let ended = sink.soft.borrow_mut().fail(slot, seq, status.0);
        if let Some((token, status)) = ended {
            sink.complete(token, UcxStatus(status), 0);
        }
    }

    /// Gives back the slot of soft read (slot, seq), whose request was
    /// never posted: it completes with nothing.
    pub(crate) fn forget_soft_read(&self, slot: u32, seq: u32) {
        let _ = self.inner.sink.soft.borrow_mut().fail(slot, seq, 0);
    }

    /// Ends every soft read asked on the endpoint of id `ep` with
    /// `status`, completing each.
    pub(crate) fn fail_soft_reads_of(&self, ep: u64, status: UcxStatus) {
        let sink = &self.inner.sink;
        sink.soft
            .borrow_mut()
            .fail_endpoint(ep, status.0, |token, st| {
                sink.complete(token, UcxStatus(st), 0)
            });
    }

    /// Accepts the pieces of answers to this worker's soft reads.
    pub(crate) fn listen_pieces(&self, id: u16) -> Result<(), UcxError> {
        self.listen_with(id, Some(piece_callback))
    }

    /// The fd that becomes readable when this worker has new events, once
    /// armed with [`Worker::arm`]; `None` when the context was created
    /// without `UCP_FEATURE_WAKEUP`. UCX owns the fd (do not close it).
    pub fn event_fd(&self) -> Option<std::os::fd::RawFd> {
        if !self.inner._context.has_wakeup() {
            return None;
        }
        let mut fd = -1;
        // SAFETY: the worker is live; fd is a valid out-parameter.
        let status = unsafe { sys::ucp_worker_get_efd(self.inner.handle, &mut fd) };
        (status == sys::ucs_status_t::UCS_OK && fd >= 0).then_some(fd)
    }

    /// Arms the event fd for the next event. `Ok(true)`: armed, the caller
    /// may block on the fd. `Ok(false)`: events are pending
    /// (`UCS_ERR_BUSY`): progress, then try again.
    pub fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: the worker is live and used only from this thread.
        let status = unsafe { sys::ucp_worker_arm(self.inner.handle) };
        if status == sys::ucs_status_t::UCS_ERR_BUSY {
            return Ok(false);
        }
        check("ucp_worker_arm", status).map(|()| true)
    }

    /// Arms the event fd and blocks until it fires or `timeout` passed.
    /// Returns `false` at once, without blocking, when events are pending
    /// (progress first) or the worker has no event fd.
    pub fn wait(&self, timeout: std::time::Duration) -> Result<bool, UcxError> {
        let Some(fd) = self.event_fd() else {
            return Ok(false);
        };
        if !self.arm()? {
            return Ok(false);
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd, alive for the call.
        unsafe { libc::poll(&mut pfd, 1, ms) };
        Ok(true)
    }

    /// Moves the completions seen so far into `out` (appended). Keeps the
    /// capacity of both lists, so steady state does not allocate.
    pub fn take_completions(&self, out: &mut Vec<Completion>) {
        out.append(&mut self.inner.sink.completions.borrow_mut());
    }

    /// Moves the endpoint failures seen so far into `out` (appended).
    pub fn take_endpoint_failures(&self, out: &mut Vec<EndpointFailure>) {
        out.append(&mut self.inner.sink.failures.borrow_mut());
    }

    /// Accepts active messages sent to `id` on this worker; read them with
    /// [`Worker::take_active_messages`].
    pub fn listen_active_messages(&self, id: u16) -> Result<(), UcxError> {
        self.listen_with(id, Some(am_callback))
    }

    fn listen_with(&self, id: u16, cb: sys::ucp_am_recv_callback_t) -> Result<(), UcxError> {
        let handler = Box::new(AmHandler {
            sink: &*self.inner.sink,
            id,
        });
        let params = sys::ucp_am_handler_param_t {
            field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64,
            id: id.into(),
            cb,
            arg: &*handler as *const AmHandler as *mut c_void,
            ..Default::default()
        };
        // SAFETY: the worker is live; the handler box is kept in the sink for
        // the worker's lifetime, so the argument stays valid.
        check("ucp_worker_set_am_recv_handler", unsafe {
            sys::ucp_worker_set_am_recv_handler(self.inner.handle, &params)
        })?;
        self.inner.sink.am_handlers.borrow_mut().push(handler);
        Ok(())
    }

    /// Hands each active message received so far to `f`, then forgets them.
    pub fn take_active_messages(&self, mut f: impl FnMut(ActiveMessage<'_>)) {
        let sink = &self.inner.sink;
        let mut index = sink.am_index.borrow_mut();
        let mut bytes = sink.am_bytes.borrow_mut();
        for &(id, start, len, reply, from) in index.iter() {
            f(ActiveMessage {
                id,
                payload: &bytes[start..start + len],
                reply,
                from,
            });
        }
        index.clear();
        bytes.clear();
    }

    /// Active messages dropped because they were not kvpoll's (rendezvous,
    /// with a header other than a return key, or over [`MAX_AM_PAYLOAD`]).
    pub fn rejected_active_messages(&self) -> u64 {
        self.inner.sink.am_rejected.get()
    }
}

/// A worker address as a peer sends it: framed and checksummed, and its UCX
/// layout walked, so garbage is refused before UCX sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerAddress(Vec<u8>);

impl WorkerAddress {
    /// Checks bytes received from a peer.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, UcxError> {
        let raw = wire::decode(bytes, Kind::WorkerAddress).map_err(UcxError::BadWorkerAddress)?;
        layout::check_worker_address(raw).map_err(UcxError::WorkerAddressLayout)?;
        Ok(Self(bytes.to_vec()))
    }

    /// The framed bytes to send to a peer.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The raw UCX address inside the frame.
    pub(crate) fn raw(&self) -> &[u8] {
        // The frame was checked when this value was made.
        wire::decode(&self.0, Kind::WorkerAddress).unwrap_or(&[])
    }
}
