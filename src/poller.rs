//! The poller: the thread that drives the protocol [`Core`] over the UCX
//! [`Transport`]. It decides nothing itself:
//!
//! drain control messages and commands (feeding the core) → progress the
//! transport → feed its completions, notifications and endpoint failures to
//! the core → advance the core's clock when something is due → execute the
//! core's actions on the transport → publish the core's events.
//!
//! Every iteration knows whether it did work; busy and idle iterations are
//! counted. A panic on this thread is caught: every request still tracked is
//! reported failed (`PollerDied`) and every later engine call says so.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::core::{Action, Command, Core, CoreConfig};
use crate::engine::{EngineError, IdlePolicy};
use crate::ledger::{Cause, Event, Ledger, Nanos, PeerId, RequestKey};
use crate::metadata::PeerMetadata;
use crate::ring::{CommandReceiver, EventPublisher};
use crate::transport::ucx::{ContextOptions, UcxTransport};
use crate::transport::Transport;

#[cfg(feature = "fault-injection")]
type Wire = crate::transport::faulty::Faulty<UcxTransport>;
#[cfg(not(feature = "fault-injection"))]
type Wire = UcxTransport;

/// What the engine thread and the poller share besides the rings.
pub(crate) struct Shared {
    pub(crate) sleeping: AtomicBool,
    pub(crate) stop: AtomicBool,
    /// Set once the poller thread died (panicked): every engine call then
    /// fails with `PollerDied`.
    pub(crate) dead: AtomicBool,
    pub(crate) busy_iterations: AtomicU64,
    pub(crate) idle_iterations: AtomicU64,
    pub(crate) malformed_notes: AtomicU64,
    pub(crate) rejected_notes: AtomicU64,
    pub(crate) ops_posted: AtomicU64,
    pub(crate) ops_completed: AtomicU64,
    pub(crate) bytes_moved: AtomicU64,
    /// The CPU the poller was pinned to and verified on; `u64::MAX` if none.
    pub(crate) pinned_core: AtomicU64,
    pub(crate) epoch: Instant,
    /// The poller thread's kernel thread id (0 until it runs), so that its
    /// CPU time can be read from /proc.
    pub(crate) tid: AtomicI32,
}

impl Shared {
    pub(crate) fn new() -> Self {
        Shared {
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            busy_iterations: AtomicU64::new(0),
            idle_iterations: AtomicU64::new(0),
            malformed_notes: AtomicU64::new(0),
            rejected_notes: AtomicU64::new(0),
            ops_posted: AtomicU64::new(0),
            ops_completed: AtomicU64::new(0),
            bytes_moved: AtomicU64::new(0),
            pinned_core: AtomicU64::new(u64::MAX),
            epoch: Instant::now(),
            tid: AtomicI32::new(0),
        }
    }
}

