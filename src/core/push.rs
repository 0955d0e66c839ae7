//! Push: writes and the destinations they write into. A write's word
//! follows its puts on their endpoint; a destination counts each writer
//! once and acknowledges what counted; a writer answers a destination's
//! question and keeps its quiet promises per incarnation.

use super::*;

/// The [`NoteKind::WriteQuiet`] promises this engine made, per asking
/// engine: receives (by incarnation) it will not write into.
#[derive(Default)]
pub(super) struct Quiet {
    pub(super) engines: HashMap<u64, (VecDeque<Incarnation>, HashSet<Incarnation>)>,
}

impl Quiet {
    pub(super) fn promised(&self, to: u64, lend: Incarnation) -> bool {
        self.engines
            .get(&to)
            .is_some_and(|(_, set)| set.contains(&lend))
    }

    /// Remembers a promise; `known` says whether an engine is a peer (one
    /// that is not is forgotten first when too many engines asked).
    pub(super) fn promise(&mut self, to: u64, lend: Incarnation, known: impl Fn(u64) -> bool) {
        if !self.engines.contains_key(&to) && self.engines.len() >= QUIET_ENGINES {
            let stranger = self.engines.keys().copied().find(|&e| !known(e));
            let gone = stranger.or_else(|| self.engines.keys().copied().next());
            if let Some(e) = gone {
                self.engines.remove(&e);
            }
        }
        let (order, set) = self.engines.entry(to).or_default();
        if !set.insert(lend) {
            return;
        }
        if order.len() == QUIET_PER_ENGINE {
            if let Some(old) = order.pop_front() {
                set.remove(&old);
            }
        }
        order.push_back(lend);
    }
}

impl Core {
    /// A write handle ended well: once every handle of the request to the
    /// same destination engine did, that engine hears (once) that its
    /// blocks hold the data.
    pub(super) fn write_landed(&mut self, hk: HandleKey) {
        let key = hk.key();
        let info = self.info[key.slot() as usize];
        let peer = self.progress[Self::index(hk)].peer;
        let base = key.slot() as usize * MAX_HANDLES;
        let all = (0..info.handles as usize).all(|h| {
            let p = &self.progress[base + h];
            p.peer != peer || (p.ok && !p.releasing && p.remaining == 0)
        });
        if all {
            let p = self.progress[Self::index(hk)];
            // The destination blocks written there, named on the write's
            // first handle to that engine.
            let blocks = (0..info.handles as usize)
                .map(|h| self.progress[base + h])
                .find(|q| q.peer == peer)
                .map_or(BlocksRead::NONE, |q| q.read);
            let note = Notification {
                blocks,
                ..self.note(NoteKind::WriteDone, info.id, p.lend, info.token)
            };
            self.send_to(peer, Some(p.ep_generation), &note, false);
        }
    }

