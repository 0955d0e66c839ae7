//! The command line: one `clap` subcommand per job, every option with its
//! type, range and default, so `--help` shows them and a bad value is an
//! error that names its option (exit 2).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use thiserror::Error;

use crate::demo::{Mode, Policy};

/// What failed after the command line was accepted.
#[derive(Debug, Error)]
pub enum CliError {
    /// Options that parse one by one but not together (exit 2, like a
    /// parse error).
    #[error("{0}")]
    Usage(String),
    /// The command ran and failed (exit 1).
    #[error("{0}")]
    Failed(String),
    /// A signal (SIGHUP, SIGINT, SIGTERM) cut the run short; it stopped
    /// cleanly (exit 128 + the signal's number).
    #[error("stopped by signal {0}")]
    Signal(i32),
}

/// Moves KV-cache blocks between prefill and decode engines over UCX, and
/// shows it: the demo, two-host runs, transfers, the machine's topology and
/// the bench suite.
///
/// Logging: RUST_LOG (for example `RUST_LOG=kvpoll=debug`); default `warn`.
#[derive(Debug, Parser)]
#[command(name = "kvpoll", version, propagate_version = true)]
pub struct Cli {
    /// The job.
    #[command(subcommand)]
    pub command: Command,
}

/// The jobs.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Prefill TP=4 and decode TP=2 over real UCX, pull then push, with
    /// faults; every block checked; exit 1 on corruption or a leak.
    Demo(DemoArgs),
    /// One prefill rank: listens for decode ranks (prints `LISTEN addr`
    /// once it serves) and serves until SIGINT, SIGTERM or SIGHUP (exit 0).
    /// An engine whose UCX worker stops hearing (a reader killed inside a
    /// shared-memory send to it) is replaced by a new one; connections
    /// are closed so that clients reconnect for its new metadata.
    Serve(ServeArgs),
    /// One decode rank reading from two prefill ranks started with `serve`.
    Connect(ConnectArgs),
    /// Moves blocks between two UCX workers in this process; reports bytes
    /// and rate, every block verified.
    Transfer(TransferArgs),
    /// Measures kvpoll against its baselines in the same run (default: the
    /// whole suite as one table, under 2 minutes).
    Bench(BenchArgs),
    /// Shows CPUs, caches, NUMA nodes, NICs/GPUs and isolation; suggests a
    /// core map, or checks one.
    Topo(TopoArgs),
    /// Prints a shell completion script, e.g. `kvpoll completions bash >
    /// /etc/bash_completion.d/kvpoll`.
    Completions(CompletionsArgs),
    /// (Internal) serves a UCX region filled with the block pattern to a
    /// parent process: the tests and `bench e2e` spawn it.
    UcxPeer(UcxPeerArgs),
    /// (Internal) runs a kvpoll engine serving patterned blocks to a parent
    /// process: the tests and `bench e2e` spawn it.
    EnginePeer(EnginePeerArgs),
    /// A process holding blocks of a known pattern in an mmap (huge pages
    /// where the kernel gives them), for `process_vm_readv`: prints `READY
    /// <hex address>` and waits for its standard input to close.
    #[command(hide = true)]
    MemPeer(MemPeerArgs),
    /// One side of `kvpoll bench rails`, started in its network namespace.
    #[command(hide = true)]
    RailsPeer(RailsPeerArgs),
}

/// How the demo runs its prefill ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Ranks {
    /// Each rank its own process (a killed rank is a killed process).
    Processes,
    /// Each rank a thread of this process.
    Threads,
}

