//! Unit tests of the core and its sub-states, fed by hand (no transport):
//! see `tests/core_sim.rs` for whole protocol runs over the simulator.

use super::pull::Ended;
use super::push::Quiet;
use super::*;
use crate::ledger::LedgerConfig;

fn core(instance: u64) -> Core {
    let ledger = Ledger::new(LedgerConfig {
        slots: 8,
        max_blocks: 8,
    })
    .expect("ledger");
    let mut c = Core::new(
        CoreConfig {
            instance,
            release_retry: Nanos(1_000),
            confirm_reads: true,
            fence_push_leases: true,
            heartbeat: Nanos(u64::MAX),
            lend_grace: Nanos(1_000_000),
        },
        ledger,
    );
    c.set_local_layout(1, 8);
    c
}

fn lend(c: &mut Core, id: u64, token: u64, now: Nanos) {
    lend_blocks(c, id, token, &[1], now);
}

/// A lend of `blocks` (in that order) to one reader.
fn lend_blocks(c: &mut Core, id: u64, token: u64, blocks: &[u32], now: Nanos) {
    let mut plan = blocks.iter().map(|&b| Command::Block(BlockId(b)));
    c.on_command(
        Command::Begin {
            id: RequestId(id),
            kind: Kind::Lend { notifications: 1 },
            handles: 0,
            blocks: blocks.len() as u32,
            expires_in: 1_000_000_000,
            token: Incarnation(token),
        },
        &mut || plan.next(),
        now,
    );
}

/// A note; a read done names the one block [`lend`] lends, a write done
/// the one block [`receive`] opens.
fn note(kind: NoteKind, id: u64, incarnation: u64, nonce: u64, sender: u64) -> Notification {
    Notification {
        kind,
        id: RequestId(id),
        incarnation: Incarnation(incarnation),
        nonce: Incarnation(nonce),
        sender,
        blocks: match kind {
            NoteKind::ReadDone => BlocksRead::of(std::iter::once(BlockId(1))),
            NoteKind::WriteDone => BlocksRead::of(std::iter::once(BlockId(3))),
            _ => BlocksRead::NONE,
        },
    }
}

/// Feeds `n` as a message with a reply handle; returns what was answered.
fn ask(c: &mut Core, n: Notification, now: Nanos) -> Vec<NoteKind> {
    feed(c, n, Some(0), now);
    let mut answers = Vec::new();
    while let Some(a) = c.next_action() {
        if let Action::Reply { notes, .. } = a {
            for b in c.notes(notes).chunks_exact(NOTE_LEN) {
                answers.push(Notification::decode(b).expect("encoded").kind);
            }
        }
    }
    answers
}

#[test]
fn a_question_naming_another_incarnation_of_a_live_id_is_refused_not_lent_and_counted_stale() {
    let mut c = core(1);
    lend(&mut c, 10, 0xaaaa, Nanos(0));
    // Request 10 is lent (0xaaaa); a question names 10 with an unknown
    // incarnation: no lend of 10 can begin while this one lives, so it is
    // refused at once, and it does not touch the live lend.
    let a = ask(
        &mut c,
        note(NoteKind::ReadDone, 10, 0xbbbb, 5, 77),
        Nanos(1),
    );
    assert_eq!(a, vec![NoteKind::ReadNotLent]);
    assert_eq!(c.ledger_stats().in_use, 1);
    assert_eq!(c.stats().refused_reads, 1);
    // Another id's live incarnation: refused as not lent, counted stale.
    lend(&mut c, 11, 0xcccc, Nanos(1));
    let before = c.stats().stale_notifications;
    let a = ask(
        &mut c,
        note(NoteKind::ReadDone, 10, 0xcccc, 5, 77),
        Nanos(2),
    );
    assert_eq!(a, vec![NoteKind::ReadNotLent]);
    assert_eq!(c.stats().stale_notifications, before + 1);
    assert_eq!(c.stats().refused_reads, 2);
    // The right incarnation, naming a block it did not lend.
    let other = Notification {
        blocks: BlocksRead::of(std::iter::once(BlockId(2))),
        ..note(NoteKind::ReadDone, 10, 0xaaaa, 5, 77)
    };
    assert_eq!(ask(&mut c, other, Nanos(2)), vec![NoteKind::ReadNotLent]);
    assert_eq!(c.stats().refused_reads, 3);
    // The right one is confirmed.
    let a = ask(
        &mut c,
        note(NoteKind::ReadDone, 10, 0xaaaa, 5, 77),
        Nanos(3),
    );
    assert_eq!(a, vec![NoteKind::ReadConfirmed]);
}

