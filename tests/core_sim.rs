//! Whole protocol cores over the simulated network (`transport::simnet`):
//! one [`Core`] per node, driven single-threaded and deterministically the
//! way `Poller::execute` drives one, with the engine's side (command
//! batches, `report`) played by the harness. Named tests for the docs/design.md §2
//! rules and for defects found before, then a proptest over whole runs.
//!
//! The whole-run proptest uses request ids again once their requests were
//! reported, lets producers fill the blocks of ended lends again, reads
//! before lends and reads of ended lends, injects late notes naming ended
//! incarnations, and removes peers; a finished read must hold the bytes of
//! the lend it named (each fill of a block is another pattern).
//!
//! Soak: `KVPOLL_SIM_CASES=200000 cargo test --release --test core_sim`

use std::collections::{BTreeMap, HashMap};

use kvpoll::core::{Action, Command, Core, CoreConfig, T_TRANSPORT, T_WORD};
use kvpoll::ledger::{
    BlockId, Cause, Event, HandleKey, Incarnation, Kind, Ledger, LedgerConfig, Nanos, Outcome,
    PeerId, Reason, RequestId, RequestKey,
};
use kvpoll::notification::{NoteKind, Notification};
use kvpoll::transport::sim::Rng;
use kvpoll::transport::simnet::{SimNet, SimNetConfig};
use kvpoll::transport::{Direction, LendWords, Transport};
use proptest::prelude::*;

const RELEASE_RETRY: u64 = 50_000;

/// One handle as the harness submits it: the remote node, the incarnation
/// of the lend (or destination) it names, and its block pairs.
type NamedHandle = (usize, Incarnation, Vec<(BlockId, BlockId)>);
const T_KIND: u64 = T_TRANSPORT; // both kind bits
const T_NOTE: u64 = 2 << 30;

/// How the engine would report a request (`Engine::report`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Report {
    FinishedRecving,
    FailedRecving(Reason, Vec<BlockId>),
    FinishedSending,
    FailedSending(Reason),
    Expired,
}

/// A request as the harness (the engine) knows it.
#[derive(Debug, Clone)]
struct Req {
    kind: Kind,
    /// Local blocks it names.
    blocks: Vec<BlockId>,
    /// For a read or a receive: (local block, source node, source block)
    /// whose bytes it must hold once finished.
    expect: Vec<(BlockId, usize, BlockId)>,
    report: Option<(Nanos, Report, RequestKey)>,
    handle_failures: Vec<(u8, Reason)>,
    /// Its incarnation (a lend's or destination's token, a read's or
    /// write's nonce).
    token: Incarnation,
    /// Unique in the run: which of the requests that used this id it is.
    serial: u64,
    /// For a read: the fill of each `expect` source block it must find
    /// (the one its lend lent).
    epochs: Vec<u8>,
}

struct NodeState {
    core: Core,
    instance: u64,
    /// Node index → this core's peer id for it.
    peers: HashMap<usize, PeerId>,
    /// Releases that fail, next ones first.
    shut: bool,
    /// Every action executed, for tests that check what was (not) done.
    actions: Vec<Action>,
    /// Notifications sent: (kind, id, to node).
    sent: Vec<(NoteKind, RequestId, usize)>,
}

/// Where a node's block belongs: a request (node, id), and whether that
/// request was reported (then nothing may land in it any more).
#[derive(Debug, Clone, Copy)]
struct BlockOwner {
    id: u64,
    serial: u64,
}

struct Harness {
    net: SimNet,
    nodes: Vec<NodeState>,
    now: Nanos,
    /// The newest request of each (node, id).
    reqs: BTreeMap<(usize, u64), Req>,
    /// Requests whose id was used again after their report.
    past: Vec<((usize, u64), Req)>,
    /// How often each (node, block) was filled.
    epochs: HashMap<(usize, u32), u8>,
    /// (node, other) where `node` removed its peer `other`.
    removed: std::collections::HashSet<(usize, usize)>,
    serials: u64,
    tokens: u64,
    owners: HashMap<(usize, u32), BlockOwner>,
    next_block: Vec<u32>,
    /// Writes already checked.
    checked: usize,
    /// Paused nodes and when they resume.
    resumes: Vec<(Nanos, usize)>,
    seed: u64,
}

fn instance_of(node: usize, life: u64) -> u64 {
    0x1000 * (life + 1) + node as u64 + 1
}

/// Byte `i` of `node`'s block `block` in `region` after its `epoch`-th
/// fill (a block the harness reuses holds other bytes each time).
fn pattern(node: usize, block: BlockId, region: usize, i: usize, epoch: u8) -> u8 {
    (node as u32 * 131
        + block.0 * 31
        + region as u32 * 7
        + i as u32 * 13
        + 1
        + u32::from(epoch) * 97) as u8
}

/// Lend words each node announces in the harness: few, so that lends
/// collide and their readers ask.
const LEND_WORDS: usize = 16;

fn new_core(
    instance: u64,
    regions: usize,
    blocks: u64,
    heartbeat: u64,
    words: Option<LendWords>,
) -> Core {
    let ledger = Ledger::new(LedgerConfig {
        slots: 64,
        max_blocks: 64,
    })
    .expect("ledger");
    let mut core = Core::new(
        CoreConfig {
            instance,
            release_retry: Nanos(RELEASE_RETRY),
            confirm_reads: true,
            fence_push_leases: true,
            heartbeat: Nanos(heartbeat),
            lend_grace: Nanos(GRACE),
        },
        ledger,
    )
    .with_lend_words(words);
    core.set_local_layout(regions, blocks);
    core
}

impl Harness {
    fn new(cfg: SimNetConfig) -> Self {
        Self::with_heartbeat(cfg, u64::MAX)
    }

    /// Cores whose reads tell their lenders every `heartbeat` ns.
    fn with_heartbeat(cfg: SimNetConfig, heartbeat: u64) -> Self {
        Self::with_options(cfg, heartbeat, LEND_WORDS)
    }

    /// Nodes without lend words: every read asks its lenders.
    fn asking(cfg: SimNetConfig) -> Self {
        Self::with_options(cfg, u64::MAX, 0)
    }

    /// Cores whose reads tell their lenders every `heartbeat` ns, and
    /// whose lends have `words` lend words (0: none).
    fn with_options(cfg: SimNetConfig, heartbeat: u64, words: usize) -> Self {
        let mut h = Harness {
            net: SimNet::new(cfg),
            nodes: Vec::new(),
            now: Nanos(0),
            reqs: BTreeMap::new(),
            past: Vec::new(),
            epochs: HashMap::new(),
            removed: Default::default(),
            serials: 0,
            tokens: cfg.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
            owners: HashMap::new(),
            next_block: vec![0; cfg.nodes],
            checked: 0,
            resumes: Vec::new(),
            seed: cfg.seed,
        };
        for n in 0..cfg.nodes {
            let instance = instance_of(n, 0);
            let words = (words > 0).then(|| h.net.lend_words(n, words));
            h.nodes.push(NodeState {
                core: new_core(instance, cfg.regions, cfg.blocks, heartbeat, words),
                instance,
                peers: HashMap::new(),
                shut: false,
                actions: Vec::new(),
                sent: Vec::new(),
            });
        }
        for a in 0..cfg.nodes {
            for b in 0..cfg.nodes {
                if a != b {
                    h.connect(a, b);
                }
            }
        }
        h
    }

    /// `a` learns `b` (the engine's `add_peer`).
    fn connect(&mut self, a: usize, b: usize) {
        let cfg = *self.net.config();
        let inst = self.nodes[b].instance;
        let pid = self.nodes[a]
            .core
            .add_peer(inst, cfg.regions, cfg.blocks)
            .expect("a new peer");
        self.execute(a);
        self.net.add_peer_node(a, pid, b);
        self.nodes[a].peers.insert(b, pid);
    }

    fn peer(&self, a: usize, b: usize) -> PeerId {
        self.nodes[a].peers[&b]
    }

    /// Fresh blocks of `node`, never reused in a run (so a late write is
    /// always attributed to the request that owned the block).
    fn alloc(&mut self, node: usize, n: usize) -> Vec<BlockId> {
        let start = self.next_block[node];
        assert!(
            u64::from(start) + n as u64 <= self.net.config().blocks,
            "out of blocks"
        );
        self.next_block[node] += n as u32;
        (start..start + n as u32).map(BlockId).collect()
    }

    /// Writes a fresh fill into `blocks` of `node` (the next epoch of each).
    fn fill(&mut self, node: usize, blocks: &[BlockId]) {
        for &b in blocks {
            let e = self.epochs.entry((node, b.0)).or_insert(0);
            *e = e.wrapping_add(1);
            let e = *e;
            for r in 0..self.net.config().regions {
                for (i, byte) in self.net.block_mut(node, r, b).iter_mut().enumerate() {
                    *byte = pattern(node, b, r, i, e);
                }
            }
        }
    }

    fn epoch(&self, node: usize, block: BlockId) -> u8 {
        self.epochs.get(&(node, block.0)).copied().unwrap_or(0)
    }

    /// A fresh incarnation token (distinct within the run, never 0).
    fn token(&mut self) -> Incarnation {
        self.tokens = self
            .tokens
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        Incarnation(self.tokens | 1)
    }

    /// The incarnation of `node`'s newest lend or receive `id`
    /// (a token nobody holds if there is none: a read of a lend that was
    /// never made).
    fn lend_token(&mut self, node: usize, id: u64) -> Incarnation {
        match self.reqs.get(&(node, id)) {
            Some(r) if matches!(r.kind, Kind::Lend { .. } | Kind::Receive { .. }) => r.token,
            _ => self.token(),
        }
    }

    /// Starts tracking a request; an id may be used again once the
    /// request that had it was reported. Returns its token.
    fn track(&mut self, node: usize, id: u64, kind: Kind, blocks: Vec<BlockId>) -> Incarnation {
        let token = self.token();
        self.serials += 1;
        let serial = self.serials;
        for &b in &blocks {
            self.owners.insert((node, b.0), BlockOwner { id, serial });
        }
        let prev = self.reqs.insert(
            (node, id),
            Req {
                kind,
                blocks,
                expect: Vec::new(),
                report: None,
                handle_failures: Vec::new(),
                token,
                serial,
                epochs: Vec::new(),
            },
        );
        if let Some(prev) = prev {
            assert!(
                prev.report.is_some(),
                "seed {}: id {id} used again on {node} before its report",
                self.seed
            );
            self.past.push(((node, id), prev));
        }
        token
    }

    fn feed(&mut self, node: usize, cmds: Vec<Command>) {
        let now = self.now;
        let mut it = cmds.into_iter();
        let first = it.next().expect("a command");
        self.nodes[node]
            .core
            .on_command(first, &mut || it.next(), now);
        self.execute(node);
        self.pump(node);
    }

    // -- the engine's calls -------------------------------------------------

    /// `Engine::read_with_deadline`: handles are (producer node, pairs).
    fn read(
        &mut self,
        node: usize,
        id: u64,
        handles: &[(usize, Vec<(BlockId, BlockId)>)],
        deadline: u64,
    ) {
        let named: Vec<_> = handles
            .iter()
            .map(|(n, p)| (*n, self.lend_token(*n, id), p.clone()))
            .collect();
        self.read_named(node, id, &named, deadline);
    }

    /// A read whose handles name the incarnation they read (the token the
    /// producer's lend returned, or any other).
    fn read_named(&mut self, node: usize, id: u64, handles: &[NamedHandle], deadline: u64) {
        let kind = if handles.is_empty() {
            Kind::PrefixHit
        } else {
            Kind::Read
        };
        let blocks: Vec<BlockId> = handles
            .iter()
            .flat_map(|(_, _, p)| p.iter().map(|x| x.0))
            .collect();
        let token = self.track(node, id, kind, blocks);
        let expect: Vec<_> = handles
            .iter()
            .flat_map(|(n, _, p)| p.iter().map(move |&(l, r)| (l, *n, r)))
            .collect();
        let epochs = expect.iter().map(|&(_, n, b)| self.epoch(n, b)).collect();
        let req = self.reqs.get_mut(&(node, id)).unwrap();
        req.expect = expect;
        req.epochs = epochs;
        let cmds = self.transfer_batch(node, id, kind, token, handles, deadline);
        self.feed(node, cmds);
    }

