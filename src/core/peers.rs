//! The peer table: endpoint generations and why they were closed, adding
//! (and refreshing) and removing peers without dropping a fence or
//! cutting puts in flight, losses, forced closes.

use super::*;

/// Whether an operation's status says its peer is gone (unreachable, the
/// connection reset or not connected, a link or endpoint failure — UCX's
/// `UCS_ERR_ENDPOINT_TIMEOUT` for a killed process among them), as opposed
/// to an error of the transfer itself.
pub(super) fn peer_gone(status: i8) -> bool {
    matches!(status, -6 | -24 | -25 | -89..=-40)
}

/// What the core knows of a peer.
#[derive(Debug, Clone, Copy)]
pub(super) struct Peer {
    pub(super) instance: u64,
    /// Blocks per region, and regions, of the peer (remote block ids are
    /// checked against them before anything is posted).
    pub(super) blocks: u64,
    pub(super) regions: usize,
    /// The current endpoint generation; bumped when it is force-closed.
    pub(super) generation: u32,
    /// Why recent generations were closed, newest first: a completion
    /// cancelled by a close carries the close's reason.
    pub(super) closes: [(u32, Cause); 4],
}

impl Peer {
    pub(super) fn ep(&self, id: PeerId) -> Ep {
        Ep {
            peer: id,
            generation: self.generation,
        }
    }

    pub(super) fn close_cause(&self, generation: u32) -> Option<Cause> {
        self.closes
            .iter()
            .find(|(g, c)| *g == generation && *c != Cause::Transfer)
            .map(|&(_, c)| c)
    }
}

impl Core {
    /// Local memory now holds `regions` regions of `blocks` blocks each.
    pub fn set_local_layout(&mut self, regions: usize, blocks: u64) {
        self.touched();
        self.local_regions = regions;
        self.local_blocks = blocks;
    }

    /// Whether a peer was ever added (registering more memory would leave
    /// those peers with stale metadata).
    pub fn has_peers(&self) -> bool {
        self.peers.iter().any(Option::is_some)
    }

    /// The peer entry of engine `instance`, if it is a peer.
    pub fn peer_of(&self, instance: u64) -> Option<PeerId> {
        self.by_instance.get(&instance).copied()
    }

    /// Adds a peer. An engine re-added under the same instance (its
    /// metadata refreshed) replaces its old entry — but only while nothing
    /// uses that entry: with operations of ours in flight on it, or a receive
    ///  waiting for its word, closing it could cut puts in
    /// flight or drop a fence, so the refresh is refused (`Err` names the
    /// entry in use). The engine is alive (same instance), so receives
    ///  that named it keep waiting, and name the new entry.
    pub fn add_peer(
        &mut self,
        instance: u64,
        regions: usize,
        blocks: u64,
    ) -> Result<PeerId, PeerId> {
        self.touched();
        let replaced = self.by_instance.get(&instance).copied();
        if let Some(old) = replaced {
            if self.in_use(old) {
                return Err(old);
            }
            self.drop_peer(old, Cause::PeerLost, false, false);
        }
        let id = PeerId(self.peers.len() as u32);
        if let Some(old) = replaced {
            self.rename_writer(old, id);
        }
        self.peers.push(Some(Peer {
            instance,
            blocks,
            regions,
            generation: 1,
            closes: [(0, Cause::Transfer); 4],
        }));
        self.by_instance.insert(instance, id);
        Ok(id)
    }

    /// Removes a peer: its handles in flight fail (deferred, as always),
    /// and nothing new is posted to it. While a receive still
    /// waits for its word, or puts of ours to it are in flight, it is only
    /// marked as leaving — closing its endpoint could cut those puts or
    /// drop the fence — and forgotten once neither holds. Returns whether
    /// the id was ever issued (a second removal is fine).
    pub fn remove_peer(&mut self, peer: PeerId) -> bool {
        self.touched();
        let Some(entry) = self.peers.get(peer.0 as usize) else {
            return false;
        };
        if entry.is_none() || self.leaving.contains(&peer) {
            return true;
        }
        if self.fence_needs(peer) || self.puts_in_flight(peer) {
            self.leaving.push(peer);
        } else {
            self.drop_peer(peer, Cause::PeerLost, true, true);
        }
        true
    }