/// The shape of a demo or `connect` run: sizes, counts and transports.
#[derive(Debug, Clone, Args)]
pub struct Workload {
    /// Requests per decode rank and mode (1 to 10^9).
    #[arg(long, value_name = "N", default_value_t = 3000, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    pub requests: u64,
    /// Blocks per KV layer, on each rank (1 to 2^24).
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=1 << 24))]
    pub blocks: u32,
    /// Bytes per block (1 to 1 GiB).
    #[arg(long, value_name = "BYTES", default_value_t = 16384, value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    pub block_size: u64,
    /// KV layers (registered regions) per rank (1 to 1024: a peer accepts
    /// at most 1024).
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub layers: u16,
    /// Blocks each prefill rank contributes to a request (1 to 4096, the
    /// most one control message names).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub blocks_per_handle: u32,
    /// Requests in flight per decode rank (1 to 4096).
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub window: u32,
    /// A prefill rank's lease on what it lends or writes, in ms (10 to
    /// 3 600 000); the decode
    /// rank lends its receives for twice as long and gives a read
    /// three quarters of it. Must match the prefill ranks' `--lease-ms`.
    #[arg(long, value_name = "MS", default_value_t = 2000, value_parser = clap::value_parser!(u64).range(10..=3_600_000))]
    pub lease_ms: u64,
    /// Print one JSON object instead of the tables.
    #[arg(long)]
    pub json: bool,
}

/// `kvpoll demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Prefill ranks as processes or as threads.
    #[arg(long, value_enum, default_value_t = Ranks::Processes)]
    pub ranks: Ranks,
    /// `eager` frees a request's blocks at its first handle failure: UNSAFE,
    /// the pre-fix behaviour of Python connectors, for comparison only (it
    /// corrupts blocks over tcp, where a sibling's bytes can land late; over
    /// shared memory a get is the reader's own copy).
    #[arg(long, value_enum, default_value_t = Policy::Safe)]
    pub policy: Policy,
    /// Turn the fault mix off.
    #[arg(long)]
    pub no_faults: bool,
    /// Do not kill and restart a prefill rank mid-run.
    #[arg(long)]
    pub no_kill: bool,
    /// Every N-th handle fails with a transfer error (0: never; at most 10^6).
    #[arg(long, value_name = "N", default_value_t = 200, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub handle_error_every: u32,
    /// Every N-th handle's release fails once (0: never; at most 10^6).
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub release_failure_every: u32,
    /// Every N-th request's setup fails (0: never; at most 10^6).
    #[arg(long, value_name = "N", default_value_t = 197, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub setup_failure_every: u64,
    /// Stall a prefill rank this often, in ms (1 to 3 600 000).
    #[arg(long, value_name = "MS", default_value_t = 2500, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub stall_every_ms: u64,
    /// How long a stall lasts, in ms (0 to 60 000, the longest stall a
    /// prefill rank takes).
    #[arg(long, value_name = "MS", default_value_t = 400, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub stall_ms: u64,
    /// Once a mode, stop a prefill rank's process (SIGSTOP) this long, in
    /// ms: past every lease (default 2.5 x --lease-ms, longer than the
    /// decode ranks' push leases too; 0: never; with `--ranks threads`
    /// its poller is stalled instead; at most 600 000).
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(0..=600_000))]
    pub pause_ms: Option<u64>,
    /// Leases are timers, not fences: reads are not confirmed and receives
    ///  are reported at their lease's end even while a stalled
    /// writer may still write. UNSAFE, for comparison only: with the pauses
    /// and stalls of the fault mix it corrupts blocks.
    #[arg(long)]
    pub no_fence: bool,
    /// Soak: run the modes over and over, with the full fault mix, for
    /// this many seconds, sampling memory, file descriptors and ring
    /// occupancy; exit 1 if any grew without bound, or on any corrupted,
    /// leaked, lost or duplicated request (0: one pull and one push run;
    /// at most 604 800, a week).
    #[arg(long, value_name = "SECS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=604_800))]
    pub soak: u64,
    /// How often the soak samples, in seconds (1 to 3600).
    #[arg(long, value_name = "SECS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub sample_secs: u64,
    /// Write the soak's samples to this CSV file.
    #[arg(long, value_name = "FILE")]
    pub soak_csv: Option<std::path::PathBuf>,
    /// UCX transports (UCX_TLS). Every rank of the demo runs on this host,
    /// so shared memory by default: posix and sysv carry messages, cma
    /// (process_vm_readv/writev) the gets and puts. `tcp` (or any list)
    /// overrides it; over tcp UCX emulates gets and puts with messages
    /// that the other side's worker must apply.
    #[arg(long, value_name = "LIST", default_value = "posix,sysv,cma")]
    pub tls: String,
    /// Move blocks over this network device (`UCX_NET_DEVICES`: `eth1`,
    /// `mlx5_0:1`), one engine with its own poller per device; given once
    /// per rail, up to 16. Reads of 4 MiB or more are striped across the
    /// rails, smaller ones go whole to the least loaded, and a rail that
    /// fails is left out until it works again. Rails carry pull mode only
    /// (reads and lends): with rails, every rank has them and only pull
    /// mode runs. Without it: one engine, UCX chooses the devices.
    #[arg(long = "rail", value_name = "DEVICE", value_parser = rail_device)]
    pub rails: Vec<String>,
    /// Before each mode, time this many transfers of the same shape done
    /// by a plain UCX worker loop (no kvpoll engine) against the live
    /// prefill ranks, one at a time and then at the demo's window on both
    /// decode ranks: the raw UCX baseline printed next to the demo's
    /// latencies (0: skip it; at most 10^6).
    #[arg(long, value_name = "N", default_value_t = 300, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub raw_requests: u32,
    /// Sizes and counts.
    #[command(flatten)]
    pub workload: Workload,
    /// The deployment's key.
    #[command(flatten)]
    pub auth: AuthArgs,
}