    /// `Engine::write`.
    fn write(
        &mut self,
        node: usize,
        id: u64,
        handles: &[(usize, Vec<(BlockId, BlockId)>)],
        acks: u32,
        lease: u64,
    ) {
        let kind = Kind::Write { acks };
        let blocks: Vec<BlockId> = handles
            .iter()
            .flat_map(|(_, p)| p.iter().map(|x| x.0))
            .collect();
        let named: Vec<_> = handles
            .iter()
            .map(|(n, p)| (*n, self.lend_token(*n, id), p.clone()))
            .collect();
        let token = self.track(node, id, kind, blocks);
        let cmds = self.transfer_batch(node, id, kind, token, &named, lease);
        self.feed(node, cmds);
    }

    /// A write whose handles name the destination incarnation they write.
    fn write_named(
        &mut self,
        node: usize,
        id: u64,
        handles: &[NamedHandle],
        acks: u32,
        lease: u64,
    ) {
        let kind = Kind::Write { acks };
        let blocks: Vec<BlockId> = handles
            .iter()
            .flat_map(|(_, _, p)| p.iter().map(|x| x.0))
            .collect();
        let token = self.track(node, id, kind, blocks);
        let cmds = self.transfer_batch(node, id, kind, token, handles, lease);
        self.feed(node, cmds);
    }

    fn transfer_batch(
        &self,
        node: usize,
        id: u64,
        kind: Kind,
        token: Incarnation,
        handles: &[NamedHandle],
        expires_in: u64,
    ) -> Vec<Command> {
        let mut cmds = vec![Command::Begin {
            id: RequestId(id),
            kind,
            handles: handles.len() as u8,
            blocks: 0,
            expires_in,
            token,
        }];
        for (peer, lend, pairs) in handles {
            cmds.push(Command::Handle {
                peer: self.peer(node, *peer),
                pairs: pairs.len() as u32,
                lend: *lend,
            });
            cmds.extend(
                pairs
                    .iter()
                    .map(|&(local, remote)| Command::Pair { local, remote }),
            );
        }
        cmds
    }

    /// `Engine::lend`: `Kind::Lend` (readers) or `Kind::Receive` (writers).
    fn lend(&mut self, node: usize, id: u64, blocks: &[BlockId], kind: Kind, lease: u64) {
        let token = self.token();
        self.lend_as(node, id, blocks, kind, lease, token);
    }

    /// `Engine::receive_from`: a receive with named writers.
    fn receive_from(
        &mut self,
        node: usize,
        id: u64,
        blocks: &[BlockId],
        writers: &[usize],
        lease: u64,
    ) {
        let kind = Kind::Receive {
            writers: writers.len() as u32,
        };
        let token = self.track(node, id, kind, blocks.to_vec());
        let mut cmds = vec![Command::Begin {
            id: RequestId(id),
            kind,
            handles: writers.len() as u8,
            blocks: blocks.len() as u32,
            expires_in: lease,
            token,
        }];
        for &w in writers {
            cmds.push(Command::Handle {
                peer: self.peer(node, w),
                pairs: 0,
                lend: Incarnation::NONE,
            });
        }
        cmds.extend(blocks.iter().map(|&b| Command::Block(b)));
        self.feed(node, cmds);
    }

    /// `Engine::notify_only` (not tracked).
    fn notify_only(&mut self, node: usize, id: u64, producers: &[usize]) {
        let token = self.token();
        let mut cmds = vec![Command::Begin {
            id: RequestId(id),
            kind: Kind::NotifyOnly,
            handles: producers.len() as u8,
            blocks: 0,
            expires_in: 0,
            token,
        }];
        for &p in producers {
            let lend = self.lend_token(p, id);
            cmds.push(Command::Handle {
                peer: self.peer(node, p),
                pairs: 0,
                lend,
            });
        }
        self.feed(node, cmds);
    }

    fn abort(&mut self, node: usize, id: u64) {
        self.feed(node, vec![Command::Abort(RequestId(id))]);
    }

    /// `Engine::lend_with`: a lend (or receive) under an
    /// incarnation drawn beforehand (and perhaps handed out already).
    fn lend_as(
        &mut self,
        node: usize,
        id: u64,
        blocks: &[BlockId],
        kind: Kind,
        lease: u64,
        token: Incarnation,
    ) {
        self.track(node, id, kind, blocks.to_vec());
        self.reqs.get_mut(&(node, id)).unwrap().token = token;
        let mut cmds = vec![Command::Begin {
            id: RequestId(id),
            kind,
            handles: 0,
            blocks: blocks.len() as u32,
            expires_in: lease,
            token,
        }];
        cmds.extend(blocks.iter().map(|&b| Command::Block(b)));
        self.feed(node, cmds);
    }

    /// `Engine::remove_peer`: `node` forgets `other`.
    fn remove_peer(&mut self, node: usize, other: usize) {
        let peer = self.peer(node, other);
        assert!(self.nodes[node].core.remove_peer(peer));
        self.removed.insert((node, other));
        self.execute(node);
        self.pump(node);
    }

    /// Hands `note`, as if it arrived from the network, to `node`.
    fn inject(&mut self, node: usize, note: Notification) {
        let now = self.now;
        self.nodes[node].core.on_transport(
            kvpoll::transport::TransportEvent::Message {
                payload: &note.encode(),
                reply: None,
            },
            now,
        );
        self.execute(node);
        self.pump(node);
    }

    /// The token of `node`'s request `id` (the newest one).
    fn token_of(&self, node: usize, id: u64) -> Incarnation {
        self.reqs[&(node, id)].token
    }

    fn shutdown(&mut self, node: usize) {
        self.nodes[node].shut = true;
        self.nodes[node].core.shutdown();
        self.execute(node);
        self.pump(node);
    }

    fn pause(&mut self, node: usize, until: Nanos) {
        self.net.pause(node);
        self.resumes.push((until, node));
    }

    // -- the poller ---------------------------------------------------------

    /// The driver's `execute`, on the node's simulated transport, one
    /// action at a time: each action and notification sent is recorded
    /// before it is performed.
    fn execute(&mut self, node: usize) {
        let now = self.now;
        let me = &mut self.nodes[node];
        let mut wire = self.net.node(node);
        let (actions, sent, peers) = (&mut me.actions, &mut me.sent, &me.peers);
        while let Some(action) = me.core.next_action() {
            actions.push(action);
            let sent_to = match action {
                Action::Send { ep, notes, .. } => {
                    let to = peers.iter().find(|(_, &p)| p == ep.peer).map(|(&n, _)| n);
                    Some((notes, to.unwrap_or(usize::MAX)))
                }
                Action::Reply { to, notes, .. } => Some((notes, to as usize)),
                _ => None,
            };
            if let Some((notes, to)) = sent_to {
                let bytes = me.core.notes(notes);
                assert_eq!(
                    bytes.len(),
                    notes.count as usize * kvpoll::notification::LEN
                );
                for b in bytes.chunks_exact(kvpoll::notification::LEN) {
                    let n = Notification::decode(b).expect("the core encodes what it sends");
                    sent.push((n.kind, n.id, to));
                }
            }
            kvpoll::driver::execute::perform(&mut me.core, &mut wire, action, now);
        }
    }

    fn live(&self, node: usize) -> bool {
        !self.net.dead(node) && !self.net.paused(node)
    }

    /// One poller iteration for `node` at `now`: transport events, due
    /// deadlines, actions, events. Returns whether anything happened.
    fn pump(&mut self, node: usize) -> bool {
        if !self.live(node) {
            return false;
        }
        let now = self.now;
        let mut work = false;
        loop {
            let mut n = 0;
            {
                let me = &mut self.nodes[node];
                let core = &mut me.core;
                self.net.node(node).drain(&mut |ev| {
                    n += 1;
                    core.on_transport(ev, now);
                });
            }
            self.execute(node);
            if self.nodes[node]
                .core
                .next_deadline()
                .is_some_and(|t| t <= now)
            {
                self.nodes[node].core.advance(now);
                self.execute(node);
                n += 1;
            }
            let mut events = Vec::new();
            self.nodes[node].core.drain_events(|e| events.push(e));
            n += events.len();
            for e in events {
                self.report(node, e);
            }
            if n == 0 {
                return work;
            }
            work = true;
        }
    }

    /// `Engine::report`, with the checks of every report.
    fn report(&mut self, node: usize, ev: Event) {
        let Event { key, id, outcome } = ev;
        let seed = self.seed;
        let req = self
            .reqs
            .get_mut(&(node, id.0))
            .unwrap_or_else(|| panic!("seed {seed}: node {node} reported unknown {id:?}"));
        if let Outcome::HandleFailed { handle, reason } = outcome {
            req.handle_failures.push((handle, reason));
            return;
        }
        assert!(
            req.report.is_none(),
            "seed {seed}: node {node} {id:?} reported twice: {:?} then {outcome:?}",
            req.report
        );
        // No report before quiescence: no data operation or flush of the
        // request is still in the network or unread by the core.
        // A read's lend word check (the flush kind, which reads do not
        // otherwise use) lands in the transport's own cell, never in the
        // read's blocks: a read that ends (its deadline) while one is out
        // is quiescent.
        let word = |t: u64| t & T_KIND == T_WORD && matches!(req.kind, Kind::Read);
        let out = self.net.outstanding(node, |t| {
            t & T_KIND != T_NOTE
                && t & T_KIND != T_TRANSPORT
                && !word(t)
                && HandleKey::from_u64(t & !T_KIND).key() == key
        });
        assert_eq!(
            out, 0,
            "seed {seed}: node {node} {id:?} reported {outcome:?} with {out} ops outstanding"
        );
        let mut invalid = Vec::new();
        let _ = self.nodes[node]
            .core
            .slots()
            .blocks_to_invalidate(key, &mut invalid);
        self.nodes[node].core.retire(key);
        let r = match (outcome, req.kind) {
            (Outcome::Finished, _) => Report::FinishedRecving,
            (Outcome::Failed(reason), Kind::Write { .. }) => Report::FailedSending(reason),
            (Outcome::Failed(_), Kind::Lend { .. }) => Report::Expired,
            (Outcome::Failed(reason), _) => Report::FailedRecving(reason, invalid),
            (Outcome::SendDone | Outcome::LendReleased, _) => Report::FinishedSending,
            (Outcome::SendExpired | Outcome::LendExpired, _) => Report::Expired,
            (Outcome::HandleFailed { .. }, _) => unreachable!(),
        };
        if let Report::FailedRecving(_, ref invalid) = r {
            // A failed read or receive names every block it may have
            // written.
            let (mut got, mut want) = (invalid.clone(), req.blocks.clone());
            got.sort();
            want.sort();
            assert_eq!(
                got, want,
                "seed {seed}: node {node} {id:?} {r:?} names the wrong blocks"
            );
        }
        if r == Report::FinishedRecving {
            // A finished read or receive holds exactly the source's bytes.
            for (k, &(local, src, sb)) in req.expect.iter().enumerate() {
                let epoch = req
                    .epochs
                    .get(k)
                    .copied()
                    .unwrap_or_else(|| self.epochs.get(&(src, sb.0)).copied().unwrap_or(0));
                for region in 0..self.net.config().regions {
                    let want: Vec<u8> = (0..self.net.config().block_size)
                        .map(|i| pattern(src, sb, region, i, epoch))
                        .collect();
                    assert_eq!(
                        self.net.block(node, region, local),
                        &want[..],
                        "seed {seed}: node {node} {id:?} finished but block {local:?} region {region} does not hold node {src}'s {sb:?}"
                    );
                }
            }
        }
        req.report = Some((self.now, r, key));
    }

