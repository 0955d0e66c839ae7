//! Pull: lends to readers and the reads of them. A lend answers a
//! reader's question about the incarnation and the blocks it names; a
//! read asks once its handles landed, asks again while its lend is not
//! there yet, and heartbeats its lenders while in flight.

use super::*;

/// Incarnations that ended, the newest [`ENDED_REMEMBERED`].
#[derive(Default)]
pub(super) struct Ended {
    pub(super) order: VecDeque<Incarnation>,
    pub(super) set: HashSet<Incarnation, std::hash::BuildHasherDefault<crate::ledger::IdHasher>>,
}

impl Ended {
    pub(super) fn record(&mut self, inc: Incarnation) {
        if inc.is_none() || !self.set.insert(inc) {
            return;
        }
        if self.order.len() == ENDED_REMEMBERED {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        self.order.push_back(inc);
    }

    pub(super) fn contains(&self, inc: Incarnation) -> bool {
        self.set.contains(&inc)
    }
}

/// A read asking a lender again whether its lend is live (the lender did
/// not know it yet).
#[derive(Debug, Clone, Copy)]
pub(super) struct Ask {
    pub(super) key: RequestKey,
    pub(super) peer: PeerId,
    /// When to ask again (`u64::MAX`: asked, waiting for the answer).
    pub(super) due: Nanos,
    /// The grace period's end: a pending answer after it fails the read.
    pub(super) until: Nanos,
    pub(super) wait: Nanos,
}

impl Core {
    /// Names, on the first handle of the read (or write) being begun to
    /// each lender (or destination), the remote blocks it moves there (of
    /// every handle to that engine): its read done (or write done) names
    /// them, and the lender confirms (the destination takes) only blocks
    /// of the lend (the receive).
    pub(super) fn name_blocks_read(&mut self) {
        let n = self.handle_peers.len();
        for h in 0..n {
            let peer = self.handle_peers[h];
            if self.handle_peers[..h].contains(&peer) {
                self.handle_reads.push(BlocksRead::NONE);
                continue;
            }
            self.read_ids.clear();
            let mut start = 0;
            for g in 0..n {
                let len = self.handle_pairs[g] as usize;
                if self.handle_peers[g] == peer {
                    let pairs = &self.pairs[start..start + len];
                    self.read_ids
                        .extend(pairs.iter().map(|&(_, remote)| remote.0));
                }
                start += len;
            }
            self.read_ids.sort_unstable();
            self.read_ids.dedup();
            let ids = self.read_ids.iter().map(|&b| BlockId(b));
            self.handle_reads.push(BlocksRead::of(ids));
        }
    }

    /// Once every handle of read `key` landed without error, asks each of
    /// its lender engines (once) whether its lend was live: the read
    /// finishes only on their confirmations.
    pub(super) fn maybe_query(&mut self, key: RequestKey) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        if info.queried || info.generation != key.generation() {
            return;
        }
        if !self.ledger.all_stopped_clean(key) {
            return;
        }
        self.info[slot].queried = true;
        // Each lender engine once (its first handle), as a question would.
        let base = slot * MAX_HANDLES;
        for h in 0..info.handles as usize {
            let Progress { peer, lend, .. } = self.progress[base + h];
            let dup = (0..h).any(|g| self.progress[base + g].peer == peer);
            let entry = self.peers.get(peer.0 as usize).and_then(|p| p.as_ref());
            let (Some(p), Some(hk)) = (entry, HandleKey::new(key, h as u8)) else {
                continue; // a peer gone: its loss fails the read
            };
            if dup || lend.is_none() {
                continue;
            }
            // Every data operation of this read completed (its handles all
            // stopped clean): the word is read only now, so no order
            // between gets is assumed of the transport.
            let ep = p.ep(peer);
            self.progress[base + h].checking = true;
            self.ops_in_flight += 1;
            self.push_on(
                peer,
                Action::ReadWord {
                    ep,
                    lend,
                    handle: hk,
                    token: hk.to_u64() | T_WORD,
                },
            );
        }
    }

