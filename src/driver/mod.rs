//! The driver: the body of the poller thread, which drives the protocol
//! [`Core`] over the UCX [`Transport`]. What is polled (the core, the transport) is apart from
//! who polls (this loop); the driver decides nothing itself:
//!
//! drain control messages and commands (feeding the core) → progress the
//! transport → feed its completions, notifications and endpoint failures to
//! the core → advance the core's clock when something is due and the
//! transport had nothing more → execute the core's actions on the
//! transport → publish the core's events.
//!
//! The parts, each in its module: `feed` (what goes into the core and
//! out of it), [`execute`] (the core's actions performed on a transport),
//! `idle` (the idle policy and the wait), `control` (the engine's rare
//! requests), `registration` (memory), `stats` (busy and idle
//! accounting, the counters the engine reads), `teardown` (shutdown, and
//! the death after a panic), `shared` (what the engine thread and the
//! driver share). A panic on this thread is caught: every request still
//! tracked is reported failed (`PollerDied`) and every later engine call
//! says so.

mod control;
pub mod execute;
mod feed;
mod idle;
mod registration;
mod shared;
mod stats;
mod teardown;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use crate::core::{Command, Core, CoreConfig};
use crate::error::BuildError;
use crate::ledger::{Event, Ledger, Nanos, RequestKey};
use crate::ring::{CommandReceiver, EventPublisher};
use crate::transport::ucx::UcxTransport;
use crate::transport::Transport;

pub(crate) use control::{Control, DeviceMemory};
pub(crate) use shared::{Channels, Config, Shared};

#[cfg(feature = "fault-injection")]
type Wire = crate::transport::faulty::Faulty<UcxTransport>;
#[cfg(not(feature = "fault-injection"))]
type Wire = UcxTransport;

struct Driver {
    cfg: Config,
    core: Core,
    wire: Wire,
    commands: CommandReceiver<Command>,
    retire: CommandReceiver<RequestKey>,
    events: EventPublisher<Event>,
    control: mpsc::Receiver<Control>,
    shared: Arc<Shared>,
    idle: idle::Idle,
    /// Turns in a row that held a due deadline back while the transport
    /// still had something (`feed::HOLD_BACK` at most).
    held_back: u32,
}

