//! The driver's one job between inputs: the protocol core decides, the
//! transport does. [`execute`] takes the core's pending actions one by one
//! and [`perform`]s each on a [`Transport`], feeding back what the
//! transport answers at once; the core itself never sees a transport. The
//! driver (over UCX) and the simulator's harness (over `transport::simnet`)
//! drive a core the same way.

use crate::core::{Action, Core};
use crate::ledger::Nanos;
use crate::transport::Transport;

/// Executes every pending action on `wire`: the driver's whole job
/// between inputs.
pub fn execute<W: Transport + ?Sized>(core: &mut Core, wire: &mut W, now: Nanos) {
    while let Some(action) = core.next_action() {
        perform(core, wire, action, now);
    }
}

/// Performs one action the core asked for on `wire`, feeding back what the
/// transport answers at once (posts, flushes and sends that could not go
/// out, releases; `now` dates release retries).
pub fn perform<W: Transport + ?Sized>(core: &mut Core, wire: &mut W, action: Action, now: Nanos) {
    match action {
        Action::Post {
            ep,
            dir,
            handle,
            token,
            pairs,
            part,
        } => {
            let lend = core.lend_of(handle);
            let r = wire.post_lent(ep, dir, core.pairs(pairs), part, lend, token);
            core.on_posted(handle, r);
        }
        Action::Flush { ep, handle, token } => {
            if let Err(status) = wire.flush(ep, token) {
                core.on_flush_failed(handle, status);
            }
        }
        Action::Send {
            ep,
            notes,
            token,
            want_reply,
        } => {
            if wire.send(ep, core.notes(notes), token, want_reply).is_err() {
                core.on_send_failed(notes.count);
            }
        }
        Action::Reply { to, notes, token } => {
            if wire.reply(to, core.notes(notes), token).is_err() {
                core.on_send_failed(notes.count);
            }
        }
        Action::ReadWord {
            ep,
            lend,
            handle,
            token,
        } => {
            if let Err(status) = wire.read_word(ep, lend, token) {
                core.on_word_failed(handle, status);
            }
        }
        Action::ServeRead { request, lent } => wire.serve_read(request, lent),
        Action::Close { ep } => wire.close(ep),
        Action::Release { handle } => {
            let released = wire.release(handle);
            core.on_released(handle, released, now);
        }
        Action::ForgetPeer { peer, drain } => wire.forget_peer(peer, drain),
    }
}