#[test]
fn a_question_that_overtakes_its_lend_is_pending_then_confirmed_and_one_about_an_ended_lend_refused(
) {
    let mut c = core(1);
    let a = ask(
        &mut c,
        note(NoteKind::ReadDone, 20, 0x2020, 9, 77),
        Nanos(0),
    );
    assert_eq!(a, vec![NoteKind::ReadPending]);
    assert_eq!(c.stats().early_notes, 1);
    lend(&mut c, 20, 0x2020, Nanos(10));
    let a = ask(
        &mut c,
        note(NoteKind::ReadDone, 20, 0x2020, 9, 77),
        Nanos(20),
    );
    assert_eq!(a, vec![NoteKind::ReadConfirmed]);
    let mut reported = Vec::new();
    c.drain_events(|e| reported.push(e.outcome));
    assert_eq!(reported, vec![Outcome::LendReleased]);
    // Ended: a late question is refused at once, not pending.
    let a = ask(
        &mut c,
        note(NoteKind::ReadDone, 20, 0x2020, 9, 88),
        Nanos(30),
    );
    assert_eq!(a, vec![NoteKind::ReadRefused]);
}

#[test]
fn a_give_up_that_overtakes_its_lend_is_held_and_releases_it_when_it_begins() {
    let mut c = core(1);
    ask(&mut c, note(NoteKind::GaveUp, 30, 0x3030, 4, 77), Nanos(0));
    lend(&mut c, 30, 0x3030, Nanos(10));
    let mut reported = Vec::new();
    c.drain_events(|e| reported.push(e.outcome));
    assert_eq!(reported, vec![Outcome::LendReleased]);
}

#[test]
fn a_held_give_up_past_the_grace_period_is_dropped() {
    let mut c = core(1);
    ask(&mut c, note(NoteKind::GaveUp, 31, 0x3131, 4, 77), Nanos(0));
    lend(&mut c, 31, 0x3131, Nanos(2_000_000)); // grace: 1 ms
    let mut reported = Vec::new();
    c.drain_events(|e| reported.push(e.outcome));
    assert!(reported.is_empty(), "{reported:?}");
}

#[test]
fn quiet_promises_are_per_engine_and_an_engine_fills_only_its_own() {
    let mut q = Quiet::default();
    q.promise(1, Incarnation(7), |_| true);
    for i in 0..(QUIET_PER_ENGINE as u64 + 10) {
        q.promise(2, Incarnation(1_000 + i), |_| true);
    }
    assert!(
        q.promised(1, Incarnation(7)),
        "engine 2's flood pushed out engine 1's promise"
    );
    assert!(
        !q.promised(2, Incarnation(1_000)),
        "engine 2's oldest was kept past its bound"
    );
    assert!(q.promised(2, Incarnation(1_000 + QUIET_PER_ENGINE as u64 + 9)));
    assert!(!q.promised(1, Incarnation(8)));
}

#[test]
fn quiet_promises_forget_an_engine_that_is_not_a_peer_first() {
    let mut q = Quiet::default();
    q.promise(1, Incarnation(7), |_| true);
    for e in 0..QUIET_ENGINES as u64 {
        q.promise(100 + e, Incarnation(1), |e| e == 1);
    }
    assert!(
        q.promised(1, Incarnation(7)),
        "a peer's promise went before a stranger's"
    );
}

#[test]
fn ended_incarnations_are_remembered_up_to_their_bound() {
    let mut e = Ended::default();
    for i in 1..=(ENDED_REMEMBERED as u64 + 1) {
        e.record(Incarnation(i));
    }
    assert!(!e.contains(Incarnation(1)));
    assert!(e.contains(Incarnation(2)));
    assert!(e.contains(Incarnation(ENDED_REMEMBERED as u64 + 1)));
    e.record(Incarnation::NONE);
    assert!(!e.contains(Incarnation::NONE));
}

