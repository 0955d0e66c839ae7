//! What users compare: kvpoll next to the physical limits and to other
//! transfer systems, over the shapes of disaggregated serving, in one run.
//!
//! Shapes ([`SMALL`], [`LAYERS`], [`LARGE`]): 16 KiB reads with 64 in
//! flight; a multi-layer request (32 layers × 4 blocks × 64 KiB = 8 MiB,
//! two in flight); one 64 MiB read. Request `i` names blocks `i·k + j`
//! (mod the peer's blocks) of every layer, so consecutive requests touch
//! different memory, and every `check_every`th request's bytes are
//! compared with the pattern the producer wrote (its time is not counted).
//!
//! A [`Group`] is one shape over one [`Link`] (shared memory, tcp over
//! loopback, tcp over a veth pair between two network namespaces), one
//! kind of memory (UCX-allocated, or caller memory: an mmap the engine
//! did not allocate, on huge pages where the kernel gives them) and one
//! direction (pull or push). Its systems run a warm-up round each, then
//! interleaved timed rounds (round i of every system, then round i + 1),
//! each at least [`RoundSize`] long (1 GB and 2 s by default); a system's
//! figure is its median round with the slowest and fastest beside it, and
//! its CPU is every thread of both of its processes over all rounds
//! (`/proc/<pid>/task/*/schedstat`):
//!
//! - **kvpoll**: an [`Engine`] here against a `kvpoll engine-peer`
//!   process; read confirmation on (the default: the peer lends every
//!   request), its caller blocking in `Engine::wait`, and in caller
//!   memory also as a serving loop drives it (one poll a step, then the
//!   core given up); for small reads also without confirmation.
//! - **raw UCX loop**: `get_batch` + `progress` against a `kvpoll
//!   ucx-peer`, one notification a request, no bookkeeping.
//! - **limits**: `memcpy` in this process and `process_vm_readv` from a
//!   `kvpoll mem-peer` (shared memory), a plain tcp stream of the same
//!   bytes over the group's link (tcp).
//! - **peers**: NIXL (progress threads on, as installed, and off; the
//!   best of its settings is "NIXL best") and Mooncake Transfer Engine
//!   (asynchronous batches in flight) through
//!   `benches/peers/peer_bench.py`, when a Python that imports them is
//!   given ([`Peers`]); otherwise they are listed as not measured.
//!
//! A system that was to run and did not start, or failed a round, is a
//! failed system, and its group failed; one not installed or not
//! applicable is not measured.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use kvpoll::transport::ucx::{
    BlockOp, Completion, Context, ContextOptions, Endpoint, MemoryRegion, PackedRkey, RemoteKey,
    Worker, WorkerAddress,
};
use kvpoll::wire::from_hex;
use kvpoll::{BlockId, Engine, Incarnation, Outcomes, PeerId, RequestId, Transfer};

use super::e2e::{
    lend_of, lent_line, median, poll_some, raw_completion, E2eError, PeerProcess, Waiting,
};
use super::memory::{cpu_clock, cpu_ns, CallerMemory, ThreadSplit};
use crate::pattern;

/// A run that takes longer than this is stuck, not slow.
const GUARD: Duration = Duration::from_secs(60);
/// The seed of the engine peer's pattern (region r: `SEED * 100 + r`) and
/// of the ucx and mem peers' (block b of their one region: `fill(SEED, b)`).
const SEED: u64 = 1;
/// The seed of what a writer writes (region r: `WRITER_SEED * 100 + r`).
const WRITER_SEED: u64 = 7;

/// One request shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Short name (JSON key part).
    pub name: &'static str,
    /// What the table calls it.
    pub label: &'static str,
    /// Bytes per block.
    pub block_size: u64,
    /// Layers (registered regions).
    pub regions: u32,
    /// Blocks per layer a request names.
    pub blocks: u32,
    /// Requests in flight.
    pub in_flight: u32,
    /// Blocks per layer on the producer.
    pub peer_blocks: u64,
    /// Requests a round over shared memory.
    pub requests_shm: u32,
    /// Requests a round over tcp.
    pub requests_tcp: u32,
    /// Every this many requests, one is checked byte for byte.
    pub check_every: u32,
}

impl Shape {
    /// Bytes one request moves.
    pub fn bytes(&self) -> u64 {
        self.block_size * u64::from(self.regions * self.blocks)
    }

    fn slots(&self) -> u32 {
        self.in_flight * self.blocks
    }

    /// Block `j` of layer `r` of request `id` on a producer that holds
    /// every layer in one region, layer after layer (the raw loop's and
    /// `process_vm_readv`'s peers, the `memcpy` source).
    fn flat_remote(&self, r: u32, id: u64, j: u32) -> u64 {
        u64::from(r) * self.peer_blocks + u64::from(self.remote(id, j))
    }

    /// Where block `j` of layer `r` of request `id` lands in a reader that
    /// holds every layer in one buffer, layer after layer (the limits'):
    /// in the request's slot of `in_flight`, as kvpoll's reads land, so
    /// that every system writes the same span of memory.
    fn flat_local(&self, r: u32, id: u64, j: u32) -> u64 {
        let slot = (id % u64::from(self.in_flight)) as u32;
        u64::from(r * self.slots() + slot * self.blocks + j)
    }

    /// Block `j` (of `k`) of request `id` on the producer.
    fn remote(&self, id: u64, j: u32) -> u32 {
        ((id * u64::from(self.blocks) + u64::from(j)) % self.peer_blocks) as u32
    }
}

/// 16 KiB reads, 64 in flight (64 MiB on the producer).
pub const SMALL: Shape = Shape {
    name: "small",
    label: "16 KiB reads, 64 in flight",
    block_size: 16 << 10,
    regions: 1,
    blocks: 1,
    in_flight: 64,
    peer_blocks: 4096,
    requests_shm: 20_000,
    requests_tcp: 4_000,
    check_every: 64,
};

/// A request of 32 layers × 4 blocks × 64 KiB (8 MiB), 2 in flight (64 MiB
/// on the producer).
pub const LAYERS: Shape = Shape {
    name: "layers",
    label: "8 MiB requests (32 layers x 4 x 64 KiB)",
    block_size: 64 << 10,
    regions: 32,
    blocks: 4,
    in_flight: 2,
    peer_blocks: 32,
    requests_shm: 48,
    requests_tcp: 12,
    check_every: 32,
};

/// One 64 MiB read at a time (128 MiB on the producer).
pub const LARGE: Shape = Shape {
    name: "large",
    label: "one 64 MiB read",
    block_size: 64 << 20,
    regions: 1,
    blocks: 1,
    in_flight: 1,
    peer_blocks: 2,
    requests_shm: 6,
    requests_tcp: 2,
    check_every: 2,
};

/// Pull (the consumer reads) or push (the producer writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Reads.
    Read,
    /// Writes into blocks the destination lent to writers.
    Write,
}

/// Where both sides' blocks live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Allocated and registered by UCX (`Engine::register`).
    Ucx,
    /// An mmap the engine did not allocate (`Engine::register_memory`).
    Caller,
}

/// What a group's two sides talk over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// Shared memory (and cma) on one host.
    Shm,
    /// tcp over the loopback device of one network namespace.
    Loopback,
    /// tcp over a veth pair between two network namespaces (MTU 1500):
    /// a real socket path, each side's packets through its own stack.
    Veth,
}

impl Link {
    /// Its name in keys and titles.
    pub fn name(self) -> &'static str {
        match self {
            Link::Shm => "shm",
            Link::Loopback => "loopback",
            Link::Veth => "veth",
        }
    }

    /// Whether it is a tcp link.
    pub fn tcp(self) -> bool {
        self != Link::Shm
    }
}

/// The two ends of a veth link, as the processes of a group over it see
/// them: the peers run in `netns`, this process in the other one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VethEnds {
    /// The network namespace of the peers' side.
    pub netns: String,
    /// This side's address.
    pub near: String,
    /// The peers' side's address.
    pub far: String,
}

/// One comparison: a shape over a link, a memory kind and a direction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// The shape.
    pub shape: Shape,
    /// The link.
    pub link: Link,
    /// UCX transports (`tcp`, or shared memory: `posix,sysv,cma`).
    pub tls: String,
    /// Memory kind.
    pub memory: Memory,
    /// Direction.
    pub op: Op,
    /// Requests of a system's warm-up round, four times over (the
    /// shape's, for this link, unless scaled). A timed round's size is
    /// [`RoundSize`]'s.
    pub requests: u32,
}

impl Group {
    /// The shape over `link` (shared memory: the transports `shm`) with
    /// its default request count.
    pub fn new(shape: Shape, link: Link, shm: &str, memory: Memory, op: Op) -> Self {
        let requests = if link.tcp() {
            shape.requests_tcp
        } else {
            shape.requests_shm
        };
        Group {
            shape,
            link,
            tls: if link.tcp() { "tcp".into() } else { shm.into() },
            memory,
            op,
            requests,
        }
    }

    /// Whether it runs over tcp.
    pub fn tcp(&self) -> bool {
        self.link.tcp()
    }