    /// A lend word read ended: `word` names the handle's lend and the
    /// blocks read as all of that lend's ([`BlocksRead::word`]), so the
    /// lend had not ended when the word was read — after the data — and
    /// the read is confirmed for that lender, which is told one way (it
    /// counts this reader, as for a question). Anything else (not lent
    /// yet, ended, another lend's, not readable, or a read of other blocks
    /// than all of the lend's) and the lender is asked, as before.
    pub(super) fn on_word(&mut self, token: u64, status: i8, word: u64) {
        // Every word read posted ends once, here (a failed post too).
        self.ops_in_flight = self.ops_in_flight.saturating_sub(1);
        let hk = HandleKey::from_u64(token & !KIND_MASK);
        let idx = Self::index(hk);
        let Some(p) = self.progress.get(idx).copied() else {
            return;
        };
        if p.generation != hk.key().generation() || !p.checking {
            return; // a read that ended meanwhile
        }
        self.progress[idx].checking = false;
        let key = hk.key();
        let slot = key.slot() as usize;
        let info = self.info[slot];
        if info.generation != key.generation() || !self.ledger.is_live(key) {
            return;
        }
        let Some(instance) = self
            .peers
            .get(p.peer.0 as usize)
            .and_then(|e| e.as_ref())
            .map(|e| e.instance)
        else {
            return;
        };
        if self.seen(slot, instance) {
            return;
        }
        let expected = p.read.word(p.lend);
        let confirmed = status == 0 && expected != 0 && word == expected;
        if confirmed {
            self.stats.word_confirmations += 1;
            self.counted(slot, instance);
            self.ledger_confirm(info.id, key);
        } else {
            self.stats.word_misses += 1;
        }
        // Confirmed: told one way (it counts this reader). Otherwise asked.
        let ask = !confirmed;
        self.send_read_done(p.peer, info.id, p.lend, info.token, p.read, ask);
        self.after_events();
    }

    /// An [`Action::ReadWord`] could not be posted: the lender is asked.
    pub fn on_word_failed(&mut self, hk: HandleKey, status: i8) {
        self.touched();
        self.on_word(hk.to_u64() | T_WORD, status.min(-1), 0);
    }

    /// Lend `slot` (incarnation `token`) takes its lend word, if free.
    pub(super) fn claim_word(&mut self, slot: usize, token: Incarnation) {
        let Some(words) = &self.words else {
            return;
        };
        let Some(i) = lend_word_of(token, words.len()) else {
            return;
        };
        let value = self.info[slot].lent.word(token);
        if value != 0 && words.get(i) == 0 {
            words.set(i, value);
            self.info[slot].word = i as u32;
        } else {
            self.stats.word_collisions += 1;
        }
    }

