//! A deterministic, seeded simulated network of engines with real memory,
//! for driving whole [`crate::core::Core`]s in tests.
//!
//! [`SimNet`] owns every node's memory (`regions × blocks × block_size`
//! bytes) and the operations in flight, each with a due time on a simulated
//! clock. [`SimNet::node`] hands out a [`SimTransport`], a `&mut` view that
//! implements [`Transport`] for one node. Nothing happens until the driver
//! calls [`SimNet::run_until`]: due operations copy their bytes, complete
//! (with the token they were posted with) and deliver messages, in due-time
//! order (ties by post order), so a run replays exactly from its seed.
//!
//! What it models of UCX:
//! - endpoint generations: a newer [`Ep::generation`] opens a fresh
//!   connection, an older (or closed) one gets [`CANCELED`]; `flush` never
//!   connects; `close` completes everything outstanding on the connection
//!   with [`CANCELED`];
//! - late writes: an operation's bytes are copied at its *data time*, at
//!   completion or (at rate `late_write`) earlier; a close after the copy
//!   does not undo it, and a put already in the wire (data time after the
//!   close) still lands at its data time (at rate `late_write`);
//! - faults: transfer errors, setup failures (`post` fails with
//!   `posted < n`), a node *paused* (operations it serves do not complete
//!   and flushes to it wait, unless `shm`; the driver stops feeding its
//!   core), a node *killed* (operations to it fail with
//!   [`ENDPOINT_TIMEOUT`], each peer with a connection open to it sees
//!   `EndpointFailed` for that generation; messages to it are lost).
//!
//! Every byte copy is logged ([`SimNet::writes`]) with its time, so a test
//! can check that nothing lands in a block after its request was reported.

use std::collections::{BTreeMap, HashMap, VecDeque};

use crate::ledger::{BlockId, Incarnation, Nanos, PeerId};
use crate::transport::peer::PeerMetadata;
use crate::transport::sim::Rng;
use crate::transport::{
    lend_word_of, Direction, Ep, LendWords, PostFailure, Transport, TransportEvent, CANCELED,
    ENDPOINT_TIMEOUT, IO_ERROR, UNREACHABLE, UNSUPPORTED,
};

/// Shape and fault rates of a simulated network. Rates are per million.
#[derive(Debug, Clone, Copy)]
pub struct SimNetConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// Nodes (engines).
    pub nodes: usize,
    /// Registered regions per node.
    pub regions: usize,
    /// Blocks per region.
    pub blocks: u64,
    /// Bytes per block.
    pub block_size: usize,
    /// Latency of an operation or message, ns, uniform in `min..=max`.
    pub latency: (u64, u64),
    /// A data operation completes with `IO_ERROR`.
    pub transfer_error: u32,
    /// A `post` fails part-way (often before any operation).
    pub setup_failure: u32,
    /// A data copy happens before completion; a put in the wire at a close
    /// still lands.
    pub late_write: u32,
    /// One-sided operations complete even when their target is paused.
    pub shm: bool,
}

impl Default for SimNetConfig {
    fn default() -> Self {
        SimNetConfig {
            seed: 1,
            nodes: 2,
            regions: 2,
            blocks: 64,
            block_size: 64,
            latency: (1_000, 20_000),
            transfer_error: 0,
            setup_failure: 0,
            late_write: 0,
            shm: false,
        }
    }
}

/// One byte copy into a node's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write {
    /// When.
    pub at: Nanos,
    /// The node written into.
    pub node: usize,
    /// Region and block written.
    pub region: usize,
    /// Block written.
    pub block: BlockId,
    /// The node that posted the operation, and its token.
    pub by: usize,
    /// Token of the operation.
    pub token: u64,
    /// Whether the operation had already completed (cancelled) when the
    /// bytes landed.
    pub after_completion: bool,
}

#[derive(Debug, Clone)]
enum OpKind {
    Data {
        dir: Direction,
        local: BlockId,
        remote: BlockId,
        region: usize,
    },
    Flush,
    Send(Vec<u8>, bool),
    /// A lend word read: the target's word `.0`, read when it completes.
    Word(usize),
}