#[test]
fn a_metadata_refresh_of_a_peer_in_use_is_refused_and_one_at_rest_replaces_it() {
    let mut c = core(1);
    let first = c.add_peer(42, 1, 8).expect("new");
    // At rest, the same engine's metadata again replaces the entry.
    let p = c.add_peer(42, 1, 8).expect("a refresh at rest");
    assert_ne!(p, first);
    assert_eq!(c.peer_of(42), Some(p));
    // A receive that names it waits for its word.
    let mut plan = vec![
        Command::Handle {
            peer: p,
            pairs: 0,
            lend: Incarnation::NONE,
        },
        Command::Block(BlockId(2)),
    ]
    .into_iter();
    c.on_command(
        Command::Begin {
            id: RequestId(5),
            kind: Kind::Receive { writers: 1 },
            handles: 1,
            blocks: 1,
            expires_in: 1_000_000,
            token: Incarnation(0x55),
        },
        &mut || plan.next(),
        Nanos(0),
    );
    while c.next_action().is_some() {}
    assert_eq!(c.add_peer(42, 1, 8), Err(p));
    // Removal waits too: the peer stays until it spoke.
    assert!(c.remove_peer(p));
    assert_eq!(c.peer_of(42), Some(p));
    hear(
        &mut c,
        note(NoteKind::WriteAbandoned, 5, 0x55, 3, 42),
        Nanos(1),
    );
    assert_eq!(
        c.peer_of(42),
        None,
        "forgotten once its destination heard from it"
    );
}

/// Begins a receive `id` (incarnation `token`) awaiting
/// `writers` writer engines, named by peer `names` (empty: unnamed).
fn receive(c: &mut Core, id: u64, token: u64, writers: u32, names: &[PeerId], lease: u64) {
    let mut plan: Vec<Command> = names
        .iter()
        .map(|&peer| Command::Handle {
            peer,
            pairs: 0,
            lend: Incarnation::NONE,
        })
        .collect();
    plan.push(Command::Block(BlockId(3)));
    let mut plan = plan.into_iter();
    c.on_command(
        Command::Begin {
            id: RequestId(id),
            kind: Kind::Receive { writers },
            handles: names.len() as u8,
            blocks: 1,
            expires_in: lease,
            token: Incarnation(token),
        },
        &mut || plan.next(),
        Nanos(0),
    );
}

/// The notes the core sends (not replies), in order.
fn sent(c: &mut Core) -> Vec<NoteKind> {
    let mut kinds = Vec::new();
    while let Some(a) = c.next_action() {
        if let Action::Send { notes, .. } = a {
            for b in c.notes(notes).chunks_exact(NOTE_LEN) {
                kinds.push(Notification::decode(b).expect("encoded").kind);
            }
        }
    }
    kinds
}

fn hear(c: &mut Core, n: Notification, now: Nanos) {
    feed(c, n, None, now);
}

/// Hands `n` to the core as a received message (`reply`: its reply handle).
fn feed(c: &mut Core, n: Notification, reply: Option<u32>, now: Nanos) {
    c.on_transport(
        TransportEvent::Message {
            payload: &n.encode(),
            reply,
        },
        now,
    );
}

#[test]
fn a_destination_that_failed_does_not_acknowledge_a_later_write_done() {
    let mut c = core(1);
    let (a, b) = (c.add_peer(41, 1, 8).unwrap(), c.add_peer(42, 1, 8).unwrap());
    receive(&mut c, 6, 0x66, 2, &[a, b], 1_000_000_000);
    sent(&mut c);
    // One writer gave up, the other says done: every writer spoke and one
    // gave up, so the destination fails — and the done is not acknowledged.
    hear(
        &mut c,
        note(NoteKind::WriteAbandoned, 6, 0x66, 1, 41),
        Nanos(1),
    );
    hear(&mut c, note(NoteKind::WriteDone, 6, 0x66, 2, 42), Nanos(2));
    let mut reported = Vec::new();
    c.drain_events(|e| reported.push(e.outcome));
    assert!(
        matches!(reported[..], [Outcome::Failed(r)] if r.cause == Cause::LeaseLost),
        "{reported:?}"
    );
    assert!(
        !sent(&mut c).contains(&NoteKind::Ack),
        "acknowledged a write into a failed destination"
    );
}

