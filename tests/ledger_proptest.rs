//! Random interleavings over many requests, driven through the seeded
//! transport simulator, with the docs/design.md §2 invariants checked after every
//! step against the simulator's ground truth (what is really in flight).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kvpoll::ledger::*;
use kvpoll::transport::sim::{Faults, Sim, SimConfig, SimEvent};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Action {
    Begin {
        kind: u8,
        handles: u8,
        acks: u8,
        peers: u16,
        post_now: u8,
        ttl_us: u16,
    },
    Post,
    Step(u8),
    Advance(u16),
    Notify(u8),
    Heartbeat(u8, u16),
    Abort(u8),
    Engine,
    StaleReplay(u8),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        4 => (any::<u8>(), 1..=4u8, 0..=2u8, any::<u16>(), any::<u8>(), 1..=200u16).prop_map(
            |(kind, handles, acks, peers, post_now, ttl_us)| Action::Begin {
                kind, handles, acks, peers, post_now, ttl_us
            }
        ),
        3 => Just(Action::Post),
        6 => (1..=8u8).prop_map(Action::Step),
        2 => (1..=100u16).prop_map(Action::Advance),
        2 => any::<u8>().prop_map(Action::Notify),
        1 => (any::<u8>(), 1..=300u16).prop_map(|(i, d)| Action::Heartbeat(i, d)),
        1 => any::<u8>().prop_map(Action::Abort),
        3 => Just(Action::Engine),
        1 => any::<u8>().prop_map(Action::StaleReplay),
    ]
}

/// What the driver knows to be true, independently of the ledger.
struct Truth {
    key: RequestKey,
    kind: Kind,
    n: u8,
    blocks: Vec<BlockId>,
    expires: Nanos,
    acks_sent: u32,
    any_failed: bool,
    cancelled: bool,
    reported: u32,
}

struct Driver {
    ledger: Ledger,
    slots: Arc<Slots>,
    sim: Sim,
    next_id: u64,
    truth: HashMap<u64, Truth>,
    by_key: HashMap<RequestKey, u64>,
    queue: VecDeque<(HandleKey, PeerId)>,
    /// Operations really outstanding in the simulator, per request
    /// (held releases included): a report while this is non-zero is a bug.
    outstanding: HashMap<RequestKey, u32>,
    inbox: Vec<Event>,
    retired: Vec<HandleKey>,
}

impl Driver {
    fn new(seed: u64) -> Self {
        let ledger = Ledger::new(LedgerConfig {
            slots: 16,
            max_blocks: 4,
        })
        .unwrap();
        Driver {
            slots: ledger.slots().clone(),
            ledger,
            sim: Sim::new(SimConfig {
                seed,
                faults: Faults {
                    handle_error: 60_000,
                    setup_failure: 40_000,
                    release_failure: 60_000,
                    stall: 40_000,
                    peer_loss: 15_000,
                },
                ..SimConfig::default()
            }),
            next_id: 1,
            truth: HashMap::new(),
            by_key: HashMap::new(),
            queue: VecDeque::new(),
            outstanding: HashMap::new(),
            inbox: Vec::new(),
            retired: Vec::new(),
        }
    }

    /// Checks every event the last input produced, then queues it for the
    /// engine.
    fn check(&mut self, events: Vec<Event>) {
        let now = self.sim.now();
        for e in events {
            let t = self
                .truth
                .get_mut(&e.id.0)
                .expect("event for an unknown id");
            assert_eq!(t.key, e.key, "event carries the request's key");
            if e.outcome.is_terminal() {
                t.reported += 1;
                assert_eq!(t.reported, 1, "request {:?} reported twice", e.id);
                let busy = self.outstanding.get(&e.key).copied().unwrap_or(0);
                assert_eq!(
                    busy, 0,
                    "{:?} reported {:?} while not quiescent",
                    e.id, e.outcome
                );
                match e.outcome {
                    Outcome::Finished => assert!(!t.any_failed, "finished despite a failure"),
                    Outcome::SendDone => {
                        assert!(!t.any_failed, "failed push reported done");
                        assert!(t.acks_sent >= t.kind_acks());
                    }
                    Outcome::LendReleased => assert!(t.acks_sent >= t.kind_acks()),
                    Outcome::SendExpired | Outcome::LendExpired => {
                        assert!(now >= t.expires, "expired before its lease")
                    }
                    Outcome::Failed(_) => assert!(t.any_failed || t.cancelled || now >= t.expires),
                    Outcome::HandleFailed { .. } => unreachable!(),
                }
            }
            self.inbox.push(e);
        }
    }