pub(crate) struct Config {
    pub(crate) block_size: u64,
    pub(crate) core: Option<usize>,
    pub(crate) idle: IdlePolicy,
    pub(crate) ucx: ContextOptions,
    pub(crate) instance: u64,
    pub(crate) confirm_reads: bool,
    pub(crate) read_heartbeat: Duration,
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
                heartbeat: Nanos(cfg.read_heartbeat.as_nanos().min(u128::from(u64::MAX)) as u64),
            },
            ledger,
        );
        Ok(Self {
            cfg,
            core,
            wire,
            commands,
            retire,
            events,
            control,
            shared,
        })
    }

    fn now(&self) -> Nanos {
        Nanos(self.shared.epoch.elapsed().as_nanos() as u64)
    }

    fn run(&mut self) {
        let mut idle_streak = 0u32;
        let (mut busy, mut idle) = (0u64, 0u64);
        let mut iteration = 0u64;
        loop {
            iteration += 1;
            let mut work = self.drain_control();
            work += self.drain_retired();
            work += self.drain_commands();
            // Checked after the commands were drained: a request submitted
            // before shutdown is begun, then cancelled and reported.
            if self.shared.stop.load(Ordering::Acquire) {
                break;
            }
            work += self.wire.progress();
            work += self.drain_transport();
            if iteration % 16 == 0 || work == 0 {
                let now = self.now();
                if self.core.next_deadline().is_some_and(|t| t <= now) {
                    self.core.advance(now);
                    self.execute();
                }
            }
            work += self.publish() as u32;
            if work > 0 {
                busy += 1;
                idle_streak = 0;
            } else {
                idle += 1;
                idle_streak = idle_streak.saturating_add(1);
                self.idle_wait(idle_streak);
            }
            if iteration % 1024 == 0 {
                self.publish_counters(&mut busy, &mut idle);
            }
        }
        self.publish_counters(&mut busy, &mut idle);
        self.shutdown();
    }

    fn publish_counters(&self, busy: &mut u64, idle: &mut u64) {
        // Relaxed: monotonic metrics, read for display only.
        self.shared
            .busy_iterations
            .fetch_add(std::mem::take(busy), Ordering::Relaxed);
        self.shared
            .idle_iterations
            .fetch_add(std::mem::take(idle), Ordering::Relaxed);
        let stats = self.core.stats();
        self.shared
            .malformed_notes
            .store(stats.malformed_notifications, Ordering::Relaxed);
        self.shared
            .rejected_notes
            .store(stats.rejected_notifications, Ordering::Relaxed);
        self.shared
            .ops_posted
            .store(stats.ops_posted, Ordering::Relaxed);
        self.shared
            .ops_completed
            .store(stats.ops_completed, Ordering::Relaxed);
        self.shared.bytes_moved.store(
            stats.blocks_moved.saturating_mul(self.cfg.block_size),
            Ordering::Relaxed,
        );
    }

    fn idle_wait(&self, streak: u32) {
        if self.cfg.idle == IdlePolicy::Busy {
            std::hint::spin_loop();
            return;
        }
        match streak {
            0..=2000 => std::hint::spin_loop(),
            2001..=4000 => std::thread::yield_now(),
            _ => {
                // SeqCst store, then a re-check of what the engine writes: the
                // engine pushes, then reads `sleeping` (SeqCst). Either it sees
                // `true` and unparks us (an unpark before the park makes the
                // park return), or we see its entry here and do not park.
                self.shared.sleeping.store(true, Ordering::SeqCst);
                if self.commands.is_empty()
                    && self.retire.is_empty()
                    && !self.shared.stop.load(Ordering::SeqCst)
                {
                    // The timeout bounds how late a remote-driven event (an
                    // incoming notification, a get served over tcp) is
                    // noticed: 200 µs at first, 2 ms once idle ~10 ms, and
                    // never past the core's next deadline.
                    let nap = if streak < 4050 { 200 } else { 2000 };
                    let mut nap = Duration::from_micros(nap);
                    if let Some(t) = self.core.next_deadline() {
                        let left = t.0.saturating_sub(self.now().0);
                        nap = nap.min(Duration::from_nanos(left.max(1_000)));
                    }
                    std::thread::park_timeout(nap);
                }
                self.shared.sleeping.store(false, Ordering::SeqCst);
            }
        }
    }

    fn drain_control(&mut self) -> u32 {
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
                    let peer =
                        self.core
                            .add_peer(meta.instance, meta.regions.len(), region_blocks(&meta));
                    self.execute();
                    let r = self
                        .wire
                        .add_peer(peer, &meta)
                        .map(|()| peer)
                        .map_err(|_| EngineError::UnknownPeer(peer));
                    let _ = reply.send(r);
                }
                Control::RemovePeer { peer, reply } => {
                    let known = self.core.remove_peer(peer);
                    self.execute();
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

    fn drain_commands(&mut self) -> u32 {
        let mut n = 0;
        let now = self.now();
        while let Some(cmd) = self.commands.recv() {
            n += 1;
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
            self.core.on_command(cmd, &mut || commands.recv(), now);
            self.execute();
        }
        n
    }

    fn drain_transport(&mut self) -> u32 {
        let mut n = 0;
        let now = self.now();
        let core = &mut self.core;
        self.wire.drain(&mut |ev| {
            n += 1;
            core.on_transport(ev, now);
        });
        if n > 0 {
            self.execute();
        }
        n
    }

    /// Executes the core's actions on the transport, feeding back results.
    fn execute(&mut self) {
        while let Some(action) = self.core.next_action() {
            match action {
                Action::Post {
                    ep,
                    dir,
                    handle,
                    token,
                    pairs,
                } => {
                    let r = self.wire.post(ep, dir, self.core.pairs(pairs), token);
                    self.core.on_posted(handle, r);
                }
                Action::Flush { ep, handle, token } => {
                    if let Err(status) = self.wire.flush(ep, token) {
                        self.core.on_flush_failed(handle, status);
                    }
                }
                Action::Send {
                    ep,
                    note,
                    token,
                    want_reply,
                } => {
                    if self.wire.send(ep, &note, token, want_reply).is_err() {
                        self.core.on_send_failed();
                    }
                }
                Action::Reply { to, note, token } => {
                    if self.wire.reply(to, &note, token).is_err() {
                        self.core.on_send_failed();
                    }
                }
                Action::Close { ep } => self.wire.close(ep),
                Action::Release { handle } => {
                    let ok = self.release(handle);
                    let now = self.now();
                    self.core.on_released(handle, ok, now);
                }
                Action::ForgetPeer { peer } => self.wire.forget_peer(peer),
            }
        }
    }

    #[cfg(feature = "fault-injection")]
    fn release(&mut self, handle: crate::ledger::HandleKey) -> bool {
        self.wire.release(handle)
    }

    #[cfg(not(feature = "fault-injection"))]
    fn release(&mut self, _handle: crate::ledger::HandleKey) -> bool {
        // Releasing a handle's UCX resources cannot fail: requests are
        // freed by their completion callbacks.
        true
    }

    fn publish(&mut self) -> usize {
        let events = &mut self.events;
        let n = self.core.drain_events(|e| {
            // Backpressure only means the overflow is past its bound; the
            // event is kept either way, nothing is dropped.
            let _ = events.publish(e);
        });
        if self.events.pending() > 0 {
            self.events.flush();
        }
        n
    }

    /// Cancels everything in flight (requests still in the command ring
    /// were begun first), waits until the transport completed every
    /// outstanding operation (bounded), publishes the reports, and releases
    /// endpoints, regions, worker and context (in that order, by drop).
    fn shutdown(&mut self) {
        self.drain_retired();
        self.drain_commands();
        self.core.shutdown();
        self.execute();
        let start = Instant::now();
        while (self.core.outstanding() > 0 || !self.core.quiescent() || self.wire.closing())
            && start.elapsed() < Duration::from_secs(10)
        {
            self.wire.progress();
            self.drain_transport();
            let now = self.now();
            self.core.advance(now);
            self.execute();
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
        self.execute();
        let start = Instant::now();
        while self.core.outstanding() > 0 && start.elapsed() < Duration::from_millis(500) {
            self.wire.progress();
            self.drain_transport();
            self.execute();
        }
        self.core.abandon(Cause::PollerDied);
        self.publish();
        let start = Instant::now();
        while self.events.flush() > 0 && start.elapsed() < Duration::from_secs(1) {
            std::thread::yield_now();
        }
    }
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
