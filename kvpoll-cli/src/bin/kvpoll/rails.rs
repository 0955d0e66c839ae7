//! `kvpoll bench rails`: reads over one rail against reads over two, each
//! rail a veth pair between two network namespaces (tcp), and the same
//! link's limit (one plain tcp stream per pair), in interleaved rounds.
//!
//! Each round of each configuration is a fresh pair of processes started
//! in their namespaces (`ip netns exec`: UCX finds its devices in the
//! namespace's `/sys`): `kvpoll rails-peer --role lender` lends ahead under
//! incarnations both sides derive from the request id; `--role reader`
//! keeps reads in flight for the round's seconds and says the bytes read,
//! the time and its CPU. Every read is checked for the lender's pattern on
//! its first and last block; a read that fails fails the run.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvpoll::ledger::{BlockId, Incarnation, RequestId};
use kvpoll::rails::Rails;
use kvpoll::transport::ucx::ContextOptions;
use kvpoll::{Outcomes, Transfer};
use kvpoll_cli::bench::memory::cpu_clock;
use kvpoll_cli::pattern;

use crate::cli::{CliError, RailsBenchArgs, RailsPeerArgs, RailsRole};
use crate::link::{self, VethLink};

const SEED: u64 = 0x4a11_5046;
/// Lends the lender keeps ahead of what was reported.
const AHEAD: u64 = 16;
/// The first port of the plain streams (one per pair).
const STREAM_PORT: u16 = 47_310;

fn failed(e: impl std::fmt::Display) -> CliError {
    CliError::Failed(e.to_string())
}

/// The lend of request `id`: its incarnation, as both sides derive it.
fn incarnation(id: u64) -> Incarnation {
    let x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ SEED;
    Incarnation((x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9) | 1)
}

fn rails(n: usize, block_size: u64, blocks: u64) -> Result<Rails, CliError> {
    let mut b = Rails::builder();
    for i in 0..n {
        b = b.rail(
            Some(&link::device(i)),
            kvpoll::Engine::builder()
                .block_size(block_size)
                .ucx(ContextOptions::with_transports("tcp")),
        );
    }
    let mut rails = b.build().map_err(failed)?;
    rails.register(blocks).map_err(failed)?;
    Ok(rails)
}

/// This process's CPU so far, ns, threads that ended included.
fn process_cpu() -> u64 {
    cpu_clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, CliError> {
    if s.len() % 2 != 0 {
        return Err(failed("odd hex"));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(failed))
        .collect()
}

/// Sets a flag when standard input closes.
fn stdin_closed() -> &'static AtomicBool {
    static EOF: AtomicBool = AtomicBool::new(false);
    std::thread::spawn(|| {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        EOF.store(true, Ordering::Release);
    });
    &EOF
}

/// `kvpoll rails-peer`.
pub fn run_peer(a: &RailsPeerArgs) -> Result<(), CliError> {
    match a.role {
        RailsRole::Lender => lender(a),
        RailsRole::Reader => reader(a),
        RailsRole::StreamSource => stream_source(a),
        RailsRole::StreamSink => stream_sink(a),
    }
}

fn lender(a: &RailsPeerArgs) -> Result<(), CliError> {
    let n = u64::from(a.blocks_per_read);
    let mut rails = rails(usize::from(a.rails), a.block_size, n)?;
    let mut buf = vec![0u8; a.block_size as usize];
    for b in 0..n {
        pattern::fill(SEED, b, &mut buf);
        rails
            .write_block(0, BlockId(b as u32), &buf)
            .map_err(failed)?;
    }
    println!("META {}", hex(&rails.local_metadata().map_err(failed)?));
    let eof = stdin_closed();
    let blocks: Vec<BlockId> = (0..n as u32).map(BlockId).collect();
    let (mut lent, mut reported) = (0u64, 0u64);
    let mut out = Outcomes::default();
    while !eof.load(Ordering::Acquire) {
        while lent < reported + AHEAD {
            lent += 1;
            rails
                .lend_with(
                    RequestId(lent),
                    &blocks,
                    1,
                    Duration::from_secs(30),
                    incarnation(lent),
                )
                .map_err(failed)?;
        }
        out.clear();
        rails.wait(&mut out, Duration::from_millis(5));
        reported += (out.finished_sending.len() + out.expired.len()) as u64;
    }
    println!("CPU {}", process_cpu());
    Ok(())
}