#[test]
fn aborting_a_destination_already_reported_leaves_nothing_quarantined() {
    let mut c = core(1);
    c.add_peer(41, 1, 8).unwrap();
    c.add_peer(42, 1, 8).unwrap();
    // Lent to one writer it did not name; 41 wrote it: finished.
    receive(&mut c, 7, 0x77, 1, &[], 1_000_000_000);
    hear(&mut c, note(NoteKind::WriteDone, 7, 0x77, 1, 41), Nanos(1));
    sent(&mut c);
    // Reported (not yet polled and retired): an abort changes nothing —
    // no quarantine, no question to the peer that never wrote.
    c.on_command(Command::Abort(RequestId(7)), &mut || None, Nanos(2));
    assert_eq!(c.quarantined(), 0);
    assert!(!sent(&mut c).contains(&NoteKind::WriteQuery));
}

#[test]
fn a_reported_destination_leaves_no_timer_behind() {
    let mut c = core(1);
    let a = c.add_peer(41, 1, 8).unwrap();
    receive(&mut c, 8, 0x88, 1, &[a], 1_000_000_000);
    assert!(c.next_deadline().is_some());
    hear(&mut c, note(NoteKind::WriteDone, 8, 0x88, 1, 41), Nanos(1));
    assert_eq!(
        c.next_deadline(),
        None,
        "the finished destination's lease still wakes the poller"
    );
}

// -- lend words ---------------------------------------------------------------

fn lender_with_words(len: usize) -> (Core, LendWords) {
    let words = LendWords::heap(len);
    let c = core(1).with_lend_words(Some(words.clone()));
    (c, words)
}

fn word_of(words: &LendWords, token: u64) -> u64 {
    words.get(lend_word_of(Incarnation(token), words.len()).expect("a word"))
}

/// The word of lend `token` lending just `block` (as [`lend`] lends block 1).
fn lent(token: u64, block: u32) -> u64 {
    BlocksRead::of(std::iter::once(BlockId(block))).word(Incarnation(token))
}

#[test]
fn a_lend_writes_its_incarnation_into_its_word_and_it_is_overwritten_before_its_end_is_published() {
    let (mut c, words) = lender_with_words(64);
    lend(&mut c, 40, 0x4040, Nanos(0));
    assert_eq!(word_of(&words, 0x4040), lent(0x4040, 1));
    // The reader's one-way word: the lend is consumed.
    feed(
        &mut c,
        note(NoteKind::ReadDone, 40, 0x4040, 7, 77),
        None,
        Nanos(1),
    );
    while c.next_action().is_some() {}
    // Ended in the ledger, not yet published: the word still names it
    // (nothing can reuse the blocks before the engine hears of the end).
    assert_eq!(word_of(&words, 0x4040), lent(0x4040, 1));
    let mut seen = Vec::new();
    c.drain_events(|e| seen.push((e.outcome, word_of(&words, 0x4040))));
    assert_eq!(
        seen,
        vec![(Outcome::LendReleased, 0)],
        "the end was published while its word still named the lend"
    );
}

#[test]
fn a_lend_whose_word_is_taken_gets_none_and_leaves_the_other_lends_word_alone() {
    // One word: every lend hashes to it.
    let (mut c, words) = lender_with_words(1);
    lend(&mut c, 41, 0x4141, Nanos(0));
    lend(&mut c, 42, 0x4242, Nanos(0));
    assert_eq!(words.get(0), lent(0x4141, 1));
    assert_eq!(c.stats().word_collisions, 1);
    // The second lend ends: the first's word is untouched.
    feed(
        &mut c,
        note(NoteKind::GaveUp, 42, 0x4242, 7, 77),
        None,
        Nanos(1),
    );
    c.drain_events(|_| {});
    assert_eq!(words.get(0), lent(0x4141, 1));
    // The first ends (its lease): its word is cleared; a new lend takes it.
    c.advance(Nanos(2_000_000_000));
    c.drain_events(|_| {});
    assert_eq!(words.get(0), 0);
    lend(&mut c, 45, 0x5151, Nanos(2_000_000_001));
    assert_eq!(words.get(0), lent(0x5151, 1));
}