#[derive(Debug, Clone)]
struct Op {
    owner: usize,
    target: usize,
    peer: PeerId,
    generation: u32,
    token: u64,
    kind: OpKind,
    /// When the bytes are copied (`None`: already, or never).
    data_at: Option<Nanos>,
    done_at: Nanos,
    status: i8,
    /// Completed (the owner was told); only a late copy remains.
    completed: bool,
}

impl Op {
    /// A new operation of `owner` on `target` over endpoint `ep`; its
    /// timing is drawn when it is pushed.
    fn new(owner: usize, target: usize, ep: Ep, token: u64, kind: OpKind) -> Op {
        Op {
            owner,
            target,
            peer: ep.peer,
            generation: ep.generation,
            token,
            kind,
            data_at: None,
            done_at: Nanos(0),
            status: 0,
            completed: false,
        }
    }
}

#[derive(Debug, Clone)]
enum Ev {
    Completion {
        token: u64,
        status: i8,
    },
    Message {
        bytes: Vec<u8>,
        /// The sending node, when it asked for answers.
        reply: Option<u32>,
    },
    EndpointFailed {
        ep: Ep,
        status: i8,
    },
    Word {
        token: u64,
        status: i8,
        word: u64,
    },
}

#[derive(Debug, Clone, Copy)]
struct Conn {
    generation: u32,
    open: bool,
    failed: bool,
}

#[derive(Debug, Default)]
struct Node {
    dead: bool,
    paused: bool,
    peers: HashMap<PeerId, usize>,
    conns: HashMap<PeerId, Conn>,
    events: VecDeque<Ev>,
    posted: u64,
    /// Releases still to fail (each failure is retried by the core).
    fail_releases: u32,
    /// Its lend words, once its driver asked for them.
    words: Option<LendWords>,
}

/// The simulated network. See the module docs.
pub struct SimNet {
    cfg: SimNetConfig,
    rng: Rng,
    now: Nanos,
    mem: Vec<Vec<u8>>,
    nodes: Vec<Node>,
    ops: BTreeMap<u64, Op>,
    next_op: u64,
    writes: Vec<Write>,
}

