//! Completion plumbing: how a caller's `u64` token reaches the completion
//! list without an allocation per operation.
//!
//! The context reserves [`REQUEST_SIZE`] bytes in every UCX request
//! (`ucp_params_t::request_size`); UCX hands that area out as the request
//! pointer. After a non-blocking call returns a request, the poster writes
//! the token into the area and arms it; the completion callback reads the
//! token, appends `(token, status)` to the worker's [`Sink`] and frees the
//! request. `user_data` points at the sink.
//!
//! UCX documents that a callback does not run before the call returns unless
//! `UCP_OP_ATTR_FLAG_NO_IMM_CMPL` is set (we never set it), but the area has
//! a state so that an early callback is still handled: it parks its status
//! in the area, and the poster, seeing `EARLY`, completes it itself.

use std::ffi::c_void;

use ucx_sys as sys;

use super::error::UcxStatus;
use super::worker::Sink;

const IDLE: u32 = 0;
const ARMED: u32 = 1;
const EARLY: u32 = 2;

/// What kvpoll keeps in each UCX request.
#[repr(C)]
struct RequestArea {
    token: u64,
    /// Index + 1 of the active-message send buffer to give back; 0 = none.
    am_buffer: u32,
    state: u32,
    early_status: i8,
}

/// Bytes reserved in every UCX request.
pub(crate) const REQUEST_SIZE: usize = std::mem::size_of::<RequestArea>();

/// `ucp_params_t::request_init`: runs once for each request object UCX
/// allocates; completed requests are reset to `IDLE` before they are freed.
pub(crate) unsafe extern "C" fn request_init(request: *mut c_void) {
    // SAFETY: UCX passes the start of the REQUEST_SIZE-byte user area of a
    // new request; it is suitably aligned (UCX aligns requests to 8 bytes or
    // more) and nobody else uses it yet.
    unsafe {
        (request as *mut RequestArea).write(RequestArea {
            token: 0,
            am_buffer: 0,
            state: IDLE,
            early_status: 0,
        })
    }
}

/// The send-type completion callback (get, put, flush, active-message send,
/// endpoint close). Never allocates (the sink's list has spare capacity in
/// steady state) and never panics across the FFI boundary.
pub(crate) unsafe extern "C" fn send_callback(
    request: *mut c_void,
    status: sys::Status,
    user_data: *mut c_void,
) {
    // SAFETY: `request` is a request we posted, so its user area is a
    // RequestArea; `user_data` is the Sink of the worker that posted it, which
    // outlives every request on that worker (the worker is destroyed before
    // its sink is freed). Callbacks run on the worker's own thread, inside a
    // UCX call made by this module, while no other reference to the sink's
    // contents is held.
    unsafe {
        let area = &mut *(request as *mut RequestArea);
        let sink = &*(user_data as *const Sink);
        if area.state == ARMED {
            sink.complete(area.token, UcxStatus(status), area.am_buffer);
            area.state = IDLE;
            area.am_buffer = 0;
            sys::ucp_request_free(request);
        } else {
            area.state = EARLY;
            area.early_status = status;
        }
    }
}

/// The request parameters for an operation whose completion goes to `sink`.
pub(crate) fn params(sink: &Sink, memh: sys::ucp_mem_h) -> sys::ucp_request_param_t {
    let mut p = sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
        user_data: sink as *const Sink as *mut c_void,
        ..Default::default()
    };
    p.cb.send = Some(send_callback);
    if !memh.is_null() {
        p.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
        p.memh = memh;
    }
    p
}

/// Finishes a post: an immediate completion goes straight to the sink, an
/// error comes back to the caller (nothing was posted, the sink is not
/// touched), a request is armed with `token`.
pub(crate) fn finish(
    sink: &Sink,
    ret: sys::ucs_status_ptr_t,
    token: u64,
    am_buffer: u32,
) -> Result<(), UcxStatus> {
    if ret.is_null() {
        sink.complete(token, UcxStatus::OK, am_buffer);
        return Ok(());
    }
    if sys::UCS_PTR_IS_ERR(ret) {
        return Err(UcxStatus(sys::UCS_PTR_RAW_STATUS(ret)));
    }
    // SAFETY: a non-error, non-NULL return is a request whose user area is a
    // RequestArea (initialised by request_init, reset on every free). We are
    // on the worker's thread and its callback cannot run concurrently.
    unsafe {
        let area = &mut *(ret as *mut RequestArea);
        if area.state == EARLY {
            sink.complete(token, UcxStatus(area.early_status), am_buffer);
            area.state = IDLE;
            sys::ucp_request_free(ret);
        } else {
            area.token = token;
            area.am_buffer = am_buffer;
            area.state = ARMED;
        }
    }
    Ok(())
}