/// The deployment's key (`kvpoll::auth`): engines and control links keyed.
#[derive(Debug, Clone, Default, Args)]
pub struct AuthArgs {
    /// Authenticate peers with the secret in this file (at least 16
    /// bytes; white space around it is left out): engine metadata,
    /// notifications and control frames are tagged with it, and a peer
    /// without it is refused. Without this flag, the secret in
    /// KVPOLL_AUTH_KEY if set; otherwise none.
    #[arg(long, value_name = "PATH")]
    pub auth_key_file: Option<PathBuf>,
}

impl AuthArgs {
    /// The key from the file, else from KVPOLL_AUTH_KEY, else none.
    pub fn key(&self) -> Result<Option<kvpoll::auth::AuthKey>, CliError> {
        let key = match &self.auth_key_file {
            Some(path) => kvpoll::auth::AuthKey::from_file(path).map(Some),
            None => kvpoll::auth::AuthKey::from_env(),
        };
        key.map_err(|e| CliError::Usage(e.to_string()))
    }
}

/// `kvpoll serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// This prefill rank's number (it seeds the block pattern; 0 to 65535).
    #[arg(long, value_name = "R", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=65535))]
    pub rank: u32,
    /// Address the control listener binds (port 0: any free port).
    #[arg(long, value_name = "ADDR:PORT", default_value = "127.0.0.1:0")]
    pub listen: String,
    /// UCX transports (UCX_TLS).
    #[arg(long, value_name = "LIST", default_value = "tcp")]
    pub tls: String,
    /// Blocks per KV layer (1 to 2^24).
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=1 << 24))]
    pub blocks: u32,
    /// Bytes per block (1 to 1 GiB).
    #[arg(long, value_name = "BYTES", default_value_t = 16384, value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    pub block_size: u64,
    /// KV layers (registered regions; 1 to 1024, as a peer accepts at most
    /// 1024).
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub layers: u16,
    /// Every N-th handle's release fails once (0: never; at most 10^6).
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub release_failure_every: u32,
    /// Lease on what this rank lends (pull) or writes (push), in ms (10 to
    /// 3 600 000).
    #[arg(long, value_name = "MS", default_value_t = 2000, value_parser = clap::value_parser!(u64).range(10..=3_600_000))]
    pub lease_ms: u64,
    /// Every N-th handle fails with a transfer error (0: never; at most 10^6).
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub handle_error_every: u32,
    /// Accept fault injection over the control port (`STALL`, which stops
    /// this rank's progress). For tests and the demo only: without it a
    /// `STALL` is refused.
    #[arg(long)]
    pub testing: bool,
    /// Serve the engine's metrics over HTTP at this address (GET /metrics,
    /// Prometheus text or OpenMetrics; port 0: any free port, printed as
    /// `METRICS addr`). Off by default.
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics: Option<std::net::SocketAddr>,
    /// Most client connections past their handshake at once (1 to 4096);
    /// one more is refused with a message saying so. The number of
    /// connections still in their handshake is capped apart (64; the
    /// oldest is dropped for a new one).
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_connections: u32,
    /// Move blocks over this network device (`UCX_NET_DEVICES`: `eth1`,
    /// `mlx5_0:1`), one engine with its own poller per device; given once
    /// per rail, up to 16. Reads of 4 MiB or more are striped across the
    /// rails, smaller ones go whole to the least loaded, and a rail that
    /// fails is left out until it works again. Rails carry pull mode only
    /// (reads and lends). Without it: one engine, UCX chooses the devices.
    #[arg(long = "rail", value_name = "DEVICE", value_parser = rail_device)]
    pub rails: Vec<String>,
    /// Rails from a core map (a TOML path, or `auto`: one poller per RDMA
    /// NIC on a CPU of the NIC's NUMA node; `kvpoll topo` shows and checks
    /// maps): one engine per `[[poller]]`, its poller pinned to the map's
    /// core with its idle policy, bound to its `workers` devices (`all`:
    /// UCX chooses). Instead of --rail.
    #[arg(long, value_name = "MAP", conflicts_with = "rails")]
    pub core_map: Option<String>,
    /// Also stop (exit 0) when standard input closes: how a parent process
    /// (the demo, a test) stops its ranks, and stops them if it dies.
    #[arg(long)]
    pub until_stdin_closes: bool,
    /// The deployment's key.
    #[command(flatten)]
    pub auth: AuthArgs,
}