impl SimNet {
    /// A network of `cfg.nodes` nodes with zeroed memory at time 0.
    pub fn new(cfg: SimNetConfig) -> Self {
        let bytes = cfg.regions * cfg.blocks as usize * cfg.block_size;
        SimNet {
            cfg,
            rng: Rng::new(cfg.seed),
            now: Nanos(0),
            mem: vec![vec![0; bytes]; cfg.nodes],
            nodes: (0..cfg.nodes).map(|_| Node::default()).collect(),
            ops: BTreeMap::new(),
            next_op: 0,
            writes: Vec::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SimNetConfig {
        &self.cfg
    }

    /// The simulated clock.
    pub fn now(&self) -> Nanos {
        self.now
    }

    /// Node `node`'s transport.
    pub fn node(&mut self, node: usize) -> SimTransport<'_> {
        SimTransport { net: self, node }
    }

    /// Node `node`'s lend words (`len` of them, a power of two), made on
    /// the first call and kept until the node is revived: give them to its
    /// core ([`crate::core::Core::with_lend_words`]) and its readers
    /// confirm by reading them. Small tables make lends collide.
    pub fn lend_words(&mut self, node: usize, len: usize) -> LendWords {
        self.nodes[node]
            .words
            .get_or_insert_with(|| LendWords::heap(len))
            .clone()
    }

    /// Routes `node`'s peer id `peer` to node `to` (what `add_peer` would
    /// learn from metadata).
    pub fn add_peer_node(&mut self, node: usize, peer: PeerId, to: usize) {
        self.nodes[node].peers.insert(peer, to);
    }

    /// One block of one region of `node`'s memory.
    pub fn block(&self, node: usize, region: usize, block: BlockId) -> &[u8] {
        let at = self.offset(region, block);
        &self.mem[node][at..at + self.cfg.block_size]
    }

    /// Mutable [`SimNet::block`] (the test fills sources; not logged).
    pub fn block_mut(&mut self, node: usize, region: usize, block: BlockId) -> &mut [u8] {
        let at = self.offset(region, block);
        let bs = self.cfg.block_size;
        &mut self.mem[node][at..at + bs]
    }

    fn offset(&self, region: usize, block: BlockId) -> usize {
        (region * self.cfg.blocks as usize + block.0 as usize) * self.cfg.block_size
    }

    /// Every byte copy so far, in time order.
    pub fn writes(&self) -> &[Write] {
        &self.writes
    }

    /// Pauses a node: see the module docs. The driver must also stop
    /// feeding its core.
    pub fn pause(&mut self, node: usize) {
        self.nodes[node].paused = true;
    }

    /// Resumes a paused node.
    pub fn resume(&mut self, node: usize) {
        self.nodes[node].paused = false;
    }

    /// Whether the node is paused.
    pub fn paused(&self, node: usize) -> bool {
        self.nodes[node].paused
    }

    /// Whether the node was killed.
    pub fn dead(&self, node: usize) -> bool {
        self.nodes[node].dead
    }

    /// The next `n` releases of `node`'s handles fail (each is retried).
    pub fn fail_releases(&mut self, node: usize, n: u32) {
        self.nodes[node].fail_releases = n;
    }

    /// Kills a node: its own operations vanish, operations to it fail with
    /// `ENDPOINT_TIMEOUT`, every node with a connection open to it sees
    /// `EndpointFailed` for that generation, messages to it are lost.
    pub fn kill(&mut self, node: usize) {
        self.nodes[node].dead = true;
        self.nodes[node].events.clear();
        self.ops.retain(|_, op| op.owner != node);
        let now = self.now;
        let lat = self.cfg.latency.0.max(1);
        for op in self.ops.values_mut() {
            if op.target == node && !op.completed {
                op.status = ENDPOINT_TIMEOUT;
                op.done_at = op.done_at.min(Nanos(now.0 + lat));
                // Bytes to or from a dead node never move.
                op.data_at = None;
            }
        }
        for n in 0..self.nodes.len() {
            if n == node || self.nodes[n].dead {
                continue;
            }
            let peers: Vec<PeerId> = self.nodes[n]
                .peers
                .iter()
                .filter(|&(_, &to)| to == node)
                .map(|(&p, _)| p)
                .collect();
            for peer in peers {
                self.fail_conn(n, peer);
            }
        }
    }

    /// Brings a killed node back with its memory kept and no connection
    /// (its driver gives it a fresh core).
    pub fn revive(&mut self, node: usize) {
        self.nodes[node] = Node::default();
    }

    fn fail_conn(&mut self, node: usize, peer: PeerId) {
        if let Some(c) = self.nodes[node].conns.get_mut(&peer) {
            if c.open && !c.failed {
                c.failed = true;
                let ep = Ep {
                    peer,
                    generation: c.generation,
                };
                self.nodes[node].events.push_back(Ev::EndpointFailed {
                    ep,
                    status: ENDPOINT_TIMEOUT,
                });
            }
        }
    }

    /// When something is next due in the network (`None`: nothing left).
    pub fn next_due(&self) -> Option<Nanos> {
        self.ops
            .iter()
            .filter(|(_, op)| self.ready(op))
            .filter_map(|(&id, op)| {
                // A flush waiting on earlier operations is due when they are.
                let done = (!op.completed && self.flush_clear(id, op)).then_some(op.done_at);
                match (done, op.data_at) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                }
            })
            .min()
    }

    /// Whether `op` can make progress (its target serves it).
    fn ready(&self, op: &Op) -> bool {
        let t = &self.nodes[op.target];
        match op.kind {
            OpKind::Send(..) => true,
            _ => op.status != 0 || t.dead || !t.paused || self.cfg.shm,
        }
    }

    /// Whether anything is still in the network: operations not yet
    /// completed, bytes not yet landed.
    pub fn busy(&self) -> bool {
        !self.ops.is_empty()
    }

    /// Operations of `node` whose token satisfies `pred` and whose
    /// completion its core has not been handed yet (still in the network,
    /// or queued for `drain`).
    pub fn outstanding(&self, node: usize, pred: impl Fn(u64) -> bool) -> usize {
        let in_net = self
            .ops
            .values()
            .filter(|op| op.owner == node && !op.completed && pred(op.token))
            .count();
        let queued = self.nodes[node]
            .events
            .iter()
            .filter(|e| {
                matches!(e, Ev::Completion { token, .. } | Ev::Word { token, .. } if pred(*token))
            })
            .count();
        in_net + queued
    }