#[test]
fn lends_that_the_core_gives_up_on_have_their_words_cleared_when_reported() {
    let (mut c, words) = lender_with_words(64);
    lend(&mut c, 43, 0x4343, Nanos(0));
    lend(&mut c, 44, 0x4444, Nanos(0));
    c.abandon(Cause::PollerDied);
    assert_eq!(c.drain_events(|_| {}), 2);
    assert_eq!((word_of(&words, 0x4343), word_of(&words, 0x4444)), (0, 0));
}

/// Begins read `id` of one block lent as `lend` by a new peer, lands its
/// data and returns its handle and the token of the word read that must
/// follow (no note to the lender before it).
fn read_to_its_word(c: &mut Core, id: u64, lend: u64) -> (HandleKey, u64) {
    let peer = c.add_peer(77, 1, 8).expect("peer");
    read_from_to_its_word(c, peer, id, lend)
}

/// [`read_to_its_word`] from a lender already added.
fn read_from_to_its_word(c: &mut Core, peer: PeerId, id: u64, lend: u64) -> (HandleKey, u64) {
    let mut plan = vec![
        Command::Handle {
            peer,
            pairs: 1,
            lend: Incarnation(lend),
        },
        Command::Pair {
            local: BlockId(0),
            remote: BlockId(0),
        },
    ]
    .into_iter();
    c.on_command(
        Command::Begin {
            id: RequestId(id),
            kind: Kind::Read,
            handles: 1,
            blocks: 0,
            expires_in: 1_000_000_000,
            token: Incarnation(9),
        },
        &mut || plan.next(),
        Nanos(0),
    );
    let mut data = None;
    while let Some(a) = c.next_action() {
        if let Action::Post { handle, token, .. } = a {
            c.on_posted(handle, Ok(1));
            data = Some((handle, token));
        }
    }
    let (hk, token) = data.expect("posted");
    c.on_transport(TransportEvent::Completion { token, status: 0 }, Nanos(1));
    let mut word_read = None;
    while let Some(a) = c.next_action() {
        match a {
            Action::Release { handle } => c.on_released(handle, true, Nanos(1)),
            Action::ReadWord {
                lend: l,
                handle,
                token,
                ..
            } => {
                assert_eq!((l, handle), (Incarnation(lend), hk));
                word_read = Some(token);
            }
            Action::Send { .. } => panic!("told the lender before reading its word"),
            _ => {}
        }
    }
    (hk, word_read.expect("no word read after the data landed"))
}

#[test]
fn a_read_awaits_answers_until_it_is_reported_and_a_lend_never_does() {
    let mut c = core(1);
    lend(&mut c, 1, 0x77, Nanos(0));
    assert!(!c.awaits_answers(), "a lend alone awaits no answer");
    let (_, token) = read_to_its_word(&mut c, 50, 0x5a5a);
    assert!(c.awaits_answers(), "a read in flight awaits its word");
    c.on_transport(
        TransportEvent::Word {
            token,
            status: 0,
            word: lent(0x5a5a, 0),
        },
        Nanos(2),
    );
    while c.next_action().is_some() {}
    assert!(c.awaits_answers(), "not reported yet");
    let mut outcomes = Vec::new();
    c.drain_events(|e| outcomes.push(e.outcome));
    assert_eq!(outcomes, vec![Outcome::Finished]);
    assert!(!c.awaits_answers(), "reported: nothing awaited any more");
}

/// A reader's side: its first handle to each lender reads that lender's
/// word once the data landed; the word naming the lend confirms the read
/// and the lender hears one way; any other word, or a word read that
/// could not be posted, and the lender is asked.
#[test]
fn a_read_reads_its_lenders_word_after_its_data_and_asks_only_if_it_does_not_name_the_lend() {
    for (word, posted, confirmed) in [
        (lent(0x5a5a, 0), true, true),
        (0, true, false),
        (0x1234, true, false),
        // The lend's, but lending another block.
        (lent(0x5a5a, 1), true, false),
        (0, false, false),
    ] {
        let mut c = core(1);
        let (hk, token) = read_to_its_word(&mut c, 50, 0x5a5a);
        if posted {
            word_read(&mut c, token, word);
        } else {
            c.on_word_failed(hk, crate::transport::UNSUPPORTED);
        }
        assert_eq!(
            sends(&mut c),
            vec![(!confirmed, vec![NoteKind::ReadDone])],
            "word {word:#x} posted {posted}"
        );
        let mut outcomes = Vec::new();
        c.drain_events(|e| outcomes.push(e.outcome));
        let want = if confirmed {
            vec![Outcome::Finished]
        } else {
            vec![]
        };
        assert_eq!(outcomes, want, "word {word:#x} posted {posted}");
        assert_eq!(c.stats().word_confirmations, u64::from(confirmed));
    }
}