    /// No byte lands in a block after its request was reported.
    fn check_writes(&mut self) {
        while self.checked < self.net.writes().len() {
            let w = self.net.writes()[self.checked];
            self.checked += 1;
            let Some(owner) = self.owners.get(&(w.node, w.block.0)).copied() else {
                panic!("seed {}: write into unowned block {w:?}", self.seed);
            };
            let req = match self.reqs.get(&(w.node, owner.id)) {
                Some(r) if r.serial == owner.serial => r,
                _ => {
                    &self
                        .past
                        .iter()
                        .find(|(_, r)| r.serial == owner.serial)
                        .expect("every owner was tracked")
                        .1
                }
            };
            let Some((at, ref r, _)) = req.report else {
                continue;
            };
            panic!(
                "seed {}: {w:?} landed after node {} request {} was reported {r:?} at {at:?}",
                self.seed, w.node, owner.id
            );
        }
    }

    // -- time ---------------------------------------------------------------

    fn next_time(&self) -> Option<Nanos> {
        let mut t = self.net.next_due();
        for (n, me) in self.nodes.iter().enumerate() {
            if self.live(n) {
                if let Some(d) = me.core.next_deadline() {
                    t = Some(t.map_or(d, |x| x.min(d)));
                }
            }
        }
        for &(r, _) in &self.resumes {
            t = Some(t.map_or(r, |x| x.min(r)));
        }
        t
    }

    /// Advances to the next thing due (but not past `limit`); returns
    /// false when nothing is left before it.
    fn step(&mut self, limit: Nanos) -> bool {
        let Some(t) = self.next_time() else {
            return false;
        };
        if t > limit {
            self.now = self.now.max(limit);
            self.net.run_until(self.now);
            self.check_writes();
            return false;
        }
        self.now = self.now.max(t);
        self.net.run_until(self.now);
        self.check_writes();
        let now = self.now;
        let mut i = 0;
        while i < self.resumes.len() {
            if self.resumes[i].0 <= now {
                let (_, n) = self.resumes.swap_remove(i);
                self.net.resume(n);
            } else {
                i += 1;
            }
        }
        for n in 0..self.nodes.len() {
            self.pump(n);
        }
        true
    }

    /// Runs until `limit` (or until nothing is left).
    fn run_until(&mut self, limit: Nanos) {
        while self.step(limit) {}
        self.now = self.now.max(limit);
    }

    /// Runs until nothing is left to happen.
    fn settle(&mut self) {
        let mut steps = 0u64;
        while self.step(Nanos(u64::MAX)) {
            steps += 1;
            assert!(steps < 1_000_000, "seed {}: no end", self.seed);
        }
    }

    fn report_of(&self, node: usize, id: u64) -> Option<&Report> {
        self.reqs[&(node, id)].report.as_ref().map(|r| &r.1)
    }

    /// Every request of every node that did not die was reported once, and
    /// every slot is free.
    fn check_end(&self) {
        let all = self
            .reqs
            .iter()
            .chain(self.past.iter().map(|(k, r)| (k, r)));
        for (&(node, id), req) in all {
            if self.net.dead(node) {
                continue;
            }
            assert!(
                req.report.is_some(),
                "seed {}: node {node} request {id} ({:?}) never reported",
                self.seed,
                req.kind
            );
        }
        for (n, me) in self.nodes.iter().enumerate() {
            if self.net.dead(n) {
                continue;
            }
            assert_eq!(
                me.core.ledger_stats().in_use,
                0,
                "seed {}: node {n} leaked slots",
                self.seed
            );
            assert_eq!(me.core.stats().refused_requests, 0, "seed {}", self.seed);
        }
    }
}

fn cfg(seed: u64, nodes: usize) -> SimNetConfig {
    SimNetConfig {
        seed,
        nodes,
        regions: 2,
        blocks: 256,
        block_size: 64,
        latency: (1_000, 20_000),
        ..SimNetConfig::default()
    }
}

const MS: u64 = 1_000_000;
/// How long a read asks again for a lend its lender does not know yet.
const GRACE: u64 = 20 * MS;

fn pairs(local: &[BlockId], remote: &[BlockId]) -> Vec<(BlockId, BlockId)> {
    local.iter().copied().zip(remote.iter().copied()).collect()
}

/// Producer `p` lends `n` filled blocks for `id` to `readers` readers.
fn lend_filled(
    h: &mut Harness,
    p: usize,
    id: u64,
    n: usize,
    readers: u32,
    lease: u64,
) -> Vec<BlockId> {
    let b = h.alloc(p, n);
    h.fill(p, &b);
    h.lend(
        p,
        id,
        &b,
        Kind::Lend {
            notifications: readers,
        },
        lease,
    );
    b
}

// -- named tests --------------------------------------------------------------

#[test]
fn pull_tp4_to_tp2_two_handles_to_two_producers_finishes_with_their_bytes() {
    let mut h = Harness::new(cfg(1, 3));
    let a = lend_filled(&mut h, 1, 7, 3, 1, 100 * MS);
    let b = lend_filled(&mut h, 2, 7, 3, 1, 100 * MS);
    let la = h.alloc(0, 3);
    let lb = h.alloc(0, 3);
    h.read(0, 7, &[(1, pairs(&la, &a)), (2, pairs(&lb, &b))], 10 * MS);
    h.settle();
    assert_eq!(h.report_of(0, 7), Some(&Report::FinishedRecving));
    assert_eq!(h.report_of(1, 7), Some(&Report::FinishedSending));
    assert_eq!(h.report_of(2, 7), Some(&Report::FinishedSending));
    h.check_end();
}

#[test]
fn three_handles_to_one_producer_send_one_read_done() {
    let mut h = Harness::new(cfg(2, 3));
    // Lent to two consumer engines: one engine's read (three handles) must
    // not release it.
    let src = lend_filled(&mut h, 1, 9, 6, 2, 100 * MS);
    let l = h.alloc(0, 6);
    let hs: Vec<_> = (0..3)
        .map(|i| (1, pairs(&l[2 * i..2 * i + 2], &src[2 * i..2 * i + 2])))
        .collect();
    h.read(0, 9, &hs, 10 * MS);
    h.run_until(Nanos(5 * MS));
    assert_eq!(h.report_of(0, 9), Some(&Report::FinishedRecving));
    let done: Vec<_> = h.nodes[0]
        .sent
        .iter()
        .filter(|s| s.0 == NoteKind::ReadDone)
        .collect();
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(
        h.report_of(1, 9),
        None,
        "one consumer engine released a Readers(2) lend"
    );
    // The second consumer engine reads: now it is released.
    a_read_finishes_and_releases_its_lend(&mut h, 2, 1, 9, &src);
}

/// `reader` reads `src` of `lender`'s lend `id`: it finishes, the lend is
/// released, and the run ends clean.
fn a_read_finishes_and_releases_its_lend(
    h: &mut Harness,
    reader: usize,
    lender: usize,
    id: u64,
    src: &[BlockId],
) {
    let l = h.alloc(reader, src.len());
    h.read(reader, id, &[(lender, pairs(&l, src))], 10 * MS);
    run_ends_with_both_finished(h, reader, lender, id);
}

/// Runs to the end: `receiver` finished receiving `id`, `sender` sending
/// it, and the run ends clean.
fn run_ends_with_both_finished(h: &mut Harness, receiver: usize, sender: usize, id: u64) {
    h.settle();
    assert_eq!(h.report_of(receiver, id), Some(&Report::FinishedRecving));
    assert_eq!(h.report_of(sender, id), Some(&Report::FinishedSending));
    h.check_end();
}

#[test]
fn wrong_kind_notification_is_rejected_and_changes_nothing() {
    let mut h = Harness::new(cfg(3, 2));
    let dst = h.alloc(1, 2);
    h.lend(1, 4, &dst, Kind::Receive { writers: 1 }, 2 * MS);
    let before = h.nodes[1].core.stats().rejected_notifications;
    for kind in [NoteKind::ReadDone, NoteKind::Ack] {
        let note = Notification {
            kind,
            id: RequestId(4),
            incarnation: h.lend_token(1, 4),
            nonce: Incarnation(1),
            sender: h.nodes[0].instance,
            blocks: Default::default(),
        };
        let now = h.now;
        h.nodes[1].core.on_transport(
            kvpoll::transport::TransportEvent::Message {
                payload: &note.encode(),
                reply: None,
            },
            now,
        );
        h.pump(1);
    }
    assert_eq!(h.nodes[1].core.stats().rejected_notifications, before + 2);
    assert_eq!(
        h.report_of(1, 4),
        None,
        "a wrong-kind notification completed it"
    );
    h.settle();
    // Its lease expired: failed, naming its blocks.
    assert_failed_recving(&h, 1, 4, Cause::LeaseExpired, &dst);
    h.check_end();
}

/// `node` reported `id` in `failed_recving` with `cause`, naming `blocks`.
fn assert_failed_recving(h: &Harness, node: usize, id: u64, cause: Cause, blocks: &[BlockId]) {
    match h.report_of(node, id) {
        Some(Report::FailedRecving(r, b)) => {
            assert_eq!(r.cause, cause);
            assert_eq!(b, blocks);
        }
        other => panic!("node {node} request {id}: {other:?}"),
    }
}

#[test]
fn abort_affects_only_its_own_request() {
    let mut h = Harness::new(cfg(4, 2));
    let mut srcs = Vec::new();
    for id in 1..=4 {
        srcs.push(lend_filled(&mut h, 1, id, 2, 1, 100 * MS));
    }
    for id in 1..=4u64 {
        let l = h.alloc(0, 2);
        let s = srcs[id as usize - 1].clone();
        h.read(0, id, &[(1, pairs(&l, &s))], 10 * MS);
    }
    h.abort(0, 2);
    h.settle();
    assert!(
        !h.nodes[0]
            .actions
            .iter()
            .any(|a| matches!(a, Action::Close { .. })),
        "an abort force-closed an endpoint"
    );
    for id in [1, 3, 4] {
        assert_eq!(
            h.report_of(0, id),
            Some(&Report::FinishedRecving),
            "sibling {id}"
        );
    }
    match h.report_of(0, 2) {
        // Everything was posted: it may finish, or fail as aborted.
        Some(Report::FinishedRecving) => {}
        Some(Report::FailedRecving(r, _)) => assert_eq!(r.cause, Cause::Aborted),
        other => panic!("{other:?}"),
    }
    h.check_end();
}

#[test]
fn deadline_closes_the_stalled_peer_siblings_fail_peer_stalled_and_a_new_request_gets_a_fresh_endpoint(
) {
    let mut h = Harness::new(cfg(5, 2));
    let s1 = lend_filled(&mut h, 1, 1, 2, 1, 100 * MS);
    let s2 = lend_filled(&mut h, 1, 2, 2, 1, 100 * MS);
    h.pause(1, Nanos(3 * MS));
    let l1 = h.alloc(0, 2);
    let l2 = h.alloc(0, 2);
    h.read(0, 1, &[(1, pairs(&l1, &s1))], MS);
    h.read(0, 2, &[(1, pairs(&l2, &s2))], 50 * MS);
    h.run_until(Nanos(2 * MS));
    let closes: Vec<_> = h.nodes[0]
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Close { ep } => Some(*ep),
            _ => None,
        })
        .collect();
    assert_eq!(closes.len(), 1, "{closes:?}");
    assert_eq!(closes[0].generation, 1);
    match h.report_of(0, 1) {
        Some(Report::FailedRecving(r, b)) => {
            assert_eq!(r.cause, Cause::Deadline);
            assert_eq!(b, &l1);
        }
        other => panic!("{other:?}"),
    }
    match h.report_of(0, 2) {
        Some(Report::FailedRecving(r, _)) => assert_eq!(r.cause, Cause::PeerStalled),
        other => panic!("{other:?}"),
    }
    h.run_until(Nanos(4 * MS));
    let s3 = lend_filled(&mut h, 1, 3, 2, 1, 100 * MS);
    let l3 = h.alloc(0, 2);
    let mark = h.nodes[0].actions.len();
    h.read(0, 3, &[(1, pairs(&l3, &s3))], 10 * MS);
    h.settle();
    assert_eq!(h.report_of(0, 3), Some(&Report::FinishedRecving));
    assert!(h.nodes[0].actions[mark..]
        .iter()
        .any(|a| matches!(a, Action::Post { ep, .. } if ep.generation == 2)));
    h.check_end();
}

