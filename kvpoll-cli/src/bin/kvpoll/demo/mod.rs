//! `kvpoll demo`: disaggregated prefill and decode over real UCX.
//!
//! Prefill runs at TP=4 (four ranks, each its own process by default), decode
//! at TP=2 (two ranks, each reading from two prefill ranks: two handles per
//! request). Pull mode, then push mode. Every block is filled with a pattern
//! of (request, layer, rank, block) and checked by its reader when it
//! arrives and again when it is given back to the pool. Faults are on by
//! default at a low rate: handle errors, setup failures, release failures,
//! stalled prefill ranks, and one prefill rank killed and restarted. All
//! ranks run on this host: shared memory by default, tcp on request. Each
//! mode's latencies come with their parts and a raw UCX baseline (raw.rs).
//!
//! `--policy eager` frees a request's blocks at its first handle failure —
//! the behaviour kvpoll exists to prevent. It is UNSAFE and for comparison
//! only: on the same scenario it corrupts blocks, which shows the checker
//! can fail.

mod decode;
mod door;
mod link;
mod pool;
mod prefill;
mod proto;
mod raw;
mod side;
mod soak;

use std::io::{BufRead, BufReader, IsTerminal};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[allow(unused_imports)]
use crate::faults::*;

use crate::cli::{CliError, ConnectArgs, DemoArgs, Ranks, ServeArgs, Workload};
use crate::signals;
use decode::{progress_of, Causes, DecodeConfig, DecodeReport, Registry};
pub use decode::{Mode, Policy};
use kvpoll_cli::control::{self, FrameReader};
use link::LinkError;
use prefill::ServeConfig;
use proto::{Layout, Msg};

const PREFILL_RANKS: u32 = 4;
const DECODE_RANKS: u32 = 2;

#[derive(Debug, Clone)]
struct Settings {
    processes: bool,
    policy: Policy,
    requests: u64,
    tls: String,
    block_size: u64,
    layers: usize,
    blocks: u32,
    per_handle: u32,
    window: usize,
    faults: bool,
    handle_error_every: u32,
    release_failure_every: u32,
    setup_failure_every: u64,
    stall_every: Duration,
    stall_for: Duration,
    kill: bool,
    json: bool,
    give_up_after: Duration,
    /// How long a PREPARE waits for its answer.
    answer_timeout: Duration,
    /// A prefill rank's lend (pull) and write (push) lease.
    lease: Duration,
    /// How long a prefill rank is stopped once a mode (zero: never).
    pause_for: Duration,
    /// Leases are timers (unsafe, for comparison).
    no_fence: bool,
    /// Soak for this long (zero: one run of each mode).
    soak: Duration,
    sample_every: Duration,
    soak_csv: Option<std::path::PathBuf>,
    /// Raw UCX transfers timed before each mode (0: none).
    raw_requests: u32,
    /// The deployment's key, and the file it came from (handed to the
    /// prefill rank processes; from the environment they inherit it).
    auth: Option<kvpoll::auth::AuthKey>,
    auth_key_file: Option<std::path::PathBuf>,
    /// Every rank's rails (`--rail`, `--core-map`), if any.
    rails: side::RailsSpec,
    /// The `--rail` devices as given, for the prefill rank processes.
    rail_args: Vec<String>,
}

impl Settings {
    /// A demo run's settings: the workload, the fault mix and how ranks run.
    fn demo(a: &DemoArgs) -> Result<Settings, CliError> {
        let mut s = Settings::workload(&a.workload, &a.tls)?;
        check_sizes(s.layers as u64, s.blocks, s.block_size, DEMO_RANKS)?;
        s.processes = a.ranks == Ranks::Processes;
        s.policy = a.policy;
        s.faults = !a.no_faults;
        if s.faults && !AVAILABLE {
            return Err(CliError::Failed(
                "this kvpoll was built without the fault-injection feature: run the demo with --no-faults".into(),
            ));
        }
        s.handle_error_every = a.handle_error_every;
        s.release_failure_every = a.release_failure_every;
        s.setup_failure_every = a.setup_failure_every;
        s.stall_every = Duration::from_millis(a.stall_every_ms);
        s.stall_for = Duration::from_millis(a.stall_ms);
        s.kill = !a.no_kill;
        s.pause_for = a.pause_ms.map_or(s.lease * 5 / 2, Duration::from_millis);
        s.no_fence = a.no_fence;
        s.soak = Duration::from_secs(a.soak);
        s.sample_every = Duration::from_secs(a.sample_secs);
        s.soak_csv = a.soak_csv.clone();
        s.raw_requests = a.raw_requests;
        s.auth = a.auth.key()?;
        s.auth_key_file = a.auth.auth_key_file.clone();
        s.rails = rails_given(&a.rails, None)?;
        s.rail_args = a.rails.clone();
        Ok(s)
    }

    /// The workload alone (what `connect` takes), faults off.
    fn workload(w: &Workload, tls: &str) -> Result<Settings, CliError> {
        let s = Settings {
            processes: true,
            policy: Policy::Safe,
            requests: w.requests,
            tls: tls.to_owned(),
            block_size: w.block_size,
            layers: usize::from(w.layers),
            blocks: w.blocks,
            per_handle: w.blocks_per_handle,
            window: w.window as usize,
            faults: false,
            handle_error_every: 0,
            release_failure_every: 0,
            setup_failure_every: 0,
            stall_every: Duration::from_millis(2500),
            stall_for: Duration::ZERO,
            kill: false,
            json: w.json,
            give_up_after: Duration::from_secs(30),
            answer_timeout: Duration::from_secs(5),
            lease: Duration::from_millis(w.lease_ms),
            pause_for: Duration::ZERO,
            no_fence: false,
            soak: Duration::ZERO,
            sample_every: Duration::from_secs(5),
            soak_csv: None,
            raw_requests: 0,
            auth: None,
            auth_key_file: None,
            rails: side::RailsSpec::None,
            rail_args: Vec::new(),
        };
        if u64::from(s.blocks) < 2 * u64::from(s.per_handle) * s.window as u64 {
            return Err(CliError::Usage(format!(
                "--blocks {} cannot hold --window {} requests of 2 x {} blocks (--blocks-per-handle)",
                s.blocks, s.window, s.per_handle
            )));
        }
        Ok(s)
    }
}

/// A started prefill rank.
enum Rank {
    Process(Child),
    Thread(Arc<AtomicBool>, std::thread::JoinHandle<()>),
}

