//! The poller: the thread that drives the protocol [`Core`] over the UCX
//! [`Transport`]. It decides nothing itself:
//!
//! drain control messages and commands (feeding the core) → progress the
//! transport → feed its completions, notifications and endpoint failures to
//! the core → advance the core's clock when something is due → execute the
//! core's actions on the transport → publish the core's events.
//!
//! Every iteration knows whether it did work; busy and idle iterations are
//! counted, and so is the time spent in busy and idle runs (the clock is
//! read when a run switches, not per iteration). An idle adaptive poller
//! blocks on the transport's event fd and the engine's eventfd (see
//! [`crate::wake`]) until an event, a submit or the core's next deadline.
//! A panic on this thread is caught: every request still tracked is
//! reported failed (`PollerDied`) and every later engine call says so.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::wake::Wake;

use crate::core::{Command, Core, CoreConfig};
use crate::error::EngineError;
use crate::ledger::{Cause, Event, Ledger, Nanos, PeerId, RequestKey};
use crate::metadata::PeerMetadata;
use crate::placement::IdlePolicy;
use crate::ring::{CommandReceiver, EventPublisher};
use crate::transport::ucx::{ContextOptions, UcxTransport};
use crate::transport::Transport;

#[cfg(feature = "fault-injection")]
type Wire = crate::transport::faulty::Faulty<UcxTransport>;
#[cfg(not(feature = "fault-injection"))]
type Wire = UcxTransport;

/// What the engine thread and the poller share besides the rings.
pub(crate) struct Shared {
    /// How the engine wakes a blocked poller (see [`crate::wake`]).
    pub(crate) wake: Wake,
    /// How the poller (and an [`crate::EngineWaker`]) wakes an engine thread
    /// blocked in [`crate::Engine::wait`]: the same protocol, roles swapped,
    /// with the event ring as the ring.
    pub(crate) reports: Wake,
    pub(crate) stop: AtomicBool,
    /// Set by the engine after it sent a control message: the poller looks
    /// at the control channel only then (a channel `try_recv` on every
    /// iteration cost more than the rest of an idle iteration).
    pub(crate) control_pending: AtomicBool,
    /// Set once the poller thread died (panicked): every engine call then
    /// fails with `PollerDied`.
    pub(crate) dead: AtomicBool,
    pub(crate) busy_iterations: AtomicU64,
    pub(crate) idle_iterations: AtomicU64,
    /// Nanoseconds spent in busy and in idle runs (blocked time is idle).
    pub(crate) busy_ns: AtomicU64,
    pub(crate) idle_ns: AtomicU64,
    pub(crate) malformed_notes: AtomicU64,
    pub(crate) rejected_notes: AtomicU64,
    pub(crate) ops_posted: AtomicU64,
    pub(crate) ops_completed: AtomicU64,
    pub(crate) bytes_moved: AtomicU64,
    pub(crate) notes_sent: AtomicU64,
    pub(crate) note_messages: AtomicU64,
    pub(crate) events_overflowed: AtomicU64,
    pub(crate) quarantined: AtomicU64,
    /// Peers lost since the engine last looked (rare: a lock is fine), and
    /// whether there are any (one relaxed load per poll when none).
    pub(crate) lost_peers: std::sync::Mutex<Vec<(crate::ledger::PeerId, crate::ledger::Reason)>>,
    pub(crate) lost_pending: AtomicBool,
    /// The CPU the poller was pinned to and verified on; `u64::MAX` if none.
    pub(crate) pinned_core: AtomicU64,
    pub(crate) epoch: Instant,
    /// The poller thread's kernel thread id (0 until it runs), so that its
    /// CPU time can be read from /proc.
    pub(crate) tid: AtomicI32,
}