    /// Peers removed or lost since the last call, with why (`PeerLost` and
    /// the endpoint's status for a loss).
    pub fn drain_lost_peers(&mut self, mut out: impl FnMut(PeerId, Reason)) {
        for (peer, reason) in self.lost.drain(..) {
            out(peer, reason);
        }
    }

    /// Whether anything of ours is in flight on `peer`'s entry, or a receive
    ///  waits for its word.
    pub(super) fn in_use(&self, peer: PeerId) -> bool {
        self.fence_needs(peer)
            || self.progress.iter().enumerate().any(|(i, p)| {
                p.peer == peer
                    && (p.remaining > 0 || p.releasing)
                    && self.info[i / MAX_HANDLES].generation == p.generation
                    && self
                        .ledger
                        .is_live(RequestKey::new((i / MAX_HANDLES) as u32, p.generation))
            })
    }

    /// Whether a live receive could still hear from `peer` (a
    /// writer it named that has not spoken, a peer it asked that has not
    /// answered, or any peer while one lent to unnamed writers is not
    /// quarantined yet: any of them could be writing).
    pub(super) fn fence_needs(&self, peer: PeerId) -> bool {
        let instance = match self.peers.get(peer.0 as usize) {
            Some(Some(p)) => p.instance,
            _ => return false,
        };
        self.fences.iter().any(|f| {
            if !self.fence_live(f.key) {
                return false;
            }
            let slot = f.key.slot() as usize;
            let info = &self.info[slot];
            if info.unnamed {
                return !info.quarantined || f.asked.contains(&peer);
            }
            let spoke = &self.notifiers[slot * MAX_CONSUMERS..][..usize::from(info.notified)];
            let base = slot * MAX_HANDLES;
            (0..info.handles as usize).any(|h| self.progress[base + h].peer == peer)
                && !spoke.contains(&instance)
        })
    }

    /// Peers marked as leaving that nothing holds any more are forgotten.
    pub(super) fn retire_leaving(&mut self) {
        let mut i = 0;
        while i < self.leaving.len() {
            let peer = self.leaving[i];
            if self.fence_needs(peer) || self.puts_in_flight(peer) {
                i += 1;
            } else {
                self.leaving.swap_remove(i);
                self.drop_peer(peer, Cause::PeerLost, true, true);
            }
        }
    }

    /// Receives that name writer `old` name `new` instead.
    pub(super) fn rename_writer(&mut self, old: PeerId, new: PeerId) {
        for slot in 0..self.info.len() {
            let info = self.info[slot];
            if !matches!(info.kind, Kind::Receive { .. }) || info.handles == 0 {
                continue;
            }
            let key = RequestKey::new(slot as u32, info.generation);
            if !self.ledger.is_live(key) {
                continue;
            }
            let base = slot * MAX_HANDLES;
            for p in &mut self.progress[base..base + info.handles as usize] {
                if p.peer == old {
                    p.peer = new;
                }
            }
        }
        for f in &mut self.fences {
            for p in &mut f.asked {
                if *p == old {
                    *p = new;
                }
            }
        }
    }

    /// Forgets `peer`; `gone` says the engine behind it is gone (lost or
    /// removed), not replaced by a newer entry of the same engine, and
    /// `removed` that it was removed, its endpoint alive (see
    /// [`Action::ForgetPeer`]).
    pub(super) fn drop_peer(&mut self, peer: PeerId, cause: Cause, gone: bool, removed: bool) {
        let drain = removed && self.ops_in_flight(peer);
        let Some(p) = self.peers.get_mut(peer.0 as usize).and_then(Option::take) else {
            return;
        };
        self.leaving.retain(|&l| l != peer);
        if self.by_instance.get(&p.instance) == Some(&peer) {
            self.by_instance.remove(&p.instance);
        }
        let events = &mut self.events;
        self.ledger
            .peer_lost_with(peer, Reason::of(cause), &mut |e| events.push(e));
        if gone {
            self.writer_lost(peer, p.instance);
        }
        self.push_on(peer, Action::ForgetPeer { peer, drain });
    }

