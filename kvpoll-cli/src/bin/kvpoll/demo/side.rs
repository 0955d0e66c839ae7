//! What a rank transfers through: one engine, or rails (one engine per
//! network device, `--rail`: `kvpoll::rails`). Pull mode runs on either;
//! push mode (writes into receives) runs on one engine only, since rails
//! carry reads and lends.

use std::time::Duration;

use kvpoll::rails::{RailStats, Rails, RailsError, RailsWaker};
use kvpoll::{
    BlockId, Engine, EngineBuilder, EngineWaker, Incarnation, Outcomes, PeerId, RegionError,
    RequestId, Transfer,
};
use kvpoll_cli::RunError;

#[cfg(not(feature = "fault-injection"))]
use crate::faults::EngineStall;

/// One engine, or one per rail.
// One per rank, made once and never moved on a hot path: boxing the engine
// would only add a load to every call.
#[allow(clippy::large_enum_variant)]
pub enum Side {
    One(Engine),
    Rails(Rails),
}

/// Why a call was refused.
#[derive(Debug, thiserror::Error)]
pub enum SideError {
    #[error(transparent)]
    Submit(#[from] kvpoll::SubmitError),
    #[error(transparent)]
    Peer(#[from] kvpoll::PeerError),
    #[error(transparent)]
    Rails(#[from] RailsError),
    #[error(transparent)]
    Run(#[from] RunError),
    /// Rails carry reads and lends; this needs one engine.
    #[error("{0} runs on one engine: rails carry reads and lends only")]
    OneEngineOnly(&'static str),
    /// One engine was given a peer of several rails.
    #[error("the peer moves blocks over rails: read it over rails too (--rail, once per rail)")]
    RailsPeer,
}

/// Which rails a rank runs, if any.
#[derive(Debug, Clone, Default)]
pub enum RailsSpec {
    /// One engine; UCX chooses its devices.
    #[default]
    None,
    /// One rail per network device (`--rail`).
    Devices(Vec<String>),
    /// One rail per `[[poller]]` of a core map (`--core-map`): pinned to
    /// its core, with its idle policy, bound to its `workers` devices.
    Map(kvpoll::CoreMap),
}

impl RailsSpec {
    pub fn is_none(&self) -> bool {
        matches!(self, RailsSpec::None)
    }

    /// The rails' devices, for a summary.
    pub fn describe(&self) -> String {
        match self {
            RailsSpec::None => String::new(),
            RailsSpec::Devices(d) => d.join(", "),
            RailsSpec::Map(m) => m
                .pollers()
                .iter()
                .map(|p| format!("{} on CPU {}", p.workers.join("+"), p.core))
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}

/// Wakes the engine thread out of [`Side::wait`], from any thread.
#[derive(Clone, Debug)]
pub enum Waker {
    One(EngineWaker),
    Rails(RailsWaker),
}

impl Waker {
    pub fn wake(&self) {
        match self {
            Waker::One(w) => w.wake(),
            Waker::Rails(w) => w.wake(),
        }
    }
}

impl Side {
    /// An engine from `builder` with `layers` regions of `blocks` blocks;
    /// with rails, one such engine per rail.
    pub fn start(
        builder: EngineBuilder,
        rails: &RailsSpec,
        layers: usize,
        blocks: u32,
    ) -> Result<Side, RunError> {
        let b = match rails {
            RailsSpec::None => {
                let mut engine = builder.build()?;
                for _ in 0..layers {
                    engine.register(u64::from(blocks))?;
                }
                return Ok(Side::One(engine));
            }
            RailsSpec::Devices(devices) => devices
                .iter()
                .fold(Rails::builder(), |b, d| b.rail(Some(d), builder.clone())),
            RailsSpec::Map(map) => kvpoll::rails::RailsBuilder::from_core_map(map, builder),
        };
        let mut r = b.build()?;
        for _ in 0..layers {
            r.register(u64::from(blocks))?;
        }
        Ok(Side::Rails(r))
    }

    pub fn is_deaf(&self) -> bool {
        match self {
            Side::One(e) => e.is_deaf(),
            Side::Rails(r) => r.is_deaf(),
        }
    }

    pub fn poll(&mut self, out: &mut Outcomes) -> usize {
        match self {
            Side::One(e) => e.poll(out),
            Side::Rails(r) => r.poll(out),
        }
    }

    pub fn wait(&mut self, out: &mut Outcomes, timeout: Duration) -> usize {
        match self {
            Side::One(e) => e.wait(out, timeout),
            Side::Rails(r) => r.wait(out, timeout),
        }
    }

    pub fn waker(&self) -> Waker {
        match self {
            Side::One(e) => Waker::One(e.waker()),
            Side::Rails(r) => Waker::Rails(r.waker()),
        }
    }

    /// Fault injection: every poller stalls for `d`.
    pub fn stall(&mut self, d: Duration) -> Result<(), SideError> {
        match self {
            Side::One(e) => Ok(e.stall(d)?),
            #[cfg(feature = "fault-injection")]
            Side::Rails(r) => Ok(r.stall(d)?),
            #[cfg(not(feature = "fault-injection"))]
            Side::Rails(_) => Err(SideError::Run(RunError::Stuck(
                "built without fault-injection: no stalls",
            ))),
        }
    }

    pub fn metrics(&self) -> kvpoll::metrics::MetricsSnapshot {
        match self {
            Side::One(e) => e.metrics(),
            Side::Rails(r) => r.metrics(),
        }
    }

    /// Every poller's busy and idle time, in ns.
    pub fn busy_idle(&self) -> (u64, u64) {
        match self {
            Side::One(e) => {
                let s = e.poller_stats();
                (s.busy_ns, s.idle_ns)
            }
            Side::Rails(r) => r.stats().iter().fold((0, 0), |(b, i), s| {
                (b + s.poller.busy_ns, i + s.poller.idle_ns)
            }),
        }
    }

    /// Per rail, what it carried; empty for one engine.
    pub fn rail_stats(&self) -> Vec<RailStats> {
        match self {
            Side::One(_) => Vec::new(),
            Side::Rails(r) => r.stats(),
        }
    }

    pub fn shutdown(&mut self) {
        match self {
            Side::One(e) => e.shutdown(),
            Side::Rails(r) => r.shutdown(),
        }
    }

    pub fn local_metadata(&self) -> Result<Vec<u8>, SideError> {
        match self {
            Side::One(e) => Ok(e.local_metadata()?),
            Side::Rails(r) => Ok(r.local_metadata()?),
        }
    }

    /// Adds a peer this side reads from. One engine does not read a peer
    /// of several rails: each of its lends would stay out on the rails
    /// not read for the lender's grace.
    pub fn add_lender(&mut self, metadata: &[u8]) -> Result<PeerId, SideError> {
        match self {
            Side::One(_) if kvpoll::rails::is_frame(metadata) => Err(SideError::RailsPeer),
            Side::One(e) => Ok(e.add_peer(metadata)?),
            Side::Rails(r) => Ok(r.add_peer(metadata)?),
        }
    }

    /// Adds a peer this side lends to (or writes to, push): one engine
    /// reaches a peer of several rails through its rail 0.
    pub fn add_reader(&mut self, metadata: &[u8]) -> Result<PeerId, SideError> {
        match self {
            Side::One(e) if kvpoll::rails::is_frame(metadata) => {
                Ok(e.add_peer(kvpoll::rails::rail_0_metadata(metadata)?)?)
            }
            Side::One(e) => Ok(e.add_peer(metadata)?),
            Side::Rails(r) => Ok(r.add_peer(metadata)?),
        }
    }

    pub fn remove_peer(&mut self, peer: PeerId) -> Result<(), SideError> {
        match self {
            Side::One(e) => Ok(e.remove_peer(peer)?),
            Side::Rails(r) => Ok(r.remove_peer(peer)?),
        }
    }

    pub fn read(&mut self, id: RequestId, handles: &[Transfer<'_>]) -> Result<(), SideError> {
        match self {
            Side::One(e) => Ok(e.read(id, handles)?),
            Side::Rails(r) => Ok(r.read(id, handles)?),
        }
    }

    pub fn lend(
        &mut self,
        id: RequestId,
        blocks: &[BlockId],
        readers: u32,
        lease: Duration,
    ) -> Result<Incarnation, SideError> {
        match self {
            Side::One(e) => Ok(e.lend(id, blocks, readers, lease)?),
            Side::Rails(r) => Ok(r.lend(id, blocks, readers, lease)?),
        }
    }

    pub fn abort(&mut self, id: RequestId) -> Result<(), SideError> {
        match self {
            Side::One(e) => Ok(e.abort(id)?),
            Side::Rails(r) => Ok(r.abort(id)?),
        }
    }

    pub fn notify_only(
        &mut self,
        id: RequestId,
        producers: &[(PeerId, Incarnation)],
    ) -> Result<(), SideError> {
        match self {
            Side::One(e) => Ok(e.notify_only(id, producers)?),
            Side::Rails(r) => Ok(r.notify_only(id, producers)?),
        }
    }

    /// The one engine, for what rails do not carry (push mode).
    pub fn one(&mut self, what: &'static str) -> Result<&mut Engine, SideError> {
        match self {
            Side::One(e) => Ok(e),
            Side::Rails(_) => Err(SideError::OneEngineOnly(what)),
        }
    }

    pub fn write_block(
        &self,
        region: usize,
        block: BlockId,
        data: &[u8],
    ) -> Result<(), RegionError> {
        match self {
            Side::One(e) => e.write_block(region, block, data),
            Side::Rails(r) => r.write_block(region, block, data),
        }
    }

    pub fn read_block(
        &self,
        region: usize,
        block: BlockId,
        out: &mut [u8],
    ) -> Result<(), RegionError> {
        match self {
            Side::One(e) => e.read_block(region, block, out),
            Side::Rails(r) => r.read_block(region, block, out),
        }
    }
}
