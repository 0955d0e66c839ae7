//! Per-handle progress: posting a handle's operations, their
//! completions, the flush that follows puts, releases and their retries.

use super::*;

/// Per-handle progress, indexed by `slot * 64 + handle`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Progress {
    /// The request key's generation this entry belongs to.
    pub(super) generation: u32,
    /// Operations outstanding (data, then the flush).
    pub(super) remaining: u32,
    /// Blocks it moves (pairs × regions; the transport may post fewer
    /// operations for them).
    pub(super) blocks: u32,
    /// The first failure, if any.
    pub(super) failure: Option<Reason>,
    pub(super) peer: PeerId,
    /// The endpoint generation the handle's operations travel on.
    pub(super) ep_generation: u32,
    /// Puts completed; the flush is outstanding.
    pub(super) flushing: bool,
    /// Ended; waits for (or retries) its release.
    pub(super) releasing: bool,
    /// Its release failed once: the next success is a retry.
    pub(super) held: bool,
    /// Whether it ended without error (puts flushed, gets landed).
    pub(super) ok: bool,
    /// The remote lend or receive it reads or writes.
    pub(super) lend: Incarnation,
    /// A read's first handle to a lender: the lender's lend word is being
    /// read.
    pub(super) checking: bool,
    /// A read's (or write's) first handle to a lender (or destination):
    /// the remote blocks the transfer moves there (all its handles to that
    /// engine), which its read done (or write done) names.
    pub(super) read: BlocksRead,
}

impl Default for Progress {
    fn default() -> Self {
        Progress {
            lend: Incarnation::NONE,
            generation: u32::MAX,
            remaining: 0,
            blocks: 0,
            failure: None,
            peer: PeerId(0),
            ep_generation: 0,
            flushing: false,
            releasing: false,
            held: false,
            ok: false,
            checking: false,
            read: BlocksRead::NONE,
        }
    }
}

impl Core {
    /// The block pairs of a [`Action::Post`].
    pub fn pairs(&self, range: (u32, u32)) -> &[(BlockId, BlockId)] {
        &self.pairs[range.0 as usize..(range.0 + range.1) as usize]
    }

    pub(super) fn start_handle(
        &mut self,
        key: RequestKey,
        h: u8,
        dir: Direction,
        range: (u32, u32),
    ) {
        let Some(hk) = HandleKey::new(key, h) else {
            return;
        };
        let peer_id = self.handle_peers[h as usize];
        let lend = self.handle_lends[h as usize];
        let part = self.handle_parts.get(h as usize).copied().flatten();
        let idx = Self::index(hk);
        self.progress[idx] = Progress {
            generation: key.generation(),
            peer: peer_id,
            lend,
            blocks: range.1.saturating_mul(self.local_regions as u32),
            read: self
                .handle_reads
                .get(h as usize)
                .copied()
                .unwrap_or_default(),
            ..Progress::default()
        };
        if self.slots.posting(hk).is_err() {
            return; // cancelled before it was posted: the ledger stopped it
        }
        let leaving = !self.leaving.is_empty() && self.leaving.contains(&peer_id);
        let valid = match self.peers.get(peer_id.0 as usize).and_then(|p| p.as_ref()) {
            Some(_) if leaving => None,
            Some(p) => {
                let pairs = &self.pairs[range.0 as usize..(range.0 + range.1) as usize];
                let ok = p.regions == self.local_regions
                    && pairs.iter().all(|&(l, r)| {
                        u64::from(l.0) < self.local_blocks && u64::from(r.0) < p.blocks
                    });
                ok.then_some(p.ep(peer_id))
            }
            None => None,
        };
        let Some(ep) = valid else {
            let events = &mut self.events;
            let _ = self
                .slots
                .setup_failed(hk, Reason::of(Cause::Setup), &mut |e| events.push(e));
            return;
        };
        if dir == Direction::Put {
            // The destination already asked whether we would write this
            // and was told no: its blocks may hold another request now.
            let to = self.peers[peer_id.0 as usize].map(|p| p.instance);
            let quiet = to.is_some_and(|to| self.quiet.promised(to, lend));
            if quiet {
                let events = &mut self.events;
                let _ = self
                    .slots
                    .setup_failed(hk, Reason::of(Cause::LeaseLost), &mut |e| events.push(e));
                return;
            }
        }
        self.progress[idx].ep_generation = ep.generation;
        self.push_on(
            ep.peer,
            Action::Post {
                ep,
                dir,
                handle: hk,
                token: hk.to_u64() | T_DATA,
                pairs: range,
                part,
            },
        );
    }

    pub(super) fn index(hk: HandleKey) -> usize {
        hk.key().slot() as usize * MAX_HANDLES + usize::from(hk.handle())
    }

    /// The result of an [`Action::Post`].
    pub fn on_posted(&mut self, hk: HandleKey, result: Result<u32, PostFailure>) {
        self.touched();
        let idx = Self::index(hk);
        let (n, failure) = match result {
            Ok(n) => (n, None),
            Err(f) => (f.posted, Some(f.status)),
        };
        self.stats.ops_posted += u64::from(n);
        self.ops_in_flight += u64::from(n);
        let p = &mut self.progress[idx];
        p.remaining = n;
        if let Some(status) = failure {
            let cause = if n == 0 {
                Cause::Setup
            } else {
                Cause::Transfer
            };
            p.failure = Some(Reason::new(cause, status.min(-1)));
        }
        if n == 0 {
            let reason = p.failure.unwrap_or(Reason::of(Cause::Setup));
            let events = &mut self.events;
            let _ = self.slots.setup_failed(hk, reason, &mut |e| events.push(e));
            self.after_events();
        }
    }