    /// The reason of an operation on `peer`'s endpoint generation that
    /// ended with `status`: a cancellation by our own forced close carries
    /// the close's cause (the peer stalled, the engine shut down).
    pub(super) fn cancel_reason(&self, peer: PeerId, generation: u32, status: i8) -> Reason {
        let closed = self
            .peers
            .get(peer.0 as usize)
            .and_then(|p| p.as_ref())
            .and_then(|p| p.close_cause(generation));
        match closed {
            Some(cause) if status == CANCELED => Reason::new(cause, status),
            // Its lender refused to serve it: not the live lend's blocks.
            _ if status == NOT_LENT => Reason::new(Cause::NotLent, status),
            _ if peer_gone(status) => Reason::new(Cause::PeerLost, status),
            _ => Reason::new(Cause::Transfer, status.min(-1)),
        }
    }

    pub(super) fn on_endpoint_failed(&mut self, ep: Ep, status: i8) {
        let current = matches!(
            self.peers.get(ep.peer.0 as usize),
            Some(Some(p)) if p.generation == ep.generation
        );
        if current {
            // Rule 9: fail its handles (deferred) and drop the peer at once;
            // add_peer with fresh metadata works again. The engine hears
            // of it.
            self.stats.peers_lost += 1;
            self.lost
                .push((ep.peer, Reason::new(Cause::PeerLost, status.min(-1))));
            self.drop_peer(ep.peer, Cause::PeerLost, true, false);
            self.after_events();
        }
    }

    /// Force-closes `peer`'s endpoint generation `generation` if it is the
    /// current one; later operations go to a fresh endpoint.
    pub(super) fn close(&mut self, peer: PeerId, generation: u32, cause: Cause) {
        let Some(Some(p)) = self.peers.get_mut(peer.0 as usize) else {
            return;
        };
        if p.generation != generation {
            return; // closed already
        }
        p.closes.rotate_right(1);
        p.closes[0] = (generation, cause);
        p.generation = generation.wrapping_add(1);
        if cause == Cause::PeerStalled {
            self.stats.stall_closes += 1;
        }
        self.push_on(
            peer,
            Action::Close {
                ep: Ep { peer, generation },
            },
        );
    }

    /// Whether operations of ours (gets, puts, flushes) are in flight on
    /// `peer`'s endpoint.
    fn ops_in_flight(&self, peer: PeerId) -> bool {
        self.progress.iter().enumerate().any(|(i, p)| {
            p.peer == peer
                && p.remaining > 0
                && self.info[i / MAX_HANDLES].generation == p.generation
        })
    }

    /// Whether a write has puts (or their flush) in flight to `peer`.
    pub(super) fn puts_in_flight(&self, peer: PeerId) -> bool {
        self.progress.iter().enumerate().any(|(i, p)| {
            p.peer == peer
                && p.remaining > 0
                && matches!(self.info[i / MAX_HANDLES].kind, Kind::Write { .. })
                && self.info[i / MAX_HANDLES].generation == p.generation
        })
    }

    /// Force-closes every open endpoint: whatever is outstanding completes
    /// (cancelled) and nothing more can reach a peer's memory through them.
    ///
    /// At shutdown, an endpoint carrying puts is closed only once they
    /// completed (or failed): a cancelled put may still land, after any
    /// word of ours on another endpoint.
    pub fn close_all(&mut self, cause: Cause) {
        self.touched();
        for i in 0..self.peers.len() {
            if let Some(p) = self.peers[i] {
                let peer = PeerId(i as u32);
                let closed = p.closes[0] == (p.generation.wrapping_sub(1), Cause::Shutdown);
                if cause == Cause::Shutdown && (closed || self.puts_in_flight(peer)) {
                    continue;
                }
                self.close(peer, p.generation, cause);
            }
        }
    }
}