impl Shared {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Shared {
            wake: Wake::new()?,
            reports: Wake::new()?,
            stop: AtomicBool::new(false),
            control_pending: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            busy_iterations: AtomicU64::new(0),
            idle_iterations: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
            idle_ns: AtomicU64::new(0),
            malformed_notes: AtomicU64::new(0),
            rejected_notes: AtomicU64::new(0),
            ops_posted: AtomicU64::new(0),
            ops_completed: AtomicU64::new(0),
            bytes_moved: AtomicU64::new(0),
            notes_sent: AtomicU64::new(0),
            note_messages: AtomicU64::new(0),
            events_overflowed: AtomicU64::new(0),
            quarantined: AtomicU64::new(0),
            lost_peers: std::sync::Mutex::new(Vec::new()),
            lost_pending: AtomicBool::new(false),
            pinned_core: AtomicU64::new(u64::MAX),
            epoch: Instant::now(),
            tid: AtomicI32::new(0),
        })
    }
}

pub(crate) struct Config {
    pub(crate) block_size: u64,
    pub(crate) core: Option<usize>,
    pub(crate) idle: IdlePolicy,
    pub(crate) ucx: ContextOptions,
    pub(crate) instance: u64,
    pub(crate) confirm_reads: bool,
    pub(crate) fence_push_leases: bool,
    pub(crate) read_heartbeat: Duration,
    pub(crate) lend_grace: Duration,
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: crate::transport::faulty::Faults,
}

type Reply<T> = mpsc::Sender<Result<T, EngineError>>;

/// Rare requests from the engine thread, answered on a reply channel.
pub(crate) enum Control {
    Register {
        blocks: u64,
        len: usize,
        /// Caller memory to map (its address), or `None` to let UCX allocate.
        user: Option<usize>,
        reply: Reply<(usize, usize)>,
    },
    Metadata {
        reply: Reply<Vec<u8>>,
    },
    AddPeer {
        meta: PeerMetadata,
        reply: Reply<PeerId>,
    },
    RemovePeer {
        peer: PeerId,
        reply: Reply<()>,
    },
    Shutdown,
}

/// The poller's ends of what connects it to the engine thread.
pub(crate) struct Channels {
    pub(crate) commands: CommandReceiver<Command>,
    pub(crate) retire: CommandReceiver<RequestKey>,
    pub(crate) events: EventPublisher<Event>,
    pub(crate) control: mpsc::Receiver<Control>,
    pub(crate) shared: Arc<Shared>,
}

struct Poller {
    cfg: Config,
    core: Core,
    wire: Wire,
    commands: CommandReceiver<Command>,
    retire: CommandReceiver<RequestKey>,
    events: EventPublisher<Event>,
    control: mpsc::Receiver<Control>,
    shared: Arc<Shared>,
    /// The last wait returned with the engine's eventfd readable; it is
    /// drained before the next announcement.
    efd_signalled: bool,
    /// What to do about a worker that refuses to arm.
    refusals: Refusals,
}