    fn live_ids(&self, pred: impl Fn(&Truth) -> bool) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .truth
            .iter()
            .filter(|(_, t)| t.reported == 0 && pred(t))
            .map(|(id, _)| *id)
            .collect();
        ids.sort();
        ids
    }

    fn force_close(&mut self, c: Cancel) {
        for h in 0..64 {
            if c.handles & 1 << h != 0 {
                let hk = HandleKey::new(c.key, h).unwrap();
                let peer = self.ledger.peer(hk).expect("cancelled request is tracked");
                self.sim.force_close(peer);
            }
        }
    }

    fn post_next(&mut self) {
        let Some((hk, peer)) = self.queue.pop_front() else {
            return;
        };
        match self.slots.posting(hk) {
            Ok(()) => match self.sim.post(hk, peer) {
                Ok(()) => *self.outstanding.entry(hk.key()).or_default() += 1,
                Err(reason) => {
                    self.truth_of(hk.key()).any_failed = true;
                    let mut ev = Vec::new();
                    self.slots
                        .setup_failed(hk, reason, &mut |e| ev.push(e))
                        .unwrap();
                    self.check(ev);
                }
            },
            // Cancelled (deadline, abort, peer loss) or already reported.
            Err(InputError::Cancelled(_)) | Err(InputError::Stale(_)) => {}
            Err(e) => panic!("posting refused: {e}"),
        }
    }

    fn truth_of(&mut self, key: RequestKey) -> &mut Truth {
        let id = self.by_key[&key];
        self.truth.get_mut(&id).unwrap()
    }

    fn step_sim(&mut self) -> bool {
        let Some(ev) = self.sim.step() else {
            return false;
        };
        let mut out = Vec::new();
        match ev {
            SimEvent::Completed {
                handle,
                result,
                released,
            } => {
                if result.is_err() {
                    self.truth_of(handle.key()).any_failed = true;
                }
                if released {
                    *self.outstanding.get_mut(&handle.key()).unwrap() -= 1;
                    self.slots
                        .completed(handle, result, &mut |e| out.push(e))
                        .unwrap();
                } else {
                    self.slots
                        .release_failed(handle, result, &mut |e| out.push(e))
                        .unwrap();
                }
            }
            SimEvent::ReleaseRetried { handle, released } => {
                if released {
                    *self.outstanding.get_mut(&handle.key()).unwrap() -= 1;
                }
                self.slots
                    .release_retried(handle, released, &mut |e| out.push(e))
                    .unwrap();
            }
            SimEvent::PeerLost(peer) => {
                // Ground truth: queued handles to the peer will never run.
                let doomed: Vec<RequestKey> = self
                    .queue
                    .iter()
                    .filter(|(_, p)| *p == peer)
                    .map(|(hk, _)| hk.key())
                    .collect();
                for key in doomed {
                    if self.by_key.contains_key(&key) {
                        self.truth_of(key).any_failed = true;
                    }
                }
                self.ledger.peer_lost(peer, &mut |e| out.push(e));
            }
        }
        self.check(out);
        true
    }

    fn advance(&mut self, now: Nanos) {
        self.sim.advance_to(now);
        let now = self.sim.now();
        for t in self.truth.values_mut() {
            if t.reported == 0 && now >= t.expires {
                t.cancelled = true;
            }
        }
        let (mut out, mut cancels) = (Vec::new(), Vec::new());
        self.ledger
            .advance(now, &mut |e| out.push(e), &mut |c| cancels.push(c));
        self.check(out);
        for c in cancels {
            self.force_close(c);
        }
    }

    fn engine(&mut self) {
        for e in std::mem::take(&mut self.inbox) {
            if !e.outcome.is_terminal() {
                continue;
            }
            let mut invalid = Vec::new();
            self.slots
                .blocks_to_invalidate(e.key, &mut invalid)
                .unwrap();
            self.ledger.retire(e.key).unwrap();
            let t = &self.truth[&e.id.0];
            if matches!(e.outcome, Outcome::Failed(_)) && t.kind == Kind::Read {
                assert_eq!(invalid, t.blocks, "failed read hands back its blocks");
            } else {
                assert!(invalid.is_empty());
            }
            self.retired
                .extend((0..t.n).map(|h| HandleKey::new(e.key, h).unwrap()));
            self.by_key.remove(&e.key);
        }
    }

    fn apply(&mut self, a: &Action) {
        let now = self.sim.now();
        match *a {
            Action::Begin {
                kind,
                handles,
                acks,
                peers,
                post_now,
                ttl_us,
            } => {
                let (kind, n) = match kind % 4 {
                    0 | 1 => (Kind::Read, handles),
                    2 => (
                        Kind::Write {
                            acks: u32::from(acks),
                        },
                        handles.min(3),
                    ),
                    _ if kind % 8 == 3 => (Kind::PrefixHit, 0),
                    _ => (
                        Kind::Lend {
                            notifications: u32::from(acks) + 1,
                        },
                        0,
                    ),
                };
                let id = self.next_id;
                let peer_ids: Vec<PeerId> = (0..n)
                    .map(|h| PeerId(u32::from(peers >> (2 * h)) & 3))
                    .collect();
                let blocks = vec![BlockId(id as u32), BlockId(id as u32 + 1)];
                let expires = now.saturating_add(Nanos(u64::from(ttl_us) * 1_000));
                let req = Request {
                    id: RequestId(id),
                    kind,
                    peers: &peer_ids,
                    blocks: &blocks,
                    expires,
                };
                let mut out = Vec::new();
                let key = match self.ledger.begin(&req, &mut |e| out.push(e)) {
                    Ok(Begun::Tracked(key)) => key,
                    Err(BeginError::Full { .. }) => return,
                    other => panic!("begin: {other:?}"),
                };
                self.next_id += 1;
                assert!(
                    self.by_key.insert(key, id).is_none(),
                    "a key was issued twice while in use"
                );
                self.truth.insert(
                    id,
                    Truth {
                        key,
                        kind,
                        n,
                        blocks,
                        expires,
                        acks_sent: 0,
                        any_failed: false,
                        cancelled: false,
                        reported: 0,
                    },
                );
                self.check(out);
                for (h, peer) in peer_ids.into_iter().enumerate() {
                    let hk = HandleKey::new(key, h as u8).unwrap();
                    if post_now & 1 << h != 0 {
                        self.queue.push_front((hk, peer));
                        self.post_next();
                    } else {
                        self.queue.push_back((hk, peer));
                    }
                }
            }
            Action::Post => self.post_next(),
            Action::Step(n) => {
                for _ in 0..n {
                    self.step_sim();
                }
            }
            Action::Advance(us) => self.advance(now.saturating_add(Nanos(u64::from(us) * 1_000))),
            Action::Notify(i) => {
                let ids =
                    self.live_ids(|t| matches!(t.kind, Kind::Write { .. } | Kind::Lend { .. }));
                let stats = self.ledger.stats();
                if ids.is_empty() {
                    let unknown = RequestId(1 << 40);
                    assert_eq!(
                        self.ledger.notify(unknown, 1, &mut |_| panic!("event")),
                        Err(NotifyError::UnknownRequest(unknown))
                    );
                    assert_eq!(
                        self.ledger.stats().rejected_notifications,
                        stats.rejected_notifications + 1
                    );
                    return;
                }
                let id = ids[usize::from(i) % ids.len()];
                let mut out = Vec::new();
                match self.ledger.notify(RequestId(id), 1, &mut |e| out.push(e)) {
                    Ok(()) => self.truth.get_mut(&id).unwrap().acks_sent += 1,
                    // Cancelling (lease expired, waiting for quiescence).
                    Err(NotifyError::UnknownRequest(_)) => {}
                    Err(e) => panic!("notify: {e}"),
                }
                self.check(out);
            }
            Action::Heartbeat(i, us) => {
                let ids =
                    self.live_ids(|t| matches!(t.kind, Kind::Write { .. } | Kind::Lend { .. }));
                if let Some(&id) = ids.get(usize::from(i) % ids.len().max(1)) {
                    let until = now.saturating_add(Nanos(u64::from(us) * 1_000));
                    if self.ledger.heartbeat(RequestId(id), until) {
                        let t = self.truth.get_mut(&id).unwrap();
                        t.expires = t.expires.max(until);
                    }
                }
            }
            Action::Abort(i) => {
                let ids = self.live_ids(|_| true);
                if let Some(&id) = ids.get(usize::from(i) % ids.len().max(1)) {
                    self.truth.get_mut(&id).unwrap().cancelled = true;
                    let mut out = Vec::new();
                    let cancel = self
                        .ledger
                        .abort(RequestId(id), &mut |e| out.push(e))
                        .unwrap();
                    self.check(out);
                    if let Some(c) = cancel {
                        self.force_close(c);
                    }
                }
            }
            Action::Engine => self.engine(),
            Action::StaleReplay(i) => {
                if self.retired.is_empty() {
                    return;
                }
                let hk = self.retired[usize::from(i) % self.retired.len()];
                let before = self.ledger.stats().rejected_inputs;
                assert_eq!(
                    self.slots.completed(hk, Ok(()), &mut |_| panic!("event")),
                    Err(InputError::Stale(hk.key()))
                );
                assert_eq!(self.slots.posting(hk), Err(InputError::Stale(hk.key())));
                assert_eq!(self.ledger.stats().rejected_inputs, before + 2);
            }
        }
    }

    /// Runs everything to the end: every request reported once, every slot
    /// free, nothing left in flight.
    fn drain(&mut self) {
        for _ in 0..100 {
            while !self.queue.is_empty() {
                self.post_next();
            }
            while self.step_sim() {}
            self.engine();
            if self.live_ids(|_| true).is_empty() && self.sim.in_flight() == 0 {
                break;
            }
            // Only stalls, missing notifications or unexpired leases remain:
            // let time pass; deadlines cancel, forced closes complete.
            let later = self.sim.now().saturating_add(Nanos(1_000_000_000));
            self.advance(later);
        }
        assert!(
            self.live_ids(|_| true).is_empty(),
            "requests never reported"
        );
        assert_eq!(self.sim.in_flight(), 0);
        assert!(self.truth.values().all(|t| t.reported == 1));
        assert_eq!(self.ledger.stats().in_use, 0, "a slot leaked");
    }
}