/// The lend word read `token` ended with `word`.
fn word_read(c: &mut Core, token: u64, word: u64) {
    c.on_transport(
        TransportEvent::Word {
            token,
            status: 0,
            word,
        },
        Nanos(2),
    );
}

/// Messages sent, each as whether it asks for answers and its notes'
/// kinds.
fn sends(c: &mut Core) -> Vec<(bool, Vec<NoteKind>)> {
    let mut sends = Vec::new();
    while let Some(a) = c.next_action() {
        if let Action::Send {
            notes, want_reply, ..
        } = a
        {
            let kinds = c
                .notes(notes)
                .chunks_exact(NOTE_LEN)
                .map(|b| Notification::decode(b).expect("encoded").kind)
                .collect();
            sends.push((want_reply, kinds));
        }
    }
    sends
}

/// A message that asks for answers gets every note in it answered: a
/// read confirmed by its lender's word tells its lender one way, in a
/// message of its own, not beside another read's question (whose answer
/// the lender would then send for both, and the reader refuse as stale).
#[test]
fn one_way_notes_and_questions_to_one_lender_travel_in_separate_messages_in_order() {
    let mut c = core(1);
    let peer = c.add_peer(77, 1, 8).expect("peer");
    let (_, confirmed) = read_from_to_its_word(&mut c, peer, 50, 0x5a5a);
    let (_, missed) = read_from_to_its_word(&mut c, peer, 51, 0x6b6b);
    let (_, confirmed_too) = read_from_to_its_word(&mut c, peer, 52, 0x7c7c);
    for (token, word) in [
        (confirmed, lent(0x5a5a, 0)),
        (missed, 0),
        (confirmed_too, lent(0x7c7c, 0)),
    ] {
        word_read(&mut c, token, word);
    }
    assert_eq!(
        sends(&mut c),
        vec![
            (false, vec![NoteKind::ReadDone]),
            (true, vec![NoteKind::ReadDone]),
            (false, vec![NoteKind::ReadDone]),
        ],
        "each message asks for answers to all of its notes or to none"
    );
}

/// Whether `c` serves a read of `first..=last` asked under lend `token`.
fn serves(c: &mut Core, token: u64, first: u32, last: u32) -> bool {
    c.on_transport(
        TransportEvent::ReadAsked {
            request: 7,
            lend: Incarnation(token),
            first: BlockId(first),
            last: BlockId(last),
        },
        Nanos(1),
    );
    let mut lent = None;
    while let Some(a) = c.next_action() {
        if let Action::ServeRead {
            request: 7,
            lent: l,
        } = a
        {
            lent = Some(l);
        }
    }
    lent.expect("answered")
}

#[test]
fn a_read_asked_is_served_only_for_a_run_every_block_of_which_the_lend_holds() {
    let mut c = core(1);
    // Blocks 5, 7, 7, 9, 8: one named twice, 6 missing.
    lend_blocks(&mut c, 10, 0xaaaa, &[5, 7, 7, 9, 8], Nanos(0));
    while c.next_action().is_some() {}
    assert!(serves(&mut c, 0xaaaa, 7, 9));
    assert!(serves(&mut c, 0xaaaa, 5, 5));
    assert!(serves(&mut c, 0xaaaa, 9, 9));
    // A run over the missing block, one the twice-named block would fill
    // by count, and one past the lend are refused.
    assert!(!serves(&mut c, 0xaaaa, 5, 7));
    assert!(!serves(&mut c, 0xaaaa, 6, 9));
    assert!(!serves(&mut c, 0xaaaa, 7, 10));
    assert!(!serves(&mut c, 0xaaaa, 9, 7));
    assert!(!serves(&mut c, 0xaaaa, 0, u32::MAX));
    // Under another incarnation nothing is this lend's to refuse.
    assert!(serves(&mut c, 0xbbbb, 5, 7));
}