/// The poller thread's body.
pub(crate) fn run(
    cfg: Config,
    ledger: Ledger,
    channels: Channels,
    ready: mpsc::Sender<Result<(), EngineError>>,
) {
    let mut poller = match Poller::new(cfg, ledger, channels) {
        Ok(p) => p,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    if catch_unwind(AssertUnwindSafe(|| poller.run())).is_err() {
        // Make the death visible first (no call is accepted from now on),
        // then report what is still tracked (once: the ledger's state CAS
        // decides), whatever state the panic left.
        poller.shared.dead.store(true, Ordering::Release);
        let _ = catch_unwind(AssertUnwindSafe(|| poller.die()));
    }
}

impl Poller {
    fn new(cfg: Config, ledger: Ledger, channels: Channels) -> Result<Self, EngineError> {
        let Channels {
            commands,
            retire,
            events,
            control,
            shared,
        } = channels;
        if let Some(core) = cfg.core {
            let outcome = crate::placement::pin_current_thread(core, cfg.idle)?;
            if outcome.warning.is_none() {
                shared.pinned_core.store(core as u64, Ordering::Release);
            }
        }
        let ucx = UcxTransport::new(&cfg.ucx, cfg.block_size)?;
        #[cfg(feature = "fault-injection")]
        let wire = crate::transport::faulty::Faulty::new(ucx, cfg.faults);
        #[cfg(not(feature = "fault-injection"))]
        let wire = ucx;
        let core = Core::new(
            CoreConfig {
                instance: cfg.instance,
                release_retry: Nanos(release_retry(&cfg).as_nanos() as u64),
                confirm_reads: cfg.confirm_reads,
                fence_push_leases: cfg.fence_push_leases,
                heartbeat: Nanos(cfg.read_heartbeat.as_nanos().min(u128::from(u64::MAX)) as u64),
                lend_grace: Nanos(cfg.lend_grace.as_nanos().min(u128::from(u64::MAX)) as u64),
            },
            ledger,
        )
        .with_lend_words(wire.lend_words());
        Ok(Self {
            cfg,
            core,
            wire,
            commands,
            retire,
            events,
            control,
            shared,
            efd_signalled: false,
            refusals: Refusals::default(),
        })
    }

    fn now(&self) -> Nanos {
        Nanos(self.shared.epoch.elapsed().as_nanos() as u64)
    }

    fn run(&mut self) {
        let mut idle_streak = 0u32;
        let mut counts = Counters::new(self.now());
        let mut idle_since = counts.run_start;
        let mut iteration = 0u64;
        loop {
            iteration += 1;
            // The clock as this iteration read it, if it did: read once
            // when commands or transport events arrive, and reused for the
            // deadline check and the busy/idle accounting below.
            let mut now = None;
            let mut work = self.drain_control();
            work += self.drain_retired();
            let commands = self.drain_commands(&mut now);
            if commands > 0 {
                // What the commands settled alone (a prefix hit, a refused
                // or aborted request) goes to the engine now, not after a
                // progress that is cold after a quiet spell (2 to 3 us of a
                // ~10 us wake-up path here, measured with timestamps).
                work += self.publish() as u32;
            }
            work += commands;
            // Checked after the commands were drained: a request submitted
            // before shutdown is begun, then cancelled and reported.
            if self.shared.stop.load(Ordering::Acquire) {
                break;
            }
            work += self.wire.progress();
            // The commands again (an emptiness check when none came), then
            // what progress saw: a peer's message that answers something
            // the engine submitted (a read of a lend it announced, say) was
            // sent after the submit, so that command is in the ring by the
            // time progress has the message. Without this second look, a
            // poller descheduled between the first drain and progress took
            // the question first and refused a read of a lend still
            // waiting in its ring.
            work += self.drain_commands(&mut now);
            work += self.drain_transport(&mut now);
            // Deadlines: on an iteration that read the clock anyway, always;
            // otherwise (an idle spin) only every 16th iteration, and only
            // when something can be due (a deadline is seen a few
            // microseconds late at most; block() reads it anyway).
            if let Some(due) = self.core.next_deadline() {
                let t = match now {
                    Some(t) => Some(t),
                    None if iteration % 16 == 0 => Some(self.now()),
                    None => None,
                };
                if let Some(t) = t.filter(|&t| due <= t) {
                    self.core.advance(t);
                    self.execute(t);
                }
            }
            work += self.publish() as u32;
            let busy = work > 0;
            if busy != counts.busy_run {
                // A run switched: it started when this iteration found its
                // work (the clock it read then) or, for an idle run, now.
                let t = match now {
                    Some(t) if busy => t,
                    _ => self.now(),
                };
                counts.switch(t);
                // (The counters' run start moves at each publication; the
                // await phase counts from the last work.)
                idle_since = t;
            }
            if busy {
                counts.busy += 1;
                idle_streak = 0;
                self.refusals.work();
            } else {
                counts.idle += 1;
                idle_streak = idle_streak.saturating_add(1);
                if self.idle_wait(idle_streak, idle_since) {
                    // About to block: the counters must not wait for it.
                    self.publish_counters(&mut counts);
                    self.block();
                }
            }
            if iteration % 1024 == 0 {
                self.publish_counters(&mut counts);
            }
        }
        self.publish_counters(&mut counts);
        self.shutdown();
    }

    fn publish_counters(&self, c: &mut Counters) {
        c.close_run(self.now());
        // Relaxed: monotonic metrics, read for display only.
        let s = &self.shared;
        s.busy_iterations
            .fetch_add(std::mem::take(&mut c.busy), Ordering::Relaxed);
        s.idle_iterations
            .fetch_add(std::mem::take(&mut c.idle), Ordering::Relaxed);
        s.busy_ns
            .fetch_add(std::mem::take(&mut c.busy_ns), Ordering::Relaxed);
        s.idle_ns
            .fetch_add(std::mem::take(&mut c.idle_ns), Ordering::Relaxed);
        let stats = self.core.stats();
        s.malformed_notes
            .store(stats.malformed_notifications, Ordering::Relaxed);
        s.rejected_notes
            .store(stats.rejected_notifications, Ordering::Relaxed);
        self.shared
            .ops_posted
            .store(stats.ops_posted, Ordering::Relaxed);
        self.shared
            .ops_completed
            .store(stats.ops_completed, Ordering::Relaxed);
        s.notes_sent
            .store(stats.notifications_sent, Ordering::Relaxed);
        s.note_messages
            .store(stats.notification_messages, Ordering::Relaxed);
        self.shared.bytes_moved.store(
            stats.blocks_moved.saturating_mul(self.cfg.block_size),
            Ordering::Relaxed,
        );
        s.events_overflowed
            .store(self.events.overflowed(), Ordering::Relaxed);
        s.quarantined
            .store(stats.quarantined_now, Ordering::Relaxed);
    }

    /// The idle phases of the adaptive policy: spin, yield the core a few
    /// times, then (returns `true`) block. The busy policy only spins.
    ///
    /// Both phases are short on purpose (see [`SPIN`]).
    fn idle_wait(&self, streak: u32, idle_since: Nanos) -> bool {
        if self.cfg.idle == IdlePolicy::Busy {
            std::hint::spin_loop();
            return false;
        }
        match streak {
            // The first idle iteration after work yields once: the engine
            // thread waiting on what was just published may share this CPU
            // (one syscall per busy -> idle switch, none while busy).
            1 => std::thread::yield_now(),
            0..=SPIN => std::hint::spin_loop(),
            YIELD_FROM..=YIELD_TO => std::thread::yield_now(),
            _ if self.awaiting(idle_since) => std::thread::yield_now(),
            _ => return true,
        }
        false
    }

    /// Whether to keep yielding rather than block: requests are in flight
    /// (the core has a deadline) and the poller went idle less than
    /// [`AWAIT`] ago. An answer a peer sends within that time (a read's
    /// confirmation, a write's acknowledgement) is then picked up by
    /// progress instead of waking this thread through UCX's async thread
    /// and the worker's event fd (two thread wake-ups, ~100 µs here).
    fn awaiting(&self, idle_since: Nanos) -> bool {
        self.core.next_deadline().is_some()
            && self.now().0.saturating_sub(idle_since.0) < AWAIT.as_nanos() as u64
    }

    /// Blocks until the transport has an event, the engine pushed
    /// something, or the core's next deadline; see [`crate::wake`].
    fn block(&mut self) {
        let wake = &self.shared.wake;
        // The eventfd signal of the last wake-up is consumed here, before
        // announcing, not on waking: a wake-up then costs no syscall on its
        // way to the work (a signal written after the announcement below
        // stays, so none is lost; one left from before can only make the
        // next wait return at once, as before).
        if std::mem::take(&mut self.efd_signalled) {
            wake.efd.drain();
        }
        // Announce. `false`: the engine pushed since we last looked (its
        // push is visible now): go round again.
        if !wake.state.prepare_park() {
            return;
        }
        // Re-check after announcing. Commands, control messages and the
        // stop flag are each followed by a notify, which the announcement
        // already caught or which will signal the eventfd; these loads
        // catch what is pushed without one (retired keys) and events the
        // engine has not drained yet (it does not notify when it drains).
        let pending_events = self.events.pending() > 0;
        let ready = !self.commands.is_empty()
            || !self.retire.is_empty()
            || self.shared.stop.load(Ordering::Acquire);
        if !ready {
            // Armed: block until the worker's fd fires. No fd (or events
            // waiting in the overflow): nap briefly on the eventfd alone.
            // Not armable (UCS_ERR_BUSY): the first time, do not block,
            // progress first (an event came in since the last progress).
            // Refused again with no work done in between: UCX holds sends
            // it cannot push out (a peer that does not drain its receive
            // queue), and only progress retries them; nap on the eventfd,
            // longer each time up to `REFUSED_NAP_MAX`, instead of
            // spinning on progress and arm (`Refusals`; work or an arm
            // that succeeds starts the count again).
            let fd = if pending_events {
                None
            } else {
                self.wire.wait_fd()
            };
            let armed = fd.is_some() && self.wire.arm();
            let cap = match fd.map(|_| self.refusals.arm(armed)) {
                Some(Refusal::Armed) => Some(MAX_BLOCK),
                Some(Refusal::ProgressFirst) => None,
                Some(Refusal::Nap(nap)) => Some(nap),
                None if pending_events => Some(Duration::from_micros(200)),
                None => Some(NAP),
            };
            if let Some(cap) = cap {
                let timeout = match self.core.next_deadline() {
                    Some(t) => cap.min(Duration::from_nanos(
                        t.0.saturating_sub(self.now().0).max(1_000),
                    )),
                    None => cap,
                };
                let efd = self.shared.wake.efd.fd();
                self.efd_signalled = wait_readable(efd, fd.filter(|_| armed), timeout);
            }
        }
        self.shared.wake.state.woke();
    }

    fn drain_control(&mut self) -> u32 {
        // A swap: a flag set after a message this drain misses stays set
        // for the next iteration (the engine sends, then sets).
        if !self.shared.control_pending.load(Ordering::Relaxed)
            || !self.shared.control_pending.swap(false, Ordering::AcqRel)
        {
            return 0;
        }
        let mut n = 0;
        while let Ok(msg) = self.control.try_recv() {
            n += 1;
            match msg {
                Control::Register {
                    blocks,
                    len,
                    user,
                    reply,
                } => {
                    let _ = reply.send(self.register(blocks, len, user));
                }
                Control::Metadata { reply } => {
                    let instance = self.cfg.instance;
                    let _ = reply.send(self.ucx().metadata(instance).map_err(EngineError::from));
                }
                Control::AddPeer { meta, reply } => {
                    self.drain_commands(&mut None);
                    let _ = reply.send(self.add_peer(&meta));
                }
                Control::RemovePeer { peer, reply } => {
                    // What the engine submitted before this call (a lend
                    // that names the peer as its writer) comes first.
                    self.drain_commands(&mut None);
                    let known = self.core.remove_peer(peer);
                    self.execute(self.now());
                    let _ = reply.send(if known {
                        Ok(())
                    } else {
                        Err(EngineError::UnknownPeer(peer))
                    });
                }
                Control::Shutdown => self.shared.stop.store(true, Ordering::Release),
            }
        }
        n
    }

    /// Adds a peer; the same engine's metadata again is a refresh: the
    /// same peer if nothing changed, a new entry if nothing uses the old
    /// one, refused while something does.
    fn add_peer(&mut self, meta: &crate::metadata::PeerMetadata) -> Result<PeerId, EngineError> {
        if let Some(old) = self.core.peer_of(meta.instance) {
            if self.ucx().peer_metadata(old) == Some(meta) {
                return Ok(old);
            }
        }
        let peer = self
            .core
            .add_peer(meta.instance, meta.regions.len(), region_blocks(meta))
            .map_err(EngineError::PeerBusy)?;
        self.execute(self.now());
        self.wire
            .add_peer(peer, meta)
            .map(|()| peer)
            .map_err(|_| EngineError::UnknownPeer(peer))
    }

    fn ucx(&mut self) -> &mut UcxTransport {
        #[cfg(feature = "fault-injection")]
        return self.wire.inner();
        #[cfg(not(feature = "fault-injection"))]
        return &mut self.wire;
    }

    fn register(
        &mut self,
        blocks: u64,
        len: usize,
        user: Option<usize>,
    ) -> Result<(usize, usize), EngineError> {
        if self.core.has_peers() {
            return Err(EngineError::RegionsFrozen);
        }
        // SAFETY: Engine::register_memory's caller guarantees the range
        // stays valid, writable and in place for the engine's lifetime.
        let out = unsafe { self.ucx().register(blocks, len, user)? };
        let regions = self.ucx().regions();
        self.core.set_local_layout(regions, blocks);
        Ok(out)
    }

    /// Frees the slots of requests the engine has consumed.
    fn drain_retired(&mut self) -> u32 {
        let mut n = 0;
        while let Some(key) = self.retire.recv() {
            self.core.retire(key);
            n += 1;
        }
        n
    }

    /// Feeds the commands in the ring to the core, executing the actions
    /// of each; reads the clock (into `now`) only if there is one.
    fn drain_commands(&mut self, now: &mut Option<Nanos>) -> u32 {
        if self.commands.is_empty() {
            return 0;
        }
        let mut n = 0;
        while let Some(cmd) = self.commands.recv() {
            n += 1;
            // Each command is dated when the poller takes it, after what
            // came before it (a stall, a batch of posts): a lease starts,
            // and a deadline counts, from then.
            let t = self.now();
            *now = Some(t);
            #[cfg(feature = "fault-injection")]
            if let Command::Stall { ns } = cmd {
                std::thread::sleep(Duration::from_nanos(ns));
                continue;
            }
            if matches!(cmd, Command::Begin { .. }) {
                // The engine admitted this request counting the slots it had
                // handed back; those keys were pushed before this command:
                // free their slots first, or the ledger could find itself
                // full and refuse it.
                self.drain_retired();
            }
            let commands = &mut self.commands;
            self.core.on_command(cmd, &mut || commands.recv(), t);
            self.execute(t);
        }
        n
    }

    /// Feeds what the transport saw to the core and executes the actions
    /// that follow, once for the whole batch. The clock is read at the
    /// first event (an idle iteration reads none); a reading this
    /// iteration already made is not reused, since posting the commands
    /// before may have taken a while.
    fn drain_transport(&mut self, now: &mut Option<Nanos>) -> u32 {
        let mut n = 0;
        let mut read = None;
        let (core, epoch) = (&mut self.core, self.shared.epoch);
        self.wire.drain(&mut |ev| {
            n += 1;
            let now = *read.get_or_insert_with(|| Nanos(epoch.elapsed().as_nanos() as u64));
            core.on_transport(ev, now);
        });
        if let Some(t) = read {
            self.execute(t);
            *now = Some(t);
        }
        n
    }

    /// Executes the core's actions on the transport, feeding back results
    /// (`now` dates release retries).
    fn execute(&mut self, now: Nanos) {
        crate::drive::execute(&mut self.core, &mut self.wire, now, |_, _| {});
    }

    fn publish(&mut self) -> usize {
        let events = &mut self.events;
        let mut n = self.core.drain_events(|e| {
            // Backpressure only means the overflow is past its bound; the
            // event is kept either way, nothing is dropped.
            let _ = events.publish(e);
        });
        let shared = &self.shared;
        self.core.drain_lost_peers(|peer, reason| {
            if let Ok(mut lost) = shared.lost_peers.lock() {
                lost.push((peer, reason));
                shared.lost_pending.store(true, Ordering::Release);
                n += 1;
            }
        });
        if self.events.pending() > 0 {
            self.events.flush();
        }
        if n > 0 {
            // After the events are in the ring (release): an engine thread
            // blocked in `wait` is woken; one that is not costs one swap.
            self.shared.reports.notify();
        }
        n
    }

    /// Cancels everything in flight (requests still in the command ring
    /// were begun first), waits until the transport completed every
    /// outstanding operation (bounded), publishes the reports, and releases
    /// endpoints, regions, worker and context (in that order, by drop).
    fn shutdown(&mut self) {
        self.drain_retired();
        self.drain_commands(&mut None);
        self.core.shutdown();
        self.execute(self.now());
        let start = Instant::now();
        while (self.core.outstanding() > 0
            || !self.core.quiescent()
            || self.core.quarantined() > 0
            || self.wire.closing())
            && start.elapsed() < Duration::from_secs(10)
        {
            self.wire.progress();
            self.drain_transport(&mut None);
            let now = self.now();
            self.core.advance(now);
            self.execute(now);
            self.publish();
        }
        // Whatever did not stop within the bound is reported all the same.
        self.core.abandon(Cause::Shutdown);
        self.publish();
        // The engine drains the ring while it waits for this thread.
        while self.events.flush() > 0 {
            std::thread::yield_now();
        }
    }

    /// After a panic: close every endpoint, give UCX a moment to cancel
    /// what was outstanding, then report everything still tracked.
    fn die(&mut self) {
        self.core.close_all(Cause::PollerDied);
        self.execute(self.now());
        let start = Instant::now();
        while self.core.outstanding() > 0 && start.elapsed() < Duration::from_millis(500) {
            self.wire.progress();
            self.drain_transport(&mut None);
            self.execute(self.now());
        }
        self.core.abandon(Cause::PollerDied);
        self.publish();
        let start = Instant::now();
        while self.events.flush() > 0 && start.elapsed() < Duration::from_secs(1) {
            std::thread::yield_now();
        }
    }
}

/// Idle iterations spent spinning, then yielding, before blocking. Short:
/// blocking is cheap to wake from (an eventfd write, a UCX fd), while a
/// thread that spun long before it slept has used up its fair share and
/// is woken behind whatever runs (measured on a loaded 2-vCPU machine: a
/// submit wake-up of ~4 ms after 2000 spins and 2000 yields).
const SPIN: u32 = 256;
const YIELD_FROM: u32 = SPIN + 1;
const YIELD_TO: u32 = SPIN + 16;
/// How long an adaptive poller with requests in flight keeps yielding
/// after its last work before it blocks (see `Poller::awaiting`).
const AWAIT: Duration = Duration::from_micros(300);

/// Longest block on an armed event fd: a safety net only (every event
/// that matters fires the fd or the eventfd, and the core's deadlines cut
/// it short).
const MAX_BLOCK: Duration = Duration::from_millis(100);
/// Nap of a poller whose transport has no event fd: how late a remote
/// event can be noticed then.
const NAP: Duration = Duration::from_micros(200);

/// First and longest nap of a poller whose worker refuses to arm with
/// nothing to do (see `Poller::block`): how late queued sends are retried
/// once the peer that held them up drains again.
const REFUSED_NAP_MIN: Duration = Duration::from_micros(50);
const REFUSED_NAP_MAX: Duration = Duration::from_millis(1);

/// Refused arms in a row with no work done in between (`UCS_ERR_BUSY`,
/// or an arm that failed outright).
#[derive(Debug, Default)]
struct Refusals(u32);

/// What [`Refusals::arm`] says to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// The worker is armed: block on its fd as usual.
    Armed,
    /// Refused once: an event came in since the last progress; progress
    /// first, do not wait.
    ProgressFirst,
    /// Refused again with no work done: UCX holds sends it cannot push
    /// out; wait this long on the eventfd before progress retries them.
    Nap(Duration),
}

