//! A transport wrapper that injects faults, for demos and tests of the
//! failure paths over real UCX. Built only with the `fault-injection`
//! feature: production engines carry no test hooks.

use std::time::Duration;

use crate::ledger::{BlockId, HandleKey, Incarnation, PeerId};
use crate::transport::peer::PeerMetadata;
use crate::transport::{
    Direction, Ep, LendWords, PostFailure, Transport, TransportEvent, IO_ERROR,
};

/// Faults to inject. The default injects none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Faults {
    /// Every n-th handle's release fails once (0: never). The handle stays
    /// held, with its request, until the retry after `release_retry_after`.
    pub release_failure_every: u32,
    /// When a failed release is retried.
    pub release_retry_after: Duration,
    /// Every n-th handle fails with a transfer error (0: never): its first
    /// operation to complete does, as if it had failed; the data may have
    /// landed, so the request fails and its blocks must be invalidated.
    pub handle_error_every: u32,
    /// The poller panics at its n-th post (0: never): to see that a dead
    /// poller is reported, not hidden.
    pub panic_at_post: u32,
    /// Every progress of the transport sleeps this long first: a poller
    /// descheduled between draining its commands and progressing UCX,
    /// while its engine thread submits and peers answer (zero: never).
    pub slow_progress: Duration,
}

/// `T` with [`Faults`] injected.
pub struct Faulty<T> {
    inner: T,
    faults: Faults,
    completions: u64,
    releases: u64,
    posts: u64,
    /// Handles whose release failed once: their retry succeeds.
    held: Vec<HandleKey>,
    /// Data tokens (one per handle) seen lately, to count handles rather
    /// than operations.
    seen: Vec<u64>,
}

impl<T> Faulty<T> {
    /// Wraps `inner`.
    pub fn new(inner: T, faults: Faults) -> Self {
        Faulty {
            inner,
            faults,
            completions: 0,
            releases: 0,
            posts: 0,
            held: Vec::new(),
            seen: Vec::with_capacity(1024),
        }
    }

    /// The wrapped transport.
    pub fn inner(&mut self) -> &mut T {
        &mut self.inner
    }
}

impl<T: Transport> Transport for Faulty<T> {
    fn add_peer(&mut self, peer: PeerId, meta: &PeerMetadata) -> Result<(), i8> {
        self.inner.add_peer(peer, meta)
    }

    fn forget_peer(&mut self, peer: PeerId, drain: bool) {
        self.inner.forget_peer(peer, drain)
    }

    fn post(
        &mut self,
        ep: Ep,
        dir: Direction,
        pairs: &[(BlockId, BlockId)],
        token: u64,
    ) -> Result<u32, PostFailure> {
        self.posts += 1;
        if self.faults.panic_at_post != 0 && self.posts == u64::from(self.faults.panic_at_post) {
            panic!(
                "kvpoll fault injection: poller panics at post {}",
                self.posts
            );
        }
        self.inner.post(ep, dir, pairs, token)
    }

    fn post_part(
        &mut self,
        ep: Ep,
        dir: Direction,
        pairs: &[(BlockId, BlockId)],
        part: crate::transport::BlockBytes,
        token: u64,
    ) -> Result<u32, PostFailure> {
        self.posts += 1;
        self.inner.post_part(ep, dir, pairs, part, token)
    }

    fn post_lent(
        &mut self,
        ep: Ep,
        dir: Direction,
        pairs: &[(BlockId, BlockId)],
        part: Option<crate::transport::BlockBytes>,
        lend: crate::ledger::Incarnation,
        token: u64,
    ) -> Result<u32, PostFailure> {
        self.posts += 1;
        if part.is_none()
            && self.faults.panic_at_post != 0
            && self.posts == u64::from(self.faults.panic_at_post)
        {
            panic!(
                "kvpoll fault injection: poller panics at post {}",
                self.posts
            );
        }
        self.inner.post_lent(ep, dir, pairs, part, lend, token)
    }

    fn serve_read(&mut self, request: u32, lent: bool) {
        self.inner.serve_read(request, lent)
    }

    fn flush(&mut self, ep: Ep, token: u64) -> Result<(), i8> {
        self.inner.flush(ep, token)
    }

    fn send(&mut self, ep: Ep, payload: &[u8], token: u64, want_reply: bool) -> Result<(), i8> {
        self.inner.send(ep, payload, token, want_reply)
    }

    fn reply(&mut self, to: u32, payload: &[u8], token: u64) -> Result<(), i8> {
        self.inner.reply(to, payload, token)
    }

    fn read_word(&mut self, ep: Ep, inc: Incarnation, token: u64) -> Result<(), i8> {
        self.inner.read_word(ep, inc, token)
    }

    fn lend_words(&self) -> Option<LendWords> {
        self.inner.lend_words()
    }

    fn close(&mut self, ep: Ep) {
        self.inner.close(ep)
    }

    fn progress(&mut self) -> u32 {
        if !self.faults.slow_progress.is_zero() {
            std::thread::sleep(self.faults.slow_progress);
        }
        self.inner.progress()
    }

    fn drain(&mut self, sink: &mut dyn FnMut(TransportEvent<'_>)) {
        let every = u64::from(self.faults.handle_error_every);
        let (count, seen) = (&mut self.completions, &mut self.seen);
        self.inner.drain(&mut |ev| match ev {
            TransportEvent::Completion { token, status }
                if every != 0 && token & crate::transport::T_TRANSPORT == 0 =>
            {
                // The first completion of a handle's data operations counts
                // the handle; every n-th handle fails there.
                let first = !seen.contains(&token);
                if first {
                    if seen.len() == seen.capacity() {
                        seen.clear();
                    }
                    seen.push(token);
                    *count += 1;
                }
                let status = if first && *count % every == 0 && status == 0 {
                    IO_ERROR
                } else {
                    status
                };
                sink(TransportEvent::Completion { token, status })
            }
            other => sink(other),
        });
    }

    fn closing(&self) -> bool {
        self.inner.closing()
    }

    fn ready(&self) -> bool {
        self.inner.ready()
    }

    fn wait_fd(&mut self) -> Option<std::os::fd::RawFd> {
        self.inner.wait_fd()
    }

    fn arm(&mut self) -> bool {
        self.inner.arm()
    }

    fn hearing(&mut self, now: crate::ledger::Nanos) -> bool {
        self.inner.hearing(now)
    }

    /// Releases a handle's resources: fails once for every n-th handle.
    fn release(&mut self, handle: HandleKey) -> bool {
        if let Some(i) = self.held.iter().position(|&h| h == handle) {
            self.held.swap_remove(i);
            return true;
        }
        self.releases += 1;
        let every = u64::from(self.faults.release_failure_every);
        let fails = every != 0 && self.releases % every == 0;
        if fails {
            self.held.push(handle);
        }
        !fails
    }
}
