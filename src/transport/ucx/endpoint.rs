use std::cell::Cell;
use std::ffi::c_void;
use std::ptr;
use std::rc::Rc;

use thiserror::Error;
use ucx_sys as sys;

use super::error::{UcxError, UcxStatus};
use super::memory::{MemoryRegion, RemoteKey};
use super::request;
use super::worker::{Sink, Worker, WorkerAddress, WorkerInner};
use super::MAX_AM_PAYLOAD;

/// One block copy of a batch: `len` bytes between `local_offset` in the local
/// region and `remote_offset` in the remote one. `token` comes back in the
/// operation's [`super::Completion`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockOp {
    /// Offset in the local [`MemoryRegion`].
    pub local_offset: u64,
    /// Offset in the remote region the [`RemoteKey`] names.
    pub remote_offset: u64,
    /// Bytes to move.
    pub len: usize,
    /// Caller's token for the completion.
    pub token: u64,
}

/// A batch stopped part way: the first `posted` operations were posted and
/// will complete through the worker; the others were not posted at all.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("posted {posted} operations, then: {error}")]
pub struct PostError {
    /// How many operations of the batch were posted.
    pub posted: usize,
    /// Why the next one was not.
    pub error: UcxError,
}

/// The error callback's argument: boxed so its address is stable.
struct EndpointState {
    sink: *const Sink,
    id: u64,
    /// 0 while healthy, else the failure status.
    failed: Cell<i8>,
}

unsafe extern "C" fn error_callback(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::Status) {
    // SAFETY: arg is the boxed EndpointState of an endpoint of this worker; it
    // lives until the endpoint is closed, after which UCX calls no error
    // callback. Runs on the worker's thread. Records only: the sink reserved
    // room for this failure when the endpoint was created, so no allocation.
    unsafe {
        let state = &*(arg as *const EndpointState);
        if state.failed.get() == 0 {
            state.failed.set(status);
            (*state.sink).endpoint_failed(state.id, UcxStatus(status));
        }
    }
}

pub(crate) struct EndpointInner {
    handle: Cell<sys::ucp_ep_h>,
    state: Box<EndpointState>,
    pub(crate) worker: Rc<WorkerInner>,
}

impl EndpointInner {
    fn live_handle(&self) -> Result<sys::ucp_ep_h, UcxError> {
        let h = self.handle.get();
        if h.is_null() {
            let f = self.state.failed.get();
            return Err(UcxError::EndpointClosed((f != 0).then_some(UcxStatus(f))));
        }
        Ok(h)
    }

    pub(crate) fn raw(&self) -> sys::ucp_ep_h {
        self.handle.get()
    }
}

impl Drop for EndpointInner {
    fn drop(&mut self) {
        let h = self.handle.replace(ptr::null_mut());
        if h.is_null() {
            return;
        }
        // A forced close is local and bounded: it does not wait for a peer
        // that may be gone. Outstanding operations complete with
        // UCS_ERR_CANCELED into the worker's completion list.
        let params = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: h is a live endpoint of this (live) worker, closed once.
        let req = unsafe { sys::ucp_ep_close_nbx(h, &params) };
        if sys::UCS_PTR_IS_PTR(req) {
            // SAFETY: req is a live request with no callback; we poll it to
            // completion on this thread and free it once.
            unsafe {
                while sys::ucp_request_check_status(req) == sys::ucs_status_t::UCS_INPROGRESS {
                    sys::ucp_worker_progress(self.worker.handle);
                }
                sys::ucp_request_free(req);
            }
        }
    }
}

/// A connection to a peer worker, in peer error mode: a peer failure is
/// reported (see [`Worker::take_endpoint_failures`]) and every operation on
/// it completes with an error instead of hanging.
pub struct Endpoint {
    pub(crate) inner: Rc<EndpointInner>,
}