    /// A key for JSON: `layers_shm_caller_pull`, `large_veth_caller_pull`.
    pub fn key(&self) -> String {
        format!(
            "{}_{}_{}_{}",
            self.shape.name,
            self.link.name(),
            match self.memory {
                Memory::Ucx => "ucx",
                Memory::Caller => "caller",
            },
            match self.op {
                Op::Read => "pull",
                Op::Write => "push",
            }
        )
    }

    /// A title: `8 MiB requests (...), shm, caller memory, pull`.
    pub fn title(&self) -> String {
        format!(
            "{}, {}, {}, {}",
            self.shape.label,
            match self.link {
                Link::Shm => "shm",
                Link::Loopback => "tcp over loopback",
                Link::Veth => "tcp over veth",
            },
            match self.memory {
                Memory::Ucx => "UCX-allocated memory",
                Memory::Caller => "caller memory",
            },
            match self.op {
                Op::Read => "pull",
                Op::Write => "push",
            }
        )
    }
}

/// The comparison groups `kvpoll bench compare` runs: every shape over
/// shared memory in both memory kinds and over tcp in caller memory, pull;
/// the multi-layer request also pushed. The tcp groups run over loopback,
/// and over a veth link too where `veth` (one can be made here).
pub fn default_groups(shm: &str, veth: bool) -> Vec<Group> {
    let mut v = Vec::new();
    for shape in [SMALL, LAYERS, LARGE] {
        for memory in [Memory::Ucx, Memory::Caller] {
            v.push(Group::new(shape, Link::Shm, shm, memory, Op::Read));
        }
        if shape == LAYERS {
            v.push(Group::new(shape, Link::Shm, shm, Memory::Caller, Op::Write));
        }
    }
    let links: &[Link] = if veth {
        &[Link::Veth, Link::Loopback]
    } else {
        &[Link::Loopback]
    };
    for &link in links {
        for shape in [SMALL, LAYERS, LARGE] {
            v.push(Group::new(shape, link, shm, Memory::Caller, Op::Read));
            if shape == LAYERS {
                v.push(Group::new(shape, link, shm, Memory::Caller, Op::Write));
            }
        }
    }
    v
}

/// How long a timed round of each system is: at least `min_bytes` moved
/// and at least `min_secs` long, whichever takes longer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundSize {
    /// Bytes a round moves at least.
    pub min_bytes: f64,
    /// Seconds a round lasts at least.
    pub min_secs: f64,
}

impl RoundSize {
    /// 1 GB or 2 s, whichever is longer, times `scale`.
    pub fn scaled(scale: f64) -> Self {
        RoundSize {
            min_bytes: 1e9 * scale,
            min_secs: 2.0 * scale,
        }
    }

    /// Requests still to run, at `per_s`, for a round that has moved
    /// `bytes` in `secs` so far (requests of `request_bytes`); 0: done.
    fn more(&self, request_bytes: f64, per_s: f64, bytes: f64, secs: f64) -> u32 {
        if bytes >= self.min_bytes && secs >= self.min_secs {
            return 0;
        }
        let for_bytes = (self.min_bytes - bytes).max(0.0) / request_bytes;
        let for_secs = (self.min_secs - secs).max(0.0) * per_s;
        // A little over, so that one run usually does it.
        (for_bytes.max(for_secs) * 1.05)
            .ceil()
            .clamp(1.0, 50_000_000.0) as u32
    }
}

/// Where the other systems come from.
#[derive(Debug, Clone, Default)]
pub struct Peers {
    /// A Python that imports `nixl_cu12` and `mooncake` (the venv `make
    /// bench-peers` makes), or none: then they are not measured.
    pub python: Option<PathBuf>,
    /// The driver script (written out of the binary by the caller).
    pub script: Option<PathBuf>,
    /// UCX options (names without `UCX_`) of one more kvpoll system,
    /// [`KVPOLL_ALT`], for comparing settings in one run; none: no such
    /// system.
    pub alt_ucx: Vec<(String, String)>,
    /// Over a veth link: where the peers' side is. Every peer process
    /// (kvpoll's, the raw loop's, NIXL's and Mooncake's targets, the tcp
    /// stream's receiver) runs there; this process is the other end.
    pub veth: Option<VethEnds>,
}

/// One timed round of one system.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Round {
    /// Requests done.
    pub requests: u32,
    /// Seconds, check time left out.
    pub secs: f64,
    /// CPU of every thread of both processes, ns, the reading side's data
    /// checks left out.
    pub cpu_ns: u64,
    /// Requests whose bytes were checked.
    pub checked: u64,
    /// Of them, how many were wrong.
    pub bad: u64,
}

/// One system's figures in one group.
#[derive(Debug, Clone, PartialEq)]
pub struct SystemFigures {
    /// Which system.
    pub system: String,
    /// Requests per second of each timed round, in round order (round i
    /// of every system of a group ran back to back).
    pub rates: Vec<f64>,
    /// Requests per second, median round.
    pub per_s: f64,
    /// Requests per second, slowest round.
    pub per_s_min: f64,
    /// Requests per second, fastest round.
    pub per_s_max: f64,
    /// Gigabytes (10⁹ bytes) per second, median round.
    pub gb_per_s: f64,
    /// Seconds of the median round.
    pub round_secs: f64,
    /// Gigabytes the median round moved.
    pub round_gb: f64,
    /// CPU seconds per gigabyte moved, both processes, all rounds.
    pub cpu_s_per_gb: f64,
    /// CPU microseconds per request, both processes, all rounds.
    pub cpu_us_per_request: f64,
    /// Requests checked byte for byte, and of them wrong.
    pub checked: u64,
    /// Wrong ones among them.
    pub bad: u64,
}

impl SystemFigures {
    /// The figures of `rounds` (each a whole timed round) of requests of
    /// `bytes`.
    fn of(system: &str, rounds: &[Round], bytes: f64) -> Self {
        let rates: Vec<f64> = rounds
            .iter()
            .map(|r| f64::from(r.requests) / r.secs.max(1e-9))
            .collect();
        let mut sorted = rates.clone();
        let per_s = median(&mut sorted);
        let mut secs: Vec<f64> = rounds.iter().map(|r| r.secs).collect();
        let mut gb: Vec<f64> = rounds
            .iter()
            .map(|r| f64::from(r.requests) * bytes / 1e9)
            .collect();
        let requests: u64 = rounds.iter().map(|r| u64::from(r.requests)).sum();
        let cpu: u64 = rounds.iter().map(|r| r.cpu_ns).sum();
        SystemFigures {
            system: system.to_owned(),
            per_s,
            per_s_min: sorted.first().copied().unwrap_or(0.0),
            per_s_max: sorted.last().copied().unwrap_or(0.0),
            rates,
            gb_per_s: per_s * bytes / 1e9,
            round_secs: median(&mut secs),
            round_gb: median(&mut gb),
            cpu_s_per_gb: cpu as f64 / (bytes * requests.max(1) as f64),
            cpu_us_per_request: cpu as f64 / 1e3 / requests.max(1) as f64,
            checked: rounds.iter().map(|r| r.checked).sum(),
            bad: rounds.iter().map(|r| r.bad).sum(),
        }
    }

    /// One tab-separated line for the process that runs a group
    /// elsewhere ([`GroupFigures::from_lines`] reads it).
    fn to_line(&self) -> String {
        let rates: Vec<String> = self.rates.iter().map(|r| format!("{r:e}")).collect();
        format!(
            "SYSTEM\t{}\t{:e}\t{:e}\t{:e}\t{:e}\t{:e}\t{:e}\t{:e}\t{:e}\t{}\t{}\t{}",
            self.system,
            self.per_s,
            self.per_s_min,
            self.per_s_max,
            self.gb_per_s,
            self.round_secs,
            self.round_gb,
            self.cpu_s_per_gb,
            self.cpu_us_per_request,
            self.checked,
            self.bad,
            rates.join(",")
        )
    }

    fn from_fields(f: &[&str]) -> Option<Self> {
        let x = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
        let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
        let rates = match f.get(12) {
            Some(r) if !r.is_empty() => r
                .split(',')
                .map(|v| v.parse::<f64>().ok())
                .collect::<Option<Vec<_>>>()?,
            _ => Vec::new(),
        };
        Some(SystemFigures {
            system: (*f.get(1)?).to_owned(),
            per_s: x(2)?,
            per_s_min: x(3)?,
            per_s_max: x(4)?,
            gb_per_s: x(5)?,
            round_secs: x(6)?,
            round_gb: x(7)?,
            cpu_s_per_gb: x(8)?,
            cpu_us_per_request: x(9)?,
            checked: n(10)?,
            bad: n(11)?,
            rates,
        })
    }
}

/// Every system's figures in one group, the systems not measured, and
/// those that failed.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupFigures {
    /// What ran.
    pub group: Group,
    /// Those measured.
    pub systems: Vec<SystemFigures>,
    /// Those not measured (not installed, not applicable), and why.
    pub absent: Vec<(String, String)>,
    /// Those that were to be measured and failed (did not start, or
    /// failed in a round), and how: the group failed.
    pub failed: Vec<(String, String)>,
}