    /// An [`Action::Flush`] could not be posted.
    pub fn on_flush_failed(&mut self, hk: HandleKey, status: i8) {
        self.touched();
        let idx = Self::index(hk);
        let p = &mut self.progress[idx];
        if p.generation != hk.key().generation() || !p.flushing {
            return;
        }
        p.remaining = 0;
        p.flushing = false;
        let (peer, generation) = (p.peer, p.ep_generation);
        self.ops_in_flight = self.ops_in_flight.saturating_sub(1);
        let reason = self.cancel_reason(peer, generation, status);
        self.progress[idx].failure.get_or_insert(reason);
        self.handle_ended(hk);
    }

    /// An [`Action::Send`] or [`Action::Reply`] of `count` notifications
    /// could not be posted (they are lost; the other side's lease decides).
    pub fn on_send_failed(&mut self, count: u32) {
        self.touched();
        self.notes_in_flight = self.notes_in_flight.saturating_sub(u64::from(count));
    }

    /// The result of an [`Action::Release`].
    pub fn on_released(&mut self, hk: HandleKey, released: bool, now: Nanos) {
        self.touched();
        let idx = Self::index(hk);
        let p = self.progress[idx];
        if p.generation != hk.key().generation() || !p.releasing {
            return;
        }
        let result = match p.failure {
            None => Ok(()),
            Some(r) => Err(r),
        };
        let events = &mut self.events;
        let mut out = |e| events.push(e);
        if p.held {
            let _ = self.slots.release_retried(hk, released, &mut out);
        } else if released {
            let _ = self.slots.completed(hk, result, &mut out);
        } else {
            let _ = self.slots.release_failed(hk, result, &mut out);
        }
        if released {
            self.progress[idx].releasing = false;
            match self.info[hk.key().slot() as usize].kind {
                Kind::Write { .. } if p.ok => self.write_landed(hk),
                Kind::Read if self.cfg.confirm_reads => self.maybe_query(hk.key()),
                _ => {}
            }
        } else {
            self.progress[idx].held = true;
            self.held
                .push((hk, now.saturating_add(self.cfg.release_retry)));
        }
        self.after_events();
    }

    pub(super) fn on_completion(&mut self, token: u64, status: i8) {
        let kind = token & KIND_MASK;
        if kind == T_NOTE {
            // A message completes for every notification it carried.
            let count = (token & !KIND_MASK).max(1);
            self.notes_in_flight = self.notes_in_flight.saturating_sub(count);
            return;
        }
        if kind == T_TRANSPORT {
            return;
        }
        self.ops_in_flight = self.ops_in_flight.saturating_sub(1);
        self.stats.ops_completed += 1;
        let hk = HandleKey::from_u64(token & !KIND_MASK);
        let idx = Self::index(hk);
        let Some(p) = self.progress.get(idx).copied() else {
            return;
        };
        if p.generation != hk.key().generation() || p.remaining == 0 || p.releasing {
            return; // not ours (cannot happen while slots retire after quiescence)
        }
        if status != 0 && p.failure.is_none() {
            let reason = self.cancel_reason(p.peer, p.ep_generation, status);
            if reason.cause == Cause::NotLent {
                // Its lender refused to serve what it asked for.
                self.stats.reads_not_lent += 1;
            }
            self.progress[idx].failure = Some(reason);
        }
        self.progress[idx].remaining -= 1;
        if self.progress[idx].remaining > 0 {
            return;
        }
        let p = self.progress[idx];
        if kind == T_DATA && p.failure.is_none() {
            self.stats.blocks_moved += u64::from(p.blocks);
        }
        if kind == T_DATA && self.is_write(hk) {
            // Puts completed: flush the endpoint they travelled on before
            // anyone is told (a completed put only frees the source), even
            // if one failed (the others may still be landing, and the
            // destination's word about them must come after them). Never
            // a fresh endpoint: if that one is closed, the flush fails.
            let ep = Ep {
                peer: p.peer,
                generation: p.ep_generation,
            };
            self.progress[idx].flushing = true;
            self.progress[idx].remaining = 1;
            self.ops_in_flight += 1;
            self.push_on(
                ep.peer,
                Action::Flush {
                    ep,
                    handle: hk,
                    token: hk.to_u64() | T_FLUSH,
                },
            );
            return;
        }
        self.handle_ended(hk);
    }

    pub(super) fn is_write(&self, hk: HandleKey) -> bool {
        matches!(self.info[hk.key().slot() as usize].kind, Kind::Write { .. })
    }

    /// A handle's operations are all done: release it.
    pub(super) fn handle_ended(&mut self, hk: HandleKey) {
        let idx = Self::index(hk);
        let p = &mut self.progress[idx];
        p.flushing = false;
        p.remaining = 0;
        p.releasing = true;
        p.ok = p.failure.is_none();
        self.actions.push_back(Action::Release { handle: hk });
    }
}