impl Endpoint {
    /// Connects `worker` to the worker at `address`. `id` names this
    /// endpoint in [`super::EndpointFailure`] reports.
    pub fn connect(worker: &Worker, address: &WorkerAddress, id: u64) -> Result<Self, UcxError> {
        let state = Box::new(EndpointState {
            sink: &*worker.inner.sink,
            id,
            failed: Cell::new(0),
        });
        worker.inner.sink.reserve_failure();
        // UCX takes no length: the padding bounds what a transport reads of
        // its own device and interface addresses (layout.rs).
        let raw = super::layout::padded(address.raw());
        let params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
            address: raw.as_ptr() as *const sys::ucp_address_t,
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler: sys::ucp_err_handler_t {
                cb: Some(error_callback),
                arg: &*state as *const EndpointState as *mut c_void,
            },
            ..Default::default()
        };
        let mut handle = ptr::null_mut();
        // SAFETY: the worker is live; the address's layout was walked when
        // it was made (every length inside fits it), its bytes live for the
        // call; the state box outlives the endpoint.
        let status = unsafe { sys::ucp_ep_create(worker.inner.handle, &params, &mut handle) };
        super::error::check("ucp_ep_create", status)?;
        Ok(Self {
            inner: Rc::new(EndpointInner {
                handle: Cell::new(handle),
                state,
                worker: worker.inner.clone(),
            }),
        })
    }

    /// The failure UCX reported for this endpoint, if any.
    pub fn failure(&self) -> Option<UcxStatus> {
        let f = self.inner.state.failed.get();
        (f != 0).then_some(UcxStatus(f))
    }

    /// UCX's description of the endpoint (`ucp_ep_print_info`): its
    /// configuration and lanes, one per line. Empty for a closed endpoint.
    pub fn describe(&self) -> String {
        let Ok(ep) = self.inner.live_handle() else {
            return String::new();
        };
        let mut buf: *mut std::ffi::c_char = ptr::null_mut();
        let mut len = 0;
        // SAFETY: buf and len are valid out-parameters; the stream owns buf
        // until fclose, which sets them to the text written.
        let stream = unsafe { libc::open_memstream(&mut buf, &mut len) };
        if stream.is_null() {
            return String::new();
        }
        // SAFETY: the endpoint is live and the stream open; fclose flushes
        // it into buf (NUL-terminated), which is ours to free after.
        unsafe {
            sys::ucp_ep_print_info(ep, stream.cast());
            libc::fclose(stream);
            let text = std::ffi::CStr::from_ptr(buf).to_string_lossy().into_owned();
            libc::free(buf.cast());
            text
        }
    }

    /// Whether the endpoint was closed ([`Endpoint::force_close`]).
    pub fn is_closed(&self) -> bool {
        self.inner.handle.get().is_null()
    }

    /// Posts a batch of gets: remote → local.
    pub fn get_batch(
        &self,
        local: &MemoryRegion,
        rkey: &RemoteKey,
        ops: &[BlockOp],
    ) -> Result<(), PostError> {
        self.post_batch(local, rkey, ops, Direction::Get)
    }

    /// Posts a batch of puts: local → remote. A completed put only means the
    /// source may be reused; [`Endpoint::flush`] before telling the consumer.
    pub fn put_batch(
        &self,
        local: &MemoryRegion,
        rkey: &RemoteKey,
        ops: &[BlockOp],
    ) -> Result<(), PostError> {
        self.post_batch(local, rkey, ops, Direction::Put)
    }

    fn post_batch(
        &self,
        local: &MemoryRegion,
        rkey: &RemoteKey,
        ops: &[BlockOp],
        dir: Direction,
    ) -> Result<(), PostError> {
        let fail = |posted, error| Err(PostError { posted, error });
        let ep = match self.inner.live_handle() {
            Ok(h) => h,
            Err(e) => return fail(0, e),
        };
        if !Rc::ptr_eq(&rkey.endpoint, &self.inner) {
            return fail(
                0,
                UcxError::Call {
                    op: "rkey check (rkey unpacked on another endpoint)",
                    status: UcxStatus(sys::ucs_status_t::UCS_ERR_INVALID_PARAM),
                },
            );
        }
        let sink = &*self.inner.worker.sink;
        let params = request::params(sink, local.memh());
        for (i, op) in ops.iter().enumerate() {
            let (lptr, raddr) = match (
                local.range_ptr(op.local_offset, op.len),
                rkey.range_addr(op.remote_offset, op.len),
            ) {
                (Ok(l), Ok(r)) => (l, r),
                (Err(e), _) | (_, Err(e)) => return fail(i, e),
            };
            // SAFETY: ep is live; lptr..lptr+len lies in the registered local
            // region (checked), raddr..raddr+len in the remote one (checked
            // against the bounds the peer packed); the rkey belongs to this
            // endpoint; params point at this worker's sink.
            let ret = unsafe {
                match dir {
                    Direction::Get => sys::ucp_get_nbx(
                        ep,
                        lptr as *mut c_void,
                        op.len,
                        raddr,
                        rkey.raw(),
                        &params,
                    ),
                    Direction::Put => sys::ucp_put_nbx(
                        ep,
                        lptr as *const c_void,
                        op.len,
                        raddr,
                        rkey.raw(),
                        &params,
                    ),
                }
            };
            if let Err(status) = request::finish(sink, ret, op.token, 0) {
                let op_name = match dir {
                    Direction::Get => "ucp_get_nbx",
                    Direction::Put => "ucp_put_nbx",
                };
                return fail(
                    i,
                    UcxError::Call {
                        op: op_name,
                        status,
                    },
                );
            }
        }
        Ok(())
    }

    /// Flushes the endpoint: completes (with `token`) once every operation
    /// posted on it before is complete at the target.
    pub fn flush(&self, token: u64) -> Result<(), UcxError> {
        let ep = self.inner.live_handle()?;
        let sink = &*self.inner.worker.sink;
        let params = request::params(sink, ptr::null_mut());
        // SAFETY: ep is live; params point at this worker's sink.
        let ret = unsafe { sys::ucp_ep_flush_nbx(ep, &params) };
        request::finish(sink, ret, token, 0).map_err(|status| UcxError::Call {
            op: "ucp_ep_flush_nbx",
            status,
        })
    }

    /// Sends `payload` as an eager active message to `id` on the peer. The
    /// payload is copied, so the caller's buffer is free at once.
    pub fn send_active_message(&self, id: u16, payload: &[u8], token: u64) -> Result<(), UcxError> {
        self.send_am(id, payload, token, sys::UCP_AM_SEND_FLAG_EAGER)
    }

    /// Sends `payload` with UCX's rendezvous protocol, as a foreign peer
    /// might: kvpoll never does, and refuses what it receives this way. For
    /// tests of that refusal.
    #[doc(hidden)]
    pub fn send_active_message_rendezvous(
        &self,
        id: u16,
        payload: &[u8],
        token: u64,
    ) -> Result<(), UcxError> {
        self.send_am(id, payload, token, sys::UCP_AM_SEND_FLAG_RNDV)
    }

    /// Sends an eager active message asking for a reply: the receiver may
    /// answer through [`Worker::reply`] without an endpoint of its own.
    pub fn send_active_message_with_reply(
        &self,
        id: u16,
        payload: &[u8],
        token: u64,
    ) -> Result<(), UcxError> {
        self.send_am(
            id,
            payload,
            token,
            sys::UCP_AM_SEND_FLAG_EAGER | sys::UCP_AM_SEND_FLAG_REPLY,
        )
    }

    /// Sends an eager active message asking for a reply, with return key
    /// `key` as its 8-byte header: the receiver answers on an endpoint of
    /// its own to the path announced under `key` (`super::returns`), and
    /// not at all where it cannot open one (never through
    /// [`Worker::reply`], whose endpoint the sender's death may free).
    pub(crate) fn send_active_message_answerable(
        &self,
        id: u16,
        payload: &[u8],
        key: u64,
        token: u64,
    ) -> Result<(), UcxError> {
        let ep = self.inner.live_handle()?;
        send_am_on(
            &self.inner.worker,
            ep,
            id,
            (&key.to_le_bytes(), payload),
            token,
            sys::UCP_AM_SEND_FLAG_EAGER | sys::UCP_AM_SEND_FLAG_REPLY,
        )
    }

    /// [`send_am_with_data`] on this endpoint.
    ///
    /// # Safety
    /// `data..data + len` stays readable until the send completes.
    pub(crate) unsafe fn send_with_data(
        &self,
        id: u16,
        header: &[u8],
        data: *const u8,
        len: usize,
        token: u64,
    ) -> Result<(), UcxError> {
        let ep = self.inner.live_handle()?;
        // SAFETY: ep is live (checked above); the data's promise is the
        // caller's.
        unsafe { send_am_with_data(&self.inner.worker, ep, id, header, data, len, token) }
    }

    fn send_am(&self, id: u16, payload: &[u8], token: u64, flags: u32) -> Result<(), UcxError> {
        let ep = self.inner.live_handle()?;
        send_am_on(&self.inner.worker, ep, id, (&[], payload), token, flags)
    }

    /// Force-closes the endpoint: UCX completes every outstanding operation
    /// on it with `UCS_ERR_CANCELED`, and the close itself completes with
    /// `token`. Nothing more can be posted; reconnect with a new endpoint.
    pub fn force_close(&self, token: u64) -> Result<(), UcxError> {
        self.close(token, sys::UCP_EP_CLOSE_FLAG_FORCE)
    }

    /// Closes the endpoint gracefully: what is outstanding on it completes
    /// first (the operations already in flight end as they would have),
    /// then the peer is told, so that it tears down its side of the
    /// connection with nothing of ours left to serve. The close completes
    /// with `token`, with an error if the peer fails meanwhile. Nothing
    /// more can be posted.
    pub fn flush_close(&self, token: u64) -> Result<(), UcxError> {
        self.close(token, 0)
    }

    fn close(&self, token: u64, flags: u32) -> Result<(), UcxError> {
        let ep = self.inner.live_handle()?;
        self.inner.handle.set(ptr::null_mut());
        let sink = &*self.inner.worker.sink;
        let mut params = request::params(sink, ptr::null_mut());
        params.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
        params.flags = flags;
        // SAFETY: ep was live and is closed once (the handle is cleared).
        let ret = unsafe { sys::ucp_ep_close_nbx(ep, &params) };
        request::finish(sink, ret, token, 0).map_err(|status| UcxError::Call {
            op: "ucp_ep_close_nbx",
            status,
        })
    }
}