    /// Lend `slot` gives its lend word up now (its readers ask instead).
    pub(super) fn drop_word(&mut self, slot: usize) {
        let Some(words) = &self.words else {
            return;
        };
        let info = &mut self.info[slot];
        if info.word == NO_WORD {
            return;
        }
        let i = info.word as usize;
        if words.get(i) == info.lent.word(info.token) {
            words.set(i, 0);
        }
        info.word = NO_WORD;
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    /// The lend words of the lends whose end is about to be published are
    /// overwritten, and the stores made visible before anything after them
    /// (the publication).
    pub(super) fn clear_ended_words(&mut self) {
        let Some(words) = &self.words else {
            return;
        };
        let mut cleared = false;
        for e in &self.events {
            if !e.outcome.is_terminal() {
                continue;
            }
            let info = &mut self.info[e.key.slot() as usize];
            if info.generation != e.key.generation() || info.word == NO_WORD {
                continue;
            }
            let i = info.word as usize;
            if words.get(i) == info.lent.word(info.token) {
                words.set(i, 0);
            }
            info.word = NO_WORD;
            cleared = true;
        }
        if cleared {
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// A note for a lend or push destination this engine does not hold
    /// under that incarnation. One that ended: refused. A read's question
    /// naming a request id this engine lends under another incarnation:
    /// refused as not lent (no lend of that id can begin while this one
    /// lives, and the serving engine hands out a new incarnation of an id
    /// only once its earlier lend was reported, which this poller did
    /// first). One not begun yet (the note overtook the lend on its way to
    /// this poller): a read's question is answered pending (the reader asks
    /// again); a give-up or a writer's word is held until the lend begins
    /// or the grace period ends, and counted as rejected if it never does.
    pub(super) fn early(&mut self, note: &Notification, reply: Option<u32>, now: Nanos) {
        let ended = self.ended.contains(note.incarnation);
        match note.kind {
            NoteKind::ReadDone if ended => self.answer(reply, NoteKind::ReadRefused, note),
            NoteKind::ReadDone if self.lends_under_another(note.id) => {
                self.not_lent(reply, note);
            }
            NoteKind::ReadDone => {
                self.stats.early_notes += 1;
                self.answer(reply, NoteKind::ReadPending, note);
            }
            NoteKind::GaveUp | NoteKind::WriteDone | NoteKind::WriteAbandoned if !ended => {
                self.stats.early_notes += 1;
                self.drop_early(now);
                if self.early.len() == EARLY_HELD {
                    self.early.pop_front();
                    self.stale();
                }
                self.early
                    .push_back((now.saturating_add(self.cfg.lend_grace), *note));
            }
            // A reader that gave up on a lend that ended, a heartbeat for
            // one: nothing to do.
            NoteKind::GaveUp => {}
            _ => self.stale(),
        }
    }

    /// Held notes whose grace period ended without their lend: dropped,
    /// and counted as rejected (they named an incarnation nobody lent
    /// here, or one that came too late).
    pub(super) fn drop_early(&mut self, now: Nanos) {
        while self.early.front().is_some_and(|&(t, _)| t <= now) {
            self.early.pop_front();
            self.stale();
        }
    }

    /// Whether request `id` is a live lend here (under an incarnation that
    /// a note about `id` did not name).
    fn lends_under_another(&self, id: RequestId) -> bool {
        self.ledger.key(id).is_some_and(|k| {
            let info = &self.info[k.slot() as usize];
            info.generation == k.generation()
                && matches!(info.kind, Kind::Lend { .. })
                && self.ledger.is_live(k)
        })
    }

    /// Refuses a read's question (or a one-way read done) about blocks or
    /// an incarnation this engine did not lend: never counted for any lend.
    pub(super) fn not_lent(&mut self, reply: Option<u32>, note: &Notification) {
        self.stats.refused_reads += 1;
        self.reject();
        self.answer(reply, NoteKind::ReadNotLent, note);
    }

    /// The notes held for incarnation `token`, which just began, are taken
    /// as if they arrived now.
    pub(super) fn take_early(&mut self, token: Incarnation, now: Nanos) {
        if self.early.is_empty() {
            return;
        }
        let mut i = 0;
        while i < self.early.len() {
            let (until, note) = self.early[i];
            if note.incarnation == token && until > now {
                self.early.remove(i);
                self.accept(note, None, now);
            } else {
                i += 1;
            }
        }
    }

    /// A reader's note about lend `key` (the incarnation it names).
    pub(super) fn lend_note(
        &mut self,
        key: RequestKey,
        note: &Notification,
        reply: Option<u32>,
        now: Nanos,
    ) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        let (seen, n) = (self.seen(slot, note.sender), usize::from(info.notified));
        match note.kind {
            NoteKind::ReadDone
                if info.not_lent
                    || !note
                        .blocks
                        .within(self.slots.blocks_of(key.slot()), info.lent) =>
            {
                // (A lend whose blocks another write wrote into confirms
                // nothing either: they may hold that write's bytes.)
                // The reader read blocks this lend did not lend (another
                // lend's, or free ones): whatever it holds is not this
                // lend's.
                self.not_lent(reply, note);
            }
            NoteKind::ReadDone => {
                // The read happened before this question, and after the
                // engine lent the blocks (the reader holds the lend's
                // token, which the engine drew then): the lend was live
                // for it if it is live now and this engine has not been
                // counted (a second read of a consumed lend is refused).
                let confirmed = if seen || n == MAX_CONSUMERS {
                    self.reject();
                    false
                } else if self.ledger_notify(note.id) {
                    true
                } else {
                    // Not live any more: the ledger counted the refusal.
                    self.stats.rejected_notifications += 1;
                    false
                };
                if confirmed {
                    self.counted(slot, note.sender);
                    self.answer(reply, NoteKind::ReadConfirmed, note);
                } else {
                    self.answer(reply, NoteKind::ReadRefused, note);
                }
            }
            NoteKind::Heartbeat => {
                // A reader is still at it: keep the lend as long again.
                let until = now.saturating_add(Nanos(info.lease));
                self.ledger.heartbeat(note.id, until);
            }
            _ => {
                // That engine will not read (its read stopped): stop waiting.
                if !seen && n < MAX_CONSUMERS && self.ledger_notify(note.id) {
                    self.counted(slot, note.sender);
                }
            }
        }
    }

    /// A lender's answer to read `key`'s question.
    pub(super) fn read_answer(&mut self, key: RequestKey, note: &Notification, now: Nanos) {
        let slot = key.slot() as usize;
        if self.seen(slot, note.sender) {
            return self.reject();
        }
        let Some(&peer) = self.by_instance.get(&note.sender) else {
            return self.reject();
        };
        match note.kind {
            NoteKind::ReadConfirmed => {
                self.counted(slot, note.sender);
                self.asking.retain(|a| a.key != key || a.peer != peer);
                self.ledger_confirm(note.id, key);
            }
            NoteKind::ReadRefused => {
                self.counted(slot, note.sender);
                self.ledger_fail(key, Cause::LeaseLost);
            }
            NoteKind::ReadNotLent => {
                self.counted(slot, note.sender);
                self.asking.retain(|a| a.key != key || a.peer != peer);
                self.fail_not_lent(key);
            }
            _ => {
                // The lender does not know the lend yet: ask again, later,
                // until the grace period ends.
                let grace = self.cfg.lend_grace;
                let i = match self
                    .asking
                    .iter()
                    .position(|a| a.key == key && a.peer == peer)
                {
                    Some(i) => i,
                    None => {
                        self.asking.push(Ask {
                            key,
                            peer,
                            due: Nanos(u64::MAX),
                            until: now.saturating_add(grace),
                            wait: Nanos(ASK_FIRST.0 / 2),
                        });
                        self.asking.len() - 1
                    }
                };
                let a = &mut self.asking[i];
                if now >= a.until {
                    self.asking.swap_remove(i);
                    self.counted(slot, note.sender);
                    self.fail_not_lent(key);
                } else {
                    a.wait = Nanos((a.wait.0 * 2).min(ASK_MAX.0));
                    a.due = now.saturating_add(a.wait);
                }
            }
        }
    }

    /// Read `key` read what its lender did not lend (or a lend that never
    /// came): it fails, and is counted.
    fn fail_not_lent(&mut self, key: RequestKey) {
        self.stats.reads_not_lent += 1;
        self.ledger_fail(key, Cause::NotLent);
    }

    /// Reads still told pending when their deadline comes fail `NotLent`
    /// rather than `Deadline`: their data landed and their lender answered
    /// (it is not stalled), but the lend they named never came.
    pub(super) fn unlent_at_deadline(&mut self, now: Nanos) {
        let mut i = 0;
        while i < self.asking.len() {
            let key = self.asking[i].key;
            if self.ledger.is_live(key) && self.ledger.expiry(key).is_some_and(|t| t <= now) {
                self.asking.swap_remove(i);
                self.fail_not_lent(key);
            } else {
                i += 1;
            }
        }
    }

    /// Reads told their lend is not known yet ask again when due.
    pub(super) fn ask_again(&mut self, now: Nanos) {
        let mut i = 0;
        while i < self.asking.len() {
            let a = self.asking[i];
            if !self.ledger.is_live(a.key)
                || self.info[a.key.slot() as usize].generation != a.key.generation()
            {
                self.asking.swap_remove(i);
                continue;
            }
            if a.due <= now {
                self.asking[i].due = Nanos(u64::MAX);
                let slot = a.key.slot() as usize;
                let info = self.info[slot];
                let base = slot * MAX_HANDLES;
                let first = (0..info.handles as usize)
                    .map(|h| self.progress[base + h])
                    .find(|p| p.peer == a.peer);
                let (lend, blocks) =
                    first.map_or((Incarnation::NONE, BlocksRead::NONE), |p| (p.lend, p.read));
                self.send_read_done(a.peer, info.id, lend, info.token, blocks, true);
            }
            i += 1;
        }
    }

    /// Reads still in flight whose heartbeat is due tell their lenders.
    pub(super) fn beat(&mut self, now: Nanos) {
        // Due entries are at the front; one that beats goes to the back
        // (due a period from now: no earlier than any entry there).
        let mut due_now = 0;
        for &(_, due) in &self.beating {
            if due > now {
                break;
            }
            due_now += 1;
        }
        for _ in 0..due_now {
            let Some((key, _)) = self.beating.pop_front() else {
                break;
            };
            if !self.ledger.is_live(key) {
                continue;
            }
            self.each_peer_once(key, NoteKind::Heartbeat, false);
            self.beating
                .push_back((key, now.saturating_add(self.cfg.heartbeat)));
        }
    }
}