impl GroupFigures {
    /// A system's figures.
    pub fn get(&self, system: &str) -> Option<&SystemFigures> {
        self.systems.iter().find(|s| s.system == system)
    }

    /// Why `system` failed, if it did. [`NIXL_BEST`] and [`KVPOLL_BEST`]:
    /// why one of their settings failed.
    pub fn failure(&self, system: &str) -> Option<&str> {
        self.failed
            .iter()
            .find(|(s, _)| match system {
                NIXL_BEST => s.starts_with(NIXL),
                KVPOLL_BEST => s == KVPOLL || s == KVPOLL_BATCHED,
                _ => s == system,
            })
            .map(|(_, why)| why.as_str())
    }

    /// A system, or the best of [`NIXL_BEST`]'s or [`KVPOLL_BEST`]'s.
    pub fn pick(&self, system: &str) -> Option<&SystemFigures> {
        match system {
            NIXL_BEST => self.nixl_best(),
            KVPOLL_BEST => self.kvpoll_best(),
            _ => self.get(system),
        }
    }

    /// The best of NIXL's settings (progress threads on as installed, or
    /// off; per request or batched) by rate: its name says which.
    pub fn nixl_best(&self) -> Option<&SystemFigures> {
        self.systems
            .iter()
            .filter(|s| s.system.starts_with(NIXL))
            .max_by(|a, b| a.per_s.total_cmp(&b.per_s))
    }

    /// The better of kvpoll's confirmed settings (per request, batched)
    /// by rate.
    pub fn kvpoll_best(&self) -> Option<&SystemFigures> {
        self.systems
            .iter()
            .filter(|s| s.system == KVPOLL || s.system == KVPOLL_BATCHED)
            .max_by(|a, b| a.per_s.total_cmp(&b.per_s))
    }

    /// One JSON object.
    pub fn to_json(&self) -> String {
        let text = |s: &str| s.replace(['"', '\\'], "'").replace(['\n', '\t'], " ");
        let systems: Vec<String> = self
            .systems
            .iter()
            .map(|s| {
                let rates: Vec<String> = s.rates.iter().map(|r| format!("{r:.2}")).collect();
                format!(
                    "{{\"system\":\"{}\",\"per_s\":{:.2},\"per_s_min\":{:.2},\"per_s_max\":{:.2},\"rounds_per_s\":[{}],\"gb_per_s\":{:.4},\"round_secs\":{:.3},\"round_gb\":{:.3},\"cpu_s_per_gb\":{:.4},\"cpu_us_per_request\":{:.3},\"checked\":{},\"bad\":{}}}",
                    s.system, s.per_s, s.per_s_min, s.per_s_max, rates.join(","), s.gb_per_s, s.round_secs, s.round_gb, s.cpu_s_per_gb, s.cpu_us_per_request, s.checked, s.bad
                )
            })
            .collect();
        let list = |v: &[(String, String)]| -> String {
            v.iter()
                .map(|(s, why)| format!("{{\"system\":\"{s}\",\"why\":\"{}\"}}", text(why)))
                .collect::<Vec<_>>()
                .join(",")
        };
        format!(
            "{{\"group\":\"{}\",\"title\":\"{}\",\"link\":\"{}\",\"tls\":\"{}\",\"bytes_per_request\":{},\"nixl_best\":{},\"systems\":[{}],\"not_measured\":[{}],\"failed\":[{}]}}",
            self.group.key(),
            self.group.title(),
            self.group.link.name(),
            self.group.tls,
            self.group.shape.bytes(),
            self.nixl_best()
                .map_or("null".into(), |s| format!("\"{}\"", s.system)),
            systems.join(","),
            list(&self.absent),
            list(&self.failed)
        )
    }

    /// Lines for the process that runs the group elsewhere: one a system
    /// measured, absent or failed.
    pub fn to_lines(&self) -> String {
        let clean = |s: &str| s.replace(['\t', '\n'], " ");
        let mut out = String::new();
        for s in &self.systems {
            out.push_str(&s.to_line());
            out.push('\n');
        }
        for (s, why) in &self.absent {
            out.push_str(&format!("ABSENT\t{s}\t{}\n", clean(why)));
        }
        for (s, why) in &self.failed {
            out.push_str(&format!("FAILED\t{s}\t{}\n", clean(why)));
        }
        out
    }

    /// The figures of `group` from [`GroupFigures::to_lines`]'s lines
    /// (other lines are skipped); none if a `SYSTEM` line is malformed.
    pub fn from_lines(group: Group, text: &str) -> Option<Self> {
        let mut g = GroupFigures {
            group,
            systems: Vec::new(),
            absent: Vec::new(),
            failed: Vec::new(),
        };
        for line in text.lines() {
            let f: Vec<&str> = line.split('\t').collect();
            match f[0] {
                "SYSTEM" => g.systems.push(SystemFigures::from_fields(&f)?),
                "ABSENT" if f.len() == 3 => g.absent.push((f[1].into(), f[2].into())),
                "FAILED" if f.len() == 3 => g.failed.push((f[1].into(), f[2].into())),
                _ => {}
            }
        }
        Some(g)
    }
}

/// kvpoll with read confirmation (the default), its caller blocking in
/// `Engine::wait` while its transfers run.
pub const KVPOLL: &str = "kvpoll";
/// kvpoll as a serving loop drives it: the caller polls once a step and
/// gives up the core after each step (`Engine::poll`, then yield).
pub const KVPOLL_SERVING: &str = "kvpoll, serving loop";
/// kvpoll with `confirm_reads(false)`.
pub const KVPOLL_UNCONFIRMED: &str = "kvpoll, no confirmation";
/// kvpoll in waves, as NIXL's batched setting runs: a wave of small
/// reads is one request ([`KvpollWavesRunner`]).
pub const KVPOLL_BATCHED: &str = "kvpoll, batched";
/// kvpoll with the UCX options of [`Peers::alt_ucx`] on top.
pub const KVPOLL_ALT: &str = "kvpoll, other UCX options";
/// kvpoll with both engines keyed (`kvpoll::auth`): what tagging every
/// notification message and checking it costs.
pub const KVPOLL_KEYED: &str = "kvpoll, keyed";
/// The secret of [`KVPOLL_KEYED`]'s engines.
const BENCH_SECRET: &str = "kvpoll bench compare's shared secret";
/// The raw UCX loop.
pub const RAW: &str = "raw UCX loop";
/// `memcpy` in one process.
pub const MEMCPY: &str = "memcpy";
/// `process_vm_readv` from another process.
pub const PVREADV: &str = "process_vm_readv";
/// A plain tcp socket stream over the group's link (loopback, or the
/// veth pair): the wire's rate and CPU on this path.
pub const TCP_STREAM: &str = "tcp stream";
/// NIXL as installed (its agents' progress threads on), one transfer a
/// request. Every NIXL system's name starts with this.
pub const NIXL: &str = "NIXL";
/// NIXL with its progress threads off: the initiator's loop and the
/// target's progress it between transfers.
pub const NIXL_NO_PT: &str = "NIXL, no progress thread";
/// NIXL as installed, one transfer a wave of requests.
pub const NIXL_BATCHED: &str = "NIXL, batched";
/// NIXL without progress threads, one transfer a wave of requests.
pub const NIXL_BATCHED_NO_PT: &str = "NIXL, batched, no progress thread";
/// The best of NIXL's settings in a group ([`GroupFigures::nixl_best`]).
pub const NIXL_BEST: &str = "NIXL best";
/// The better of kvpoll's confirmed settings in a group
/// ([`GroupFigures::kvpoll_best`]).
pub const KVPOLL_BEST: &str = "kvpoll (best)";
/// Mooncake Transfer Engine, several asynchronous batches in flight.
pub const MOONCAKE: &str = "Mooncake";

/// A system that can run rounds.
trait Runner {
    fn run(&mut self, n: u32) -> Result<Round, E2eError>;
    /// Requests of a round relative to the group's (slow drivers run
    /// fewer; rates are per second).
    fn scale(&self) -> f64 {
        1.0
    }
    /// Stops the system's processes between its rounds (an idle progress
    /// thread would take a core from the system being timed).
    fn pause(&mut self) {}
    /// Lets them run again.
    fn resume(&mut self) {}
    /// The system's processes other than this one (for
    /// [`ThreadSplit`]).
    fn peer_pids(&self) -> Vec<u32> {
        Vec::new()
    }
}

/// The sampled data checks of one round, and the time and CPU they took
/// (left out of the round's time and CPU: checking is the bench's work,
/// not the system's, and each system's memory is read its own way).
#[derive(Default)]
struct Checks {
    checked: u64,
    bad: u64,
    time: Duration,
    cpu_ns: u64,
}

/// When a check began, by the wall clock and the checking thread's CPU
/// clock.
struct Began {
    at: Instant,
    cpu_ns: u64,
}

impl Began {
    fn now() -> Self {
        Began {
            at: Instant::now(),
            cpu_ns: cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID),
        }
    }
}