fn reader(a: &RailsPeerArgs) -> Result<(), CliError> {
    let n = a.blocks_per_read;
    let slots = a.in_flight;
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(failed)?;
    let meta = unhex(
        line.trim()
            .strip_prefix("META ")
            .ok_or_else(|| failed("no META"))?,
    )?;
    let mut rails = rails(usize::from(a.rails), a.block_size, u64::from(n * slots))?;
    let peer = rails.add_peer(&meta).map_err(failed)?;
    let remote: Vec<BlockId> = (0..n).map(BlockId).collect();
    let locals: Vec<Vec<BlockId>> = (0..slots)
        .map(|s| (s * n..(s + 1) * n).map(BlockId).collect())
        .collect();
    let mut free: Vec<u32> = (0..slots).collect();
    let mut flying: Vec<(RequestId, u32)> = Vec::new();
    let mut out = Outcomes::default();
    let mut next = 0u64;
    let mut buf = vec![0u8; a.block_size as usize];
    let (mut bytes, mut reads) = (0u64, 0u64);
    // The first read of each slot warms the connections up, untimed.
    let mut timed_from: Option<(Instant, u64)> = None;
    let seconds = Duration::from_secs_f64(a.seconds);
    let mut last = Instant::now();
    loop {
        let running = timed_from.is_none_or(|(t, _)| t.elapsed() < seconds);
        if running {
            while let Some(slot) = free.pop() {
                next += 1;
                let t = Transfer {
                    peer,
                    local: &locals[slot as usize],
                    remote: &remote,
                    lend: incarnation(next),
                };
                rails.read(RequestId(next), &[t]).map_err(failed)?;
                flying.push((RequestId(next), slot));
            }
        }
        if flying.is_empty() {
            break;
        }
        out.clear();
        rails.wait(&mut out, Duration::from_millis(5));
        if let Some(f) = out.failed_recving.first() {
            return Err(failed(format!("read {} failed: {:?}", f.id.0, f.reason)));
        }
        for id in &out.finished_recving {
            let i = flying
                .iter()
                .position(|f| f.0 == *id)
                .ok_or_else(|| failed("stray"))?;
            let (_, slot) = flying.swap_remove(i);
            for (l, r) in [(0, 0), (n - 1, n - 1)] {
                rails
                    .read_block(0, locals[slot as usize][l as usize], &mut buf)
                    .map_err(failed)?;
                if !pattern::check(SEED, u64::from(r), &buf) {
                    return Err(failed(format!("read {} holds other bytes", id.0)));
                }
            }
            free.push(slot);
            last = Instant::now();
            match timed_from {
                Some(_) => {
                    bytes += u64::from(n) * a.block_size;
                    reads += 1;
                }
                None if next >= u64::from(slots) => timed_from = Some((last, process_cpu())),
                None => {}
            }
        }
    }
    let (from, cpu) = timed_from.ok_or_else(|| failed("no read timed"))?;
    let cpu = process_cpu() - cpu;
    println!(
        "RESULT {bytes} {} {cpu} {reads}",
        last.duration_since(from).as_nanos()
    );
    Ok(())
}