/// `kvpoll connect`.
#[derive(Debug, Clone, Args)]
pub struct ConnectArgs {
    /// The two prefill ranks' `LISTEN` addresses, comma separated.
    #[arg(
        long,
        value_name = "ADDR,ADDR",
        required = true,
        value_delimiter = ',',
        num_args = 1
    )]
    pub to: Vec<String>,
    /// Pull (this rank reads) or push (the prefill ranks write).
    #[arg(long, value_enum, default_value_t = Mode::Pull)]
    pub mode: Mode,
    /// Stop (exit 1, saying why) once a prefill rank stayed unreachable
    /// this long (1 to 86 400 s), retrying with exponential backoff until
    /// then.
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub give_up_after: u64,
    /// How long a request's PREPARE may wait for a prefill rank's READY or
    /// BUSY before the request fails ("no answer"), in ms.
    #[arg(long, value_name = "MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub answer_timeout_ms: u64,
    /// Exit 0 even when requests failed, expired or were refused, as long
    /// as none was corrupted or leaked and every one was reported (without
    /// it, `connect` exits 1 unless every request was transferred).
    #[arg(long)]
    pub allow_failures: bool,
    /// UCX transports (UCX_TLS); they must match the prefill ranks'.
    #[arg(long, value_name = "LIST", default_value = "tcp")]
    pub tls: String,
    /// Move blocks over this network device (`UCX_NET_DEVICES`: `eth1`,
    /// `mlx5_0:1`), one engine with its own poller per device; given once
    /// per rail, up to 16. Reads of 4 MiB or more are striped across the
    /// rails, smaller ones go whole to the least loaded, and a rail that
    /// fails is left out until it works again. Rails carry pull mode only
    /// (reads and lends); the prefill ranks may have other rails or none. Without it: one engine, UCX chooses the devices.
    #[arg(long = "rail", value_name = "DEVICE", value_parser = rail_device)]
    pub rails: Vec<String>,
    /// Rails from a core map (a TOML path, or `auto`: one poller per RDMA
    /// NIC on a CPU of the NIC's NUMA node; `kvpoll topo` shows and checks
    /// maps): one engine per `[[poller]]`, its poller pinned to the map's
    /// core with its idle policy, bound to its `workers` devices (`all`:
    /// UCX chooses). Instead of --rail.
    #[arg(long, value_name = "MAP", conflicts_with = "rails")]
    pub core_map: Option<String>,

    /// Sizes and counts (as for `demo`; they must match the prefill
    /// ranks').
    #[command(flatten)]
    pub workload: Workload,
    /// The deployment's key (the prefill ranks' own).
    #[command(flatten)]
    pub auth: AuthArgs,
}