impl Checks {
    /// One check, begun at `began` on this thread, that found the bytes
    /// `ok` or not.
    fn record(&mut self, began: Began, ok: bool) {
        self.checked += 1;
        self.bad += u64::from(!ok);
        self.time += began.at.elapsed();
        self.cpu_ns += cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID).saturating_sub(began.cpu_ns);
    }

    /// The round of `requests` begun at `t0` that took `cpu_ns` of CPU,
    /// its checks' included.
    fn round(self, requests: u32, t0: Instant, cpu_ns: u64) -> Round {
        Round {
            requests,
            secs: (t0.elapsed() - self.time).as_secs_f64(),
            cpu_ns: cpu_ns.saturating_sub(self.cpu_ns),
            checked: self.checked,
            bad: self.bad,
        }
    }
}

/// A peer's blocks, their size and the seed of their pattern, as its
/// command line says them.
fn blocks_args(blocks: u64, block_size: u64) -> [String; 6] {
    [
        "--blocks".into(),
        blocks.to_string(),
        "--block-size".into(),
        block_size.to_string(),
        "--seed".into(),
        SEED.to_string(),
    ]
}

fn failed(what: &str, e: impl std::fmt::Display) -> E2eError {
    E2eError::Failed(format!("{what}: {e}"))
}

/// CPU time of this whole process so far, ns: every thread's, including
/// threads that already ended (a sum over `/proc/self/task` would drop a
/// thread that ended inside the span measured, and the span's CPU with it).
fn self_cpu() -> u64 {
    cpu_clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// Slots (of `in_flight`) not in use, and which request holds each.
struct Slots {
    free: Vec<u32>,
    of: Vec<u32>,
}

impl Slots {
    fn new(in_flight: u32, n: u32) -> Self {
        Slots {
            free: (0..in_flight).rev().collect(),
            of: vec![0; n as usize],
        }
    }
}

// ---------------------------------------------------------------- kvpoll

/// How a kvpoll system is set up: read confirmation, UCX options on top
/// of kvpoll's own (names without `UCX_`), a shared key, and how its
/// caller waits.
#[derive(Clone, Copy, Default)]
struct KvpollSetting<'a> {
    unconfirmed: bool,
    ucx: &'a [(String, String)],
    keyed: bool,
    serving_loop: bool,
}

struct KvpollRunner {
    engine: Engine,
    /// The caller polls once a step and yields (a serving loop), rather
    /// than blocking in `Engine::wait`.
    serving_loop: bool,
    peer: PeerId,
    shape: Shape,
    op: Op,
    out: Outcomes,
    next_id: u64,
    lent: mpsc::Receiver<(u64, Incarnation)>,
    /// A push destination's checks: (request id, whether its bytes were right).
    checks: mpsc::Receiver<(u64, bool)>,
    /// Checks that arrived before their round looked for them.
    early_checks: HashMap<u64, bool>,
    buf: Vec<u8>,
    /// How many of a checked request's blocks (from its first) are
    /// compared: all of them, or one for a wave of reads.
    check_blocks: usize,
    peer_pid: u32,
    _mem: Vec<CallerMemory>,
    _peer: PeerProcess,
}

impl Drop for KvpollRunner {
    fn drop(&mut self) {
        self.engine.shutdown();
    }
}

/// How long a writer waits, after its round, for the destination's
/// report on a push it checked.
const DESTINATION_CHECK_WAIT: Duration = Duration::from_secs(10);

/// A destination's `CHECKED <id> ok|bad` line.
fn checked_line(line: &str) -> Option<(u64, bool)> {
    let (id, verdict) = line.trim().strip_prefix("CHECKED ")?.split_once(' ')?;
    let ok = match verdict {
        "ok" => true,
        "bad" => false,
        _ => return None,
    };
    Some((id.parse().ok()?, ok))
}

/// A lending peer's lends (id, incarnation) and a destination's checks
/// (id, whether the bytes were right), as they arrive.
type PeerLines = (
    mpsc::Receiver<(u64, Incarnation)>,
    mpsc::Receiver<(u64, bool)>,
);

/// Reads a lending peer's output: `LENT` lines and `CHECKED` lines.
fn read_peer_lines(p: &mut PeerProcess) -> PeerLines {
    let (ltx, lrx) = mpsc::channel();
    let (ctx, crx) = mpsc::channel();
    for &l in &p.lent {
        let _ = ltx.send(l);
    }
    if let Some(mut out) = p.stdout.take() {
        std::thread::spawn(move || {
            let mut line = String::new();
            while matches!(out.read_line(&mut line), Ok(n) if n > 0) {
                if let Some(l) = lent_line(&line) {
                    let _ = ltx.send(l);
                } else if let Some(c) = checked_line(&line) {
                    let _ = ctx.send(c);
                }
                line.clear();
            }
        });
    }
    (lrx, crx)
}

impl KvpollRunner {
    /// The engine-peer runs in `veth`'s far namespace, where given.
    fn new(
        exe: &Path,
        g: &Group,
        veth: Option<&VethEnds>,
        setting: KvpollSetting<'_>,
    ) -> Result<Self, E2eError> {
        let KvpollSetting {
            unconfirmed,
            ucx,
            keyed,
            serving_loop,
        } = setting;
        let confirm = !unconfirmed;
        let s = g.shape;
        let mut args: Vec<String> = vec![
            "--tls".into(),
            g.tls.clone(),
            "--regions".into(),
            s.regions.to_string(),
            "--memory".into(),
            mem_arg(g.memory).into(),
        ];
        args.extend(blocks_args(s.peer_blocks, s.block_size));
        // Every system lends (with confirmation off too: its reads tell
        // their lender afterwards, as a serving engine's would), enough
        // ahead that a read never outruns its lend.
        let ahead = (4 * g.requests).clamp(64, 8192);
        args.extend([
            "--lend-ahead".into(),
            ahead.to_string(),
            "--lend-blocks".into(),
            s.blocks.to_string(),
        ]);
        if g.op == Op::Write {
            args.extend([
                "--lend-to".into(),
                "writers".into(),
                "--check-every".into(),
                s.check_every.to_string(),
                "--writer-seed".into(),
                WRITER_SEED.to_string(),
            ]);
        }
        let mut env: Vec<(String, String)> = ucx
            .iter()
            .map(|(k, v)| (format!("UCX_{}", k.trim_start_matches("UCX_")), v.clone()))
            .collect();
        if keyed {
            env.push((kvpoll::auth::ENV.into(), BENCH_SECRET.into()));
        }
        let key = keyed
            .then(|| kvpoll::auth::AuthKey::from_secret(BENCH_SECRET.as_bytes()))
            .transpose()
            .map_err(|e| failed("the bench key", e))?;
        let mut peer = in_netns(veth, || {
            PeerProcess::spawn_with_env(exe, "engine-peer", &args, &env)
        })??;
        let mut options = ContextOptions::with_transports(&g.tls);
        for (k, v) in ucx {
            options = options.option(k, v);
        }
        let metadata = from_hex(&peer.ready).map_err(|_| E2eError::Peer {
            what: "engine-peer",
            why: "metadata is not hex".into(),
        })?;
        let (lent, checks) = read_peer_lines(&mut peer);
        let mut engine = Engine::builder()
            .block_size(s.block_size)
            .ucx(options)
            .confirm_reads(confirm)
            .auth_key(key)
            .build()?;
        let local_blocks = match g.op {
            Op::Read => u64::from(s.slots()),
            Op::Write => s.peer_blocks,
        };
        let len = (local_blocks * s.block_size) as usize;
        let mut mem = Vec::new();
        for _ in 0..s.regions {
            match g.memory {
                Memory::Ucx => {
                    engine.register(local_blocks)?;
                }
                Memory::Caller => {
                    let m = CallerMemory::new(len).map_err(|e| failed("mmap", e))?;
                    // SAFETY: the mapping is kept in the runner, dropped
                    // after the engine has shut down.
                    unsafe { engine.register_memory(m.as_ptr(), len)? };
                    mem.push(m);
                }
            }
        }
        let mut buf = vec![0u8; s.block_size as usize];
        if g.op == Op::Write {
            for r in 0..s.regions as usize {
                for b in 0..s.peer_blocks {
                    pattern::fill(WRITER_SEED * 100 + r as u64, b, &mut buf);
                    engine.write_block(r, BlockId(b as u32), &buf)?;
                }
            }
        }
        let peer_id = engine.add_peer(&metadata)?;
        if g.op == Op::Write {
            // The destination acknowledges writers it knows.
            let meta = engine.local_metadata()?;
            let hex = kvpoll::wire::to_hex(&meta);
            let sent = peer
                .stdin
                .as_mut()
                .map(|s| writeln!(s, "PEER {hex}").and_then(|_| s.flush()));
            if !matches!(sent, Some(Ok(()))) {
                return Err(E2eError::Peer {
                    what: "engine-peer",
                    why: "could not send it the writer's metadata".into(),
                });
            }
        }
        Ok(KvpollRunner {
            engine,
            serving_loop,
            peer: peer_id,
            shape: s,
            op: g.op,
            out: Outcomes::default(),
            next_id: 0,
            lent,
            checks,
            early_checks: HashMap::new(),
            buf,
            check_blocks: s.blocks as usize,
            peer_pid: peer.child.id(),
            _mem: mem,
            _peer: peer,
        })
    }