fn stream_source(a: &RailsPeerArgs) -> Result<(), CliError> {
    let listeners = (0..usize::from(a.rails))
        .map(|i| std::net::TcpListener::bind((link::far_address(i), STREAM_PORT + i as u16)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(failed)?;
    println!("META listening");
    let senders: Vec<_> = listeners
        .into_iter()
        .map(|l| {
            std::thread::spawn(move || {
                if let Ok((mut s, _)) = l.accept() {
                    let chunk = vec![0x5au8; 1 << 20];
                    while s.write_all(&chunk).is_ok() {}
                }
            })
        })
        .collect();
    for s in senders {
        let _ = s.join();
    }
    println!("CPU {}", process_cpu());
    Ok(())
}

fn stream_sink(a: &RailsPeerArgs) -> Result<(), CliError> {
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(failed)?;
    let seconds = Duration::from_secs_f64(a.seconds);
    let cpu = process_cpu();
    let t = Instant::now();
    let readers: Vec<_> = (0..usize::from(a.rails))
        .map(|i| {
            let addr = (link::far_address(i), STREAM_PORT + i as u16);
            std::thread::spawn(move || -> std::io::Result<u64> {
                let mut s = std::net::TcpStream::connect(addr)?;
                let mut buf = vec![0u8; 1 << 20];
                let mut got = 0u64;
                let t = Instant::now();
                while t.elapsed() < seconds {
                    got += s.read(&mut buf)? as u64;
                }
                Ok(got)
            })
        })
        .collect();
    let mut bytes = 0;
    for r in readers {
        bytes += r
            .join()
            .map_err(|_| failed("stream thread"))?
            .map_err(failed)?;
    }
    let ns = t.elapsed().as_nanos();
    println!("RESULT {bytes} {ns} {} 0", process_cpu() - cpu);
    Ok(())
}

/// One configuration's figures in one round.
#[derive(Debug, Clone, Copy, Default)]
struct Figures {
    gbps: f64,
    /// Both processes' CPU per GB moved, ms.
    cpu_ms_per_gb: f64,
}

/// What a peer process printed after `tag`.
fn line_of(out: &mut impl BufRead, tag: &str) -> Result<String, CliError> {
    let mut l = String::new();
    loop {
        l.clear();
        if out.read_line(&mut l).map_err(failed)? == 0 {
            return Err(failed(format!("a peer ended without {tag}")));
        }
        if let Some(rest) = l.trim().strip_prefix(tag) {
            return Ok(rest.trim().to_owned());
        }
    }
}

fn spawn(ns: &str, args: &[String]) -> Result<Child, CliError> {
    Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(std::env::current_exe().map_err(failed)?)
        .arg("rails-peer")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(failed)
}

/// One round of one configuration: the far side's process, the near
/// side's, their figures.
fn round(link: &VethLink, roles: (&str, &str), args: &[String]) -> Result<Figures, CliError> {
    let with = |role: &str| {
        let mut v = vec!["--role".to_owned(), role.to_owned()];
        v.extend_from_slice(args);
        v
    };
    let mut far = spawn(&link.far, &with(roles.0))?;
    let mut far_out = BufReader::new(far.stdout.take().ok_or_else(|| failed("no stdout"))?);
    let meta = line_of(&mut far_out, "META")?;
    let mut near = spawn(&link.near, &with(roles.1))?;
    writeln!(
        near.stdin.take().ok_or_else(|| failed("no stdin"))?,
        "META {meta}"
    )
    .map_err(failed)?;
    let mut near_out = BufReader::new(near.stdout.take().ok_or_else(|| failed("no stdout"))?);
    let result = line_of(&mut near_out, "RESULT");
    let near_ok = near.wait().map_err(failed)?.success();
    drop(far.stdin.take());
    let far_cpu = line_of(&mut far_out, "CPU");
    if !far.wait().map_err(failed)?.success() || !near_ok {
        return Err(failed(format!("a side of {} failed", roles.1)));
    }
    let r: Vec<f64> = result?
        .split(' ')
        .map(|v| v.parse::<f64>().map_err(failed))
        .collect::<Result<_, _>>()?;
    let far_cpu: f64 = far_cpu?.parse().map_err(failed)?;
    let (bytes, ns, cpu) = (r[0], r[1], r[2]);
    if bytes == 0.0 || ns == 0.0 {
        return Err(failed("nothing moved"));
    }
    Ok(Figures {
        gbps: bytes / ns,
        // The stream's source writes from its start; its CPU over the
        // whole process is the honest figure for it too.
        cpu_ms_per_gb: (cpu + far_cpu) / 1e6 / (bytes / 1e9),
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `a.rounds` rounds of one rail, then two, interleaved: each rail
/// count's figures, round by round.
fn interleaved(
    link: &VethLink,
    roles: (&str, &str),
    a: &RailsBenchArgs,
    shape: &[String],
) -> Result<[Vec<Figures>; 2], CliError> {
    let mut figs: [Vec<Figures>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..a.rounds {
        for (k, f) in figs.iter_mut().enumerate() {
            let mut args = vec![
                format!("--rails={}", k + 1),
                format!("--seconds={}", a.seconds),
            ];
            args.extend_from_slice(shape);
            f.push(round(link, roles, &args)?);
        }
    }
    Ok(figs)
}

/// `kvpoll bench rails`.
pub fn run_bench(a: &RailsBenchArgs) -> Result<(), CliError> {
    let link = VethLink::create_pairs(2).map_err(|e| failed(format!("the rails bench: {e}")))?;
    // (name, block size, blocks per read, reads in flight): one request
    // holds at most 512 blocks by default.
    let shapes: [(&str, u64, u32, u32); 2] = [
        ("64 MiB read", 128 << 10, 512, 2),
        ("8 MiB request", 64 << 10, 128, 4),
    ];
    // Per shape, per rail count: each round's figures.
    let mut rows: Vec<(String, [Vec<Figures>; 2])> = Vec::new();
    for (name, block_size, blocks, in_flight) in shapes {
        let shape = [
            format!("--block-size={block_size}"),
            format!("--blocks-per-read={blocks}"),
            format!("--in-flight={in_flight}"),
        ];
        let figs = interleaved(&link, ("lender", "reader"), a, &shape)?;
        rows.push((name.to_owned(), figs));
    }
    let streams = interleaved(&link, ("stream-source", "stream-sink"), a, &[])?;
    rows.push(("tcp streams, one per pair".to_owned(), streams));
    report(&rows, a.json);
    Ok(())
}

fn report(rows: &[(String, [Vec<Figures>; 2])], json: bool) {
    let summary: Vec<_> = rows
        .iter()
        .map(|(name, figs)| {
            let stat = |f: &Vec<Figures>, g: fn(&Figures) -> f64| {
                let mut v: Vec<f64> = f.iter().map(g).collect();
                let m = median(&mut v);
                (m, v[0], v[v.len() - 1])
            };
            let one = stat(&figs[0], |f| f.gbps);
            let two = stat(&figs[1], |f| f.gbps);
            let ratios: Vec<f64> = figs[0]
                .iter()
                .zip(&figs[1])
                .map(|(a, b)| b.gbps / a.gbps)
                .collect();
            let mut r = ratios.clone();
            let ratio = median(&mut r);
            let cpu1 = stat(&figs[0], |f| f.cpu_ms_per_gb).0;
            let cpu2 = stat(&figs[1], |f| f.cpu_ms_per_gb).0;
            (
                name.clone(),
                one,
                two,
                ratio,
                r[0],
                r[r.len() - 1],
                cpu1,
                cpu2,
            )
        })
        .collect();
    if json {
        let items: Vec<String> = summary
            .iter()
            .map(|(name, one, two, ratio, lo, hi, c1, c2)| {
                format!(
                    "{{\"shape\":\"{name}\",\"link\":\"veth\",\"one_rail_gbps\":{:.4},\"two_rails_gbps\":{:.4},\"ratio\":{ratio:.3},\"ratio_min\":{lo:.3},\"ratio_max\":{hi:.3},\"one_rail_cpu_ms_per_gb\":{c1:.1},\"two_rails_cpu_ms_per_gb\":{c2:.1}}}",
                    one.0, two.0
                )
            })
            .collect();
        println!("{{\"rows\":[{}]}}", items.join(","));
        return;
    }
    println!(
        "{:<28} {:>16} {:>16} {:>18} {:>18}",
        "veth pairs (tcp)", "1 rail GB/s", "2 rails GB/s", "2 / 1 (range)", "CPU ms/GB 1 / 2"
    );
    for (name, one, two, ratio, lo, hi, c1, c2) in summary {
        println!(
            "{name:<28} {:>16} {:>16} {:>18} {:>18}",
            format!("{:.3} ({:.3}-{:.3})", one.0, one.1, one.2),
            format!("{:.3} ({:.3}-{:.3})", two.0, two.1, two.2),
            format!("{ratio:.2} ({lo:.2}-{hi:.2})"),
            format!("{c1:.0} / {c2:.0}")
        );
    }
}