    /// Events queued for `node`'s driver.
    pub fn pending_events(&self, node: usize) -> usize {
        self.nodes[node].events.len()
    }

    /// Runs everything due at or before `t`, in order; the clock is then `t`.
    pub fn run_until(&mut self, t: Nanos) {
        loop {
            let mut best: Option<(Nanos, u64, bool)> = None; // (time, id, is_data)
            for (&id, op) in &self.ops {
                if !self.ready(op) {
                    continue;
                }
                if let Some(d) = op.data_at {
                    if d <= t && best.is_none_or(|b| (d, id) < (b.0, b.1)) {
                        best = Some((d, id, true));
                    }
                }
                if !op.completed
                    && op.done_at <= t
                    && best.is_none_or(|b| (op.done_at, id) < (b.0, b.1))
                    && self.flush_clear(id, op)
                {
                    best = Some((op.done_at, id, false));
                }
            }
            let Some((at, id, data)) = best else { break };
            self.now = self.now.max(at);
            if data {
                self.copy(id);
            } else {
                self.complete(id);
            }
        }
        self.now = self.now.max(t);
    }

    /// A flush completes only after every earlier operation on its
    /// connection did.
    fn flush_clear(&self, id: u64, op: &Op) -> bool {
        if !matches!(op.kind, OpKind::Flush) || op.status != 0 {
            return true;
        }
        !self.ops.range(..id).any(|(_, o)| {
            o.owner == op.owner
                && o.peer == op.peer
                && o.generation == op.generation
                && !matches!(o.kind, OpKind::Send(..))
                && (!o.completed || o.data_at.is_some())
        })
    }

    fn copy(&mut self, id: u64) {
        let op = self.ops.get_mut(&id).expect("op");
        op.data_at = None;
        let (owner, target, token, completed) = (op.owner, op.target, op.token, op.completed);
        let OpKind::Data {
            dir,
            local,
            remote,
            region,
        } = op.kind
        else {
            return;
        };
        if completed {
            // Only the late copy was left.
            self.ops.remove(&id);
        }
        let bs = self.cfg.block_size;
        let (src, sb, dst, db) = match dir {
            Direction::Get => (target, remote, owner, local),
            Direction::Put => (owner, local, target, remote),
        };
        let so = self.offset(region, sb);
        let dof = self.offset(region, db);
        let bytes = self.mem[src][so..so + bs].to_vec();
        self.mem[dst][dof..dof + bs].copy_from_slice(&bytes);
        self.writes.push(Write {
            at: self.now,
            node: dst,
            region,
            block: db,
            by: owner,
            token,
            after_completion: completed,
        });
    }

    fn complete(&mut self, id: u64) {
        if self.ops[&id].status == 0 && self.ops[&id].data_at.is_some() {
            // Success: the bytes land now if they have not yet.
            self.copy(id);
        }
        let op = self.ops.get_mut(&id).expect("op");
        op.completed = true;
        let op = op.clone();
        if op.data_at.is_none() {
            self.ops.remove(&id);
        }
        if let OpKind::Word(i) = op.kind {
            let words = self.nodes[op.target].words.as_ref();
            let (status, word) = match words {
                _ if op.status != 0 => (op.status, 0),
                Some(w) if i < w.len() => (0, w.get(i)),
                _ => (UNSUPPORTED, 0),
            };
            if !self.nodes[op.owner].dead {
                self.nodes[op.owner].events.push_back(Ev::Word {
                    token: op.token,
                    status,
                    word,
                });
            }
            return;
        }
        if let OpKind::Send(bytes, wants_reply) = op.kind {
            if op.status == 0 && !self.nodes[op.target].dead {
                let reply = wants_reply.then_some(op.owner as u32);
                self.nodes[op.target]
                    .events
                    .push_back(Ev::Message { bytes, reply });
            }
        }
        if !self.nodes[op.owner].dead {
            self.nodes[op.owner].events.push_back(Ev::Completion {
                token: op.token,
                status: op.status,
            });
        }
    }