#[test]
fn write_flush_on_a_closed_puts_generation_fails_the_handle_never_write_done() {
    let mut h = Harness::new(cfg(6, 2));
    let dst = h.alloc(1, 2);
    h.lend(1, 5, &dst, Kind::Receive { writers: 1 }, 5 * MS);
    let src = h.alloc(0, 2);
    h.fill(0, &src);
    h.write(0, 5, &[(1, pairs(&src, &dst))], 1, 20 * MS);
    // Run until the puts completed locally and the flush is out.
    while !h.nodes[0]
        .actions
        .iter()
        .any(|a| matches!(a, Action::Flush { .. }))
    {
        assert!(h.step(Nanos(MS)), "no flush");
    }
    let flush_gen = h.nodes[0]
        .actions
        .iter()
        .find_map(|a| match a {
            Action::Flush { ep, .. } => Some(ep.generation),
            _ => None,
        })
        .unwrap();
    let put_gen = h.nodes[0]
        .actions
        .iter()
        .find_map(|a| match a {
            Action::Post {
                ep,
                dir: Direction::Put,
                ..
            } => Some(ep.generation),
            _ => None,
        })
        .unwrap();
    assert_eq!(flush_gen, put_gen);
    // The destination stalls before the flush completes; a sibling's
    // deadline closes that generation.
    h.pause(1, Nanos(3 * MS));
    let s = h.alloc(0, 1);
    h.read(0, 6, &[(1, vec![(s[0], BlockId(200))])], MS / 2);
    h.run_until(Nanos(2 * MS));
    match h.report_of(0, 5) {
        Some(Report::FailedSending(r)) => assert_eq!(r.cause, Cause::PeerStalled),
        other => panic!("{other:?}"),
    }
    h.settle();
    assert!(
        !h.nodes[0].sent.iter().any(|s| s.0 == NoteKind::WriteDone),
        "WriteDone sent though the flush's endpoint was closed"
    );
    // The writer's word cannot follow its puts (their endpoint is closed),
    // and a word on a fresh endpoint could overtake them: the destination
    // holds its blocks to its lease's end, then asks the writer, which
    // answers quiet (nothing of it is in flight any more); only then are
    // the blocks reported, named, and nothing lands after.
    match h.report_of(1, 5) {
        Some(Report::FailedRecving(r, b)) => {
            assert_eq!(r.cause, Cause::LeaseExpired);
            assert_eq!(b, &dst);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        h.nodes[0].sent.iter().any(|s| s.0 == NoteKind::WriteQuiet),
        "the writer was not asked, or did not answer"
    );
    h.check_end();
}

#[test]
fn push_destination_failure_and_expiry_name_its_blocks() {
    let mut h = Harness::new(cfg(7, 2));
    let d1 = h.alloc(1, 3);
    let d2 = h.alloc(1, 2);
    h.lend(1, 1, &d1, Kind::Receive { writers: 1 }, MS);
    h.lend(1, 2, &d2, Kind::Receive { writers: 1 }, 10 * MS);
    h.abort(1, 2);
    h.settle();
    match h.report_of(1, 1) {
        Some(Report::FailedRecving(r, b)) => {
            assert_eq!(r.cause, Cause::LeaseExpired);
            assert_eq!(b, &d1);
        }
        other => panic!("{other:?}"),
    }
    match h.report_of(1, 2) {
        Some(Report::FailedRecving(r, b)) => {
            assert_eq!(r.cause, Cause::Aborted);
            assert_eq!(b, &d2);
        }
        other => panic!("{other:?}"),
    }
    h.check_end();
}

#[test]
fn push_finishes_with_the_writers_bytes_and_write_done_once() {
    let mut h = Harness::new(cfg(8, 2));
    let dst = h.alloc(1, 4);
    h.lend(1, 3, &dst, Kind::Receive { writers: 1 }, 50 * MS);
    let src = h.alloc(0, 4);
    h.fill(0, &src);
    h.reqs.get_mut(&(1, 3)).unwrap().expect =
        dst.iter().zip(&src).map(|(&d, &s)| (d, 0, s)).collect();
    // Two handles to the same destination engine: one WriteDone.
    h.write(
        0,
        3,
        &[
            (1, pairs(&src[..2], &dst[..2])),
            (1, pairs(&src[2..], &dst[2..])),
        ],
        1,
        50 * MS,
    );
    h.settle();
    assert_eq!(h.report_of(1, 3), Some(&Report::FinishedRecving));
    assert_eq!(h.report_of(0, 3), Some(&Report::FinishedSending));
    assert_eq!(
        h.nodes[0]
            .sent
            .iter()
            .filter(|s| s.0 == NoteKind::WriteDone)
            .count(),
        1
    );
    h.check_end();
}

#[test]
fn shutdown_reports_every_tracked_request_once() {
    let mut h = Harness::new(cfg(9, 3));
    let s = lend_filled(&mut h, 1, 1, 2, 1, 100 * MS);
    let s2 = lend_filled(&mut h, 2, 2, 2, 1, 100 * MS);
    h.pause(2, Nanos(100 * MS));
    let l = h.alloc(0, 2);
    h.read(0, 1, &[(1, pairs(&l, &s))], 50 * MS);
    let l2 = h.alloc(0, 2);
    h.read(0, 2, &[(2, pairs(&l2, &s2))], 50 * MS);
    let d = h.alloc(0, 2);
    h.lend(0, 3, &d, Kind::Receive { writers: 1 }, 50 * MS);
    let d2 = h.alloc(0, 2);
    h.lend(0, 4, &d2, Kind::Lend { notifications: 1 }, 50 * MS);
    h.shutdown(0);
    h.run_until(Nanos(MS));
    for id in [1, 2, 4] {
        assert!(
            h.report_of(0, id).is_some(),
            "request {id} not reported at shutdown"
        );
    }
    match h.report_of(0, 2) {
        Some(Report::FailedRecving(r, b)) => {
            assert_eq!(r.cause, Cause::Shutdown);
            assert_eq!(b, &l2);
        }
        other => panic!("{other:?}"),
    }
    // The receive lent to an unnamed writer waits for every peer
    // that could be writing into it: the stopped one answers once it
    // resumes (a driver reports it at its shutdown bound regardless).
    assert_eq!(h.report_of(0, 3), None, "released while a peer was stopped");
    assert_eq!(h.nodes[0].core.quarantined(), 1);
    h.settle();
    match h.report_of(0, 3) {
        Some(Report::FailedRecving(r, b)) => {
            assert_eq!(r.cause, Cause::Shutdown);
            assert_eq!(b, &d);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(h.nodes[0].core.ledger_stats().in_use, 0);
    assert_eq!(h.nodes[0].core.outstanding(), 0);
    assert_eq!(h.nodes[0].core.quarantined(), 0);
}

#[test]
fn a_failed_handle_is_reported_only_after_its_stalled_sibling_stopped() {
    let mut h = Harness::new(cfg(10, 3));
    let s1 = lend_filled(&mut h, 1, 1, 2, 1, 100 * MS);
    let s2 = lend_filled(&mut h, 2, 1, 2, 1, 100 * MS);
    h.pause(2, Nanos(100 * MS));
    let l1 = h.alloc(0, 2);
    let l2 = h.alloc(0, 2);
    // Handle 0 names a block the producer does not have: setup fails at
    // once. Handle 1 stalls.
    let _ = s1;
    h.read(
        0,
        1,
        &[(1, vec![(l1[0], BlockId(9999))]), (2, pairs(&l2, &s2))],
        5 * MS,
    );
    h.run_until(Nanos(4 * MS));
    let req = &h.reqs[&(0, 1)];
    assert_eq!(req.handle_failures.len(), 1);
    assert_eq!(req.handle_failures[0].1.cause, Cause::Setup);
    assert!(
        req.report.is_none(),
        "reported before its stalled handle stopped"
    );
    h.run_until(Nanos(6 * MS));
    match h.report_of(0, 1) {
        Some(Report::FailedRecving(r, b)) => {
            assert_eq!(r.cause, Cause::Setup);
            assert_eq!(b.len(), 3);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_failed_release_retains_the_request_until_its_retry() {
    let mut h = Harness::new(cfg(11, 2));
    let s = lend_filled(&mut h, 1, 1, 2, 1, 100 * MS);
    let l = h.alloc(0, 2);
    h.net.fail_releases(0, 1);
    h.read(0, 1, &[(1, pairs(&l, &s))], 10 * MS);
    h.settle();
    let (at, r, _) = h.reqs[&(0, 1)].report.clone().unwrap();
    assert_eq!(r, Report::FinishedRecving);
    assert!(
        at.0 >= RELEASE_RETRY,
        "reported at {at:?}, before the release retry"
    );
    h.check_end();
}

#[test]
fn a_lost_peer_fails_its_handles_and_can_be_re_added() {
    let mut h = Harness::new(cfg(12, 2));
    let s = lend_filled(&mut h, 1, 1, 2, 1, 100 * MS);
    h.pause(1, Nanos(100 * MS));
    let l = h.alloc(0, 2);
    h.read(0, 1, &[(1, pairs(&l, &s))], 50 * MS);
    h.run_until(Nanos(MS));
    h.net.kill(1);
    h.run_until(Nanos(2 * MS));
    match h.report_of(0, 1) {
        Some(Report::FailedRecving(r, b)) => {
            assert_eq!(r.cause, Cause::PeerLost);
            assert_eq!(b, &l);
        }
        other => panic!("{other:?}"),
    }
    // The engine comes back with a new instance: re-added, it serves.
    h.net.revive(1);
    h.resumes.clear();
    let cfgn = *h.net.config();
    let inst = instance_of(1, 1);
    let words = Some(h.net.lend_words(1, LEND_WORDS));
    h.nodes[1].core = new_core(inst, cfgn.regions, cfgn.blocks, u64::MAX, words);
    h.nodes[1].instance = inst;
    h.reqs.retain(|k, _| k.0 != 1);
    h.connect(0, 1);
    h.connect(1, 0);
    let s2 = lend_filled(&mut h, 1, 2, 2, 1, 100 * MS);
    let l2 = h.alloc(0, 2);
    h.read(0, 2, &[(1, pairs(&l2, &s2))], 50 * MS);
    h.settle();
    assert_eq!(h.report_of(0, 2), Some(&Report::FinishedRecving));
    assert_eq!(h.report_of(1, 2), Some(&Report::FinishedSending));
    h.check_end();
}

#[test]
fn notify_only_releases_a_lend() {
    let mut h = Harness::new(cfg(13, 3));
    lend_filled(&mut h, 1, 1, 2, 1, 100 * MS);
    lend_filled(&mut h, 2, 1, 2, 1, 100 * MS);
    h.notify_only(0, 1, &[1, 2, 1]);
    h.run_until(Nanos(MS));
    assert_eq!(h.report_of(1, 1), Some(&Report::FinishedSending));
    assert_eq!(h.report_of(2, 1), Some(&Report::FinishedSending));
    assert_eq!(
        h.nodes[0].sent.len(),
        2,
        "one notification per producer engine"
    );
    h.settle();
    h.check_end();
}

#[test]
fn reads_that_finish_together_tell_their_lender_in_one_message_and_hear_back_in_one() {
    // Every operation takes the same time: the reads below, posted at the
    // same moment, complete in the same poller iteration.
    // Lenders without lend words: the reads ask.
    let mut h = Harness::asking(SimNetConfig {
        latency: (5_000, 5_000),
        ..cfg(21, 2)
    });
    let n = 8u64;
    let srcs: Vec<_> = (1..=n)
        .map(|id| lend_filled(&mut h, 1, id, 1, 1, 100 * MS))
        .collect();
    for id in 1..=n {
        let l = h.alloc(0, 1);
        h.read(0, id, &[(1, pairs(&l, &srcs[id as usize - 1]))], 10 * MS);
    }
    h.settle();
    for id in 1..=n {
        assert_eq!(h.report_of(0, id), Some(&Report::FinishedRecving));
        assert_eq!(h.report_of(1, id), Some(&Report::FinishedSending));
    }
    let questions = h.nodes[0]
        .sent
        .iter()
        .filter(|s| s.0 == NoteKind::ReadDone)
        .count();
    assert_eq!(questions, n as usize, "one question a read");
    let sends = |node: usize| {
        h.nodes[node]
            .actions
            .iter()
            .filter(|a| matches!(a, Action::Send { .. }))
            .count()
    };
    let replies = h.nodes[1]
        .actions
        .iter()
        .filter(|a| matches!(a, Action::Reply { .. }))
        .count();
    assert_eq!(sends(0), 1, "the reader's questions were not coalesced");
    assert_eq!(replies, 1, "the lender's answers were not coalesced");
    h.check_end();
}

#[test]
fn reads_from_two_lenders_that_finish_together_send_each_lender_one_message() {
    // TP: every read has a handle on each of two lenders, so the questions
    // to the two alternate as the reads finish; each lender still gets one
    // message, and answers in one.
    // Lenders without lend words: the reads ask.
    let mut h = Harness::asking(SimNetConfig {
        latency: (5_000, 5_000),
        ..cfg(23, 3)
    });
    let n = 8u64;
    let srcs: Vec<_> = (1..=n)
        .map(|id| {
            (
                lend_filled(&mut h, 1, id, 1, 1, 100 * MS),
                lend_filled(&mut h, 2, id, 1, 1, 100 * MS),
            )
        })
        .collect();
    for id in 1..=n {
        let l = h.alloc(0, 2);
        let (a, b) = &srcs[id as usize - 1];
        h.read(
            0,
            id,
            &[(1, pairs(&l[..1], a)), (2, pairs(&l[1..], b))],
            10 * MS,
        );
    }
    h.settle();
    for id in 1..=n {
        assert_eq!(h.report_of(0, id), Some(&Report::FinishedRecving));
        assert_eq!(h.report_of(1, id), Some(&Report::FinishedSending));
        assert_eq!(h.report_of(2, id), Some(&Report::FinishedSending));
    }
    let sends: Vec<_> = h.nodes[0]
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { ep, notes, .. } => Some((ep.peer, notes.count)),
            _ => None,
        })
        .collect();
    assert_eq!(
        sends.len(),
        2,
        "one message to each lender expected: {sends:?}"
    );
    assert!(sends.iter().all(|&(_, c)| c == n as u32), "{sends:?}");
    for lender in [1, 2] {
        let replies = h.nodes[lender]
            .actions
            .iter()
            .filter(|a| matches!(a, Action::Reply { .. }))
            .count();
        assert_eq!(replies, 1, "lender {lender} answered in {replies} messages");
    }
    h.check_end();
}

#[test]
fn a_message_of_several_notifications_is_taken_note_by_note_and_a_damaged_one_alone_is_dropped() {
    let mut h = Harness::new(cfg(22, 2));
    for id in 1..=2 {
        lend_filled(&mut h, 1, id, 1, 1, 100 * MS);
    }
    let reader = h.nodes[0].instance;
    let lends = [h.lend_token(1, 1), h.lend_token(1, 2)];
    let gave_up = |id: u64| {
        Notification {
            kind: NoteKind::GaveUp,
            id: RequestId(id),
            incarnation: lends[(id as usize).saturating_sub(1).min(1)],
            nonce: Incarnation(1),
            sender: reader,
            blocks: Default::default(),
        }
        .encode()
    };
    let mut damaged = gave_up(7);
    damaged[5] ^= 0x40;
    let feed = |h: &mut Harness, payload: &[u8]| {
        let now = h.now;
        h.nodes[1].core.on_transport(
            kvpoll::transport::TransportEvent::Message {
                payload,
                reply: None,
            },
            now,
        );
        h.pump(1);
    };
    // Not a whole number of notifications: refused whole, nothing taken.
    let mut ragged = gave_up(1).to_vec();
    ragged.extend_from_slice(&gave_up(2)[..27]);
    feed(&mut h, &ragged);
    assert_eq!(h.nodes[1].core.stats().malformed_notifications, 1);
    assert_eq!(h.report_of(1, 1), None, "a ragged message was taken");
    // Three notes, the middle one damaged: the other two count.
    let payload = [gave_up(1), damaged, gave_up(2)].concat();
    feed(&mut h, &payload);
    assert_eq!(h.nodes[1].core.stats().malformed_notifications, 2);
    assert_eq!(h.report_of(1, 1), Some(&Report::FinishedSending));
    assert_eq!(h.report_of(1, 2), Some(&Report::FinishedSending));
    h.settle();
    h.check_end();
}

// -- whole runs -----------------------------------------------------------------

/// One random run, all of it drawn from `seed`: 2–3 nodes, up to 20
/// requests (pulls with lends on the producers, pushes into receives,
/// notify-only), aborts, short deadlines and leases, pauses, transfer
/// errors, setup failures, release failures, late writes, a kill, and
/// shutdown at a random moment. The checks run at every step (see
/// `Harness::report` and `Harness::check_writes`) and at the end.
fn whole_run(seed: u64) -> Harness {
    let mut rng = Rng::new(seed ^ 0x5eed_cafe);
    let nodes = 2 + rng.below(2) as usize;
    let pick = |rng: &mut Rng, xs: &[u32]| xs[rng.below(xs.len() as u64) as usize];
    let net = SimNetConfig {
        seed,
        nodes,
        regions: 1 + rng.below(2) as usize,
        blocks: 160,
        block_size: 64,
        latency: (1_000, 1_000 + rng.below(40_000)),
        transfer_error: pick(&mut rng, &[0, 0, 20_000, 100_000]),
        setup_failure: pick(&mut rng, &[0, 0, 20_000, 100_000]),
        late_write: pick(&mut rng, &[0, 300_000, 1_000_000]),
        shm: rng.below(2) == 0,
    };
    let mut h = Harness::new(net);
    for n in 0..nodes {
        let fail = if rng.below(4) == 0 {
            rng.below(3) as u32
        } else {
            0
        };
        h.net.fail_releases(n, fail);
    }
    let requests = 1 + rng.below(20);
    let shutdown_after = (rng.below(4) == 0).then(|| rng.below(requests + 1));
    let kill_after =
        (rng.below(8) == 0).then(|| (rng.below(requests + 1), rng.below(nodes as u64) as usize));
    let mut id = 0u64;
    let time = |rng: &mut Rng| match rng.below(4) {
        0 => 20_000 + rng.below(200_000),
        _ => 200_000 + rng.below(5 * MS),
    };
    // Blocks of pull sources whose lend was reported: the producer's engine
    // may fill them again for a later lend (reuse), and a late read of the
    // old lend must then never finish with the new bytes.
    let mut released: Vec<Vec<BlockId>> = vec![Vec::new(); nodes];
    let mut moved = std::collections::HashSet::new();
    for i in 0..requests {
        let until = Nanos(h.now.0 + rng.below(100_000));
        h.run_until(until);
        for ((n, _), r) in h.reqs.iter().chain(h.past.iter().map(|(k, r)| (k, r))) {
            if matches!(r.kind, Kind::Lend { .. }) && r.report.is_some() && moved.insert(r.serial) {
                released[*n].extend_from_slice(&r.blocks);
            }
        }
        if kill_after.is_some_and(|(k, _)| k == i) {
            h.net.kill(kill_after.unwrap().1);
        }
        if shutdown_after == Some(i) {
            break;
        }
        let live: Vec<usize> = (0..nodes).filter(|&n| !h.net.dead(n)).collect();
        if live.len() < 2 {
            break;
        }
        let a = live[rng.below(live.len() as u64) as usize];
        let others: Vec<usize> = live.iter().copied().filter(|&n| n != a).collect();
        // An id is used again once every request that had it was reported.
        let reusable: Vec<u64> = (1..=id)
            .filter(|&x| (0..nodes).all(|n| h.reqs.get(&(n, x)).is_none_or(|r| r.report.is_some())))
            .collect();
        let this = if !reusable.is_empty() && rng.below(4) == 0 {
            reusable[rng.below(reusable.len() as u64) as usize]
        } else {
            id += 1;
            id
        };
        let op = rng.below(12);
        if std::env::var_os("KVPOLL_SIM_TRACE").is_some() {
            eprintln!("t={:?} op {op} node {a} id {this} others {others:?}", h.now);
        }
        match op {
            0..=4 => {
                // Pull: `a` reads from 1–2 producers, 1–2 handles each; the
                // producer may fill blocks of an ended lend again; the read
                // may reach the producer before its lend, or name an
                // earlier lend of the same id.
                let np = 1 + rng.below(others.len().min(2) as u64) as usize;
                let early = rng.below(4) == 0;
                let mut handles = Vec::new();
                let mut lends = Vec::new();
                for &p in &others[..np] {
                    let k = 1 + rng.below(3) as usize;
                    let src = if released[p].len() >= k && rng.below(3) == 0 {
                        let at = released[p].len() - k;
                        released[p].split_off(at)
                    } else {
                        h.alloc(p, k)
                    };
                    h.fill(p, &src);
                    let lease = time(&mut rng);
                    let inc = if early {
                        h.token()
                    } else {
                        h.lend(p, this, &src, Kind::Lend { notifications: 1 }, lease);
                        // An earlier lend of the same id, now over.
                        let stale = h
                            .past
                            .iter()
                            .rfind(|((n, x), r)| {
                                *n == p && *x == this && matches!(r.kind, Kind::Lend { .. })
                            })
                            .map(|(_, r)| r.token);
                        match stale {
                            Some(old) if rng.below(6) == 0 => old,
                            _ => h.token_of(p, this),
                        }
                    };
                    lends.push((p, inc, src.clone(), lease));
                    let dst = h.alloc(a, k);
                    let split = if k > 1 && rng.below(2) == 0 { 1 } else { k };
                    handles.push((p, inc, pairs(&dst[..split], &src[..split])));
                    if split < k {
                        handles.push((p, inc, pairs(&dst[split..], &src[split..])));
                    }
                }
                let deadline = time(&mut rng);
                h.read_named(a, this, &handles, deadline);
                if early {
                    let until = Nanos(h.now.0 + rng.below(2 * MS));
                    h.run_until(until);
                    for (p, inc, src, lease) in lends {
                        if h.reqs.get(&(p, this)).is_none_or(|r| r.report.is_some()) {
                            h.lend_as(p, this, &src, Kind::Lend { notifications: 1 }, lease, inc);
                        }
                    }
                }
            }
            // (An engine cannot fence a writer it removed: it neither
            // names it nor lends to writers it no longer knows.)
            5..=7
                if h.reqs
                    .get(&(others[0], this))
                    .is_none_or(|r| r.report.is_some())
                    && !h.removed.contains(&(others[0], a)) =>
            {
                // Push: `a` writes into blocks `d` lent to one writer.
                let d = others[0];
                let k = 1 + rng.below(3) as usize;
                let dst = h.alloc(d, k);
                let lease = time(&mut rng);
                // Named or not, the destination's lease is a fence.
                if rng.below(2) == 0 {
                    h.receive_from(d, this, &dst, &[a], lease);
                } else {
                    h.lend(d, this, &dst, Kind::Receive { writers: 1 }, lease);
                }
                let src = h.alloc(a, k);
                h.fill(a, &src);
                h.reqs.get_mut(&(d, this)).unwrap().expect =
                    dst.iter().zip(&src).map(|(&x, &s)| (x, a, s)).collect();
                let mut handles = vec![(
                    d,
                    pairs(&dst, &src)
                        .iter()
                        .map(|&(x, s)| (s, x))
                        .collect::<Vec<_>>(),
                )];
                if k > 1 && rng.below(2) == 0 {
                    let second = handles[0].1.split_off(1);
                    handles.push((d, second));
                }
                let lease = time(&mut rng);
                h.write(a, this, &handles, 1, lease);
            }
            10 => {
                // A late note: a real request id, and incarnations of
                // requests that were reported (over), of any kind, from a
                // real engine. (A live incarnation with its own sender is
                // the word of the party that holds it, not a late note.)
                let all: Vec<(u64, Incarnation)> = h
                    .reqs
                    .iter()
                    .chain(h.past.iter().map(|(k, r)| (k, r)))
                    .filter(|(_, r)| r.report.is_some())
                    .map(|(&(_, x), r)| (x, r.token))
                    .collect();
                if !all.is_empty() {
                    let pick = |rng: &mut Rng| all[rng.below(all.len() as u64) as usize];
                    let (x, inc) = pick(&mut rng);
                    let (_, nonce) = pick(&mut rng);
                    let kinds = [
                        NoteKind::ReadDone,
                        NoteKind::WriteDone,
                        NoteKind::Ack,
                        NoteKind::ReadConfirmed,
                        NoteKind::ReadRefused,
                        NoteKind::GaveUp,
                        NoteKind::WriteAbandoned,
                        NoteKind::Heartbeat,
                        NoteKind::WriteQuery,
                        NoteKind::WriteQuiet,
                        NoteKind::ReadPending,
                        NoteKind::ReadNotLent,
                        NoteKind::WriteNotLent,
                    ];
                    let kind = kinds[rng.below(kinds.len() as u64) as usize];
                    let sender = h.nodes[others[0]].instance;
                    if h.live(a) {
                        h.inject(
                            a,
                            Notification {
                                kind,
                                id: RequestId(x),
                                incarnation: inc,
                                nonce,
                                sender,
                                blocks: Default::default(),
                            },
                        );
                    }
                }
            }
            11 if rng.below(4) == 0 && h.live(a) && !h.nodes[a].shut => {
                // An engine forgets a peer (maybe a writer one of its
                // destinations waits for): no fence may drop.
                h.remove_peer(a, others[0]);
            }
            8 => {
                // Abort something still tracked on a live, running node.
                let open: Vec<(usize, u64)> = h
                    .reqs
                    .iter()
                    .filter(|(&(n, _), r)| r.report.is_none() && h.live(n) && !h.nodes[n].shut)
                    .map(|(&k, _)| k)
                    .collect();
                if !open.is_empty() {
                    let (n, x) = open[rng.below(open.len() as u64) as usize];
                    h.abort(n, x);
                }
            }
            9 | 11 => {
                if rng.below(2) == 0 {
                    let until = Nanos(h.now.0 + 50_000 + rng.below(3 * MS));
                    if h.live(a) {
                        h.pause(a, until);
                    }
                } else if h
                    .reqs
                    .get(&(others[0], this))
                    .is_none_or(|r| r.report.is_some())
                {
                    let p = others[0];
                    lend_filled(&mut h, p, this, 1, 1, time(&mut rng));
                    h.notify_only(a, this, &[p]);
                }
            }
            _ => {}
        }
    }
    if shutdown_after.is_some() {
        // Shutdown at a random moment: every live engine stops.
        for n in 0..nodes {
            if !h.net.dead(n) {
                h.net.resume(n);
                h.shutdown(n);
            }
        }
    }
    h.settle();
    h.check_end();
    h
}

fn sim_cases() -> u32 {
    std::env::var("KVPOLL_SIM_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

proptest! {
    // Soak: KVPOLL_SIM_CASES=200000 cargo test --release --test core_sim
    #![proptest_config(ProptestConfig {
        cases: sim_cases(),
        max_shrink_iters: 64,
        ..ProptestConfig::default()
    })]
    #[test]
    fn whole_runs_report_each_request_once_after_quiescence_and_nothing_lands_late(seed in any::<u64>()) {
        whole_run(seed);
    }
}

/// The proptest's runs really exercise faults: over a fixed set of seeds,
/// some requests fail and some finish, and receives are
/// quarantined (their lease ran out with a writer silent). Late copies of
/// puts cut by a forced close are rare now (writes are never force-closed
/// at their lease's end; only a sibling read's deadline or a lost peer cuts
/// them) and are only counted.
#[test]
fn whole_runs_cover_failures_and_successes() {
    let (mut ok, mut failed, mut late, mut quarantined) = (0, 0, 0, 0);
    // Lend words: reads confirmed from them, reads that had to ask, lends
    // that found their word taken.
    let mut words = (0u64, 0u64, 0u64);
    let mut causes = BTreeMap::new();
    for seed in 0..300 {
        let h = whole_run(seed);
        for r in h.reqs.values() {
            match r.report.as_ref().map(|r| &r.1) {
                Some(Report::FinishedRecving | Report::FinishedSending) => ok += 1,
                Some(_) => failed += 1,
                None => {}
            }
        }
        late += h.net.writes().iter().filter(|w| w.after_completion).count();
        for n in &h.nodes {
            let st = n.core.stats();
            words.0 += st.word_confirmations;
            words.1 += st.word_misses;
            words.2 += st.word_collisions;
        }
        quarantined += h
            .nodes
            .iter()
            .map(|n| n.core.stats().quarantined_receives)
            .sum::<u64>();
        for r in h.reqs.values() {
            if let Some((_, Report::FailedRecving(r, _) | Report::FailedSending(r), _)) = &r.report
            {
                *causes.entry(format!("{:?}", r.cause)).or_insert(0) += 1;
            }
        }
    }
    eprintln!(
        "ok {ok} failed {failed} late {late} quarantined {quarantined} words {words:?} causes {causes:?}"
    );
    assert!(ok > 100 && failed > 100, "ok {ok} failed {failed}");
    assert!(quarantined > 10, "quarantined {quarantined}");
    assert!(
        words.0 > 100 && words.1 > 100 && words.2 > 10,
        "lend words (confirmed, missed, collided): {words:?}"
    );
}

// -- a read finishes only if its lend was live ---------------------------------

/// A read of a lend that had already expired (and been reported, so its
/// blocks may hold another request now) is refused by the lender: the read
/// fails with `LeaseLost`, naming its blocks, instead of finishing.
#[test]
fn a_read_of_an_expired_lend_is_refused_and_fails_naming_its_blocks() {
    let mut h = Harness::new(cfg(21, 2));
    let src = lend_filled(&mut h, 1, 8, 2, 1, MS);
    h.run_until(Nanos(2 * MS));
    assert_eq!(h.report_of(1, 8), Some(&Report::Expired));
    let dst = h.alloc(0, 2);
    h.read(0, 8, &[(1, pairs(&dst, &src))], 50 * MS);
    h.settle();
    match h.report_of(0, 8) {
        Some(Report::FailedRecving(r, b)) => {
            assert_eq!(r.cause, Cause::LeaseLost);
            assert_eq!(b, &dst);
        }
        other => panic!("a read of an expired lend: {other:?}"),
    }
    h.check_end();
}

/// One reader consumed a `Readers(1)` lend; a second engine reading it is
/// refused (the blocks were released to the lender's engine).
#[test]
fn a_lend_consumed_by_one_reader_is_refused_to_a_second() {
    let mut h = Harness::new(cfg(22, 3));
    let src = lend_filled(&mut h, 2, 9, 1, 1, 100 * MS);
    let d0 = h.alloc(0, 1);
    h.read(0, 9, &[(2, pairs(&d0, &src))], 50 * MS);
    h.settle();
    assert_eq!(h.report_of(0, 9), Some(&Report::FinishedRecving));
    assert_eq!(h.report_of(2, 9), Some(&Report::FinishedSending));
    let d1 = h.alloc(1, 1);
    h.read(1, 9, &[(2, pairs(&d1, &src))], 50 * MS);
    h.settle();
    match h.report_of(1, 9) {
        Some(Report::FailedRecving(r, _)) => assert_eq!(r.cause, Cause::LeaseLost),
        other => panic!("a second read of a consumed lend: {other:?}"),
    }
    h.check_end();
}

/// A read that fails (here: one handle names a block beyond its producer's
/// regions) tells its other lender once it is quiescent, which releases its
/// blocks at once instead of at the end of its lease.
#[test]
fn a_failed_read_tells_its_lenders_which_release_at_once() {
    let mut h = Harness::new(cfg(23, 3));
    let a = lend_filled(&mut h, 1, 10, 1, 1, 1_000 * MS);
    let b = lend_filled(&mut h, 2, 10, 1, 1, 1_000 * MS);
    let la = h.alloc(0, 1);
    let lb = h.alloc(0, 1);
    let beyond = [BlockId(10_000)];
    h.read(
        0,
        10,
        &[(1, pairs(&la, &a)), (2, pairs(&lb, &beyond))],
        50 * MS,
    );
    h.run_until(Nanos(10 * MS));
    assert!(matches!(
        h.report_of(0, 10),
        Some(Report::FailedRecving(..))
    ));
    assert!(
        h.nodes[0].sent.iter().any(|s| s.0 == NoteKind::GaveUp),
        "the failed read did not tell its lenders"
    );
    // Released long before the 1 s lease.
    assert_eq!(h.report_of(1, 10), Some(&Report::FinishedSending));
    assert_eq!(h.report_of(2, 10), Some(&Report::FinishedSending));
    let _ = b;
    h.check_end();
}

/// A read slower than its lender's lease: its heartbeats keep the lend
/// alive (each extends it by the lease's length), and it finishes with the
/// lender's bytes. Without heartbeats, the same read is refused.
#[test]
fn a_reads_heartbeats_keep_its_lend_alive_past_the_lease() {
    for (heartbeat, finishes) in [(MS / 4, true), (u64::MAX, false)] {
        let mut cfg = cfg(24, 2);
        // Every operation and message takes 3-4 ms: the read's data lands
        // after ~4 ms and its question reaches the lender after ~8 ms; the
        // lease is 6 ms.
        cfg.latency = (3 * MS, 4 * MS);
        let mut h = Harness::with_heartbeat(cfg, heartbeat);
        let src = lend_filled(&mut h, 1, 11, 2, 1, 6 * MS);
        let dst = h.alloc(0, 2);
        h.read(0, 11, &[(1, pairs(&dst, &src))], 100 * MS);
        h.settle();
        let report = h.report_of(0, 11).cloned();
        if finishes {
            assert_eq!(report, Some(Report::FinishedRecving), "with heartbeats");
            assert_eq!(h.report_of(1, 11), Some(&Report::FinishedSending));
        } else {
            assert!(
                matches!(report, Some(Report::FailedRecving(r, _)) if r.cause == Cause::LeaseLost),
                "without heartbeats: {report:?}"
            );
        }
        h.check_end();
    }
}

/// The lender stops (a paused process) right after lending 12 blocks; over
/// shared memory its reader reads them all meanwhile, and the reads'
/// notes wait at the lender. It resumes past every lease: the notes are
/// taken in, in the same step, before the leases are judged, so every lend
/// is released and none is reported expired.
#[test]
fn a_lender_resumed_past_its_leases_takes_in_its_readers_notes_before_judging_them() {
    let mut h = Harness::new(SimNetConfig {
        shm: true,
        ..cfg(26, 2)
    });
    let ids: Vec<u64> = (40..52).collect();
    let src: Vec<Vec<BlockId>> = ids
        .iter()
        .map(|&id| lend_filled(&mut h, 1, id, 1, 1, MS))
        .collect();
    h.pause(1, Nanos(10 * MS));
    for (&id, src) in ids.iter().zip(&src) {
        let l = h.alloc(0, 1);
        h.read(0, id, &[(1, pairs(&l, src))], 50 * MS);
    }
    h.run_until(Nanos(5 * MS));
    for &id in &ids {
        assert_eq!(h.report_of(1, id), None, "reported while stopped");
    }
    h.settle();
    for &id in &ids {
        assert_eq!(h.report_of(0, id), Some(&Report::FinishedRecving));
        assert_eq!(
            h.report_of(1, id),
            Some(&Report::FinishedSending),
            "lend {id}: judged expired before its reader's note was taken in"
        );
    }
    h.check_end();
}

// -- a receive's lease is a fence ---------------------------------------

/// The writer stops (a paused process) right after posting its puts; the
/// destination's lease runs out meanwhile. Its blocks are not reported (so
/// not reused) while the writer is silent; once the writer resumes, its
/// word releases them, and nothing lands after the report.
#[test]
fn a_named_writer_paused_past_the_destinations_lease_keeps_its_blocks_quarantined() {
    let mut h = Harness::new(cfg(25, 2));
    let dst = h.alloc(1, 2);
    h.receive_from(1, 12, &dst, &[0], 2 * MS);
    let src = h.alloc(0, 2);
    h.fill(0, &src);
    h.write(0, 12, &[(1, pairs(&src, &dst))], 1, 50 * MS);
    h.pause(0, Nanos(10 * MS));
    h.run_until(Nanos(8 * MS));
    assert_eq!(
        h.report_of(1, 12),
        None,
        "reported while its writer was silent"
    );
    assert_eq!(h.nodes[1].core.stats().quarantined_now, 1);
    h.settle();
    assert!(h.report_of(1, 12).is_some(), "never released");
    assert_eq!(h.nodes[1].core.stats().quarantined_now, 0);
    h.check_end();
}

/// A writer whose puts are slow (a congested link) tells its destination
/// it is still at it: the destination's lease is extended and its blocks
/// are not quarantined; without heartbeats the same run quarantines them
/// (and the writer's word then releases them). Either way the data lands
/// whole and nothing lands after the report.
#[test]
fn a_writer_in_flight_heartbeats_its_destination_and_keeps_its_lease() {
    let slow = SimNetConfig {
        latency: (3 * MS, 4 * MS),
        ..cfg(31, 2)
    };
    let run = |heartbeat: u64| {
        let mut h = Harness::with_heartbeat(slow, heartbeat);
        let dst = h.alloc(1, 2);
        h.receive_from(1, 18, &dst, &[0], 5 * MS);
        let src = h.alloc(0, 2);
        h.fill(0, &src);
        h.reqs.get_mut(&(1, 18)).unwrap().expect =
            dst.iter().zip(&src).map(|(&x, &s)| (x, 0, s)).collect();
        h.write(0, 18, &[(1, pairs(&src, &dst))], 1, 100 * MS);
        h.settle();
        assert_eq!(h.report_of(1, 18), Some(&Report::FinishedRecving));
        h.check_end();
        h.nodes[1].core.stats().quarantined_receives
    };
    assert_eq!(run(MS / 2), 0, "quarantined although its writer beat");
    assert_eq!(
        run(u64::MAX),
        1,
        "the run is not slow enough to need the beat"
    );
}

/// A named writer that is lost (its process killed) releases the
/// quarantine: the destination fails, naming its blocks.
#[test]
fn a_lost_named_writer_releases_the_quarantine() {
    let mut h = Harness::new(cfg(26, 2));
    let dst = h.alloc(1, 2);
    h.receive_from(1, 13, &dst, &[0], 2 * MS);
    // Stopped, the writer cannot answer the destination's question.
    h.pause(0, Nanos(1_000 * MS));
    h.run_until(Nanos(5 * MS));
    assert_eq!(
        h.report_of(1, 13),
        None,
        "a silent writer's destination was reported"
    );
    h.net.kill(0);
    // The destination's poller sees its endpoint to the writer fail.
    h.pump(1);
    h.settle();
    match h.report_of(1, 13) {
        Some(Report::FailedRecving(_, b)) => assert_eq!(b, &dst),
        other => panic!("after the writer was lost: {other:?}"),
    }
}

/// Node 1 lends `n` blocks for `id` to its named writer node 0, which
/// writes them and stops (its puts posted) until `until`; `then` does what
/// the destination's engine does meanwhile. The destination must not be
/// reported while its writer is stopped (checked up to `held`), and must be
/// once it spoke — with its bytes, nothing landing after.
fn a_destination_waits_for_its_stopped_writer(
    seed: u64,
    id: u64,
    n: usize,
    lease: u64,
    until: u64,
    held: u64,
    then: impl FnOnce(&mut Harness),
) {
    let mut h = Harness::new(cfg(seed, 2));
    let dst = h.alloc(1, n);
    h.receive_from(1, id, &dst, &[0], lease);
    let src = h.alloc(0, n);
    h.fill(0, &src);
    h.reqs.get_mut(&(1, id)).unwrap().expect =
        dst.iter().zip(&src).map(|(&x, &s)| (x, 0, s)).collect();
    h.write(0, id, &[(1, pairs(&src, &dst))], 1, 50 * MS);
    h.pause(0, Nanos(until));
    then(&mut h);
    h.run_until(Nanos(held));
    assert_eq!(
        h.report_of(1, id),
        None,
        "released while its writer could write"
    );
    h.settle();
    assert!(h.report_of(1, id).is_some());
    h.check_end();
}

/// An abort of a receive with named writers waits for them too:
/// a writer with puts in flight is not answered for until its word.
#[test]
fn an_aborted_named_destination_waits_for_its_writers() {
    a_destination_waits_for_its_stopped_writer(27, 14, 1, 100 * MS, 20 * MS, 10 * MS, |h| {
        h.abort(1, 14)
    });
}

/// A destination aborted before its writer wrote asks the writer, which
/// promises quiet: the blocks are released at once, and the write, when
/// it comes, is refused before anything is posted (nothing lands).
#[test]
fn a_writer_that_answered_quiet_refuses_a_later_write_of_that_request() {
    let mut h = Harness::new(cfg(28, 2));
    let dst = h.alloc(1, 1);
    h.receive_from(1, 15, &dst, &[0], 100 * MS);
    h.abort(1, 15);
    h.run_until(Nanos(MS));
    match h.report_of(1, 15) {
        Some(Report::FailedRecving(r, b)) => {
            assert_eq!(r.cause, Cause::Aborted);
            assert_eq!(b, &dst);
        }
        other => panic!("the quiet writer did not release the destination: {other:?}"),
    }
    let src = h.alloc(0, 1);
    h.fill(0, &src);
    h.write(0, 15, &[(1, pairs(&src, &dst))], 1, 50 * MS);
    h.settle();
    match h.report_of(0, 15) {
        Some(Report::FailedSending(r)) => assert_eq!(r.cause, Cause::LeaseLost),
        other => panic!("a write the writer promised not to do: {other:?}"),
    }
    assert!(
        !h.nodes[0].actions.iter().any(|a| matches!(
            a,
            Action::Post {
                dir: Direction::Put,
                ..
            }
        )),
        "a put was posted"
    );
    h.check_end();
}

/// A destination lent to an unnamed writer is a fence too: the writer,
/// stopped with its puts posted past the destination's lease, keeps the
/// blocks quarantined until it resumes and speaks; nothing lands after
/// the report.
#[test]
fn an_unnamed_writer_paused_past_the_destinations_lease_keeps_its_blocks_quarantined() {
    let mut h = Harness::new(cfg(29, 2));
    let dst = h.alloc(1, 2);
    h.lend(1, 16, &dst, Kind::Receive { writers: 1 }, 2 * MS);
    let src = h.alloc(0, 2);
    h.fill(0, &src);
    h.write(0, 16, &[(1, pairs(&src, &dst))], 1, 50 * MS);
    h.pause(0, Nanos(10 * MS));
    h.run_until(Nanos(8 * MS));
    assert_eq!(
        h.report_of(1, 16),
        None,
        "reported while a writer could still write"
    );
    assert_eq!(h.nodes[1].core.stats().quarantined_now, 1);
    h.settle();
    assert!(h.report_of(1, 16).is_some(), "never released");
    assert_eq!(h.nodes[1].core.stats().quarantined_now, 0);
    h.check_end();
}

/// A destination lent to unnamed writers none of which wrote is released
/// once every peer answered that it will not write.
#[test]
fn an_unnamed_destination_nobody_wrote_is_released_when_every_peer_is_quiet() {
    let mut h = Harness::new(cfg(30, 3));
    let dst = h.alloc(1, 1);
    h.lend(1, 17, &dst, Kind::Receive { writers: 1 }, 2 * MS);
    h.run_until(Nanos(10 * MS));
    match h.report_of(1, 17) {
        Some(Report::Expired) | Some(Report::FailedRecving(..)) => {}
        other => panic!("never released: {other:?}"),
    }
    let quiet = (0..3)
        .filter(|&n| h.nodes[n].sent.iter().any(|s| s.0 == NoteKind::WriteQuiet))
        .count();
    assert_eq!(quiet, 2, "both other peers answer");
    h.check_end();
}

// -- one request id living twice ----------------------------------------------

/// A read retried under the same id (its first attempt failed at its
/// deadline while the lender was paused): the first attempt's late
/// confirmation names the first attempt's nonce, so the retry does not
/// finish on it — only on its own answer.
#[test]
fn a_late_confirmation_of_a_first_read_attempt_never_finishes_its_retry() {
    // A lender without lend words: its readers ask it (with them, the
    // reads below would confirm from its word while it is paused).
    let mut h = Harness::asking(SimNetConfig {
        // Shared memory: the retry's gets land while the lender is paused.
        shm: true,
        ..cfg(40, 2)
    });
    let src = lend_filled(&mut h, 1, 5, 2, 1, 100 * MS);
    let lend = h.token_of(1, 5);
    h.pause(1, Nanos(10 * MS));
    let l1 = h.alloc(0, 2);
    h.read(0, 5, &[(1, pairs(&l1, &src))], MS);
    h.run_until(Nanos(3 * MS));
    assert!(
        matches!(h.report_of(0, 5), Some(Report::FailedRecving(r, _)) if r.cause == Cause::Deadline),
        "{:?}",
        h.report_of(0, 5)
    );
    let first = h.token_of(0, 5);
    // The retry, while the lender is still paused.
    let l2 = h.alloc(0, 2);
    h.read(0, 5, &[(1, pairs(&l2, &src))], 50 * MS);
    let stale = h.nodes[0].core.stats().stale_notifications;
    let lender = h.nodes[1].instance;
    h.inject(
        0,
        Notification {
            kind: NoteKind::ReadConfirmed,
            id: RequestId(5),
            incarnation: lend,
            nonce: first,
            sender: lender,
            blocks: Default::default(),
        },
    );
    assert_eq!(h.nodes[0].core.stats().stale_notifications, stale + 1);
    h.run_until(Nanos(9 * MS));
    assert_eq!(
        h.report_of(0, 5),
        None,
        "the retry finished on its first attempt's answer"
    );
    h.settle();
    assert!(h.report_of(0, 5).is_some());
    h.check_end();
}

/// A lend released by its reader's give-up, then lent again under the same
/// id: a late give-up naming the first incarnation does not release the
/// second, and a read of the first is refused.
#[test]
fn a_late_note_about_an_earlier_lend_never_touches_a_later_lend_of_the_same_id() {
    let mut h = Harness::new(cfg(41, 2));
    lend_filled(&mut h, 1, 7, 1, 1, 100 * MS);
    let first = h.token_of(1, 7);
    h.notify_only(0, 7, &[1]);
    h.run_until(Nanos(2 * MS));
    assert_eq!(h.report_of(1, 7), Some(&Report::FinishedSending));
    let src = lend_filled(&mut h, 1, 7, 1, 1, 100 * MS);
    let reader = h.nodes[0].instance;
    for kind in [NoteKind::GaveUp, NoteKind::Heartbeat, NoteKind::ReadDone] {
        h.inject(
            1,
            Notification {
                kind,
                id: RequestId(7),
                incarnation: first,
                nonce: Incarnation(3),
                sender: reader,
                blocks: Default::default(),
            },
        );
    }
    h.run_until(Nanos(5 * MS));
    assert_eq!(
        h.report_of(1, 7),
        None,
        "a note of the first lend ended the second"
    );
    // The reader of the second lend is served and releases it.
    a_read_finishes_and_releases_its_lend(&mut h, 0, 1, 7, &src);
}

/// A writer answered quiet for a destination that gave up on it; the
/// destination lends the same request id again (a new incarnation) to the
/// same writer: the promise was about the first one, so the write lands.
#[test]
fn a_quiet_promise_about_one_destination_does_not_refuse_the_next_of_the_same_id() {
    let mut h = Harness::new(cfg(42, 2));
    let d1 = h.alloc(1, 1);
    h.receive_from(1, 15, &d1, &[0], MS);
    h.run_until(Nanos(5 * MS));
    assert!(
        matches!(h.report_of(1, 15), Some(Report::FailedRecving(r, _)) if r.cause == Cause::LeaseExpired),
        "{:?}",
        h.report_of(1, 15)
    );
    assert!(h.nodes[0].sent.iter().any(|s| s.0 == NoteKind::WriteQuiet));
    let d2 = h.alloc(1, 2);
    h.receive_from(1, 15, &d2, &[0], 50 * MS);
    let src = h.alloc(0, 2);
    h.fill(0, &src);
    h.reqs.get_mut(&(1, 15)).unwrap().expect =
        d2.iter().zip(&src).map(|(&x, &s)| (x, 0, s)).collect();
    h.write(0, 15, &[(1, pairs(&src, &d2))], 1, 50 * MS);
    run_ends_with_both_finished(&mut h, 1, 0, 15);
}

/// A third engine floods a writer with questions about destinations that
/// do not exist: the writer's promise to a real destination is kept, and a
/// late write into that destination is still refused before anything is
/// posted (nothing lands in its reused blocks).
#[test]
fn a_flood_of_questions_from_one_engine_does_not_push_out_anothers_quiet_promises() {
    let mut h = Harness::new(cfg(43, 3));
    let d = h.alloc(1, 1);
    h.receive_from(1, 16, &d, &[0], MS);
    h.run_until(Nanos(5 * MS));
    assert!(h.report_of(1, 16).is_some());
    let dest = h.token_of(1, 16);
    let flooder = h.nodes[2].instance;
    for i in 0..20_000u64 {
        let now = h.now;
        let note = Notification {
            kind: NoteKind::WriteQuery,
            id: RequestId(1_000_000 + i),
            incarnation: Incarnation(0x000f_100d_0000 + i),
            nonce: Incarnation::NONE,
            sender: flooder,
            blocks: Default::default(),
        };
        h.nodes[0].core.on_transport(
            kvpoll::transport::TransportEvent::Message {
                payload: &note.encode(),
                reply: None,
            },
            now,
        );
    }
    h.execute(0);
    h.pump(0);
    let src = h.alloc(0, 1);
    h.write_named(0, 16, &[(1, dest, pairs(&src, &d))], 1, 10 * MS);
    h.settle();
    match h.report_of(0, 16) {
        Some(Report::FailedSending(r)) => assert_eq!(r.cause, Cause::LeaseLost),
        other => panic!("the write into a destination it promised to leave: {other:?}"),
    }
    h.check_end();
}

/// A destination lent to writers it did not name asks every peer it
/// knows — 65 of them — and waits for the last, paused one.
#[test]
fn an_unnamed_destination_asks_every_peer_past_64_and_waits_for_the_last() {
    let mut h = Harness::new(SimNetConfig {
        blocks: 16,
        ..cfg(44, 66)
    });
    let d = h.alloc(0, 1);
    h.lend(0, 17, &d, Kind::Receive { writers: 1 }, MS);
    h.pause(65, Nanos(30 * MS));
    h.run_until(Nanos(20 * MS));
    let asked = h.nodes[0]
        .sent
        .iter()
        .filter(|s| s.0 == NoteKind::WriteQuery && s.1 == RequestId(17))
        .map(|s| s.2)
        .collect::<std::collections::BTreeSet<_>>();
    assert_eq!(asked.len(), 65, "peers asked: {asked:?}");
    assert_eq!(
        h.report_of(0, 17),
        None,
        "released before the 65th peer answered"
    );
    h.settle();
    assert!(h.report_of(0, 17).is_some());
    h.check_end();
}

/// Removing a named writer that has not spoken keeps its destination's
/// fence: nothing is reported until its word, whose puts land first.
#[test]
fn removing_a_named_writer_keeps_its_destinations_fence_until_it_speaks() {
    a_destination_waits_for_its_stopped_writer(45, 18, 2, MS, 10 * MS, 9 * MS, |h| {
        h.remove_peer(1, 0)
    });
}

/// A read's question that overtakes its lend (the block ids and the
/// incarnation reached the reader first) is answered pending, asked again,
/// and confirmed once the lend begins.
#[test]
fn a_read_question_that_overtakes_its_lend_is_confirmed_once_the_lend_begins() {
    let mut h = Harness::new(cfg(46, 2));
    let src = h.alloc(1, 2);
    h.fill(1, &src);
    let inc = h.token();
    let l = h.alloc(0, 2);
    h.read_named(0, 19, &[(1, inc, pairs(&l, &src))], 50 * MS);
    h.run_until(Nanos(3 * MS));
    assert_eq!(h.report_of(0, 19), None);
    assert!(
        h.nodes[1].core.stats().early_notes > 0,
        "no question reached the lender first"
    );
    // It found no lend word (the lend is not there) and asked.
    assert_eq!(h.nodes[0].core.stats().word_misses, 1);
    h.lend_as(1, 19, &src, Kind::Lend { notifications: 1 }, 100 * MS, inc);
    run_ends_with_both_finished(&mut h, 0, 1, 19);
    assert_eq!(h.nodes[0].core.stats().word_confirmations, 0);
}

/// ...and a read whose lend never begins fails once the grace period ran
/// out, naming its blocks: `NotLent`, its lender never knew the lend.
#[test]
fn a_read_whose_lend_never_begins_fails_after_the_grace_period() {
    let mut h = Harness::new(cfg(47, 2));
    let src = h.alloc(1, 1);
    let l = h.alloc(0, 1);
    let inc = h.token();
    h.read_named(0, 20, &[(1, inc, pairs(&l, &src))], 500 * MS);
    h.run_until(Nanos(GRACE / 2));
    assert_eq!(
        h.report_of(0, 20),
        None,
        "refused before the grace period ended"
    );
    h.settle();
    assert_failed_recving(&h, 0, 20, Cause::NotLent, &l);
    assert!(h.now.0 >= GRACE);
    h.check_end();
}

/// Replays one whole run by its seed (from a proptest failure), printing
/// each step with `KVPOLL_SIM_TRACE=1`:
/// `KVPOLL_SIM_SEED=n KVPOLL_SIM_TRACE=1 cargo test --release --test core_sim replay_one_run -- --ignored --nocapture`.
#[test]
#[ignore = "a debugging aid: needs KVPOLL_SIM_SEED"]
fn replay_one_run() {
    let seed = std::env::var("KVPOLL_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .expect("KVPOLL_SIM_SEED=<seed of the run to replay>");
    whole_run(seed);
}

// -- lend words ------------------------------------------------------------------

/// A read whose lender's word names its lend after the data landed is
/// confirmed from the word: no question, no answer; its lender is told one
/// way and counts it (the lend is consumed, reported finished).
#[test]
fn a_read_confirmed_from_its_lend_word_tells_its_lender_one_way_and_is_counted() {
    let mut h = Harness::new(cfg(60, 2));
    let src = lend_filled(&mut h, 1, 30, 2, 1, 100 * MS);
    let l = h.alloc(0, 2);
    h.read(0, 30, &[(1, pairs(&l, &src))], 50 * MS);
    run_ends_with_both_finished(&mut h, 0, 1, 30);
    assert_eq!(h.nodes[0].core.stats().word_confirmations, 1);
    assert_eq!(h.nodes[0].core.stats().word_misses, 0);
    let one_way = h.nodes[0].actions.iter().any(|a| {
        matches!(
            a,
            Action::Send {
                want_reply: false,
                ..
            }
        )
    });
    assert!(one_way, "the reader did not tell its lender one way");
    let asked = h.nodes[0].actions.iter().any(|a| {
        matches!(
            a,
            Action::Send {
                want_reply: true,
                ..
            }
        )
    });
    assert!(!asked, "the reader asked although the word named its lend");
    let answered = h.nodes[1]
        .actions
        .iter()
        .any(|a| matches!(a, Action::Reply { .. }));
    assert!(!answered, "the lender answered a question nobody asked");
}

/// The lend's lease ends after the read's data landed and before its lend
/// word is read: the word no longer names the lend (it was overwritten
/// before the lend's end was reported, and the blocks filled again), the
/// reader asks, is refused, and fails — it never finishes with bytes the
/// lender may have reused.
#[test]
fn a_lease_that_ends_between_the_data_and_the_word_read_fails_the_read() {
    // Every operation takes 10 µs: the data lands at 10 µs, the word read
    // (posted then) reads the word at 20 µs; the lease ends at 15 µs.
    let mut h = Harness::new(SimNetConfig {
        latency: (10_000, 10_000),
        ..cfg(61, 2)
    });
    let src = lend_filled(&mut h, 1, 31, 1, 1, 15_000);
    let l = h.alloc(0, 1);
    h.read(0, 31, &[(1, pairs(&l, &src))], 50 * MS);
    h.run_until(Nanos(16_000));
    assert_eq!(h.report_of(1, 31), Some(&Report::Expired));
    assert_eq!(
        h.report_of(0, 31),
        None,
        "reported before its word was read"
    );
    // The lender's engine reuses the blocks at once.
    h.fill(1, &src);
    h.settle();
    assert_failed_recving(&h, 0, 31, Cause::LeaseLost, &l);
    assert_eq!(h.nodes[0].core.stats().word_misses, 1);
    assert_eq!(h.nodes[0].core.stats().word_confirmations, 0);
    h.check_end();
}

/// A lend of the same request id under a new incarnation takes the word the
/// ended lend had (one word: every lend has it): a reader still naming the
/// ended lend finds the new incarnation there, asks, and is refused; the
/// new lend is untouched and its own reader confirms from the word.
#[test]
fn a_lend_word_taken_by_a_new_lend_fails_a_reader_of_the_old_one() {
    let mut h = Harness::with_options(cfg(62, 2), u64::MAX, 1);
    let src = lend_filled(&mut h, 1, 32, 1, 1, MS);
    let old = h.token_of(1, 32);
    h.run_until(Nanos(2 * MS));
    assert_eq!(h.report_of(1, 32), Some(&Report::Expired));
    h.fill(1, &src);
    h.lend(1, 32, &src, Kind::Lend { notifications: 1 }, 100 * MS);
    let new = h.token_of(1, 32);
    assert_ne!(old, new);
    let l = h.alloc(0, 1);
    h.read_named(0, 32, &[(1, old, pairs(&l, &src))], 50 * MS);
    h.run_until(Nanos(10 * MS));
    assert_failed_recving(&h, 0, 32, Cause::LeaseLost, &l);
    assert_eq!(h.nodes[0].core.stats().word_misses, 1);
    assert_eq!(h.report_of(1, 32), None, "the new lend was touched");
    // The id again, now naming the new lend: confirmed from the word.
    let l2 = h.alloc(0, 1);
    h.read_named(0, 32, &[(1, new, pairs(&l2, &src))], 50 * MS);
    run_ends_with_both_finished(&mut h, 0, 1, 32);
    assert_eq!(h.nodes[0].core.stats().word_confirmations, 1);
}