/// Sends `message`'s header (at most 8 bytes: a return key, or none) and
/// payload, both copied into a send buffer that lives until the send
/// completes, as an active message to `id` on raw endpoint `ep` of
/// `worker`.
pub(crate) fn send_am_on(
    worker: &WorkerInner,
    ep: sys::ucp_ep_h,
    id: u16,
    message: (&[u8], &[u8]),
    token: u64,
    flags: u32,
) -> Result<(), UcxError> {
    let (header, payload) = message;
    if payload.len() > MAX_AM_PAYLOAD || header.len() > 8 {
        return Err(UcxError::MessageTooLong(payload.len() + header.len()));
    }
    let sink = &*worker.sink;
    let (buffer, head) = sink.take_send_buffer(header, payload);
    // SAFETY: the payload was copied right after the header, inside the
    // buffer.
    let data = unsafe { head.add(header.len()) };
    let mut params = request::params(sink, ptr::null_mut());
    params.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
    params.flags = flags;
    // SAFETY: the caller passes a live endpoint of `worker`; the send buffer
    // stays allocated and untouched until the completion gives it back;
    // params point at the worker's sink.
    let ret = unsafe {
        sys::ucp_am_send_nbx(
            ep,
            id.into(),
            if header.is_empty() {
                ptr::null()
            } else {
                head as *const c_void
            },
            header.len(),
            data as *const c_void,
            payload.len(),
            &params,
        )
    };
    finish_am(sink, ret, token, buffer)
}