    fn latency(&mut self) -> u64 {
        let (lo, hi) = self.cfg.latency;
        lo.max(1) + self.rng.below(hi.saturating_sub(lo) + 1)
    }

    fn push_op(&mut self, mut op: Op) {
        let lat = self.latency();
        op.done_at = Nanos(self.now.0 + lat);
        if let OpKind::Data { .. } = op.kind {
            op.data_at = Some(if self.rng.chance(self.cfg.late_write) {
                Nanos(self.now.0 + self.rng.below(lat))
            } else {
                op.done_at
            });
            if op.status == 0 && self.rng.chance(self.cfg.transfer_error) {
                op.status = IO_ERROR;
                op.data_at = None;
            }
        }
        if self.nodes[op.target].dead {
            op.status = ENDPOINT_TIMEOUT;
            op.data_at = None;
        }
        self.nodes[op.owner].posted += 1;
        self.ops.insert(self.next_op, op);
        self.next_op += 1;
    }

    /// The connection of `node` to `ep`'s peer for an operation; `connect`:
    /// a newer generation opens a fresh one.
    fn conn(&mut self, node: usize, ep: Ep, connect: bool) -> Result<usize, i8> {
        let Some(&target) = self.nodes[node].peers.get(&ep.peer) else {
            return Err(UNREACHABLE);
        };
        let n = &mut self.nodes[node];
        match n.conns.get(&ep.peer).copied() {
            Some(c) if c.generation == ep.generation && c.open => {}
            Some(c) if c.generation >= ep.generation => return Err(CANCELED),
            _ if !connect => return Err(CANCELED),
            _ => {
                n.conns.insert(
                    ep.peer,
                    Conn {
                        generation: ep.generation,
                        open: true,
                        failed: false,
                    },
                );
                if self.nodes[target].dead {
                    self.fail_conn(node, ep.peer);
                }
            }
        }
        Ok(target)
    }

    fn close_conn(&mut self, node: usize, ep: Ep) {
        let Some(c) = self.nodes[node].conns.get_mut(&ep.peer) else {
            return;
        };
        if c.generation != ep.generation || !c.open {
            return;
        }
        c.open = false;
        let now = self.now;
        let lat = self.cfg.latency.0.max(1);
        let late = self.cfg.late_write;
        let ids: Vec<u64> = self
            .ops
            .iter()
            .filter(|(_, o)| {
                o.owner == node
                    && o.peer == ep.peer
                    && o.generation == ep.generation
                    && !o.completed
            })
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let keep_late = self.rng.chance(late);
            let op = self.ops.get_mut(&id).expect("op");
            if op.status == 0 {
                op.status = CANCELED;
            }
            op.done_at = op.done_at.min(Nanos(now.0 + lat));
            if let (OpKind::Data { dir, .. }, Some(_)) = (&op.kind, op.data_at) {
                // A get's bytes never arrive once its connection is gone; a
                // put already in the wire may still land.
                if *dir == Direction::Get || !keep_late {
                    op.data_at = None;
                }
            }
        }
    }
}

/// One node's view of the network: its [`Transport`].
pub struct SimTransport<'a> {
    net: &'a mut SimNet,
    node: usize,
}