impl Refusals {
    /// The outcome of an arm: an arm forgets the refusals before it;
    /// doubling naps from [`REFUSED_NAP_MIN`] up
    /// to [`REFUSED_NAP_MAX`] from the second refusal in a row.
    fn arm(&mut self, armed: bool) -> Refusal {
        if armed {
            // Whatever held the worker busy is gone.
            self.0 = 0;
            return Refusal::Armed;
        }
        self.0 = self.0.saturating_add(1);
        if self.0 == 1 {
            return Refusal::ProgressFirst;
        }
        let doublings = (self.0 - 2).min(16);
        Refusal::Nap((REFUSED_NAP_MIN * (1 << doublings)).min(REFUSED_NAP_MAX))
    }

    /// An iteration did work: the next refusal is a fresh one.
    fn work(&mut self) {
        self.0 = 0;
    }
}

/// Busy and idle iterations and nanoseconds since the last publication,
/// and the run in progress (busy or idle) with the time it started.
struct Counters {
    busy: u64,
    idle: u64,
    busy_ns: u64,
    idle_ns: u64,
    busy_run: bool,
    run_start: Nanos,
}

impl Counters {
    fn new(now: Nanos) -> Self {
        Counters {
            busy: 0,
            idle: 0,
            busy_ns: 0,
            idle_ns: 0,
            busy_run: false,
            run_start: now,
        }
    }