/// A generic UCX datatype whose bytes are packed by copying them from
/// where they are: UCX never sends it zero-copy (its protocol selection
/// gives generic datatypes no zero-copy threshold), and over tcp UCX 1.13
/// completes a zero-copy send to a peer that died twice over
/// (`uct_iface.h:884 Assertion 'comp->count > 0'`, seen in
/// `tests/teardown.rs`). Created once per process; `None` if UCX refused.
fn copied_bytes() -> Option<sys::ucp_datatype_t> {
    static DT: std::sync::OnceLock<Option<sys::ucp_datatype_t>> = std::sync::OnceLock::new();
    *DT.get_or_init(|| {
        let ops = sys::ucp_generic_dt_ops_t {
            start_pack: Some(dt_start_pack),
            start_unpack: Some(dt_start_unpack),
            packed_size: Some(dt_packed_size),
            pack: Some(dt_pack),
            unpack: Some(dt_unpack),
            finish: Some(dt_finish),
        };
        let mut dt: sys::ucp_datatype_t = 0;
        // SAFETY: ops is read during the call (UCX copies it); dt is a
        // valid out-parameter.
        let status = unsafe { sys::ucp_dt_create_generic(&ops, ptr::null_mut(), &mut dt) };
        (status == sys::ucs_status_t::UCS_OK).then_some(dt)
    })
}

/// A pack's state: where the bytes are and how many.
struct Packing {
    from: *const u8,
    len: usize,
}

