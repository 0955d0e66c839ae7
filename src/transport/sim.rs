//! A deterministic, seeded simulator of transfers, for tests and benches.
//!
//! It stands where UCX stands for the poller: operations are posted to
//! peers, and complete later, in an order and with latencies drawn from a
//! seeded generator — so a failing run replays exactly from its seed. Faults
//! are injected at configured rates: a transfer error, a setup failure, a
//! release failure (retried until it works), a stall (the operation never
//! completes until its endpoint is force-closed) and a peer loss (every
//! operation in flight to the peer fails with `UCS_ERR_ENDPOINT_TIMEOUT`).
//!
//! ```
//! use kvpoll::ledger::{HandleKey, PeerId, RequestKey};
//! use kvpoll::transport::sim::{Sim, SimConfig, SimEvent};
//! let mut sim = Sim::new(SimConfig { seed: 1, ..SimConfig::default() });
//! let h = HandleKey::new(RequestKey::new(0, 0), 0).unwrap();
//! sim.post(h, PeerId(3)).unwrap();
//! match sim.step() {
//!     Some(SimEvent::Completed { handle, result: Ok(()), released: true }) => assert_eq!(handle, h),
//!     other => panic!("{other:?}"),
//! }
//! assert_eq!(sim.step(), None);
//! ```

#![warn(missing_docs)]

use crate::ledger::{Cause, HandleKey, Nanos, PeerId, Reason};

/// `UCS_ERR_IO_ERROR`.
pub const IO_ERROR: i8 = -3;
/// `UCS_ERR_UNREACHABLE`.
pub const UNREACHABLE: i8 = -6;
/// `UCS_ERR_CANCELED`: what a forced endpoint close completes operations with.
pub const CANCELED: i8 = -16;
/// `UCS_ERR_ENDPOINT_TIMEOUT`: what a lost peer fails operations with.
pub const ENDPOINT_TIMEOUT: i8 = -80;

/// SplitMix64: a tiny, good-enough, seedable generator.
///
/// ```
/// use kvpoll::transport::sim::Rng;
/// let (mut a, mut b) = (Rng::new(9), Rng::new(9));
/// assert_eq!(a.next_u64(), b.next_u64());
/// assert!(a.below(10) < 10);
/// ```
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
        }
    }
    /// True with probability `per_million` / 1 000 000.
    pub fn chance(&mut self, per_million: u32) -> bool {
        self.below(1_000_000) < u64::from(per_million)
    }
}

/// Fault rates, in events per million operations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// An operation completes with `UCS_ERR_IO_ERROR`.
    pub handle_error: u32,
    /// Posting fails (`UCS_ERR_UNREACHABLE`): no operation is posted.
    pub setup_failure: u32,
    /// Releasing a completed operation fails (each retry fails again at this
    /// rate).
    pub release_failure: u32,
    /// The operation never completes until its endpoint is force-closed.
    pub stall: u32,
    /// The peer is lost while the operation is in flight.
    pub peer_loss: u32,
}

/// A simulator's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// Shortest operation latency.
    pub latency_min: Nanos,
    /// Longest operation latency.
    pub latency_max: Nanos,
    /// Delay before a failed release is retried.
    pub release_retry: Nanos,
    /// Fault rates.
    pub faults: Faults,
}

impl Default for SimConfig {
    /// Seed 0, 1–50 µs latencies, retries after 10 µs, no faults.
    fn default() -> Self {
        SimConfig {
            seed: 0,
            latency_min: Nanos(1_000),
            latency_max: Nanos(50_000),
            release_retry: Nanos(10_000),
            faults: Faults::default(),
        }
    }
}

/// Something that happened in the simulated transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimEvent {
    /// The handle's operation finished with `result`; `released` false means
    /// releasing it failed (report `release_failed`; a
    /// [`SimEvent::ReleaseRetried`] follows).
    Completed {
        /// The handle.
        handle: HandleKey,
        /// How the operation ended.
        result: Result<(), Reason>,
        /// Whether its resources were released.
        released: bool,
    },
    /// A retried release of the handle, and whether it worked this time.
    ReleaseRetried {
        /// The handle.
        handle: HandleKey,
        /// Whether it worked.
        released: bool,
    },
    /// The peer's endpoint failed; its operations in flight fail next.
    PeerLost(PeerId),
}

#[derive(Clone, Copy, Debug)]
enum Due {
    At(Nanos),
    Never,
}

#[derive(Clone, Copy, Debug)]
enum Pending {
    Op {
        handle: HandleKey,
        peer: PeerId,
        result: Result<(), Reason>,
    },
    Retry {
        handle: HandleKey,
    },
    Loss {
        peer: PeerId,
    },
}

/// The simulated transport: a clock and the operations in flight.
pub struct Sim {
    config: SimConfig,
    rng: Rng,
    now: Nanos,
    seq: u64,
    /// (due, sequence number for a stable order, what).
    pending: Vec<(Due, u64, Pending)>,
}

impl Sim {
    /// A simulator at time 0 with nothing in flight.
    pub fn new(config: SimConfig) -> Self {
        Sim {
            rng: Rng::new(config.seed),
            config,
            now: Nanos(0),
            seq: 0,
            pending: Vec::new(),
        }
    }

    /// The simulated clock.
    pub fn now(&self) -> Nanos {
        self.now
    }

    /// The generator, for drivers that want their choices seeded too.
    pub fn rng(&mut self) -> &mut Rng {
        &mut self.rng
    }

    /// Moves the clock to `t` (never back): for a driver waiting for a
    /// deadline while only stalled operations remain.
    pub fn advance_to(&mut self, t: Nanos) {
        self.now = self.now.max(t);
    }