    /// Counts the run in progress up to `now`; it goes on from there.
    fn close_run(&mut self, now: Nanos) {
        let ns = now.0.saturating_sub(self.run_start.0);
        if self.busy_run {
            self.busy_ns += ns;
        } else {
            self.idle_ns += ns;
        }
        self.run_start = now;
    }

    /// Closes the run in progress at `now` and starts the other kind.
    fn switch(&mut self, now: Nanos) {
        self.close_run(now);
        self.busy_run = !self.busy_run;
    }
}

/// Waits until `efd` or `other` is readable or `timeout` passed (`ppoll`,
/// nanosecond timeout). Returns whether `efd` was readable.
pub(crate) fn wait_readable(
    efd: libc::c_int,
    other: Option<libc::c_int>,
    timeout: Duration,
) -> bool {
    let mut fds = [
        libc::pollfd {
            fd: efd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: other.unwrap_or(-1),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    let n: libc::nfds_t = if other.is_some() { 2 } else { 1 };
    // SAFETY: fds holds `n` initialised pollfd entries and ts a valid
    // timespec, both alive for the call; a null sigmask keeps the mask.
    let r = unsafe { libc::ppoll(fds.as_mut_ptr(), n, &ts, std::ptr::null()) };
    r > 0 && fds[0].revents & libc::POLLIN != 0
}

fn region_blocks(meta: &PeerMetadata) -> u64 {
    meta.regions.iter().map(|r| r.blocks).min().unwrap_or(0)
}

#[cfg(feature = "fault-injection")]
fn release_retry(cfg: &Config) -> Duration {
    cfg.faults.release_retry_after
}

#[cfg(not(feature = "fault-injection"))]
fn release_retry(_cfg: &Config) -> Duration {
    Duration::from_millis(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_arm_is_progressed_first_then_napped_on_longer_each_time_and_forgotten_once_armed()
    {
        let mut r = Refusals::default();
        assert_eq!(r.arm(true), Refusal::Armed);
        assert_eq!(r.arm(false), Refusal::ProgressFirst);
        let naps: Vec<Refusal> = (0..7).map(|_| r.arm(false)).collect();
        let us = |n| Refusal::Nap(Duration::from_micros(n));
        assert_eq!(
            naps,
            [
                us(50),
                us(100),
                us(200),
                us(400),
                us(800),
                us(1000),
                us(1000)
            ]
        );
        // Work done: the next refusal is progressed first again.
        r.work();
        assert_eq!(r.arm(false), Refusal::ProgressFirst);
        assert_eq!(r.arm(false), us(50));
        // Armed again (the held sends went out, say, with progress
        // reporting nothing): a later refusal is a fresh event, not the
        // same stuck peer, and must not wait a nap before its progress.
        assert_eq!(r.arm(true), Refusal::Armed);
        assert_eq!(r.arm(false), Refusal::ProgressFirst);
    }

    #[test]
    fn counters_split_time_between_busy_and_idle_runs_at_each_switch() {
        let mut c = Counters::new(Nanos(100));
        // Idle from 100 to 250, busy from 250 to 300, idle until 1000.
        c.switch(Nanos(250));
        assert!(c.busy_run);
        c.switch(Nanos(300));
        c.close_run(Nanos(1000));
        assert_eq!((c.idle_ns, c.busy_ns), (150 + 700, 50));
        assert!(!c.busy_run, "closing a run keeps its kind");
    }
}