impl Rank {
    fn stop(self) {
        match self {
            Rank::Process(mut c) => {
                drop(c.stdin.take());
                let deadline = Instant::now() + Duration::from_secs(5);
                while Instant::now() < deadline {
                    if matches!(c.try_wait(), Ok(Some(_))) {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                let _ = c.kill();
                let _ = c.wait();
            }
            Rank::Thread(stop, t) => {
                stop.store(true, Ordering::Release);
                let _ = t.join();
            }
        }
    }
}

/// A decode rank's settings, without faults; rank 1 on prefill ranks 0, 1.
fn decode_config(s: &Settings, mode: Mode, policy: Policy) -> DecodeConfig {
    DecodeConfig {
        rank: 1,
        prefill: [0, 1],
        tls: s.tls.clone(),
        blocks: s.blocks,
        block_size: s.block_size,
        layers: s.layers,
        requests: s.requests,
        window: s.window,
        per_handle: s.per_handle,
        mode,
        policy,
        setup_failure_every: 0,
        faults: Faults::default(),
        deadline: s.lease * 3 / 4,
        // Longer than a prefill rank's write lease: see serve_config.
        lease: s.lease * 2,
        hold: Duration::from_millis(30),
        give_up: Duration::from_secs(240),
        answer_timeout: s.answer_timeout,
        give_up_after: s.give_up_after,
        fence: !s.no_fence,
        stall: None,
        doze: None,
        rings: None,
        auth: s.auth.clone(),
        rails: s.rails.clone(),
    }
}

fn serve_config(s: &Settings, rank: u32) -> ServeConfig {
    ServeConfig {
        rank,
        tls: s.tls.clone(),
        blocks: s.blocks,
        block_size: s.block_size,
        layers: s.layers,
        // Shorter than the decode side's lend lease: a producer's write
        // normally ends (done or failed) before its destination's lease.
        lease: s.lease,
        metrics: None,
        limits: door::Limits { max_conns: 256 },
        // The demo stalls its ranks on purpose.
        testing: s.faults,
        auth: s.auth.clone(),
        rails: s.rails.clone(),
        faults: Faults {
            handle_error_every: if s.faults {
                s.handle_error_every * 2
            } else {
                0
            },
            release_failure_every: if s.faults {
                s.release_failure_every * 2
            } else {
                0
            },
            release_retry_after: Duration::from_millis(20),
            ..Faults::default()
        },
    }
}

fn start_rank(s: &Settings, rank: u32) -> Result<(Rank, String), CliError> {
    if s.processes {
        let exe = std::env::current_exe().map_err(|e| CliError::Failed(e.to_string()))?;
        let mut child = Command::new(exe)
            .args([
                "serve",
                "--rank",
                &rank.to_string(),
                "--listen",
                "127.0.0.1:0",
                // Closing its stdin stops it, also when the demo is killed.
                "--until-stdin-closes",
            ])
            .args(["--tls", &s.tls, "--blocks", &s.blocks.to_string()])
            .args([
                "--block-size",
                &s.block_size.to_string(),
                "--layers",
                &s.layers.to_string(),
            ])
            .args(["--lease-ms", &s.lease.as_millis().to_string()])
            .args([
                "--handle-error-every",
                &serve_config(s, rank).faults.handle_error_every.to_string(),
            ])
            .args([
                "--release-failure-every",
                &serve_config(s, rank)
                    .faults
                    .release_failure_every
                    .to_string(),
            ])
            // The coordinator stalls ranks: fault injection must be allowed.
            .args(s.faults.then_some("--testing"))
            .args(s.rail_args.iter().flat_map(|d| ["--rail", d.as_str()]))
            .args(
                s.auth_key_file
                    .iter()
                    .flat_map(|f| [std::ffi::OsStr::new("--auth-key-file"), f.as_os_str()]),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| CliError::Failed(format!("starting prefill rank {rank}: {e}")))?;
        let mut line = String::new();
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| CliError::Failed("no stdout".into()))?;
        BufReader::new(stdout)
            .read_line(&mut line)
            .map_err(|e| CliError::Failed(e.to_string()))?;
        let addr = line
            .strip_prefix("LISTEN ")
            .map(|a| a.trim().to_owned())
            .ok_or_else(|| CliError::Failed(format!("prefill rank {rank} said {line:?}")))?;
        Ok((Rank::Process(child), addr))
    } else {
        let listener =
            TcpListener::bind("127.0.0.1:0").map_err(|e| CliError::Failed(e.to_string()))?;
        let addr = listener
            .local_addr()
            .map_err(|e| CliError::Failed(e.to_string()))?
            .to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let (cfg, flag) = (serve_config(s, rank), stop.clone());
        let t = std::thread::spawn(move || {
            let stop = move || flag.load(Ordering::Acquire);
            if let Err(e) = prefill::serve(listener, cfg, stop, || {}) {
                tracing::error!(rank, "prefill rank stopped: {e}");
            }
        });
        Ok((Rank::Thread(stop, t), addr))
    }
}

/// One control request to a prefill rank on a fresh connection, after the
/// handshake; its reply if one is wanted.
fn ask(addr: &str, s: &Settings, msg: &Msg, want_reply: bool) -> Result<Option<Msg>, LinkError> {
    let mut o = link::handshake(addr, layout(s), s.auth.as_ref())?;
    control::send_in(&mut o.stream, &o.session, msg).map_err(LinkError::Write)?;
    if !want_reply {
        return Ok(None);
    }
    let mut frames = FrameReader::new(o.stream, link::FRAME_TIMEOUT, Some(link::HANDSHAKE_TIMEOUT))
        .with_session(o.session);
    match frames.read_msg()? {
        Msg::Refused(why) => Err(LinkError::Refused(why)),
        m => Ok(Some(m)),
    }
}

/// The layout every rank of a run registers.
fn layout(s: &Settings) -> Layout {
    Layout {
        block_size: s.block_size,
        layers: s.layers as u32,
        blocks: s.blocks,
    }
}

/// Whether UCX may pick tcp from the transport list `tls` (an exclusion
/// list, `^...`, or a list naming tcp or everything).
fn uses_tcp(tls: &str) -> bool {
    tls.starts_with('^')
        || tls
            .split(',')
            .any(|t| matches!(t.trim(), "tcp" | "all" | "net"))
}

/// Ranks of a demo run that register a pool: four prefill, two decode.
const DEMO_RANKS: u64 = (PREFILL_RANKS + DECODE_RANKS) as u64;

/// Refuses, before anything starts, pools that cannot be registered: sizes
/// that overflow, or more memory than the machine has available for
/// `ranks` pools of `layers` x `blocks` x `block_size` bytes.
fn check_sizes(layers: u64, blocks: u32, block_size: u64, ranks: u64) -> Result<(), CliError> {
    let per_rank = layers
        .checked_mul(u64::from(blocks))
        .and_then(|n| n.checked_mul(block_size));
    let total = per_rank.and_then(|b| b.checked_mul(ranks));
    let (Some(per_rank), Some(total)) = (per_rank, total) else {
        return Err(CliError::Usage(format!(
            "--layers {layers} x --blocks {blocks} x --block-size {block_size} overflows"
        )));
    };
    if let Some(avail) = mem_available() {
        if total > avail {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            return Err(CliError::Usage(format!(
                "--layers {layers} x --blocks {blocks} x --block-size {block_size} is {:.1} GiB a rank, {:.1} GiB for {ranks} rank(s): more than the {:.1} GiB of memory available",
                gib(per_rank),
                gib(total),
                gib(avail)
            )));
        }
    }
    Ok(())
}

/// MemAvailable from /proc/meminfo, in bytes (None where unreadable).
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[derive(Debug, Default, Clone)]
struct ModeReport {
    decode: Vec<DecodeReport>,
    prefill_leaked: u64,
    /// The prefill ranks' pollers' busy and idle time in this mode, ns.
    prefill_busy: u64,
    prefill_idle: u64,
    seconds: f64,
    kills: u32,
    stalls: u32,
    pauses: u32,
    prefill_transfer_errors: u64,
    prefill_release_failures: u64,
    /// The raw UCX baseline timed before the mode, if it ran.
    raw: Option<RawFigures>,
}

/// The raw UCX baseline of a mode: p50 and p99 in µs, one request at a
/// time and at the demo's window on every decode rank at once.
#[derive(Debug, Default, Clone)]
struct RawFigures {
    single: Option<[u64; 2]>,
    windowed: Option<[u64; 2]>,
    /// Why a part did not run.
    error: Option<String>,
}

/// Times the raw UCX baseline for `mode` against the live prefill ranks,
/// from this (the decode ranks') process: first one request at a time on
/// decode rank 1's two prefill ranks, then `window` at a time on every
/// decode rank at once, as the demo runs.
fn raw_baseline(s: &Settings, mode: Mode, registry: &Registry) -> RawFigures {
    let addrs: Vec<String> = registry
        .addrs
        .lock()
        .map(|a| a.iter().map(|x| x.0.clone()).collect())
        .unwrap_or_default();
    let cfg = |window: usize| raw::RawConfig {
        tls: s.tls.clone(),
        layout: layout(s),
        per_handle: s.per_handle,
        mode,
        requests: s.raw_requests,
        window,
        auth: s.auth.clone(),
    };
    let pair = |d: u32| -> Result<[String; 2], String> {
        match addrs.get(2 * d as usize..2 * d as usize + 2) {
            Some([a, b]) => Ok([a.clone(), b.clone()]),
            _ => Err(format!(
                "no address for decode rank {}'s prefill ranks",
                d + 1
            )),
        }
    };
    let p50_p99 = |h: &raw::Latencies| [h.value_at_quantile(0.5), h.value_at_quantile(0.99)];
    let mut out = RawFigures::default();
    match pair(0).and_then(|[a, b]| raw::measure(&cfg(1), [&a, &b])) {
        Ok(h) => out.single = Some(p50_p99(&h)),
        Err(e) => out.error = Some(format!("1 in flight: {e}")),
    }
    let runs: Vec<_> = (0..DECODE_RANKS)
        .map(|d| {
            let (c, p) = (cfg(s.window), pair(d));
            std::thread::spawn(move || p.and_then(|[a, b]| raw::measure(&c, [&a, &b])))
        })
        .collect();
    let mut all: Option<raw::Latencies> = None;
    for r in runs {
        match r.join().unwrap_or_else(|_| Err("panicked".into())) {
            Ok(h) => match &mut all {
                Some(a) => {
                    let _ = a.add(&h);
                }
                None => all = Some(h),
            },
            Err(e) => {
                out.error.get_or_insert(format!("window {}: {e}", s.window));
            }
        }
    }
    if out.error.is_none() {
        out.windowed = all.as_ref().map(p50_p99);
    }
    if let Some(e) = &out.error {
        tracing::warn!("raw UCX baseline ({mode:?}): {e}");
    }
    out
}

pub fn run(args: &DemoArgs) -> Result<(), CliError> {
    let s = Settings::demo(args)?;
    let mut ranks = Vec::new();
    let registry = Arc::new(Registry::default());
    for r in 0..PREFILL_RANKS {
        let (rank, addr) = start_rank(&s, r)?;
        ranks.push(Some(rank));
        if let Ok(mut a) = registry.addrs.lock() {
            a.push((addr, 0));
        }
    }
    if !s.json {
        println!(
            "kvpoll demo: prefill TP={PREFILL_RANKS} ({}), decode TP={DECODE_RANKS} (2 handles a request), {} requests per decode rank and mode, {} layers x {} KiB blocks over {}{}, faults {}, policy {}, leases {}",
            if s.processes { "processes" } else { "threads" },
            s.requests,
            s.layers,
            s.block_size / 1024,
            s.tls,
            if s.rails.is_none() {
                String::new()
            } else {
                format!(" on rails {} (pull mode only)", s.rails.describe())
            },
            if s.faults { "on" } else { "off" },
            match s.policy { Policy::Safe => "safe", Policy::Eager => "EAGER (unsafe, for comparison)" },
            if s.no_fence { "TIMERS (--no-fence: unsafe, for comparison)" } else { "fenced" }
        );
    }
    refresh_pids(&registry, &ranks);
    let rings: Vec<Arc<AtomicU64>> = (0..DECODE_RANKS).map(|_| Arc::default()).collect();
    let soak_until = (!s.soak.is_zero()).then(|| Instant::now() + s.soak);
    let sampler = soak_until.map(|_| {
        let reg = registry.clone();
        soak::Sampler::start(
            s.sample_every,
            move || reg.pids.lock().map(|p| p.clone()).unwrap_or_default(),
            rings.clone(),
        )
    });
    let mut reports = Vec::new();
    let mut cycle = 0u32;
    let mut counted_before = std::collections::HashMap::new();
    loop {
        cycle += 1;
        // Rails carry reads and lends: pull mode only.
        let modes: &[Mode] = if s.rails.is_none() {
            &[Mode::Pull, Mode::Push]
        } else {
            &[Mode::Pull]
        };
        for &mode in modes {
            let r = run_mode(&s, mode, &registry, &mut ranks, &rings, &mut counted_before)?;
            if !s.json {
                if soak_until.is_some() {
                    print_soak_line(cycle, mode, &r);
                } else {
                    print_table(mode, &r, &s);
                }
            }
            reports.push((mode, r));
            if signals::caught().is_some() {
                break;
            }
        }
        if let Some(sig) = signals::caught() {
            for r in ranks.into_iter().flatten() {
                r.stop();
            }
            return Err(CliError::Signal(sig));
        }
        let stopped_early = reports.iter().any(|(_, r)| gave_up(r).is_some());
        match soak_until {
            Some(t) if Instant::now() < t && !stopped_early => {}
            _ => break,
        }
    }
    for r in ranks.into_iter().flatten() {
        r.stop();
    }
    let mut problems = Vec::new();
    if let Some(sampler) = sampler {
        let samples = sampler.finish();
        if let (Some(first), Some(last)) = (samples.first(), samples.last()) {
            if !s.json {
                println!(
                    "soak: {cycle} cycles, {} samples; decode RSS {} -> {} KiB, fds {} -> {}; prefill RSS {} -> {} KiB, fds {} -> {}; ring occupancy {} -> {}",
                    samples.len(),
                    first.rss_kib,
                    last.rss_kib,
                    first.fds,
                    last.fds,
                    first.ranks_rss_kib,
                    last.ranks_rss_kib,
                    first.ranks_fds,
                    last.ranks_fds,
                    first.ring_occupancy,
                    last.ring_occupancy
                );
            }
        }
        if let Some(path) = &s.soak_csv {
            std::fs::write(path, soak::csv(&samples))
                .map_err(|e| CliError::Failed(format!("{}: {e}", path.display())))?;
        }
        problems.extend(soak::growth(&samples));
    }
    for (mode, r) in &reports {
        for d in &r.decode {
            let reported = progress_of(d);
            if reported != d.requests && d.gave_up.is_none() {
                problems.push(format!(
                    "{mode:?}: {} of {} requests were never reported",
                    d.requests - reported.min(d.requests),
                    d.requests
                ));
            }
            if d.unexpected_reports > 0 {
                problems.push(format!(
                    "{mode:?}: {} reports of requests not awaited (duplicated)",
                    d.unexpected_reports
                ));
            }
        }
    }
    let corrupted: u64 = reports
        .iter()
        .flat_map(|(_, r)| &r.decode)
        .map(|d| d.corrupted_blocks)
        .sum();
    let leaked: u64 = reports
        .iter()
        .map(|(_, r)| r.prefill_leaked + r.decode.iter().map(|d| d.leaked_blocks).sum::<u64>())
        .sum();
    if s.json {
        println!("{}", json(&s, &reports));
    } else {
        println!("total: {corrupted} corrupted blocks, {leaked} leaked blocks");
    }
    if let Some(why) = reports.iter().find_map(|(_, r)| gave_up(r)) {
        return Err(CliError::Failed(format!(
            "a decode rank stopped early: {why}"
        )));
    }
    if s.policy == Policy::Safe && !s.no_fence && (corrupted > 0 || leaked > 0) {
        return Err(CliError::Failed(format!(
            "{corrupted} corrupted and {leaked} leaked blocks under the safe policy"
        )));
    }
    if !problems.is_empty() {
        return Err(CliError::Failed(problems.join("; ")));
    }
    Ok(())
}

/// Records the process ids of the prefill ranks run as processes.
fn refresh_pids(registry: &Registry, ranks: &[Option<Rank>]) {
    let pids = ranks
        .iter()
        .filter_map(|r| match r {
            Some(Rank::Process(c)) => Some(c.id()),
            _ => None,
        })
        .collect();
    if let Ok(mut p) = registry.pids.lock() {
        *p = pids;
    }
}

/// One line a mode in a soak.
fn print_soak_line(cycle: u32, mode: Mode, r: &ModeReport) {
    let t = sums(r);
    println!(
        "cycle {cycle} {mode:?}: transferred {} of {} ({:.1}%), {} failed, {} corrupted, {} leaked; fired {}",
        t.finished,
        t.requests,
        pct(t.finished, t.requests),
        t.failed,
        t.corrupted,
        t.leaked,
        faults_fired(r)
    );
}

/// The injected faults that fired in a mode, in words.
fn faults_fired(r: &ModeReport) -> String {
    let f = fired(r);
    format!(
        "{} transfer errors, {} setup failures, {} release failures, {} prefill stalls, {} prefill pauses, {} decode stalls, {} kills",
        f.transfer_errors,
        f.setup_failures,
        f.release_failures,
        r.stalls,
        r.pauses,
        decode_stalls(r),
        r.kills
    )
}

fn run_mode(
    s: &Settings,
    mode: Mode,
    registry: &Arc<Registry>,
    ranks: &mut [Option<Rank>],
    rings: &[Arc<AtomicU64>],
    counted_before: &mut std::collections::HashMap<String, [u64; 4]>,
) -> Result<ModeReport, CliError> {
    // The baseline first, with no request in flight (see raw.rs).
    let raw = (s.raw_requests > 0 && s.soak.is_zero()).then(|| raw_baseline(s, mode, registry));
    let progress = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut decoders = Vec::new();
    for d in 0..DECODE_RANKS {
        let mut cfg = decode_config(s, mode, s.policy);
        cfg.rank = d + 1;
        cfg.prefill = [2 * d, 2 * d + 1];
        cfg.rings = rings.get(d as usize).cloned();
        if s.faults {
            // Each decode rank's poller hangs once past the prefill ranks'
            // lease (pull: its reads land late; push: its destinations'
            // leases run out under their writers), and its engine thread
            // sleeps once.
            cfg.stall = Some((s.requests * 3 / 5, s.lease * 3 / 2));
            cfg.doze = Some((s.requests * 4 / 5, s.lease * 3 / 2));
            cfg.setup_failure_every = s.setup_failure_every;
            cfg.faults = Faults {
                handle_error_every: s.handle_error_every,
                release_failure_every: s.release_failure_every,
                release_retry_after: Duration::from_millis(20),
                ..Faults::default()
            };
        }
        let (reg, prog, st) = (registry.clone(), progress.clone(), stop.clone());
        decoders.push(std::thread::spawn(move || {
            decode::run(&cfg, &reg, &prog, &|| st.load(Ordering::Acquire))
        }));
    }

    let total = s.requests * u64::from(DECODE_RANKS);
    let bar = (!s.json && std::io::stderr().is_terminal()).then(|| {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{prefix} [{bar:40}] {pos}/{len} requests {per_sec} {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.set_prefix(format!("{mode:?}"));
        b
    });
    let (mut stalls, mut kills, mut pauses) = (0u32, 0u32, 0u32);
    let mut pause_done = !s.faults || s.pause_for.is_zero();
    let mut paused: Option<(u32, Instant)> = None;
    let mut next_stall = Instant::now() + s.stall_every;
    // In push mode over tcp only on a UCX that survives it: a writer killed
    // mid-put over tcp makes UCX before 1.22 abort its destination's
    // process (see docs/design.md, UCX facts); over shared memory the
    // writer copies its puts itself.
    let push_kill_safe = !uses_tcp(&s.tls)
        || !kvpoll::transport::ucx::KnownUcxLimits::loaded().tcp_target_dies_with_its_writer;
    let mut killed = !(s.faults && s.kill && s.processes && (mode == Mode::Pull || push_kill_safe));
    let mut last_line = Instant::now();
    while decoders.iter().any(|d| !d.is_finished()) {
        std::thread::sleep(Duration::from_millis(20));
        if signals::caught().is_some() {
            // Cut short: the decode ranks stop; the caller stops the rest.
            stop.store(true, Ordering::Release);
        }
        let done = progress.load(Ordering::Relaxed);
        if let Some(b) = &bar {
            b.set_position(done);
        } else if !s.json && last_line.elapsed() > Duration::from_secs(2) {
            println!("  {mode:?}: {done}/{total} requests reported");
            last_line = Instant::now();
        }
        if s.faults && Instant::now() >= next_stall {
            // Stall the prefill ranks in turn, as a rank that hangs would.
            let r = stalls as usize % ranks.len();
            let addr = registry
                .addrs
                .lock()
                .ok()
                .and_then(|a| a.get(r).map(|x| x.0.clone()));
            if let Some(addr) = addr {
                let stall = Msg::Stall {
                    ms: s.stall_for.as_millis() as u64,
                };
                match ask(&addr, s, &stall, false) {
                    Ok(_) => stalls += 1,
                    Err(e) => tracing::warn!(rank = r, addr, "stalling prefill rank {r}: {e}"),
                }
            }
            next_stall = Instant::now() + s.stall_every;
        }
        if !pause_done && done > total / 5 {
            // Stop prefill rank 1 past every lease: a GC pause, a stopped
            // container. Its lends and pushes must be fenced, not timed out.
            pause_done = true;
            match &ranks[1] {
                Some(Rank::Process(c)) => {
                    // SAFETY: signalling our own child process.
                    if unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGSTOP) } == 0 {
                        paused = Some((c.id(), Instant::now() + s.pause_for));
                        pauses += 1;
                    }
                }
                _ => {
                    let addr = registry
                        .addrs
                        .lock()
                        .ok()
                        .and_then(|a| a.get(1).map(|x| x.0.clone()));
                    let pause = Msg::Stall {
                        ms: s.pause_for.as_millis() as u64,
                    };
                    if let Some(addr) = addr {
                        if ask(&addr, s, &pause, false).is_ok() {
                            pauses += 1;
                        }
                    }
                }
            }
        }
        if let Some((pid, until)) = paused {
            if Instant::now() >= until {
                // SAFETY: signalling our own child process.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
                paused = None;
            }
        }
        if !killed && done > total * 2 / 5 {
            // Kill prefill rank 3 mid-run and start it again; decode re-adds
            // it with its fresh metadata.
            killed = true;
            if let Some(Rank::Process(mut c)) = ranks[3].take() {
                let _ = c.kill();
                let _ = c.wait();
            }
            let (rank, addr) = start_rank(s, 3)?;
            ranks[3] = Some(rank);
            refresh_pids(registry, ranks);
            if let Ok(mut a) = registry.addrs.lock() {
                a[3] = (addr, a[3].1 + 1);
            }
            kills += 1;
        }
    }
    if let Some((pid, _)) = paused {
        // SAFETY: signalling our own child process.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    stop.store(true, Ordering::Release);
    let mut report = ModeReport {
        seconds: start.elapsed().as_secs_f64(),
        stalls,
        kills,
        pauses,
        raw,
        ..ModeReport::default()
    };
    for d in decoders {
        let r = d
            .join()
            .map_err(|_| CliError::Failed("a decode rank panicked".into()))?
            .map_err(|e| CliError::Failed(e.to_string()))?;
        report.decode.push(r);
    }
    // Prefill blocks come back when readers notify or leases end: wait for
    // the leases, then count what is still out.
    let addrs = registry.addrs.lock().map(|a| a.clone()).unwrap_or_default();
    let give_up = Instant::now() + Duration::from_secs(6);
    for (addr, _) in &addrs {
        loop {
            let reply = ask(addr, s, &Msg::Stats, true);
            if let Err(e) = &reply {
                tracing::warn!(addr, "asking a prefill rank for its stats: {e}");
            }
            if let Ok(Some(Msg::StatsReply {
                total,
                free,
                busy,
                idle,
                transfer_errors,
                release_failures,
                ..
            })) = reply
            {
                if free == total || Instant::now() > give_up {
                    report.prefill_leaked += total - free;
                    // The rank's counters run from its start: this mode's
                    // share is what they grew by since the last mode.
                    let now = [transfer_errors, release_failures, busy, idle];
                    let seen = counted_before.entry(addr.clone()).or_insert([0; 4]);
                    let [errors, releases, busy, idle] = grown(now, seen);
                    report.prefill_transfer_errors += errors;
                    report.prefill_release_failures += releases;
                    report.prefill_busy += busy;
                    report.prefill_idle += idle;
                    break;
                }
            } else if Instant::now() > give_up {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(report)
}

/// A mode's counts over its decode ranks (and prefill leaks).
#[derive(Debug, Default)]
struct Sums {
    requests: u64,
    finished: u64,
    failed: u64,
    expired: u64,
    refused: u64,
    lease_too_short: u64,
    corrupted: u64,
    leaked: u64,
    bytes: u64,
    causes: Causes,
}

fn sums(r: &ModeReport) -> Sums {
    let f = |g: fn(&DecodeReport) -> u64| r.decode.iter().map(g).sum::<u64>();
    let mut causes = Causes::default();
    for d in &r.decode {
        causes.add(&d.causes);
    }
    Sums {
        requests: f(|d| d.requests),
        finished: f(|d| d.finished),
        failed: f(|d| d.failed),
        expired: f(|d| d.expired),
        refused: f(|d| d.refused),
        lease_too_short: f(|d| d.lease_too_short),
        corrupted: f(|d| d.corrupted_blocks),
        leaked: f(|d| d.leaked_blocks) + r.prefill_leaked,
        bytes: f(|d| d.bytes),
        causes,
    }
}

/// Why a mode's decode ranks stopped early, if any did.
fn gave_up(r: &ModeReport) -> Option<&str> {
    r.decode.iter().find_map(|d| d.gave_up.as_deref())
}

/// What each of a prefill rank's counters grew by since `seen` (which
/// becomes `now`). A counter below what was seen means the rank was
/// restarted (a fault): all it counted since is new.
fn grown<const N: usize>(now: [u64; N], seen: &mut [u64; N]) -> [u64; N] {
    let d = std::array::from_fn(|i| now[i].checked_sub(seen[i]).unwrap_or(now[i]));
    *seen = now;
    d
}

/// The share of the pollers' time (decode and prefill ranks together) they
/// were busy, % (`PollerStats::busy_ns` and `idle_ns`): iterations would
/// weigh a short idle spin like a long transfer.
fn busy_pct(r: &ModeReport) -> f64 {
    let busy: u64 = r.decode.iter().map(|d| d.busy_ns).sum::<u64>() + r.prefill_busy;
    let idle: u64 = r.decode.iter().map(|d| d.idle_ns).sum::<u64>() + r.prefill_idle;
    if busy + idle == 0 {
        0.0
    } else {
        100.0 * busy as f64 / (busy + idle) as f64
    }
}

/// Request latency at quantile `i` (0: p50, 1: p90, 2: p99), in µs: the
/// slowest decode rank's.
fn latency(r: &ModeReport, i: usize) -> u64 {
    slowest(r, i, |d| &d.latencies_us)
}

/// The slowest decode rank's figure `i` of `of`.
fn slowest(r: &ModeReport, i: usize, of: fn(&DecodeReport) -> &Vec<u64>) -> u64 {
    r.decode
        .iter()
        .filter_map(|d| of(d).get(i).copied())
        .max()
        .unwrap_or(0)
}

/// Prints the latency rows: p50 and p99 of the request, its parts, and
/// the raw UCX baseline.
fn print_latencies(mode: Mode, r: &ModeReport, s: &Settings) {
    let row = |name: &str, [p50, p99]: [u64; 2]| {
        println!("  {name:<48} p50 {p50:>7} us  p99 {p99:>7} us")
    };
    let q = |of: fn(&DecodeReport) -> &Vec<u64>| [slowest(r, 0, of), slowest(r, 2, of)];
    row("request latency, issue -> report", q(|d| &d.latencies_us));
    match mode {
        Mode::Pull => {
            row(
                "  control: issue -> both prefill READY",
                q(|d| &d.control_us),
            );
            row("  transfer: Engine::read -> report", q(|d| &d.transfer_us));
        }
        Mode::Push => row("  transfer: PUSH sent -> report", q(|d| &d.transfer_us)),
    }
    if let Some(raw) = &r.raw {
        let op = match mode {
            Mode::Pull => "gets",
            Mode::Push => "puts+flush",
        };
        if let Some(x) = raw.single {
            row(&format!("raw UCX transfer ({op}), 1 in flight"), x);
        }
        if let Some(x) = raw.windowed {
            row(
                &format!(
                    "raw UCX transfer ({op}), {DECODE_RANKS} x {} in flight",
                    s.window
                ),
                x,
            );
        }
        if let Some(e) = &raw.error {
            println!("  raw UCX transfer: not measured: {e}");
        }
    }
    println!("  (latencies: the slowest decode rank's percentiles)");
}

fn print_table(mode: Mode, r: &ModeReport, s: &Settings) {
    let t = sums(r);
    let row = |name: &str, v: u64| println!("  {name:<34} {v:>12}");
    println!();
    println!("{mode:?} mode ({:.1} s)", r.seconds);
    println!("  faults fired: {}", faults_fired(r));
    println!(
        "  transferred {} of {} requests ({:.1}%)",
        t.finished,
        t.requests,
        pct(t.finished, t.requests)
    );
    row("requests finished", t.finished);
    row("requests failed", t.failed);
    row("  peer lost", t.causes.peer_lost);
    row("  peer stalled", t.causes.peer_stalled);
    row("  deadline", t.causes.deadline);
    row("  lease lost", t.causes.lease_lost);
    row("  other causes", t.causes.other);
    row("  wrong answer to PREPARE", t.causes.bad_answer);
    row("  no answer to PREPARE", t.causes.no_answer);
    row("requests expired", t.expired);
    row("requests refused before transfer", t.refused);
    row("  lease too short to read", t.lease_too_short);
    row("corrupted blocks", t.corrupted);
    row("leaked blocks", t.leaked);
    row(
        "decode engines rebuilt (deafened)",
        u64::from(engines_rebuilt(r)),
    );
    print_latencies(mode, r, s);
    println!(
        "  {:<34} {:>12.0}",
        "throughput, requests/s",
        t.finished as f64 / r.seconds
    );
    println!(
        "  {:<34} {:>12.3}",
        "throughput, GB/s",
        t.bytes as f64 / r.seconds / 1e9
    );
    println!("  {:<34} {:>11.1}%", "pollers busy", busy_pct(r));
    for (i, x) in rails(r).iter().enumerate() {
        println!(
            "  rail {i} ({}): {:.3} GB, {} parts finished, {} failed, left out {} times, relinked {}",
            x.device,
            x.bytes as f64 / 1e9,
            x.parts_finished,
            x.parts_failed,
            x.links_down,
            x.relinks
        );
    }
    if let Some(why) = gave_up(r) {
        println!("  stopped early: {why}");
    }
    if s.policy == Policy::Eager {
        println!("  policy EAGER: blocks were freed at the first handle failure (unsafe)");
    }
    if s.no_fence {
        println!("  NO FENCE: leases were timers, reads unconfirmed (unsafe)");
    }
}

/// What each rail carried, summed over the decode ranks (rail `i` of
/// each); empty without rails.
fn rails(r: &ModeReport) -> Vec<decode::RailReport> {
    let mut out = Vec::new();
    for d in &r.decode {
        decode::RailReport::add_all(&mut out, &d.rails);
    }
    out
}

/// Injected faults that fired on the decode and prefill ranks.
fn fired(r: &ModeReport) -> decode::Fired {
    let mut f = decode::Fired {
        transfer_errors: r.prefill_transfer_errors,
        release_failures: r.prefill_release_failures,
        ..decode::Fired::default()
    };
    for d in &r.decode {
        f.transfer_errors += d.faults.transfer_errors;
        f.setup_failures += d.faults.setup_failures;
        f.release_failures += d.faults.release_failures;
    }
    f
}

/// Engines the decode ranks replaced because they went deaf.
fn engines_rebuilt(r: &ModeReport) -> u32 {
    r.decode.iter().map(|d| d.engines_rebuilt).sum()
}

/// Poller stalls and engine-thread sleeps of the decode ranks.
fn decode_stalls(r: &ModeReport) -> u32 {
    r.decode.iter().map(|d| d.stalls).sum()
}

fn pct(n: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        100.0 * n as f64 / of as f64
    }
}

/// `s` as a JSON string literal.
fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn json(s: &Settings, reports: &[(Mode, ModeReport)]) -> String {
    let modes: Vec<String> = reports
        .iter()
        .map(|(mode, r)| {
            let t = sums(r);
            let c = t.causes;
            let num = |x: Option<u64>| x.map_or("null".to_owned(), |v| v.to_string());
            let q = |of: fn(&DecodeReport) -> &Vec<u64>, i| slowest(r, i, of);
            let raw = r.raw.clone().unwrap_or_default();
            let latencies = format!(
                "\"transfer_p50_us\":{},\"transfer_p99_us\":{},\"control_p50_us\":{},\"control_p99_us\":{},\"raw_p50_us\":{},\"raw_p99_us\":{},\"raw_window\":{},\"raw_window_p50_us\":{},\"raw_window_p99_us\":{},\"raw_error\":{}",
                q(|d| &d.transfer_us, 0),
                q(|d| &d.transfer_us, 2),
                num((*mode == Mode::Pull).then(|| q(|d| &d.control_us, 0))),
                num((*mode == Mode::Pull).then(|| q(|d| &d.control_us, 2))),
                num(raw.single.map(|x| x[0])),
                num(raw.single.map(|x| x[1])),
                s.window,
                num(raw.windowed.map(|x| x[0])),
                num(raw.windowed.map(|x| x[1])),
                raw.error.as_deref().map_or("null".to_owned(), json_str),
            );
            format!(
                "{{\"mode\":\"{}\",\"seconds\":{:.3},\"requests\":{},\"transferred\":{},\"finished\":{},\"failed\":{},\"failed_peer_lost\":{},\"failed_peer_stalled\":{},\"failed_deadline\":{},\"failed_lease_lost\":{},\"failed_other\":{},\"failed_bad_answer\":{},\"failed_no_answer\":{},\"first_bad_answer\":{},\"first_failure\":{},\"expired\":{},\"refused\":{},\"refused_lease_too_short\":{},\"corrupted_blocks\":{},\"leaked_blocks\":{},\"latency_p50_us\":{},\"latency_p99_us\":{},{},\"requests_per_s\":{:.1},\"gb_per_s\":{:.4},\"poller_busy_pct\":{:.2},\"transfer_errors\":{},\"setup_failures\":{},\"release_failures\":{},\"stalls\":{},\"pauses\":{},\"decode_stalls\":{},\"kills\":{},\"decode_engines_rebuilt\":{},\"rails\":[{}],\"gave_up\":{}}}",
                if *mode == Mode::Pull { "pull" } else { "push" },
                r.seconds,
                t.requests,
                t.finished,
                t.finished,
                t.failed,
                c.peer_lost,
                c.peer_stalled,
                c.deadline,
                c.lease_lost,
                c.other,
                c.bad_answer,
                c.no_answer,
                r.decode
                    .iter()
                    .find_map(|d| d.first_bad_answer.as_deref())
                    .map_or("null".to_owned(), json_str),
                r.decode
                    .iter()
                    .find_map(|d| d.first_failure.as_deref())
                    .map_or("null".to_owned(), json_str),
                t.expired,
                t.refused,
                t.lease_too_short,
                t.corrupted,
                t.leaked,
                latency(r, 0),
                latency(r, 2),
                latencies,
                t.finished as f64 / r.seconds,
                t.bytes as f64 / r.seconds / 1e9,
                busy_pct(r),
                fired(r).transfer_errors,
                fired(r).setup_failures,
                fired(r).release_failures,
                r.stalls,
                r.pauses,
                decode_stalls(r),
                r.kills,
                engines_rebuilt(r),
                rails(r)
                    .iter()
                    .enumerate()
                    .map(|(i, x)| format!(
                        "{{\"rail\":{i},\"device\":{},\"core\":{},\"bytes\":{},\"operations\":{},\"parts_finished\":{},\"parts_failed\":{},\"links_down\":{},\"relinks\":{}}}",
                        json_str(&x.device),
                        x.core.map_or("null".to_owned(), |c| c.to_string()),
                        x.bytes,
                        x.operations,
                        x.parts_finished,
                        x.parts_failed,
                        x.links_down,
                        x.relinks
                    ))
                    .collect::<Vec<_>>()
                    .join(","),
                gave_up(r).map_or("null".to_owned(), json_str),
            )
        })
        .collect();
    format!(
        "{{\"policy\":\"{}\",\"fenced\":{},\"ranks\":\"{}\",\"tls\":{},\"faults\":{},\"modes\":[{}]}}",
        if s.policy == Policy::Safe {
            "safe"
        } else {
            "eager"
        },
        !s.no_fence,
        if s.processes { "processes" } else { "threads" },
        json_str(&s.tls),
        s.faults,
        modes.join(",")
    )
}

/// The rails asked for: the `--rail` devices (at most
/// [`kvpoll::rails::MAX_RAILS`]), or a core map's pollers (`--core-map`, a
/// TOML path or `auto`, checked against this machine), or none.
fn rails_given(rails: &[String], core_map: Option<&str>) -> Result<side::RailsSpec, CliError> {
    if let Some(path) = core_map {
        let topology = kvpoll::placement::Topology::detect()
            .map_err(|e| CliError::Failed(format!("--core-map {path}: {e}")))?;
        let map = kvpoll::CoreMap::load(path, &topology)
            .map_err(|e| CliError::Usage(format!("--core-map {path}: {e}")))?;
        if map.pollers().len() > kvpoll::rails::MAX_RAILS {
            return Err(CliError::Usage(format!(
                "--core-map {path}: {} pollers, at most {} rails",
                map.pollers().len(),
                kvpoll::rails::MAX_RAILS
            )));
        }
        return Ok(side::RailsSpec::Map(map));
    }
    if rails.len() > kvpoll::rails::MAX_RAILS {
        return Err(CliError::Usage(format!(
            "{} --rail given: at most {} rails",
            rails.len(),
            kvpoll::rails::MAX_RAILS
        )));
    }
    Ok(if rails.is_empty() {
        side::RailsSpec::None
    } else {
        side::RailsSpec::Devices(rails.to_vec())
    })
}

/// `kvpoll serve`: one prefill rank, listening for decode ranks.
pub fn serve(args: &ServeArgs) -> Result<(), CliError> {
    let listen = &args.listen;
    let cfg = ServeConfig {
        rank: args.rank,
        tls: args.tls.clone(),
        blocks: args.blocks,
        block_size: args.block_size,
        layers: usize::from(args.layers),
        lease: Duration::from_millis(args.lease_ms),
        faults: Faults {
            handle_error_every: args.handle_error_every,
            release_failure_every: args.release_failure_every,
            release_retry_after: Duration::from_millis(20),
            ..Faults::default()
        },
        metrics: args.metrics.map(|_| Arc::default()),
        limits: door::Limits {
            max_conns: args.max_connections as usize,
        },
        testing: args.testing,
        auth: args.auth.key()?,
        rails: rails_given(&args.rails, args.core_map.as_deref())?,
    };
    check_sizes(u64::from(args.layers), args.blocks, args.block_size, 1)?;
    let listener = TcpListener::bind(listen)
        .map_err(|e| CliError::Failed(format!("listening on {listen}: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| CliError::Failed(e.to_string()))?;
    // Everything `LISTEN` promises listens before it is printed.
    let metrics = match (args.metrics, &cfg.metrics) {
        (Some(at), Some(snapshot)) => Some(
            crate::metrics_http::start(at, snapshot.clone())
                .map_err(|e| CliError::Failed(format!("--metrics {at}: {e}")))?,
        ),
        _ => None,
    };
    // Serve until a signal, or (`--until-stdin-closes`) until the parent
    // closes our standard input.
    let stdin = args.until_stdin_closes.then(crate::peer::stdin_closed);
    let stop = move || {
        signals::caught().is_some() || stdin.as_ref().is_some_and(|c| c.load(Ordering::Acquire))
    };
    let announce = || {
        println!("LISTEN {addr}");
        if let Some(bound) = metrics {
            println!("METRICS {bound}");
        }
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
    };
    prefill::serve(listener, cfg, stop, announce).map_err(|e| CliError::Failed(e.to_string()))
}

/// `kvpoll connect`: one decode rank reading from two prefill ranks.
pub fn connect(args: &ConnectArgs) -> Result<(), CliError> {
    if args.to.len() != 2 {
        return Err(CliError::Usage(format!(
            "--to takes two addresses, comma separated; got {}",
            args.to.len()
        )));
    }
    let addrs = args.to.clone();
    let mode = args.mode;
    let mut s = Settings::workload(&args.workload, &args.tls)?;
    s.rails = rails_given(&args.rails, args.core_map.as_deref())?;
    if !s.rails.is_none() && mode == Mode::Push {
        return Err(CliError::Usage(
            "rails (--rail, --core-map) carry pull mode only (reads and lends): push runs on one engine"
                .into(),
        ));
    }
    s.give_up_after = Duration::from_secs(args.give_up_after);
    s.auth = args.auth.key()?;
    check_sizes(s.layers as u64, s.blocks, s.block_size, 1)?;
    let registry = Registry::default();
    if let Ok(mut a) = registry.addrs.lock() {
        a.extend(addrs.into_iter().map(|x| (x, 0)));
    }
    s.answer_timeout = Duration::from_millis(args.answer_timeout_ms);
    let cfg = decode_config(&s, mode, Policy::Safe);
    let stop = || signals::caught().is_some();
    let r = decode::run(&cfg, &registry, &AtomicU64::new(0), &stop)
        .map_err(|e| CliError::Failed(e.to_string()))?;
    let report = ModeReport {
        seconds: r.seconds,
        decode: vec![r],
        ..ModeReport::default()
    };
    if s.json {
        println!("{}", json(&s, &[(mode, report.clone())]));
    } else {
        print_table(mode, &report, &s);
    }
    let t = sums(&report);
    if t.corrupted > 0 || t.leaked > 0 {
        return Err(CliError::Failed(format!(
            "{} corrupted and {} leaked blocks",
            t.corrupted, t.leaked
        )));
    }
    if let Some(sig) = signals::caught() {
        return Err(CliError::Signal(sig));
    }
    if let Some(why) = gave_up(&report) {
        return Err(CliError::Failed(format!(
            "transferred {} of {} requests: {why}",
            t.finished, t.requests
        )));
    }
    if t.finished < t.requests && !args.allow_failures {
        let first = report.decode[0]
            .first_bad_answer
            .as_ref()
            .map_or(String::new(), |w| format!("; the first wrong answer: {w}"));
        let failure = report.decode[0]
            .first_failure
            .as_ref()
            .map_or(String::new(), |w| format!("; the first failure: {w}"));
        return Err(CliError::Failed(format!(
            "transferred {} of {} requests: {} failed, {} expired, {} refused{first}{failure}",
            t.finished, t.requests, t.failed, t.expired, t.refused
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pollers_busy_is_the_share_of_the_pollers_time_they_were_busy() {
        // Decode 900 of 1 000 ns, prefill 300 of 1 000 ns: 60 % of the
        // pollers' time (it was a share of iterations, which weigh a short
        // idle spin like a long transfer).
        let decode = DecodeReport {
            busy_ns: 900,
            idle_ns: 100,
            ..DecodeReport::default()
        };
        let r = ModeReport {
            decode: vec![decode],
            prefill_busy: 300,
            prefill_idle: 700,
            ..ModeReport::default()
        };
        assert!((busy_pct(&r) - 60.0).abs() < 1e-9, "{}", busy_pct(&r));
    }

    #[test]
    fn a_prefill_ranks_counters_count_per_mode_and_survive_its_restart() {
        let mut seen = [0; 2];
        assert_eq!(grown([5, 100], &mut seen), [5, 100]);
        assert_eq!(grown([7, 160], &mut seen), [2, 60]);
        // Restarted: its counters began again from zero.
        assert_eq!(grown([1, 30], &mut seen), [1, 30]);
        assert_eq!(seen, [1, 30]);
    }
}