/// The driver thread's body.
pub(crate) fn run(
    cfg: Config,
    ledger: Ledger,
    channels: Channels,
    ready: mpsc::Sender<Result<(), BuildError>>,
) {
    let mut driver = match Driver::new(cfg, ledger, channels) {
        Ok(d) => d,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    if catch_unwind(AssertUnwindSafe(|| driver.run())).is_err() {
        // Make the death visible first (no call is accepted from now on),
        // then report what is still tracked (once: the ledger's state CAS
        // decides), whatever state the panic left.
        driver.shared.dead.store(true, Ordering::Release);
        let _ = catch_unwind(AssertUnwindSafe(|| driver.die()));
    }
}

impl Driver {
    fn new(cfg: Config, ledger: Ledger, channels: Channels) -> Result<Self, BuildError> {
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
        let ucx = UcxTransport::with_remote_write(&cfg.ucx, cfg.block_size, cfg.remote_write)?;
        #[cfg(feature = "fault-injection")]
        let wire = crate::transport::faulty::Faulty::new(ucx, cfg.faults);
        #[cfg(not(feature = "fault-injection"))]
        let wire = ucx;
        let words = wire.lend_words();
        // Relaxed: read by the engine after the driver reported ready.
        shared
            .lend_words
            .store(words.as_ref().map_or(0, |w| w.len()), Ordering::Relaxed);
        let core = Core::new(CoreConfig::from(&cfg), ledger)
            .with_lend_words(words)
            .with_auth_key(cfg.auth.clone());
        let idle = idle::Idle::new(Nanos(shared.epoch.elapsed().as_nanos() as u64));
        Ok(Self {
            cfg,
            core,
            wire,
            commands,
            retire,
            events,
            control,
            shared,
            idle,
            held_back: 0,
        })
    }

    fn now(&self) -> Nanos {
        Nanos(self.shared.epoch.elapsed().as_nanos() as u64)
    }

    /// The loop: a turn of work, then the accounting and the idle policy.
    /// Every turn knows whether it did work; busy and idle turns are
    /// counted, and so is the time spent in busy and idle runs (the clock
    /// is read when a run switches, not per turn).
    fn run(&mut self) {
        let mut counts = stats::Counters::new(self.now());
        for turn in 1u64.. {
            // The clock as this turn read it, if it did: read once when
            // commands or transport events arrive, and reused for the
            // deadline check and the busy/idle accounting.
            let mut now = None;
            let Some(work) = self.turn(turn, &mut now) else {
                break; // stopped
            };
            let busy = work > 0;
            if busy != counts.busy_run {
                // A run switched: it started when this turn found its work
                // (the clock it read then) or, for an idle run, now.
                let t = match now {
                    Some(t) if busy => t,
                    _ => self.now(),
                };
                counts.switch(t);
                self.idle.switch(t, busy);
            }
            self.idle.turn_done();
            if busy {
                counts.busy += 1;
                self.idle.work();
            } else {
                counts.idle += 1;
                if self.idle_wait() {
                    // About to block: the counters must not wait for it.
                    self.publish_counters(&mut counts);
                    self.block();
                }
            }
            if turn % 1024 == 0 {
                self.publish_counters(&mut counts);
                self.hear();
            }
        }
        // Shutdown may still begin commands (those the engine pushed
        // before it stopped) and meet notes: count them, then publish.
        self.shutdown();
        self.publish_counters(&mut counts);
    }

    /// One turn: the engine's inputs, the transport's, due deadlines, the
    /// reports. Returns the work done, or `None` once stopped.
    fn turn(&mut self, turn: u64, now: &mut Option<Nanos>) -> Option<u32> {
        let mut work = self.drain_control();
        work += self.drain_retired();
        let commands = self.drain_commands(now);
        if commands > 0 {
            // What the commands settled alone (a prefix hit, a refused or
            // aborted request) goes to the engine now, not after a
            // progress that is cold after a quiet spell (2 to 3 us of a
            // ~10 us wake-up path here, measured with timestamps).
            work += self.publish() as u32;
        }
        work += commands;
        // Checked after the commands were drained: a request submitted
        // before shutdown is begun, then cancelled and reported.
        if self.shared.stop.load(Ordering::Acquire) {
            return None;
        }
        let progressed = self.wire.progress();
        // The commands again (an emptiness check when none came), then
        // what progress saw: a peer's message that answers something the
        // engine submitted (a read of a lend it announced, say) was sent
        // after the submit, so that command is in the ring by the time
        // progress has the message. Without this second look, a driver
        // descheduled between the first drain and progress took the
        // question first and refused a read of a lend still in its ring.
        work += self.drain_commands(now);
        let took = progressed + self.drain_transport(now);
        work += took;
        self.advance_if_due(turn, *now, took);
        work += self.publish() as u32;
        Some(work)
    }

    /// Asks the transport whether it still hears (it probes now and then:
    /// a clock reading and a branch when nothing is due). Called every
    /// 1024 turns and before each block or nap. Once deaf, the engine is
    /// told (its calls fail `Stopped::Deaf`, and `Engine::is_deaf` says
    /// so) and the driver runs on: leases and deadlines still end what is
    /// in flight, and each end is reported as before.
    fn hear(&mut self) {
        if self.shared.deaf.load(Ordering::Relaxed) {
            return;
        }
        let now = self.now();
        if !self.wire.hearing(now) {
            tracing::error!(
                "this engine's UCX worker receives no more messages (a peer was killed inside \
                 a shared-memory send to it): build a new engine and give its peers the new \
                 metadata"
            );
            self.shared.deaf.store(true, Ordering::Release);
            self.shared.reports.notify();
        }
    }
}