    /// What the push destination found in request `id`'s blocks, waiting
    /// for its line as long as [`DESTINATION_CHECK_WAIT`].
    fn destination_check(&mut self, id: u64) -> Result<bool, E2eError> {
        let deadline = Instant::now() + DESTINATION_CHECK_WAIT;
        loop {
            if let Some(ok) = self.early_checks.remove(&id) {
                return Ok(ok);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.checks.recv_timeout(left) {
                Ok((i, ok)) => {
                    self.early_checks.insert(i, ok);
                }
                Err(_) => {
                    return Err(E2eError::Failed(format!(
                        "the push destination did not report its check of request {id} within {DESTINATION_CHECK_WAIT:?} of its end"
                    )))
                }
            }
        }
    }

    /// Whether the local blocks of a read hold what the producer wrote.
    fn check(&mut self, id: u64, local: &[BlockId]) -> Result<bool, E2eError> {
        let mut ok = true;
        for r in 0..self.shape.regions as usize {
            for (j, &l) in local.iter().enumerate().take(self.check_blocks) {
                self.engine.read_block(r, l, &mut self.buf)?;
                let remote = self.shape.remote(id, j as u32);
                ok &= pattern::check(SEED * 100 + r as u64, u64::from(remote), &self.buf);
            }
        }
        Ok(ok)
    }
}

impl Runner for KvpollRunner {
    fn peer_pids(&self) -> Vec<u32> {
        vec![self.peer_pid]
    }

    fn run(&mut self, n: u32) -> Result<Round, E2eError> {
        let s = self.shape;
        let k = s.blocks as usize;
        let first = self.next_id;
        let mut slots = Slots::new(s.in_flight, n);
        let (mut submitted, mut done) = (0u32, 0u32);
        let mut checks = Checks::default();
        let mut local = vec![BlockId(0); k];
        let mut remote = vec![BlockId(0); k];
        let cpu0 = self_cpu() + cpu_ns(self.peer_pid);
        let t0 = Instant::now();
        while done < n {
            while submitted < n && !slots.free.is_empty() {
                let slot = slots.free.pop().unwrap_or(0);
                let id = first + u64::from(submitted);
                for j in 0..k {
                    remote[j] = BlockId(s.remote(id, j as u32));
                    local[j] = match self.op {
                        Op::Read => BlockId(slot * s.blocks + j as u32),
                        Op::Write => remote[j],
                    };
                }
                let lend = lend_of(Some(&self.lent), id)?;
                let t = [Transfer {
                    peer: self.peer,
                    local: &local,
                    remote: &remote,
                    lend,
                }];
                match self.op {
                    Op::Read => self.engine.read(RequestId(id), &t)?,
                    Op::Write => {
                        self.engine
                            .write(RequestId(id), &t, 1, Duration::from_secs(30))?
                    }
                }
                slots.of[submitted as usize] = slot;
                submitted += 1;
            }
            let waiting = if self.serving_loop {
                Waiting::Yield
            } else {
                Waiting::Block
            };
            if !poll_some(&mut self.engine, &mut self.out, waiting, t0, done, n)? {
                continue;
            }
            if self.serving_loop {
                // The rest of the step (the model's work) runs elsewhere:
                // one poll a step, then the core is given up.
                std::thread::yield_now();
            }
            let ended = match self.op {
                Op::Read => std::mem::take(&mut self.out.finished_recving),
                Op::Write => std::mem::take(&mut self.out.finished_sending),
            };
            for id in &ended {
                let Some(i) = id.0.checked_sub(first).filter(|&i| i < u64::from(n)) else {
                    return Err(E2eError::Failed(format!("kvpoll reported unknown {id:?}")));
                };
                let slot = slots.of[i as usize];
                if self.op == Op::Read && id.0 % u64::from(s.check_every) == 0 {
                    let c = Began::now();
                    for (j, l) in local.iter_mut().enumerate() {
                        *l = BlockId(slot * s.blocks + j as u32);
                    }
                    let lb = local.clone();
                    let ok = self.check(id.0, &lb)?;
                    checks.record(c, ok);
                }
                slots.free.push(slot);
                done += 1;
            }
            match self.op {
                Op::Read => self.out.finished_recving = ended,
                Op::Write => self.out.finished_sending = ended,
            }
        }
        let cpu = (self_cpu() + cpu_ns(self.peer_pid)).saturating_sub(cpu0);
        self.next_id = first + u64::from(n);
        let mut round = checks.round(n, t0, cpu);
        if self.op == Op::Write {
            // A push destination checks what landed and says so, after
            // the writer saw its push end: wait for this round's.
            let every = u64::from(s.check_every);
            let ids = (first..first + u64::from(n)).filter(|id| id % every == 0);
            for id in ids {
                let ok = self.destination_check(id)?;
                round.checked += 1;
                round.bad += u64::from(!ok);
            }
        }
        Ok(round)
    }
}

/// kvpoll in waves, the way NIXL's batched setting runs the same shape:
/// each wave of the shape's `in_flight` reads is one request naming all
/// their blocks (one lend of them on the peer, one read, one confirmation,
/// one report), and a wave starts when the one before it ended. Rates
/// count reads, as NIXL's do; the blocks each read names, the memory and
/// the share of reads checked are the per-request shape's.
struct KvpollWavesRunner {
    inner: KvpollRunner,
    wave: u32,
}

impl KvpollWavesRunner {
    fn new(exe: &Path, g: &Group, veth: Option<&VethEnds>) -> Result<Self, E2eError> {
        let s = g.shape;
        let wave = s.in_flight;
        // Request w names blocks w·wave + j: the blocks of reads
        // w·wave + j of the per-request shape (whose reads name one
        // block each), on a peer that lends them together. Every wave's
        // first read is checked: where waves are `check_every` reads long
        // (small reads: 64 and 64), the reads the per-request system
        // checks.
        let shape = Shape {
            blocks: s.blocks * wave,
            in_flight: 1,
            check_every: 1,
            ..s
        };
        let waves = Group {
            shape,
            requests: g.requests.div_ceil(wave),
            ..g.clone()
        };
        let mut inner = KvpollRunner::new(exe, &waves, veth, KvpollSetting::default())?;
        inner.check_blocks = s.blocks as usize;
        Ok(KvpollWavesRunner { inner, wave })
    }
}

impl Runner for KvpollWavesRunner {
    fn peer_pids(&self) -> Vec<u32> {
        self.inner.peer_pids()
    }

    fn run(&mut self, n: u32) -> Result<Round, E2eError> {
        let r = self.inner.run(n.div_ceil(self.wave))?;
        Ok(Round {
            requests: r.requests * self.wave,
            ..r
        })
    }
}

fn mem_arg(m: Memory) -> &'static str {
    match m {
        Memory::Ucx => "ucx",
        Memory::Caller => "caller",
    }
}

// ---------------------------------------------------------------- raw UCX

struct RawRunner {
    // Field order is drop order: endpoint state before the worker and context.
    rkey: RemoteKey,
    ep: Endpoint,
    local: MemoryRegion,
    worker: Worker,
    _ctx: Context,
    _mem: Option<CallerMemory>,
    shape: Shape,
    done: Vec<Completion>,
    ops: Vec<BlockOp>,
    buf: Vec<u8>,
    next_id: u64,
    peer_pid: u32,
    _peer: PeerProcess,
}

impl RawRunner {
    fn new(exe: &Path, g: &Group, veth: Option<&VethEnds>) -> Result<Self, E2eError> {
        let s = g.shape;
        let mut args: Vec<String> = vec![
            "--tls".into(),
            g.tls.clone(),
            "--memory".into(),
            mem_arg(g.memory).into(),
        ];
        args.extend(blocks_args(
            u64::from(s.regions) * s.peer_blocks,
            s.block_size,
        ));
        let peer = in_netns(veth, || PeerProcess::spawn(exe, "ucx-peer", &args))??;
        let (addr, rkey) = super::e2e::ucx_peer_ready(&peer.ready)?;
        let ctx = Context::new(&ContextOptions::with_transports(&g.tls))?;
        let worker = Worker::new(&ctx)?;
        let len = (u64::from(s.regions * s.slots()) * s.block_size) as usize;
        let mut mem = None;
        let local = match g.memory {
            Memory::Ucx => MemoryRegion::allocate(&ctx, len)?,
            Memory::Caller => {
                let m = mem.insert(CallerMemory::new(len).map_err(|e| failed("mmap", e))?);
                // SAFETY: the mapping is dropped after the region.
                unsafe { MemoryRegion::map(&ctx, m.as_ptr(), len)? }
            }
        };
        let ep = Endpoint::connect(&worker, &WorkerAddress::from_bytes(&addr)?, 1)?;
        let rkey = RemoteKey::unpack(&ep, &PackedRkey::from_bytes(&rkey)?)?;
        Ok(RawRunner {
            rkey,
            ep,
            local,
            worker,
            _ctx: ctx,
            _mem: mem,
            shape: s,
            done: Vec::with_capacity(4096),
            ops: Vec::new(),
            buf: vec![0u8; s.block_size as usize],
            next_id: 0,
            peer_pid: peer.child.id(),
            _peer: peer,
        })
    }

