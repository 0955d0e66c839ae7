//! What the engine thread and the driver share: the wake words, flags,
//! the published counters; the driver's configuration and its ends of the
//! rings and the control channel.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::Control;
use crate::core::{Command, CoreConfig};
use crate::ledger::{Event, Nanos, RequestKey};
use crate::placement::IdlePolicy;
use crate::ring::{CommandReceiver, EventPublisher};
use crate::transport::ucx::ContextOptions;
use crate::wake::Wake;

/// What the engine thread and the driver share besides the rings.
pub(crate) struct Shared {
    /// How the engine wakes a blocked driver (see [`crate::wake`]).
    pub(crate) wake: Wake,
    /// How the driver (and an [`crate::EngineWaker`]) wakes an engine thread
    /// blocked in [`crate::Engine::wait`]: the same protocol, roles swapped,
    /// with the event ring as the ring.
    pub(crate) reports: Wake,
    pub(crate) stop: AtomicBool,
    /// Set by the engine after it sent a control message: the driver looks
    /// at the control channel only then (a channel `try_recv` on every
    /// iteration cost more than the rest of an idle iteration).
    pub(crate) control_pending: AtomicBool,
    /// Set once the driver thread died (panicked): every engine call then
    /// fails with `PollerDied`.
    pub(crate) dead: AtomicBool,
    /// Set once the driver found its transport deaf (it receives no
    /// message again): every engine call that would start something then
    /// fails with `Deaf`; what is in flight ends on its own.
    pub(crate) deaf: AtomicBool,
    pub(crate) busy_iterations: AtomicU64,
    pub(crate) idle_iterations: AtomicU64,
    /// Nanoseconds spent in busy and in idle runs (blocked time is idle).
    pub(crate) busy_ns: AtomicU64,
    pub(crate) idle_ns: AtomicU64,
    pub(crate) malformed_notes: AtomicU64,
    pub(crate) rejected_notes: AtomicU64,
    pub(crate) refused_reads: AtomicU64,
    pub(crate) reads_not_lent: AtomicU64,
    pub(crate) refused_writes: AtomicU64,
    pub(crate) writes_not_lent: AtomicU64,
    /// Peer metadata refused as unauthenticated (counted by the engine
    /// thread, in `add_peer`).
    pub(crate) unauthenticated_peers: AtomicU64,
    pub(crate) unauthenticated_notes: AtomicU64,
    pub(crate) replayed_notes: AtomicU64,
    pub(crate) word_confirmations: AtomicU64,
    pub(crate) word_misses: AtomicU64,
    pub(crate) word_collisions: AtomicU64,
    /// How many lend words the driver's transport has (0: none), set
    /// before the driver reports ready: the engine draws lends'
    /// incarnations whose words its other live lends do not hold.
    pub(crate) lend_words: std::sync::atomic::AtomicUsize,
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
    /// The CPU the driver was pinned to and verified on; `u64::MAX` if none.
    pub(crate) pinned_core: AtomicU64,
    pub(crate) epoch: Instant,
    /// The driver thread's kernel thread id (0 until it runs), so that its
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
            deaf: AtomicBool::new(false),
            busy_iterations: AtomicU64::new(0),
            idle_iterations: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
            idle_ns: AtomicU64::new(0),
            malformed_notes: AtomicU64::new(0),
            rejected_notes: AtomicU64::new(0),
            refused_reads: AtomicU64::new(0),
            reads_not_lent: AtomicU64::new(0),
            refused_writes: AtomicU64::new(0),
            writes_not_lent: AtomicU64::new(0),
            unauthenticated_peers: AtomicU64::new(0),
            unauthenticated_notes: AtomicU64::new(0),
            replayed_notes: AtomicU64::new(0),
            word_confirmations: AtomicU64::new(0),
            word_misses: AtomicU64::new(0),
            word_collisions: AtomicU64::new(0),
            lend_words: std::sync::atomic::AtomicUsize::new(0),
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
    /// Peers may write into the regions (`EngineBuilder::remote_write`).
    pub(crate) remote_write: bool,
    /// The deployment's key (`EngineBuilder::auth_key`).
    pub(crate) auth: Option<crate::auth::AuthKey>,
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: crate::transport::faulty::Faults,
}

/// The driver's ends of what connects it to the engine thread.
pub(crate) struct Channels {
    pub(crate) commands: CommandReceiver<Command>,
    pub(crate) retire: CommandReceiver<RequestKey>,
    pub(crate) events: EventPublisher<Event>,
    pub(crate) control: mpsc::Receiver<Control>,
    pub(crate) shared: Arc<Shared>,
}

impl From<&Config> for CoreConfig {
    fn from(cfg: &Config) -> Self {
        let ns = |d: Duration| Nanos(d.as_nanos().min(u128::from(u64::MAX)) as u64);
        CoreConfig {
            instance: cfg.instance,
            release_retry: ns(release_retry(cfg)),
            confirm_reads: cfg.confirm_reads,
            fence_push_leases: cfg.fence_push_leases,
            heartbeat: ns(cfg.read_heartbeat),
            lend_grace: ns(cfg.lend_grace),
        }
    }
}

#[cfg(feature = "fault-injection")]
fn release_retry(cfg: &Config) -> Duration {
    cfg.faults.release_retry_after
}

#[cfg(not(feature = "fault-injection"))]
fn release_retry(_cfg: &Config) -> Duration {
    Duration::from_millis(1)
}
