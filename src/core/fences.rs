//! Fences: a push destination's lease ends in quarantine, not in a free,
//! until every writer that could still write has spoken, answered quiet or
//! been lost.

use super::*;

/// A push destination's fence: when its lease ends (or at its abort), when
/// to ask its silent writers again once quarantined, and — lent to writers
/// it did not name — the peers it asked that have not answered yet (every
/// peer it knew then, however many).
#[derive(Debug, Clone)]
pub(super) struct Fence {
    pub(super) key: RequestKey,
    pub(super) due: Nanos,
    pub(super) asked: Vec<PeerId>,
}

impl Core {
    pub(super) fn fence_of(&self, key: RequestKey) -> Option<&Fence> {
        self.fences.iter().find(|f| f.key == key)
    }

    /// Peer `peer` answered push destination `key`'s question (or spoke):
    /// it is not waited for any more.
    pub(super) fn answered(&mut self, key: RequestKey, peer: Option<PeerId>) {
        let Some(peer) = peer else {
            return;
        };
        for f in self.fences.iter_mut().filter(|f| f.key == key) {
            f.asked.retain(|&p| p != peer);
        }
    }

    /// A quarantined push destination is released once nothing can land
    /// in it any more: every writer it asked (or named) has spoken,
    /// answered quiet or was lost — or, lent to unnamed writers, as many
    /// as it was lent to have spoken.
    pub(super) fn lift_fence(&mut self, key: RequestKey) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        if !info.quarantined || info.generation != key.generation() {
            return;
        }
        let base = slot * MAX_HANDLES;
        let spoke = &self.notifiers[slot * MAX_CONSUMERS..][..usize::from(info.notified)];
        let all_fenced = if info.unnamed {
            // Every peer it asked answered, spoke or was lost.
            self.fence_of(key).is_none_or(|f| f.asked.is_empty())
        } else {
            (0..info.handles as usize).all(|h| {
                // A peer no longer known was lost (and counted then), or
                // replaced under a new id that its handle names now.
                let peer = self.progress[base + h].peer;
                match self.peers.get(peer.0 as usize).and_then(|p| p.as_ref()) {
                    Some(p) => spoke.contains(&p.instance),
                    None => true,
                }
            })
        };
        let enough = info.unnamed
            && matches!(info.kind, Kind::Receive { writers } if u32::from(info.words) >= writers);
        if all_fenced || enough {
            self.info[slot].quarantined = false;
            self.stats.quarantined_now = self.stats.quarantined_now.saturating_sub(1);
            let cause = if self.shutting_down {
                Cause::Shutdown
            } else if info.aborted {
                Cause::Aborted
            } else if info.abandoned {
                Cause::LeaseLost
            } else {
                Cause::LeaseExpired
            };
            self.ledger_fail(key, cause);
        }
    }

    /// Push destinations whose lease ran out are quarantined (their
    /// writers asked); quarantined ones whose writers are still silent are
    /// asked again.
    pub(super) fn expire_fences(&mut self, now: Nanos) {
        let mut i = 0;
        while i < self.fences.len() {
            let (key, due) = (self.fences[i].key, self.fences[i].due);
            if !self.fence_live(key) {
                self.fences.swap_remove(i);
                continue;
            }
            if due <= now {
                if self.info[key.slot() as usize].quarantined {
                    self.query_writers(key);
                } else {
                    self.quarantine(key);
                }
                if !self.fence_live(key) {
                    self.fences.swap_remove(i);
                    continue;
                }
                let lease = Nanos(self.info[key.slot() as usize].lease);
                self.fences[i].due = now.saturating_add(lease.max(REQUERY_MIN));
            }
            i += 1;
        }
    }

    pub(super) fn fence_live(&self, key: RequestKey) -> bool {
        self.info[key.slot() as usize].generation == key.generation() && self.ledger.is_live(key)
    }

    /// Push destination `key` stops being a timer and becomes a fence: its
    /// blocks are held (not reported) until every writer that could still
    /// write into them has spoken, answered quiet or been lost. Unnamed
    /// writers could be any peer: every peer is asked.
    pub(super) fn quarantine(&mut self, key: RequestKey) {
        let slot = key.slot() as usize;
        self.info[slot].quarantined = true;
        self.stats.quarantined_receives += 1;
        self.stats.quarantined_now += 1;
        if self.info[slot].unnamed {
            // Every peer known now, however many, that has not spoken.
            let spoke =
                &self.notifiers[slot * MAX_CONSUMERS..][..usize::from(self.info[slot].notified)];
            let asked: Vec<PeerId> = self
                .peers
                .iter()
                .enumerate()
                .filter_map(|(i, p)| {
                    p.filter(|p| !spoke.contains(&p.instance))
                        .map(|_| PeerId(i as u32))
                })
                .collect();
            if let Some(f) = self.fences.iter_mut().find(|f| f.key == key) {
                f.asked = asked;
            }
        }
        self.query_writers(key);
        self.lift_fence(key);
    }

    /// Asks each writer of quarantined push destination `key` that has not
    /// spoken whether anything of it will still land.
    pub(super) fn query_writers(&mut self, key: RequestKey) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        if info.unnamed {
            let asked = self
                .fence_of(key)
                .map(|f| f.asked.clone())
                .unwrap_or_default();
            for peer in asked {
                self.send_note(
                    peer,
                    None,
                    NoteKind::WriteQuery,
                    info.id,
                    info.token,
                    Incarnation::NONE,
                    true,
                );
            }
            return;
        }
        let base = slot * MAX_HANDLES;
        for h in 0..info.handles as usize {
            let peer = self.progress[base + h].peer;
            let Some(instance) = self
                .peers
                .get(peer.0 as usize)
                .and_then(|p| p.map(|p| p.instance))
            else {
                continue;
            };
            let spoke = self.notifiers[slot * MAX_CONSUMERS..]
                [..usize::from(self.info[slot].notified)]
                .contains(&instance);
            if !spoke && !(0..h).any(|g| self.progress[base + g].peer == peer) {
                let (id, inc) = (info.id, info.token);
                self.send_note(
                    peer,
                    None,
                    NoteKind::WriteQuery,
                    id,
                    inc,
                    Incarnation::NONE,
                    true,
                );
            }
        }
    }

    /// Writer `instance` (peer `peer`) is gone: the push destinations that
    /// named it and did not hear from it count it as having given up.
    pub(super) fn writer_lost(&mut self, peer: PeerId, instance: u64) {
        // Destinations lent to unnamed writers that asked it stop waiting.
        let mut lifted = Vec::new();
        for f in &mut self.fences {
            if f.asked.contains(&peer) {
                f.asked.retain(|&p| p != peer);
                lifted.push(f.key);
            }
        }
        for key in lifted {
            self.lift_fence(key);
        }
        for slot in 0..self.info.len() {
            let info = self.info[slot];
            if !matches!(info.kind, Kind::Receive { .. }) || info.handles == 0 || info.unnamed {
                continue;
            }
            let key = RequestKey::new(slot as u32, info.generation);
            if self.ledger.expiry(key).is_none() {
                continue;
            }
            let base = slot * MAX_HANDLES;
            let named = (0..info.handles as usize).any(|h| self.progress[base + h].peer == peer);
            let n = usize::from(info.notified);
            let spoke =
                self.notifiers[slot * MAX_CONSUMERS..slot * MAX_CONSUMERS + n].contains(&instance);
            if named && !spoke {
                self.counted(slot, instance);
                self.info[slot].abandoned = true;
                if self.info[slot].quarantined {
                    self.lift_fence(key);
                } else if usize::from(self.info[slot].notified) >= usize::from(info.handles) {
                    self.ledger_fail(key, Cause::PeerLost);
                }
            }
        }
    }

    /// Push destinations quarantined now (waiting for writers to answer).
    pub fn quarantined(&self) -> u64 {
        self.stats.quarantined_now
    }
}