    /// A write ended without success: each destination engine not already
    /// told that its blocks hold the data hears that the write gave up, on
    /// the endpoint its puts travelled (after their flush), so that the
    /// word cannot overtake them.
    pub(super) fn abandon_write(&mut self, key: RequestKey) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        let base = slot * MAX_HANDLES;
        for h in 0..info.handles as usize {
            let p = self.progress[base + h];
            if (0..h).any(|g| self.progress[base + g].peer == p.peer) {
                continue;
            }
            let done = (0..info.handles as usize).all(|g| {
                let q = &self.progress[base + g];
                q.peer != p.peer || q.ok
            });
            if !done {
                self.send_note(
                    p.peer,
                    // Never posted: nothing of it is on any endpoint.
                    Some(p.ep_generation).filter(|&g| g != 0),
                    NoteKind::WriteAbandoned,
                    info.id,
                    p.lend,
                    info.token,
                    false,
                );
            }
        }
    }

    /// Acknowledges writer engine `done.sender`'s push, through its
    /// endpoint, naming the write's nonce.
    pub(super) fn acknowledge(&mut self, done: &Notification) {
        if let Some(&peer) = self.by_instance.get(&done.sender) {
            let (id, inc, nonce) = (done.id, done.incarnation, done.nonce);
            self.send_note(peer, None, NoteKind::Ack, id, inc, nonce, false);
        }
    }

    /// A writer's word this destination does not take: counted, logged,
    /// and answered so that the write fails at once.
    pub(super) fn refuse_write(&mut self, done: &Notification) {
        self.stats.refused_writes += 1;
        self.reject();
        if let Some(&peer) = self.by_instance.get(&done.sender) {
            let (id, inc, nonce) = (done.id, done.incarnation, done.nonce);
            self.send_note(peer, None, NoteKind::WriteNotLent, id, inc, nonce, false);
        }
    }

    /// A write named `blocks` under an incarnation whose receive they are
    /// not (`named`'s, or a lend's): every other live receive or lend
    /// whose blocks they are (a run of them) may now hold that write's
    /// bytes, and takes no word. Rare (a writer's mistake), so a scan of
    /// the live ones is cheap.
    pub(super) fn taint_blocks(&mut self, blocks: BlocksRead, named: Option<RequestKey>) {
        let hit: Vec<RequestKey> = self
            .by_token
            .values()
            .copied()
            .filter(|&key| {
                let info = &self.info[key.slot() as usize];
                Some(key) != named
                    && info.generation == key.generation()
                    && self.ledger.is_live(key)
                    && blocks.within(self.slots.blocks_of(key.slot()), info.lent)
            })
            .collect();
        for key in hit {
            self.taint(key);
        }
    }

    /// Live receive or lend `key`'s blocks may hold bytes of a write that
    /// was not its own: a receive takes no writer's word from now on (it
    /// fails `NotLent` once every writer has spoken), a lend confirms no
    /// read (its readers fail `NotLent`; its lend word is taken down so
    /// that they ask).
    pub(super) fn taint(&mut self, key: RequestKey) {
        let slot = key.slot() as usize;
        self.info[slot].not_lent = true;
        match self.info[slot].kind {
            Kind::Receive { .. } => self.info[slot].abandoned = true,
            Kind::Lend { .. } => self.drop_word(slot),
            _ => {}
        }
    }

    /// A destination did not take write `key`'s word: the write fails.
    pub(super) fn write_not_lent(&mut self, key: RequestKey, note: &Notification) {
        let slot = key.slot() as usize;
        if self.seen(slot, note.sender) {
            return self.reject();
        }
        self.counted(slot, note.sender);
        self.stats.writes_not_lent += 1;
        self.ledger_fail(key, Cause::NotLent);
    }

    /// A writer's note about receive `key`.
    pub(super) fn receive_note(&mut self, key: RequestKey, note: &Notification, now: Nanos) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        let Kind::Receive { writers } = info.kind else {
            return;
        };
        let (seen, n) = (self.seen(slot, note.sender), usize::from(info.notified));
        let sender = self.by_instance.get(&note.sender).copied();
        match note.kind {
            NoteKind::WriteDone | NoteKind::WriteAbandoned => {
                let named = !info.unnamed;
                if seen || n == MAX_CONSUMERS || (named && !self.is_party(slot, note.sender)) {
                    return self.reject();
                }
                self.counted(slot, note.sender);
                self.answered(key, sender);
                let words = info.words.saturating_add(1);
                self.info[slot].words = words;
                let done = note.kind == NoteKind::WriteDone;
                // A word about blocks that are not this receive's: its
                // bytes landed elsewhere (in another receive's blocks, or
                // in free ones), and this receive's blocks lack them.
                if done
                    && !note
                        .blocks
                        .within(self.slots.blocks_of(key.slot()), info.lent)
                {
                    self.info[slot].not_lent = true;
                    self.taint_blocks(note.blocks, Some(key));
                }
                let not_lent = self.info[slot].not_lent;
                let abandoned = info.abandoned || !done || not_lent;
                self.info[slot].abandoned = abandoned;
                let counted = if abandoned && u32::from(words) >= writers {
                    // Every writer has spoken and one gave up (or one wrote
                    // where it should not): nothing more lands; the blocks
                    // hold partial data.
                    let cause = if not_lent {
                        Cause::NotLent
                    } else {
                        Cause::LeaseLost
                    };
                    self.ledger_fail(key, cause);
                    false
                } else if not_lent {
                    false
                } else {
                    self.ledger_notify(note.id)
                };
                if done && not_lent {
                    self.refuse_write(note);
                } else if done && counted {
                    // Acknowledged only if its data counted: a destination
                    // that failed (or whose lease ran out) does not hold it.
                    self.acknowledge(note);
                }
                self.lift_fence(key);
            }
            NoteKind::WriteQuiet => {
                // A writer this destination asked: nothing of it will land.
                let asked = info.unnamed
                    && sender
                        .is_some_and(|p| self.fence_of(key).is_some_and(|f| f.asked.contains(&p)));
                if !asked && (seen || n == MAX_CONSUMERS || !self.is_party(slot, note.sender)) {
                    return self.reject();
                }
                if !info.unnamed {
                    self.counted(slot, note.sender);
                }
                self.answered(key, sender);
                self.lift_fence(key);
            }
            _ => {
                // A writer still at it: keep the lease as long again.
                let until = now.saturating_add(Nanos(info.lease));
                if !info.quarantined {
                    for f in self.fences.iter_mut().filter(|f| f.key == key) {
                        f.due = f.due.max(until);
                    }
                }
            }
        }
    }

    /// A receive asks whether anything of ours will still land in
    /// it (the incarnation it names): quiet unless a write of ours has puts
    /// in flight to the asking engine for that incarnation — then its word
    /// follows them. A quiet answer is a promise: no write into that
    /// incarnation is posted from now on.
    pub(super) fn write_query(
        &mut self,
        live: Option<RequestKey>,
        note: &Notification,
        reply: Option<u32>,
    ) {
        let asker = self.by_instance.get(&note.sender).copied();
        if let (Some(key), Some(peer)) = (live, asker) {
            let slot = key.slot() as usize;
            let info = self.info[slot];
            let base = slot * MAX_HANDLES;
            let in_flight = matches!(info.kind, Kind::Write { .. })
                && (0..info.handles as usize).any(|h| {
                    let p = &self.progress[base + h];
                    p.peer == peer && p.lend == note.incarnation && p.remaining > 0
                });
            if in_flight {
                return;
            }
        }
        let by_instance = &self.by_instance;
        self.quiet.promise(note.sender, note.incarnation, |e| {
            by_instance.contains_key(&e)
        });
        self.answer(reply, NoteKind::WriteQuiet, note);
    }
}