/// `kvpoll transfer`.
#[derive(Debug, Clone, Args)]
pub struct TransferArgs {
    /// UCX transports (UCX_TLS).
    #[arg(long, value_name = "LIST", default_value = "posix,sysv,cma")]
    pub tls: String,
    /// Blocks per round (1 to 2^24; with --block-size at most 4 GiB).
    #[arg(long, value_name = "N", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=1 << 24))]
    pub blocks: u64,
    /// Bytes per block (1 to 1 GiB).
    #[arg(long, value_name = "BYTES", default_value_t = 16384, value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    pub block_size: u64,
    /// Rounds (1 to 10^6; the first is a warm-up, verified but not timed).
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub rounds: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `kvpoll bench`: the suite, or one comparison.
#[derive(Debug, Clone, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    /// One comparison instead of the suite.
    #[command(subcommand)]
    pub what: Option<BenchWhat>,
    /// The suite's options (`kvpoll bench` is `kvpoll bench all`).
    #[command(flatten)]
    pub all: SuiteArgs,
}

/// The comparisons `kvpoll bench` runs.
#[derive(Debug, Clone, Subcommand)]
pub enum BenchWhat {
    /// The whole suite as one table (the default).
    All(SuiteArgs),
    /// Handle completions/s: the ledger against a Mutex<HashMap> tracker.
    Ledger(JsonArgs),
    /// Completion -> visible against a cache-line round trip;
    /// `Engine::poll` with nothing new.
    Engine(JsonArgs),
    /// End to end over UCX between two processes, against a raw UCX loop.
    E2e(E2eArgs),
    /// What users compare: serving shapes (16 KiB reads, 8 MiB multi-layer
    /// requests, a 64 MiB read; pull and push) over shared memory and tcp
    /// (over a veth link between two network namespaces when run as root,
    /// and over loopback), in UCX-allocated and caller memory, next to
    /// memcpy, process_vm_readv, a plain tcp stream, a raw UCX loop, and
    /// NIXL (at its better setting) and Mooncake where `make bench-peers`
    /// installed them. A group that does not run fails the run.
    Compare(CompareArgs),
    /// Reads over one rail against reads over two, each rail a veth pair
    /// between two network namespaces (tcp; needs root), and one plain
    /// tcp stream per pair: 64 MiB reads and 8 MiB requests, interleaved
    /// rounds, throughput and both processes' CPU per GB.
    Rails(RailsBenchArgs),
    /// Writes the ledger bench's completion trace, for the Python
    /// reference (kvpoll-cli/benches/reference/vllm_style.py).
    Trace(TraceArgs),
}

/// `kvpoll bench compare`.
#[derive(Debug, Clone, Default, Args)]
pub struct CompareArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Draw the comparison (each system's rate as a share of the group's
    /// best limit) into this SVG file.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Shared-memory transports.
    #[arg(long, value_name = "LIST", default_value = "posix,sysv,cma")]
    pub shm: String,
    /// Interleaved rounds per system (medians and min-max are reported).
    /// Each round of a system moves at least 1 GB and lasts at least 2 s.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    /// Scale every round (0.001 to 10): its 1 GB and 2 s, and the
    /// warm-up's requests. A quick look, or a longer one.
    #[arg(long, value_name = "X", default_value_t = 1.0)]
    pub scale: f64,
    /// Run the tcp groups over loopback only, even where a veth link
    /// between two network namespaces can be made.
    #[arg(long)]
    pub loopback_only: bool,
    /// Only the groups whose key contains this (e.g. `tcp`, `layers_shm`).
    #[arg(long, value_name = "TEXT")]
    pub only: Option<String>,
    /// One more kvpoll system with these UCX options on both sides
    /// (`NAME=VALUE,...`, names without `UCX_`): settings compared in one run.
    #[arg(long, value_name = "LIST")]
    pub alt_ucx: Option<String>,
    /// The Python that imports NIXL and Mooncake [default: the venv `make
    /// bench-peers` makes, target/bench-peers/venv, next to this binary's
    /// directory; $KVPOLL_BENCH_PYTHON]. `none`: do not measure them.
    #[arg(long, value_name = "PATH")]
    pub peers_python: Option<PathBuf>,
    /// Internal: run the one group `--only` names in this process's
    /// network namespace, its peers in this one (the far end of a veth
    /// link), and print its figures as lines for the process that made
    /// the link.
    #[arg(long, value_name = "NAME", hide = true, requires = "only")]
    pub peer_netns: Option<String>,
}

