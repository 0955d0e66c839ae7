//! Notification batching: the notes bound for one endpoint generation (or
//! one reply handle) travel in one message, queued before anything that
//! must not overtake them.

use super::*;

/// Where a batch of notifications goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NoteTarget {
    /// An endpoint generation of a peer.
    Ep(Ep),
    /// The reply handle of a received message, and its sender's instance.
    Reply(u32, u64),
}

/// Notifications for one target, not yet queued.
pub(super) struct Batch {
    pub(super) to: NoteTarget,
    pub(super) want_reply: bool,
    pub(super) count: u32,
    pub(super) bytes: [u8; MAX_PER_MESSAGE * NOTE_LEN],
}

impl Core {
    /// The next action to execute, if any. Notifications waiting in
    /// batches are queued once nothing else is.
    pub fn next_action(&mut self) -> Option<Action> {
        if self.actions.is_empty() {
            while !self.batches.is_empty() {
                self.queue_batch(self.batches.len() - 1);
            }
        }
        self.actions.pop_front()
    }

    /// The encoded notifications of an [`Action::Send`] or
    /// [`Action::Reply`].
    pub fn notes(&self, notes: Notes) -> &[u8] {
        &self.note_bytes[notes.range()]
    }

    /// Sends `kind` about request `key` once to each distinct peer of its
    /// handles, naming the incarnation each handle works on (and, for a
    /// read or a write, the request's own).
    pub(super) fn each_peer_once(&mut self, key: RequestKey, kind: NoteKind, want_reply: bool) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        let nonce = match info.kind {
            Kind::Receive { .. } => Incarnation::NONE,
            _ => info.token,
        };
        let base = slot * MAX_HANDLES;
        for h in 0..info.handles as usize {
            let Progress { peer, lend, .. } = self.progress[base + h];
            let dup = (0..h).any(|g| self.progress[base + g].peer == peer);
            // A read of memory no lend guards has nobody to tell.
            if dup || lend.is_none() {
                continue;
            }
            if kind == NoteKind::ReadDone {
                let blocks = self.progress[base + h].read;
                self.send_read_done(peer, info.id, lend, nonce, blocks, want_reply);
            } else {
                self.send_note(peer, None, kind, info.id, lend, nonce, want_reply);
            }
        }
    }

    pub(super) fn note(
        &self,
        kind: NoteKind,
        id: RequestId,
        incarnation: Incarnation,
        nonce: Incarnation,
    ) -> Notification {
        Notification {
            kind,
            id,
            incarnation,
            nonce,
            sender: self.cfg.instance,
            blocks: BlocksRead::NONE,
        }
    }

    /// Adds `note` to the batch waiting for `to` (a new one if none, or if
    /// that one is full or asks for answers where `note` does not, or the
    /// other way round: it is queued first). Batches become actions when a
    /// post, flush, close or forget of their peer is queued (so nothing of
    /// that peer is reordered with them) or when the queue runs dry.
    pub(super) fn enqueue_note(&mut self, to: NoteTarget, note: &[u8; NOTE_LEN], want_reply: bool) {
        self.notes_in_flight += 1;
        self.stats.notifications_sent += 1;
        let i = match self.batches.iter().position(|b| b.to == to) {
            // Full, or of the other kind: a message that asks for answers
            // gets every note in it answered (a one-way note among
            // questions would be answered too, and the answer refused as
            // stale). Queued first, so the order of the notes is kept.
            Some(i)
                if self.batches[i].count as usize == MAX_PER_MESSAGE
                    || self.batches[i].want_reply != want_reply =>
            {
                self.queue_batch(i);
                self.new_batch(to, want_reply)
            }
            Some(i) => i,
            None => self.new_batch(to, want_reply),
        };
        let b = &mut self.batches[i];
        let at = b.count as usize * NOTE_LEN;
        b.bytes[at..at + NOTE_LEN].copy_from_slice(note);
        b.count += 1;
    }

    pub(super) fn new_batch(&mut self, to: NoteTarget, want_reply: bool) -> usize {
        let fresh = Batch {
            to,
            want_reply,
            count: 0,
            bytes: [0; MAX_PER_MESSAGE * NOTE_LEN],
        };
        self.batches.push(fresh);
        self.batches.len() - 1
    }

    /// Queues batch `i` as one [`Action::Send`] or [`Action::Reply`].
    pub(super) fn queue_batch(&mut self, i: usize) {
        let b = self.batches.swap_remove(i);
        if self.actions.is_empty() {
            // No queued action refers to these bytes any more.
            self.note_bytes.clear();
        }
        let start = self.note_bytes.len();
        let body = &b.bytes[..b.count as usize * NOTE_LEN];
        self.note_bytes.extend_from_slice(body);
        if let Some(sealer) = self.sealer.as_mut() {
            let to = match b.to {
                NoteTarget::Ep(ep) => self.peers[ep.peer.0 as usize]
                    .as_ref()
                    .map_or(0, |p| p.instance),
                NoteTarget::Reply(_, instance) => instance,
            };
            self.note_bytes.extend_from_slice(&sealer.seal(to, body));
        }
        let notes = Notes {
            start: start as u32,
            count: b.count,
            len: (self.note_bytes.len() - start) as u32,
        };
        self.stats.notification_messages += 1;
        let token = T_NOTE | u64::from(b.count);
        self.actions.push_back(match b.to {
            NoteTarget::Ep(ep) => Action::Send {
                ep,
                notes,
                token,
                want_reply: b.want_reply,
            },
            NoteTarget::Reply(to, _) => Action::Reply { to, notes, token },
        });
    }

    /// Queues the notification batches to `peer` (before an action that
    /// must not overtake them).
    pub(super) fn queue_batches_to(&mut self, peer: PeerId) {
        let mut i = 0;
        while i < self.batches.len() {
            if matches!(self.batches[i].to, NoteTarget::Ep(ep) if ep.peer == peer) {
                self.queue_batch(i);
            } else {
                i += 1;
            }
        }
    }

    /// Queues `action` on `peer`'s endpoint, after what was to be sent there.
    pub(super) fn push_on(&mut self, peer: PeerId, action: Action) {
        if !self.batches.is_empty() {
            self.queue_batches_to(peer);
        }
        self.actions.push_back(action);
    }

    /// Queues a notification to `peer`, on endpoint generation `on` if given
    /// (a write-done must follow its flush) or the current one.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn send_note(
        &mut self,
        peer: PeerId,
        on: Option<u32>,
        kind: NoteKind,
        id: RequestId,
        incarnation: Incarnation,
        nonce: Incarnation,
        want_reply: bool,
    ) {
        let note = self.note(kind, id, incarnation, nonce);
        self.send_to(peer, on, &note, want_reply);
    }

    /// Queues a read's read done to lender `peer` about lend `lend`,
    /// naming the lender blocks it read; `ask`: the lender answers
    /// whether it lent them (otherwise it only counts this reader, if it
    /// did).
    pub(super) fn send_read_done(
        &mut self,
        peer: PeerId,
        id: RequestId,
        lend: Incarnation,
        nonce: Incarnation,
        blocks: BlocksRead,
        ask: bool,
    ) {
        let note = Notification {
            blocks,
            ..self.note(NoteKind::ReadDone, id, lend, nonce)
        };
        self.send_to(peer, None, &note, ask);
    }

    pub(super) fn send_to(
        &mut self,
        peer: PeerId,
        on: Option<u32>,
        note: &Notification,
        want_reply: bool,
    ) {
        let Some(p) = self.peers.get(peer.0 as usize).and_then(|p| p.as_ref()) else {
            return;
        };
        let ep = Ep {
            peer,
            generation: on.unwrap_or(p.generation),
        };
        self.enqueue_note(NoteTarget::Ep(ep), &note.encode(), want_reply);
    }

    /// Answers received note `to_note` through its reply handle, if its
    /// sender asked for answers, naming the same incarnation and nonce.
    pub(super) fn answer(&mut self, reply: Option<u32>, kind: NoteKind, to_note: &Notification) {
        if let Some(to) = reply {
            let note = self.note(kind, to_note.id, to_note.incarnation, to_note.nonce);
            let to = NoteTarget::Reply(to, to_note.sender);
            self.enqueue_note(to, &note.encode(), false);
        }
    }
}