impl Truth {
    fn kind_acks(&self) -> u32 {
        match self.kind {
            Kind::Write { acks } => acks,
            Kind::Lend { notifications } => notifications,
            _ => 0,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_interleavings_report_every_request_exactly_once_and_only_when_quiescent(
        seed in any::<u64>(),
        actions in proptest::collection::vec(action(), 1..200),
    ) {
        let mut d = Driver::new(seed);
        for a in &actions {
            d.apply(a);
        }
        d.drain();
    }
}

#[test]
fn a_long_seeded_run_reuses_every_slot_many_times_without_a_leak() {
    let mut d = Driver::new(42);
    let mut rng = kvpoll::transport::sim::Rng::new(7);
    let mut begun = 0;
    for i in 0..20_000u32 {
        let a = match rng.below(10) {
            0..=2 => Action::Begin {
                kind: rng.below(256) as u8,
                handles: 1 + rng.below(4) as u8,
                acks: rng.below(3) as u8,
                peers: rng.below(1 << 16) as u16,
                post_now: rng.below(256) as u8,
                ttl_us: 1 + rng.below(200) as u16,
            },
            3 => Action::Post,
            4..=6 => Action::Step(4),
            7 => Action::Advance(20),
            8 => Action::Notify(rng.below(256) as u8),
            _ => Action::Engine,
        };
        if matches!(a, Action::Begin { .. }) {
            begun += 1;
        }
        d.apply(&a);
        if i % 1000 == 0 {
            d.apply(&Action::StaleReplay(rng.below(256) as u8));
        }
    }
    d.drain();
    assert!(
        d.truth.len() > 16 * 20,
        "slots were reused: {} of {begun}",
        d.truth.len()
    );
}