    /// Local byte offset of block `j` of `slot` in layer `r`.
    fn local_offset(&self, r: u32, slot: u32, j: u32) -> u64 {
        let s = self.shape;
        u64::from(r * s.slots() + slot * s.blocks + j) * s.block_size
    }
}

impl Runner for RawRunner {
    fn peer_pids(&self) -> Vec<u32> {
        vec![self.peer_pid]
    }

    fn run(&mut self, n: u32) -> Result<Round, E2eError> {
        let s = self.shape;
        let bs = s.block_size;
        let first = self.next_id;
        let mut slots = Slots::new(s.in_flight, n);
        let mut left = vec![0u32; n as usize];
        let (mut submitted, mut done) = (0u32, 0u32);
        let mut checks = Checks::default();
        let cpu0 = self_cpu() + cpu_ns(self.peer_pid);
        let t0 = Instant::now();
        while done < n {
            while submitted < n && !slots.free.is_empty() {
                let slot = slots.free.pop().unwrap_or(0);
                let id = first + u64::from(submitted);
                self.ops.clear();
                for r in 0..s.regions {
                    for j in 0..s.blocks {
                        let remote = s.flat_remote(r, id, j);
                        self.ops.push(BlockOp {
                            local_offset: self.local_offset(r, slot, j),
                            remote_offset: remote * bs,
                            len: bs as usize,
                            token: u64::from(submitted),
                        });
                    }
                }
                slots.of[submitted as usize] = slot;
                left[submitted as usize] = s.regions * s.blocks;
                self.ep
                    .get_batch(&self.local, &self.rkey, &self.ops)
                    .map_err(|e| failed("raw get_batch", e))?;
                submitted += 1;
            }
            let events = self.worker.progress();
            self.done.clear();
            self.worker.take_completions(&mut self.done);
            if events == 0 && self.done.is_empty() {
                // As kvpoll's engine thread does: on a small machine the
                // peer that answers needs the core.
                std::thread::yield_now();
            }
            if self.done.is_empty() && t0.elapsed() > GUARD {
                return Err(E2eError::Failed(format!(
                    "raw: {done} of {n} requests after {GUARD:?}"
                )));
            }
            let completions = std::mem::take(&mut self.done);
            for c in &completions {
                let Some(i) = raw_completion(&self.ep, c, &mut left)? else {
                    continue;
                };
                let id = first + i as u64;
                let slot = slots.of[i];
                if id % u64::from(s.check_every) == 0 {
                    let t = Began::now();
                    let mut ok = true;
                    for r in 0..s.regions {
                        for j in 0..s.blocks {
                            self.local
                                .read(self.local_offset(r, slot, j), &mut self.buf)?;
                            let remote = s.flat_remote(r, id, j);
                            ok &= pattern::check(SEED, remote, &self.buf);
                        }
                    }
                    checks.record(t, ok);
                }
                slots.free.push(slot);
                done += 1;
            }
            self.done = completions;
        }
        let cpu = (self_cpu() + cpu_ns(self.peer_pid)).saturating_sub(cpu0);
        self.next_id = first + u64::from(n);
        Ok(checks.round(n, t0, cpu))
    }
}

// ---------------------------------------------------------------- limits

/// Whether slot 0 of `dst` (layer after layer, `slots()` blocks a layer)
/// holds request `id` as a flat producer wrote it (pattern `SEED`).
fn copied_ok(dst: &CallerMemory, s: &Shape, id: u64) -> bool {
    let bs = s.block_size as usize;
    (0..s.regions).all(|r| {
        (0..s.blocks).all(|j| {
            let at = s.flat_local(r, id, j) as usize * bs;
            pattern::check(SEED, s.flat_remote(r, id, j), dst.slice(at, bs))
        })
    })
}

/// `memcpy` of the same blocks inside this process (caller memory on both
/// sides): the copy limit.
struct MemcpyRunner {
    src: CallerMemory,
    dst: CallerMemory,
    shape: Shape,
    next_id: u64,
}

impl MemcpyRunner {
    fn new(g: &Group) -> Result<Self, E2eError> {
        let s = g.shape;
        let bs = s.block_size as usize;
        let blocks = u64::from(s.regions) * s.peer_blocks;
        let mut src = CallerMemory::new(blocks as usize * bs).map_err(|e| failed("mmap", e))?;
        for b in 0..blocks as usize {
            pattern::fill(SEED, b as u64, src.slice_mut(b * bs, bs));
        }
        let dst = CallerMemory::new((s.regions * s.slots()) as usize * bs)
            .map_err(|e| failed("mmap", e))?;
        Ok(MemcpyRunner {
            src,
            dst,
            shape: s,
            next_id: 0,
        })
    }
}

impl Runner for MemcpyRunner {
    fn run(&mut self, n: u32) -> Result<Round, E2eError> {
        let s = self.shape;
        let bs = s.block_size as usize;
        let mut checks = Checks::default();
        let cpu0 = self_cpu();
        let t0 = Instant::now();
        for i in 0..n {
            let id = self.next_id + u64::from(i);
            for r in 0..s.regions {
                for j in 0..s.blocks {
                    let from = s.flat_remote(r, id, j) as usize * bs;
                    let to = s.flat_local(r, id, j) as usize * bs;
                    let src = self.src.slice(from, bs).as_ptr();
                    self.dst.slice_mut(to, bs).copy_from_slice(
                        // SAFETY: src..src+bs lies in the source mapping.
                        unsafe { std::slice::from_raw_parts(src, bs) },
                    );
                }
            }
            if id % u64::from(s.check_every) == 0 {
                let t = Began::now();
                checks.record(t, copied_ok(&self.dst, &s, id));
            }
        }
        self.next_id += u64::from(n);
        Ok(checks.round(n, t0, self_cpu().saturating_sub(cpu0)))
    }
}

/// `process_vm_readv` of the same blocks from a `kvpoll mem-peer`, one
/// call a request (all its blocks as one iovec list): what a one-sided
/// copy between two processes costs (cma is this call).
struct VmReadvRunner {
    dst: CallerMemory,
    base: usize,
    pid: i32,
    shape: Shape,
    next_id: u64,
    _peer: PeerProcess,
}

impl VmReadvRunner {
    fn new(exe: &Path, g: &Group) -> Result<Self, E2eError> {
        let s = g.shape;
        let peer = PeerProcess::spawn(
            exe,
            "mem-peer",
            &blocks_args(u64::from(s.regions) * s.peer_blocks, s.block_size),
        )?;
        let base = usize::from_str_radix(peer.ready.trim(), 16).map_err(|_| E2eError::Peer {
            what: "mem-peer",
            why: "bad address".into(),
        })?;
        let dst = CallerMemory::new((s.regions * s.slots()) as usize * s.block_size as usize)
            .map_err(|e| failed("mmap", e))?;
        Ok(VmReadvRunner {
            dst,
            base,
            pid: peer.child.id() as i32,
            shape: s,
            next_id: 0,
            _peer: peer,
        })
    }
}

impl Runner for VmReadvRunner {
    fn peer_pids(&self) -> Vec<u32> {
        vec![self.pid as u32]
    }

    fn run(&mut self, n: u32) -> Result<Round, E2eError> {
        let s = self.shape;
        let bs = s.block_size as usize;
        let mut checks = Checks::default();
        let mut local = Vec::with_capacity((s.regions * s.blocks) as usize);
        let mut remote = Vec::with_capacity(local.capacity());
        let cpu0 = self_cpu() + cpu_ns(self.pid as u32);
        let t0 = Instant::now();
        for i in 0..n {
            let id = self.next_id + u64::from(i);
            local.clear();
            remote.clear();
            let mut want = 0usize;
            for r in 0..s.regions {
                for j in 0..s.blocks {
                    let from = s.flat_remote(r, id, j) as usize * bs;
                    let to = s.flat_local(r, id, j) as usize * bs;
                    local.push(libc::iovec {
                        iov_base: self.dst.slice_mut(to, bs).as_mut_ptr() as *mut libc::c_void,
                        iov_len: bs,
                    });
                    remote.push(libc::iovec {
                        iov_base: (self.base + from) as *mut libc::c_void,
                        iov_len: bs,
                    });
                    want += bs;
                }
            }
            let mut got = 0usize;
            while got < want {
                // SAFETY: the local iovecs name this process's mapping; the
                // remote ones are checked by the kernel against the peer.
                let r = unsafe {
                    libc::process_vm_readv(
                        self.pid,
                        local.as_ptr(),
                        local.len() as libc::c_ulong,
                        remote.as_ptr(),
                        remote.len() as libc::c_ulong,
                        0,
                    )
                };
                if r <= 0 {
                    return Err(failed("process_vm_readv", std::io::Error::last_os_error()));
                }
                got += r as usize;
                if got < want {
                    // A partial read ends on an iovec boundary only when the
                    // kernel says so; the shapes never hit it, so say so.
                    return Err(E2eError::Failed(format!(
                        "process_vm_readv read {got} of {want} bytes"
                    )));
                }
            }
            if id % u64::from(s.check_every) == 0 {
                let t = Began::now();
                checks.record(t, copied_ok(&self.dst, &s, id));
            }
        }
        self.next_id += u64::from(n);
        Ok(checks.round(
            n,
            t0,
            (self_cpu() + cpu_ns(self.pid as u32)).saturating_sub(cpu0),
        ))
    }
}