/// `kvpoll bench [all]`.
#[derive(Debug, Clone, Default, Args)]
pub struct SuiteArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// UCX transports of the e2e figures [default: posix,sysv,cma, then tcp
    /// if shared memory cannot be used].
    #[arg(long, value_name = "LIST")]
    pub tls: Option<String>,
    /// Draw the latency CDFs of kvpoll and its baselines into this SVG
    /// file, and the comparison of `bench compare` next to it
    /// (`<name>-compare.svg`).
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Leave out the comparison of `bench compare`.
    #[arg(long)]
    pub no_compare: bool,
    /// The Python for NIXL and Mooncake (see `bench compare`).
    #[arg(long, value_name = "PATH")]
    pub peers_python: Option<PathBuf>,
}

/// `--json` alone.
#[derive(Debug, Clone, Args)]
pub struct JsonArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `kvpoll bench e2e`.
#[derive(Debug, Clone, Args)]
pub struct E2eArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// UCX transports of both processes [default: posix,sysv,cma, then tcp
    /// if shared memory cannot be used].
    #[arg(long, value_name = "LIST")]
    pub tls: Option<String>,
}

/// `kvpoll bench trace`.
#[derive(Debug, Clone, Args)]
pub struct TraceArgs {
    /// Where to write the trace.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

/// `kvpoll topo`.
#[derive(Debug, Clone, Args)]
pub struct TopoArgs {
    /// Validate a core map (a TOML path, or `auto`) on this machine and warn
    /// about costly placements (exit 0 valid, 1 invalid).
    #[arg(long, value_name = "MAP")]
    pub check: Option<String>,
    /// Print only the suggested core map.
    #[arg(long, conflicts_with = "check")]
    pub map: bool,
}

/// `kvpoll completions`.
#[derive(Debug, Clone, Args)]
pub struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// `kvpoll ucx-peer`.
#[derive(Debug, Clone, Args)]
pub struct UcxPeerArgs {
    /// UCX transports (UCX_TLS).
    #[arg(long, value_name = "LIST", default_value = "tcp")]
    pub tls: String,
    /// Its blocks.
    #[command(flatten)]
    pub pattern: MemPeerArgs,
    /// Where the region lives: UCX-allocated, or an mmap of this process.
    #[arg(long, value_enum, default_value_t = PeerMemory::Ucx)]
    pub memory: PeerMemory,
}

/// Where a bench peer's blocks live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PeerMemory {
    /// Allocated and registered by UCX.
    Ucx,
    /// An anonymous mapping of the process (huge pages where the kernel
    /// gives them), registered as caller memory.
    Caller,
}

/// What a lending `engine-peer` lends to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PeerLendTo {
    /// Readers (pull): one reader each.
    Readers,
    /// Writers (push destinations): one writer each.
    Writers,
}

/// `kvpoll mem-peer`, and the blocks of a `ucx-peer`.
#[derive(Debug, Clone, Copy, Args)]
pub struct MemPeerArgs {
    /// Blocks in the region.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub blocks: u64,
    /// Bytes per block.
    #[arg(long, value_name = "BYTES", default_value_t = 16384, value_parser = clap::value_parser!(u64).range(1..))]
    pub block_size: u64,
    /// Seed of the block pattern.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
}