    /// Operations (and retries, losses) still to happen, stalled ones
    /// included.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Whether anything will happen without a forced close.
    pub fn has_due(&self) -> bool {
        self.pending.iter().any(|p| matches!(p.0, Due::At(_)))
    }

    fn latency(&mut self) -> Nanos {
        let (lo, hi) = (self.config.latency_min.0, self.config.latency_max.0);
        Nanos(lo + self.rng.below(hi.saturating_sub(lo) + 1))
    }

    fn push(&mut self, due: Due, what: Pending) {
        self.seq += 1;
        self.pending.push((due, self.seq, what));
    }

    /// Posts `handle`'s operation to `peer`. `Err` is an injected setup
    /// failure: nothing was posted.
    pub fn post(&mut self, handle: HandleKey, peer: PeerId) -> Result<(), Reason> {
        let f = self.config.faults;
        if self.rng.chance(f.setup_failure) {
            return Err(Reason::new(Cause::Setup, UNREACHABLE));
        }
        let at = self.now.saturating_add(self.latency());
        if self.rng.chance(f.peer_loss) {
            let lost = Nanos(self.now.0 + (at.0 - self.now.0) / 2);
            self.push(Due::At(lost), Pending::Loss { peer });
        }
        let result = if self.rng.chance(f.handle_error) {
            Err(Reason::new(Cause::Transfer, IO_ERROR))
        } else {
            Ok(())
        };
        let due = if self.rng.chance(f.stall) {
            Due::Never
        } else {
            Due::At(at)
        };
        self.push(
            due,
            Pending::Op {
                handle,
                peer,
                result,
            },
        );
        Ok(())
    }

    /// Force-closes `peer`'s endpoint: every operation in flight to it
    /// completes now with `UCS_ERR_CANCELED`.
    pub fn force_close(&mut self, peer: PeerId) {
        self.fail_peer(peer, CANCELED);
    }

    fn fail_peer(&mut self, peer: PeerId, status: i8) {
        let now = self.now;
        for p in &mut self.pending {
            if let Pending::Op {
                peer: q, result, ..
            } = &mut p.2
            {
                if *q == peer {
                    p.0 = Due::At(now);
                    *result = Err(Reason::new(Cause::Transfer, status));
                }
            }
        }
    }

    /// The next thing to happen, moving the clock to it; `None` when only
    /// stalled operations (or nothing) remain.
    pub fn step(&mut self) -> Option<SimEvent> {
        let (i, _) = self
            .pending
            .iter()
            .enumerate()
            .filter_map(|(i, (due, seq, _))| match due {
                Due::At(t) => Some((i, (*t, *seq))),
                Due::Never => None,
            })
            .min_by_key(|(_, k)| *k)?;
        let (due, _, what) = self.pending.swap_remove(i);
        if let Due::At(t) = due {
            self.now = self.now.max(t);
        }
        let release_failure = self.config.faults.release_failure;
        Some(match what {
            Pending::Op { handle, result, .. } => {
                let released = !self.rng.chance(release_failure);
                if !released {
                    let at = self.now.saturating_add(self.config.release_retry);
                    self.push(Due::At(at), Pending::Retry { handle });
                }
                SimEvent::Completed {
                    handle,
                    result,
                    released,
                }
            }
            Pending::Retry { handle } => {
                let released = !self.rng.chance(release_failure);
                if !released {
                    let at = self.now.saturating_add(self.config.release_retry);
                    self.push(Due::At(at), Pending::Retry { handle });
                }
                SimEvent::ReleaseRetried { handle, released }
            }
            Pending::Loss { peer } => {
                self.fail_peer(peer, ENDPOINT_TIMEOUT);
                SimEvent::PeerLost(peer)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::RequestKey;

    fn h(i: u8) -> HandleKey {
        HandleKey::new(RequestKey::new(0, 0), i).unwrap()
    }

    fn run(seed: u64) -> Vec<SimEvent> {
        let mut sim = Sim::new(SimConfig {
            seed,
            faults: Faults {
                handle_error: 200_000,
                release_failure: 200_000,
                ..Faults::default()
            },
            ..SimConfig::default()
        });
        for i in 0..20 {
            let _ = sim.post(h(i), PeerId(u32::from(i % 3)));
        }
        std::iter::from_fn(|| sim.step()).collect()
    }

    #[test]
    fn same_seed_replays_the_same_run_and_another_seed_does_not() {
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn stalled_operation_completes_only_when_its_endpoint_is_force_closed() {
        let mut sim = Sim::new(SimConfig {
            faults: Faults {
                stall: 1_000_000,
                ..Faults::default()
            },
            ..SimConfig::default()
        });
        sim.post(h(0), PeerId(1)).unwrap();
        assert_eq!(sim.step(), None);
        assert_eq!(sim.in_flight(), 1);
        sim.force_close(PeerId(1));
        assert_eq!(
            sim.step(),
            Some(SimEvent::Completed {
                handle: h(0),
                result: Err(Reason::new(Cause::Transfer, CANCELED)),
                released: true
            })
        );
    }

    #[test]
    fn lost_peer_fails_its_operations_after_announcing_the_loss() {
        let mut sim = Sim::new(SimConfig {
            faults: Faults {
                peer_loss: 1_000_000,
                ..Faults::default()
            },
            ..SimConfig::default()
        });
        sim.post(h(0), PeerId(2)).unwrap();
        assert_eq!(sim.step(), Some(SimEvent::PeerLost(PeerId(2))));
        assert!(matches!(
            sim.step(),
            Some(SimEvent::Completed { result: Err(r), .. }) if r.status.code() == ENDPOINT_TIMEOUT
        ));
    }
}