/// A plain tcp connection pushing the same bytes over the group's link,
/// as fast as one writer and one reader thread move them: the wire's rate
/// and CPU on this path. Over veth the reader is in the far namespace.
struct TcpStreamRunner {
    tx: TcpStream,
    received: Arc<AtomicU64>,
    sent: u64,
    chunk: Vec<u8>,
    bytes: u64,
}

impl TcpStreamRunner {
    fn new(g: &Group, veth: Option<&VethEnds>) -> Result<Self, E2eError> {
        let far = veth.map_or("127.0.0.1", |v| v.far.as_str());
        let listener = in_netns(veth, || TcpListener::bind((far, 0)))?
            .map_err(|e| failed("tcp stream bind", e))?;
        let addr = listener.local_addr().map_err(|e| failed("tcp stream", e))?;
        let received = Arc::new(AtomicU64::new(0));
        let count = received.clone();
        std::thread::spawn(move || {
            let Ok((mut s, _)) = listener.accept() else {
                return;
            };
            let mut buf = vec![0u8; 1 << 20];
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 {
                    return;
                }
                count.fetch_add(n as u64, Ordering::Release);
            }
        });
        let tx = TcpStream::connect(addr).map_err(|e| failed("tcp stream connect", e))?;
        let _ = tx.set_nodelay(true);
        let bytes = g.shape.bytes();
        Ok(TcpStreamRunner {
            tx,
            received,
            sent: 0,
            chunk: vec![0x5a; bytes.min(4 << 20) as usize],
            bytes,
        })
    }
}

impl Runner for TcpStreamRunner {
    fn run(&mut self, n: u32) -> Result<Round, E2eError> {
        let total = self.bytes * u64::from(n);
        let cpu0 = self_cpu();
        let t0 = Instant::now();
        let mut left = total;
        while left > 0 {
            let c = left.min(self.chunk.len() as u64) as usize;
            self.tx
                .write_all(&self.chunk[..c])
                .map_err(|e| failed("tcp stream write", e))?;
            left -= c as u64;
        }
        self.sent += total;
        while self.received.load(Ordering::Acquire) < self.sent {
            if t0.elapsed() > GUARD {
                return Err(E2eError::Failed("the tcp stream stalled".into()));
            }
            std::thread::yield_now();
        }
        Ok(Round {
            requests: n,
            secs: t0.elapsed().as_secs_f64(),
            cpu_ns: self_cpu().saturating_sub(cpu0),
            checked: 0,
            bad: 0,
        })
    }
}

// ---------------------------------------------------------------- peers

/// NIXL or Mooncake through `peer_bench.py`: the driver is the initiator
/// and starts its own target; it reports each round's time, both
/// processes' CPU and its checks.
struct ExternalRunner {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    /// The last lines the driver (and its target) wrote to standard
    /// error: why it failed, when it does.
    stderr: Arc<std::sync::Mutex<std::collections::VecDeque<String>>>,
    scale: f64,
}

impl ExternalRunner {
    /// `python`: the peers' Python, `script` the driver.
    fn new(
        python: &Path,
        script: &Path,
        g: &Group,
        system: &str,
        veth: Option<&VethEnds>,
    ) -> Result<Self, String> {
        let s = g.shape;
        let mut cmd = Command::new(python);
        cmd.arg(script)
            .args([
                "--system",
                if system == MOONCAKE {
                    "mooncake"
                } else {
                    "nixl"
                },
            ])
            .args(["--op", if g.op == Op::Write { "write" } else { "read" }])
            .args(["--block-size", &s.block_size.to_string()])
            .args(["--regions", &s.regions.to_string()])
            .args(["--blocks-per-request", &s.blocks.to_string()])
            .args(["--in-flight", &s.in_flight.to_string()])
            .args(["--peer-blocks", &s.peer_blocks.to_string()])
            .args(["--check-every", &s.check_every.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // Its own process group, the target with it: paused and resumed
        // together.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        if system == NIXL_BATCHED || system == NIXL_BATCHED_NO_PT {
            cmd.arg("--batch");
        }
        if system == NIXL_NO_PT || system == NIXL_BATCHED_NO_PT {
            cmd.args(["--progress-thread", "off"]);
        }
        if let Some(v) = veth {
            cmd.args(["--target-netns", &v.netns])
                .args(["--host", &v.far])
                .args(["--client-host", &v.near]);
        }
        if system != MOONCAKE {
            // NIXL's UCX backend reads UCX_TLS; it asks UCX for peer
            // failure handling, which shared memory gives only with
            // UCX_MM_ERROR_HANDLING=y, as NIXL's deployments set it
            // (without it, shared memory alone has no transport and NIXL
            // does not start).
            cmd.env("UCX_TLS", format!("{},self", g.tls));
            if !g.tcp() {
                cmd.env("UCX_MM_ERROR_HANDLING", "y");
            }
            cmd.env("NIXL_LOG_LEVEL", "WARN");
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("spawning {}: {e}", python.display()))?;
        let stdin = child.stdin.take();
        let stderr = Arc::new(std::sync::Mutex::new(std::collections::VecDeque::new()));
        if let Some(err) = child.stderr.take() {
            let tail = stderr.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    let Ok(mut t) = tail.lock() else { return };
                    if t.len() == 4 {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            });
        }
        let Some(out) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err("no standard output".into());
        };
        let mut r = ExternalRunner {
            child,
            stdin,
            stdout: BufReader::new(out),
            stderr,
            // Python drives one request at a time: small reads warm up
            // with a quarter as many.
            scale: if s == SMALL { 0.25 } else { 1.0 },
        };
        if r.line("READY").is_none() {
            let why = r.why();
            return Err(format!(
                "{system} did not start (its driver ended before READY){why}"
            ));
        }
        Ok(r)
    }

    /// The driver's last words on standard error, if it said any.
    fn why(&mut self) -> String {
        // Its standard error ends with it: give the reader a moment.
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(500) {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                std::thread::sleep(Duration::from_millis(50));
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let tail = self
            .stderr
            .lock()
            .map(|t| t.iter().cloned().collect::<Vec<_>>().join(" | "))
            .unwrap_or_default();
        if tail.is_empty() {
            String::new()
        } else {
            format!(": {tail}")
        }
    }

    /// The next line starting with `tag`, the rest of it.
    fn line(&mut self, tag: &str) -> Option<String> {
        let mut line = String::new();
        loop {
            line.clear();
            if !matches!(self.stdout.read_line(&mut line), Ok(n) if n > 0) {
                return None;
            }
            if let Some(rest) = line.trim().strip_prefix(tag) {
                return Some(rest.trim().to_owned());
            }
        }
    }
}

impl Runner for ExternalRunner {
    fn run(&mut self, n: u32) -> Result<Round, E2eError> {
        let Some(stdin) = self.stdin.as_mut() else {
            return Err(E2eError::Failed("peer driver closed".into()));
        };
        writeln!(stdin, "RUN {n}")
            .and_then(|_| stdin.flush())
            .map_err(|e| failed("peer driver", e))?;
        let Some(rest) = self.line("RESULT") else {
            let why = self.why();
            return Err(E2eError::Failed(format!(
                "the peer driver ended mid-round{why}"
            )));
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
        match (num(0), num(1), num(2), num(3), num(4)) {
            (Some(req), Some(secs), Some(cpu), Some(checked), Some(bad)) => Ok(Round {
                requests: req as u32,
                secs,
                cpu_ns: cpu as u64,
                checked: checked as u64,
                bad: bad as u64,
            }),
            _ => Err(E2eError::Failed(format!("the peer driver said {rest:?}"))),
        }
    }

    fn scale(&self) -> f64 {
        self.scale
    }

    fn pause(&mut self) {
        self.signal(libc::SIGSTOP);
    }

    fn resume(&mut self) {
        self.signal(libc::SIGCONT);
    }
}

impl ExternalRunner {
    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on the process group this runner made.
        unsafe { libc::kill(-(self.child.id() as i32), sig) };
    }
}