unsafe extern "C" fn dt_start_pack(
    _context: *mut c_void,
    buffer: *const c_void,
    count: usize,
) -> *mut c_void {
    Box::into_raw(Box::new(Packing {
        from: buffer as *const u8,
        len: count,
    })) as *mut c_void
}

unsafe extern "C" fn dt_start_unpack(
    _context: *mut c_void,
    _buffer: *mut c_void,
    _count: usize,
) -> *mut c_void {
    // kvpoll never receives into this datatype.
    ptr::null_mut()
}

unsafe extern "C" fn dt_packed_size(state: *mut c_void) -> usize {
    // SAFETY: state is a Packing made by dt_start_pack, live until finish.
    unsafe { (*(state as *const Packing)).len }
}

unsafe extern "C" fn dt_pack(
    state: *mut c_void,
    offset: usize,
    dest: *mut c_void,
    max_length: usize,
) -> usize {
    // SAFETY: state is a live Packing; UCX asks for bytes inside the
    // packed size and gives `max_length` writable bytes at dest; the
    // sender keeps the source readable until the send completes.
    unsafe {
        let p = &*(state as *const Packing);
        let n = max_length.min(p.len.saturating_sub(offset));
        ptr::copy_nonoverlapping(p.from.add(offset), dest as *mut u8, n);
        n
    }
}

unsafe extern "C" fn dt_unpack(
    _state: *mut c_void,
    _offset: usize,
    _src: *const c_void,
    _length: usize,
) -> sys::Status {
    sys::ucs_status_t::UCS_ERR_UNSUPPORTED
}

unsafe extern "C" fn dt_finish(state: *mut c_void) {
    if !state.is_null() {
        // SAFETY: made by dt_start_pack with Box::into_raw, finished once.
        drop(unsafe { Box::from_raw(state as *mut Packing) });
    }
}

/// Sends an eager active message to `id` on raw endpoint `ep` of
/// `worker`: `header` copied into a send buffer that lives until the send
/// completes, then the `len` bytes at `data`, copied by UCX as it sends
/// them ([`copied_bytes`]: never zero-copy).
///
/// # Safety
/// `ep` is a live endpoint of `worker`; `data..data + len` stays readable
/// until the send completes.
pub(crate) unsafe fn send_am_with_data(
    worker: &WorkerInner,
    ep: sys::ucp_ep_h,
    id: u16,
    header: &[u8],
    data: *const u8,
    len: usize,
    token: u64,
) -> Result<(), UcxError> {
    if header.len() > MAX_AM_PAYLOAD {
        return Err(UcxError::MessageTooLong(header.len()));
    }
    let Some(datatype) = copied_bytes() else {
        return Err(UcxError::Call {
            op: "ucp_dt_create_generic",
            status: UcxStatus(sys::ucs_status_t::UCS_ERR_NO_MEMORY),
        });
    };
    let sink = &*worker.sink;
    // UCX before 1.14 reads the header until the send completes (there is
    // no UCP_AM_SEND_FLAG_COPY_HEADER): it lives in a send buffer.
    let (buffer, head) = sink.take_send_buffer(&[], header);
    let mut params = request::params(sink, ptr::null_mut());
    params.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS | sys::UCP_OP_ATTR_FIELD_DATATYPE;
    params.flags = sys::UCP_AM_SEND_FLAG_EAGER;
    params.datatype = datatype;
    // SAFETY: the caller's promises (live endpoint, data readable until
    // completion); the header buffer stays allocated and untouched until
    // the completion gives it back; params point at the worker's sink.
    let ret = unsafe {
        sys::ucp_am_send_nbx(
            ep,
            id.into(),
            head as *const c_void,
            header.len(),
            data as *const c_void,
            len,
            &params,
        )
    };
    finish_am(sink, ret, token, buffer)
}

/// Finishes an active-message send posted with send buffer `buffer`,
/// giving the buffer back if nothing was posted.
fn finish_am(
    sink: &Sink,
    ret: sys::ucs_status_ptr_t,
    token: u64,
    buffer: u32,
) -> Result<(), UcxError> {
    request::finish(sink, ret, token, buffer).map_err(|status| {
        sink.return_send_buffer(buffer);
        UcxError::Call {
            op: "ucp_am_send_nbx",
            status,
        }
    })
}

#[derive(Clone, Copy)]
enum Direction {
    Get,
    Put,
}