/// `kvpoll engine-peer`.
#[derive(Debug, Clone, Args)]
pub struct EnginePeerArgs {
    /// UCX transports (UCX_TLS).
    #[arg(long, value_name = "LIST", default_value = "tcp")]
    pub tls: String,
    /// Blocks per region.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub blocks: u64,
    /// Bytes per block.
    #[arg(long, value_name = "BYTES", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
    pub block_size: u64,
    /// Seed of the block pattern (region r holds the pattern of seed*100 + r).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// Regions (KV layers) to register.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..))]
    pub regions: u16,
    /// Lend request ids 0, 1, 2, … (the blocks of `--lend-blocks`, to one
    /// reader each), keeping
    /// this many lent ahead of those released: a reader that confirms its
    /// reads (the default) reads ids in that order. 0: lend nothing.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=65536))]
    pub lend_ahead: u32,
    /// Blocks each lend names: request id i lends blocks i*K .. i*K+K
    /// (modulo the region's blocks), so consecutive requests touch
    /// different blocks.
    #[arg(long, value_name = "K", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=512))]
    pub lend_blocks: u32,
    /// Lend to readers (pull) or to writers (push destinations).
    #[arg(long, value_enum, default_value_t = PeerLendTo::Readers)]
    pub lend_to: PeerLendTo,
    /// Writers: check the blocks of every Nth request received against
    /// the pattern of `--writer-seed` and print `CHECKED <id> ok|bad`
    /// (0: never).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub check_every: u32,
    /// The seed of the pattern writers write (region r: seed*100 + r).
    #[arg(long, value_name = "N", default_value_t = 7)]
    pub writer_seed: u64,
    /// Where the regions live: UCX-allocated, or mmaps of this process.
    #[arg(long, value_enum, default_value_t = PeerMemory::Ucx)]
    pub memory: PeerMemory,
    /// Entries of the engine's command ring (at least 2; default: the
    /// engine's). For tests: a small ring fills while lending ahead.
    #[arg(long, value_name = "N", hide = true, value_parser = clap::value_parser!(u32).range(2..))]
    pub command_ring: Option<u32>,
    /// The deployment's key (`kvpoll bench compare`'s keyed rows).
    #[command(flatten)]
    pub auth: AuthArgs,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}

/// A rail's network device as `UCX_NET_DEVICES` names one: 1 to 64
/// letters, digits and `_-.:`.
fn rail_device(s: &str) -> Result<String, String> {
    let ok = (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.:".contains(&b));
    if ok {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is not a network device name (1 to 64 letters, digits and _-.:)"
        ))
    }
}

/// Seconds, 0.1 to 600.
fn seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.1..=600.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not within 0.1 to 600 seconds"))
    }
}

/// `kvpoll bench rails`.
#[derive(Debug, Clone, Args)]
pub struct RailsBenchArgs {
    /// Interleaved rounds per configuration (1 to 100; medians and ranges
    /// are reported).
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    /// Seconds each round reads for (0.1 to 600), after a warm-up read.
    #[arg(long, value_name = "S", default_value_t = 3.0, value_parser = seconds)]
    pub seconds: f64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// The Python that imports Mooncake, measured over the same pairs
    /// [default: the venv `make bench-peers` makes, target/bench-peers/venv,
    /// next to this binary's directory; $KVPOLL_BENCH_PYTHON]. `none`: do
    /// not measure it. Without one, the run fails.
    #[arg(long, value_name = "PATH")]
    pub peers_python: Option<PathBuf>,
}

/// What a `kvpoll rails-peer` process does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RailsRole {
    /// Lends ahead until standard input closes.
    Lender,
    /// Reads the lender's metadata from standard input, reads for the
    /// given seconds, prints `RESULT bytes ns cpu_ns reads`.
    Reader,
    /// Writes one tcp stream per pair until the other side closes.
    StreamSource,
    /// Reads one tcp stream per pair for the given seconds.
    StreamSink,
}

/// `kvpoll rails-peer`.
#[derive(Debug, Clone, Args)]
pub struct RailsPeerArgs {
    /// What this side does.
    #[arg(long, value_enum)]
    pub role: RailsRole,
    /// Rails (veth pairs `kvpoll0`, `kvpoll1`, ...; 1 to 16).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub rails: u16,
    /// Bytes per block (4 KiB to 64 MiB).
    #[arg(long, value_name = "BYTES", default_value_t = 65536, value_parser = clap::value_parser!(u64).range(4096..=1 << 26))]
    pub block_size: u64,
    /// Blocks per read (1 to 4096).
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub blocks_per_read: u32,
    /// Reads in flight (1 to 64).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub in_flight: u32,
    /// Seconds the reader reads for (0.1 to 600).
    #[arg(long, value_name = "S", default_value_t = 3.0, value_parser = seconds)]
    pub seconds: f64,
}