impl Drop for ExternalRunner {
    fn drop(&mut self) {
        self.resume();
        drop(self.stdin.take());
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------- veth

/// Runs `f` with this thread in `veth`'s far network namespace, where
/// given (what it spawns or binds is there), and brings the thread back.
pub fn in_netns<T>(veth: Option<&VethEnds>, f: impl FnOnce() -> T) -> Result<T, E2eError> {
    let Some(v) = veth else { return Ok(f()) };
    let open =
        |path: &str| std::fs::File::open(path).map_err(|e| failed(&format!("opening {path}"), e));
    let here = open("/proc/thread-self/ns/net")?;
    let there = open(&format!("/run/netns/{}", v.netns))?;
    set_netns(&there).map_err(|e| failed(&format!("entering {}", v.netns), e))?;
    let out = f();
    if let Err(e) = set_netns(&here) {
        // A thread left in the wrong namespace would measure the wrong
        // link from here on: stop.
        panic!("kvpoll bench: could not leave {}: {e}", v.netns);
    }
    Ok(out)
}

fn set_netns(ns: &std::fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: setns(2) on a descriptor this function's caller holds open.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

// ---------------------------------------------------------------- a group

/// The systems of group `g`, set up; those not applicable or not
/// installed as absent, those that failed to start as failed.
type Setup = (
    Vec<(&'static str, Box<dyn Runner>)>,
    Vec<(String, String)>,
    Vec<(String, String)>,
);

fn set_up(exe: &Path, g: &Group, peers: &Peers) -> Setup {
    let veth = peers.veth.as_ref();
    let mut runners: Vec<(&'static str, Box<dyn Runner>)> = Vec::new();
    let mut absent = Vec::new();
    let mut failed = Vec::new();
    let mut add = |name: &'static str, r: Result<Box<dyn Runner>, String>| match r {
        Ok(r) => runners.push((name, r)),
        Err(why) => failed.push((name.to_owned(), why)),
    };
    let boxed = |r: Result<Box<dyn Runner>, E2eError>| r.map_err(|e| e.to_string());
    let kvpoll = |setting: KvpollSetting<'_>| {
        boxed(KvpollRunner::new(exe, g, veth, setting).map(|r| Box::new(r) as Box<dyn Runner>))
    };
    add(KVPOLL, kvpoll(KvpollSetting::default()));
    if g.memory == Memory::Caller {
        add(
            KVPOLL_SERVING,
            kvpoll(KvpollSetting {
                serving_loop: true,
                ..KvpollSetting::default()
            }),
        );
    }
    if !peers.alt_ucx.is_empty() {
        add(
            KVPOLL_ALT,
            kvpoll(KvpollSetting {
                ucx: &peers.alt_ucx,
                ..KvpollSetting::default()
            }),
        );
    }
    if g.op == Op::Read && g.memory == Memory::Caller && (g.shape == SMALL || g.shape == LAYERS) {
        add(
            KVPOLL_KEYED,
            kvpoll(KvpollSetting {
                keyed: true,
                ..KvpollSetting::default()
            }),
        );
    }
    let small_read = g.shape == SMALL && g.op == Op::Read;
    if small_read {
        add(
            KVPOLL_UNCONFIRMED,
            kvpoll(KvpollSetting {
                unconfirmed: true,
                ..KvpollSetting::default()
            }),
        );
        add(
            KVPOLL_BATCHED,
            boxed(KvpollWavesRunner::new(exe, g, veth).map(|r| Box::new(r) as Box<dyn Runner>)),
        );
    }
    if g.op == Op::Read {
        add(
            RAW,
            boxed(RawRunner::new(exe, g, veth).map(|r| Box::new(r) as Box<dyn Runner>)),
        );
    }
    if g.tcp() {
        add(
            TCP_STREAM,
            boxed(TcpStreamRunner::new(g, veth).map(|r| Box::new(r) as Box<dyn Runner>)),
        );
    } else if g.op == Op::Read {
        add(
            PVREADV,
            boxed(VmReadvRunner::new(exe, g).map(|r| Box::new(r) as Box<dyn Runner>)),
        );
        add(
            MEMCPY,
            boxed(MemcpyRunner::new(g).map(|r| Box::new(r) as Box<dyn Runner>)),
        );
    }
    let mut external: Vec<&'static str> = vec![NIXL, NIXL_NO_PT];
    if small_read {
        external.extend([NIXL_BATCHED, NIXL_BATCHED_NO_PT]);
    }
    if g.tcp() {
        external.push(MOONCAKE);
    } else {
        absent.push((
            MOONCAKE.to_owned(),
            "its tcp transport only here (no shared memory in this build)".into(),
        ));
    }
    match (&peers.python, &peers.script) {
        (Some(python), Some(script)) => {
            for system in external {
                add(
                    system,
                    ExternalRunner::new(python, script, g, system, veth)
                        .map(|r| Box::new(r) as Box<dyn Runner>),
                );
            }
        }
        _ => {
            for system in external {
                absent.push((
                    system.to_owned(),
                    "no Python with the peer systems (make bench-peers)".into(),
                ));
            }
        }
    }
    (runners, absent, failed)
}

/// Runs one group: every system that applies, a warm-up round each, then
/// `rounds` timed rounds interleaved across the systems (round i of
/// every system, then round i + 1), each round as long as `size` says.
/// A system that does not start or fails a round is listed as failed (so
/// is the group); one not installed or not applicable, as not measured.
pub fn run_group(
    exe: &Path,
    g: &Group,
    peers: &Peers,
    rounds: u32,
    size: RoundSize,
) -> Result<GroupFigures, E2eError> {
    if g.requests == 0 || rounds == 0 {
        return Err(E2eError::Shape("requests and rounds must be >= 1"));
    }
    let (mut runners, absent, mut failed) = set_up(exe, g, peers);
    let bytes = g.shape.bytes() as f64;
    let mut failed_at: Vec<Option<String>> = vec![None; runners.len()];
    // Each system's rate so far: how many requests its next round needs.
    let mut rate = vec![0.0f64; runners.len()];
    for (i, (_, r)) in runners.iter_mut().enumerate() {
        let n = ((f64::from(g.requests) * r.scale()).round() as u32)
            .max(1)
            .div_ceil(4);
        match r.run(n) {
            Ok(w) => rate[i] = f64::from(w.requests) / w.secs.max(1e-9),
            Err(e) => failed_at[i] = Some(format!("warm-up: {e}")),
        }
        r.pause();
    }
    let mut done: Vec<Vec<Round>> = vec![Vec::new(); runners.len()];
    for _ in 0..rounds {
        for (i, (name, r)) in runners.iter_mut().enumerate() {
            if failed_at[i].is_some() {
                continue;
            }
            r.resume();
            let split = ThreadSplit::start(&r.peer_pids());
            let mut round = Round::default();
            let result = loop {
                let moved = bytes * f64::from(round.requests);
                let mut n = size.more(bytes, rate[i], moved, round.secs);
                if round.requests == 0 {
                    n = n.max(1);
                }
                if n == 0 {
                    break Ok(());
                }
                match r.run(n) {
                    Ok(part) => {
                        round.requests += part.requests;
                        round.secs += part.secs;
                        round.cpu_ns += part.cpu_ns;
                        round.checked += part.checked;
                        round.bad += part.bad;
                        rate[i] = f64::from(round.requests) / round.secs.max(1e-9);
                    }
                    Err(e) => break Err(e),
                }
            };
            r.pause();
            if let Some(split) = split {
                eprintln!(
                    "{}",
                    split.line(&format!("[{}] {name}", g.key()), round.requests)
                );
            }
            match result {
                Ok(()) => done[i].push(round),
                Err(e) => failed_at[i] = Some(e.to_string()),
            }
        }
    }
    let names: Vec<&'static str> = runners.iter().map(|(n, _)| *n).collect();
    // Peers and engines go before the figures are made.
    drop(runners);
    let mut systems = Vec::new();
    for (i, name) in names.into_iter().enumerate() {
        match failed_at[i].take() {
            Some(why) => failed.push((name.to_owned(), why)),
            None => systems.push(SystemFigures::of(name, &done[i], bytes)),
        }
    }
    Ok(GroupFigures {
        group: g.clone(),
        systems,
        absent,
        failed,
    })
}

#[cfg(test)]
mod tests {
    use super::{checked_line, Began, Checks};
    use crate::bench::memory::burn_cpu;

    #[test]
    fn the_cpu_a_check_burns_on_its_thread_is_left_out_of_the_round() {
        let mut checks = Checks::default();
        let t0 = std::time::Instant::now();
        let began = Began::now();
        // Work of the check's own: at least 2 ms of this thread's CPU.
        burn_cpu(2_000_000);
        checks.record(began, true);
        let total = 1_000_000_000;
        let round = checks.round(1, t0, total);
        assert!(round.cpu_ns <= total - 2_000_000, "{}", round.cpu_ns);
        assert_eq!(round.checked, 1);
        // A round that took less CPU than its checks (clocks of different
        // threads) is not wrapped around.
        let checks = Checks {
            cpu_ns: 5,
            ..Checks::default()
        };
        assert_eq!(checks.round(1, t0, 3).cpu_ns, 0);
    }

    #[test]
    fn a_destination_check_line_names_its_request_and_verdict() {
        assert_eq!(checked_line("CHECKED 16 ok\n"), Some((16, true)));
        assert_eq!(checked_line("CHECKED 8 bad"), Some((8, false)));
        for wrong in [
            "CHECKED 8",
            "CHECKED x ok",
            "CHECKED 8 fine",
            "LENT 8 ok",
            "",
        ] {
            assert_eq!(checked_line(wrong), None, "{wrong:?}");
        }
    }
}