impl Transport for SimTransport<'_> {
    /// Routing comes from [`SimNet::add_peer_node`]; metadata is ignored.
    fn add_peer(&mut self, _peer: PeerId, _meta: &PeerMetadata) -> Result<(), i8> {
        Ok(())
    }

    fn forget_peer(&mut self, peer: PeerId, _drain: bool) {
        if let Some(c) = self.net.nodes[self.node].conns.get(&peer).copied() {
            self.net.close_conn(
                self.node,
                Ep {
                    peer,
                    generation: c.generation,
                },
            );
        }
        self.net.nodes[self.node].peers.remove(&peer);
    }

    fn post(
        &mut self,
        ep: Ep,
        dir: Direction,
        pairs: &[(BlockId, BlockId)],
        token: u64,
    ) -> Result<u32, PostFailure> {
        let node = self.node;
        let target = self
            .net
            .conn(node, ep, true)
            .map_err(|status| PostFailure { posted: 0, status })?;
        let regions = self.net.cfg.regions;
        let n = (pairs.len() * regions) as u32;
        let fail_at = if self.net.rng.chance(self.net.cfg.setup_failure) {
            Some(if self.net.rng.below(2) == 0 {
                0
            } else {
                self.net.rng.below(u64::from(n)) as u32
            })
        } else {
            None
        };
        let mut posted = 0;
        for &(local, remote) in pairs {
            for region in 0..regions {
                if Some(posted) == fail_at {
                    return Err(PostFailure {
                        posted,
                        status: UNREACHABLE,
                    });
                }
                self.net.push_op(Op::new(
                    node,
                    target,
                    ep,
                    token,
                    OpKind::Data {
                        dir,
                        local,
                        remote,
                        region,
                    },
                ));
                posted += 1;
            }
        }
        Ok(posted)
    }

    fn flush(&mut self, ep: Ep, token: u64) -> Result<(), i8> {
        let node = self.node;
        let target = self.net.conn(node, ep, false)?;
        self.net
            .push_op(Op::new(node, target, ep, token, OpKind::Flush));
        Ok(())
    }

    fn send(&mut self, ep: Ep, payload: &[u8], token: u64, want_reply: bool) -> Result<(), i8> {
        let node = self.node;
        let target = self.net.conn(node, ep, true)?;
        self.net.push_op(Op::new(
            node,
            target,
            ep,
            token,
            OpKind::Send(payload.to_vec(), want_reply),
        ));
        Ok(())
    }

    fn reply(&mut self, to: u32, payload: &[u8], token: u64) -> Result<(), i8> {
        let target = to as usize;
        if target >= self.net.nodes.len() || self.net.nodes[target].dead {
            return Err(crate::transport::ENDPOINT_TIMEOUT);
        }
        // Answers travel on the sender's own connection, which no close of
        // ours names: an endpoint id no peer has.
        let nobody = Ep {
            peer: PeerId(u32::MAX),
            generation: u32::MAX,
        };
        let kind = OpKind::Send(payload.to_vec(), false);
        self.net
            .push_op(Op::new(self.node, target, nobody, token, kind));
        Ok(())
    }

    fn read_word(&mut self, ep: Ep, inc: Incarnation, token: u64) -> Result<(), i8> {
        let node = self.node;
        let target = self.net.conn(node, ep, true)?;
        let len = self.net.nodes[target].words.as_ref().map_or(0, |w| w.len());
        let i = lend_word_of(inc, len).ok_or(UNSUPPORTED)?;
        self.net
            .push_op(Op::new(node, target, ep, token, OpKind::Word(i)));
        Ok(())
    }

    fn lend_words(&self) -> Option<LendWords> {
        self.net.nodes[self.node].words.clone()
    }

    fn close(&mut self, ep: Ep) {
        self.net.close_conn(self.node, ep);
    }

    fn progress(&mut self) -> u32 {
        // The driver moves the clock ([`SimNet::run_until`]); a paused node
        // does nothing of its own.
        0
    }

    fn drain(&mut self, sink: &mut dyn FnMut(TransportEvent<'_>)) {
        while let Some(ev) = self.net.nodes[self.node].events.pop_front() {
            match ev {
                Ev::Completion { token, status } => {
                    sink(TransportEvent::Completion { token, status })
                }
                Ev::Message { bytes, reply } => sink(TransportEvent::Message {
                    payload: &bytes,
                    reply,
                }),
                Ev::EndpointFailed { ep, status } => {
                    sink(TransportEvent::EndpointFailed { ep, status })
                }
                Ev::Word {
                    token,
                    status,
                    word,
                } => sink(TransportEvent::Word {
                    token,
                    status,
                    word,
                }),
            }
        }
    }

    fn release(&mut self, _handle: crate::ledger::HandleKey) -> bool {
        let n = &mut self.net.nodes[self.node];
        if n.fail_releases > 0 {
            n.fail_releases -= 1;
            return false;
        }
        true
    }

    fn closing(&self) -> bool {
        // A close completes once no byte of it is still in the wire.
        self.net
            .ops
            .values()
            .any(|op| op.owner == self.node && op.completed)
    }
}
