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
//!
//! Mooncake Transfer Engine runs the same shapes over the same pairs in
//! the same rounds (`peer_bench.py`, its initiator in the near namespace,
//! its target in the far one; every 8th request checked). Its tcp
//! transport reaches a segment at the one address the segment gives, so
//! given both pairs it moves over one: its row is what it makes of them.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
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

/// Mooncake's requests in a round: a warm-up of `WARM` requests times the
/// rate, then enough for the round's seconds.
const WARM: u32 = 8;

/// One round of Mooncake over pair 0, reading `shape`'s request (`blocks`
/// of `block_size`, `in_flight` at once) for about `seconds`.
fn mooncake_round(
    link: &VethLink,
    python: &Path,
    script: &Path,
    shape: (u64, u32, u32),
    seconds: f64,
) -> Result<Figures, CliError> {
    let (block_size, blocks, in_flight) = shape;
    let mut child = Command::new("ip")
        .args(["netns", "exec", &link.near])
        .arg(python)
        .arg(script)
        .args(["--system", "mooncake", "--op", "read"])
        .args(["--block-size", &block_size.to_string()])
        .args(["--blocks-per-request", &blocks.to_string()])
        .args(["--in-flight", &in_flight.to_string()])
        .args(["--peer-blocks", &blocks.to_string()])
        .args(["--check-every", "8"])
        .args(["--target-netns", &link.far])
        .args(["--host", &link::far_address(0)])
        .args(["--client-host", &link::near_address(0)])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| failed(format!("Mooncake's driver ({}): {e}", python.display())))?;
    let mut input = child.stdin.take().ok_or_else(|| failed("no stdin"))?;
    let mut out = BufReader::new(child.stdout.take().ok_or_else(|| failed("no stdout"))?);
    let ready = line_of(&mut out, "READY");
    let mut run = |n: u32| -> Result<[f64; 5], CliError> {
        writeln!(input, "RUN {n}").map_err(failed)?;
        input.flush().map_err(failed)?;
        let r: Vec<f64> = line_of(&mut out, "RESULT")?
            .split(' ')
            .map(|v| v.parse::<f64>().map_err(failed))
            .collect::<Result<_, _>>()?;
        <[f64; 5]>::try_from(r).map_err(|_| failed("Mooncake's driver: a short RESULT"))
    };
    let figures = ready.and_then(|_| {
        let warm = run(WARM * in_flight)?;
        let rate = warm[0] / warm[1].max(1e-9);
        let n = ((rate * seconds).ceil() as u32).max(in_flight);
        let [done, secs, cpu_ns, checked, bad] = run(n)?;
        if bad > 0.0 || checked == 0.0 {
            return Err(failed(format!(
                "Mooncake: {bad} of {checked} requests checked held other bytes"
            )));
        }
        let bytes = done * blocks as f64 * block_size as f64;
        Ok(Figures {
            gbps: bytes / secs / 1e9,
            cpu_ms_per_gb: cpu_ns / 1e6 / (bytes / 1e9),
        })
    });
    // End of its input ends the driver (and its target).
    drop(input);
    let status = child.wait().map_err(failed)?;
    let figures = figures?;
    if !status.success() {
        return Err(failed(format!("Mooncake's driver ended {status}")));
    }
    Ok(figures)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Each configuration's figures, round by round: one rail, two rails,
/// and Mooncake where it runs.
type Rounds = [Vec<Figures>; 3];

/// `a.rounds` rounds of one rail, then two, then `mooncake` (where given),
/// interleaved.
fn interleaved(
    link: &VethLink,
    roles: (&str, &str),
    a: &RailsBenchArgs,
    shape: &[String],
    mooncake: Option<&dyn Fn() -> Result<Figures, CliError>>,
) -> Result<Rounds, CliError> {
    let mut figs: Rounds = Default::default();
    for _ in 0..a.rounds {
        for (k, f) in figs.iter_mut().take(2).enumerate() {
            let mut args = vec![
                format!("--rails={}", k + 1),
                format!("--seconds={}", a.seconds),
            ];
            args.extend_from_slice(shape);
            f.push(round(link, roles, &args)?);
        }
        if let Some(m) = mooncake {
            figs[2].push(m()?);
        }
    }
    Ok(figs)
}

/// `kvpoll bench rails`.
pub fn run_bench(a: &RailsBenchArgs) -> Result<(), CliError> {
    let link = VethLink::create_pairs(2).map_err(|e| failed(format!("the rails bench: {e}")))?;
    // Mooncake is measured unless told not to (`--peers-python none`); a
    // Python without it fails the run rather than leave its rows out.
    let asked_none = a.peers_python.as_deref() == Some(Path::new("none"));
    let python = crate::compare::peers_python(a.peers_python.as_deref());
    if python.is_none() && !asked_none {
        return Err(failed(
            "the rails bench measures Mooncake beside kvpoll: no Python with it (make \
             bench-peers, or --peers-python PATH; --peers-python none leaves it out)",
        ));
    }
    let driver = match python {
        Some(_) => Some(crate::compare::Driver::write()?),
        None => None,
    };
    // (name, block size, blocks per read, reads in flight): one request
    // holds at most 512 blocks by default.
    let shapes: [(&str, u64, u32, u32); 2] = [
        ("64 MiB read", 128 << 10, 512, 2),
        ("8 MiB request", 64 << 10, 128, 4),
    ];
    // Per shape, per configuration: each round's figures.
    let mut rows: Vec<(String, Rounds)> = Vec::new();
    for (name, block_size, blocks, in_flight) in shapes {
        let shape = [
            format!("--block-size={block_size}"),
            format!("--blocks-per-read={blocks}"),
            format!("--in-flight={in_flight}"),
        ];
        let mooncake = python.as_deref().zip(driver.as_ref()).map(|(py, d)| {
            let link = &link;
            let script = d.script.clone();
            move || {
                mooncake_round(
                    link,
                    py,
                    &script,
                    (block_size, blocks, in_flight),
                    a.seconds,
                )
            }
        });
        let m = mooncake
            .as_ref()
            .map(|f| f as &dyn Fn() -> Result<Figures, CliError>);
        let figs = interleaved(&link, ("lender", "reader"), a, &shape, m)?;
        rows.push((name.to_owned(), figs));
    }
    let streams = interleaved(&link, ("stream-source", "stream-sink"), a, &[], None)?;
    rows.push(("tcp streams, one per pair".to_owned(), streams));
    report(&rows, a.json);
    Ok(())
}

/// A configuration's median and range of `g` over its rounds.
fn stat(f: &[Figures], g: fn(&Figures) -> f64) -> (f64, f64, f64) {
    let mut v: Vec<f64> = f.iter().map(g).collect();
    let m = median(&mut v);
    (m, v[0], v[v.len() - 1])
}

/// The median and range of configuration `b`'s throughput over `a`'s,
/// round by round (rounds ran back to back).
fn ratio(a: &[Figures], b: &[Figures]) -> (f64, f64, f64) {
    let mut r: Vec<f64> = a.iter().zip(b).map(|(a, b)| b.gbps / a.gbps).collect();
    let m = median(&mut r);
    (m, r[0], r[r.len() - 1])
}

fn report(rows: &[(String, Rounds)], json: bool) {
    if json {
        let items: Vec<String> = rows
            .iter()
            .map(|(name, figs)| {
                let (one, two) = (stat(&figs[0], |f| f.gbps), stat(&figs[1], |f| f.gbps));
                let (r, lo, hi) = ratio(&figs[0], &figs[1]);
                let (c1, c2) = (
                    stat(&figs[0], |f| f.cpu_ms_per_gb).0,
                    stat(&figs[1], |f| f.cpu_ms_per_gb).0,
                );
                let mooncake = if figs[2].is_empty() {
                    String::new()
                } else {
                    let (m, mlo, mhi) = ratio(&figs[2], &figs[1]);
                    format!(
                        ",\"mooncake_gbps\":{:.4},\"mooncake_cpu_ms_per_gb\":{:.1},\"two_rails_vs_mooncake\":{m:.3},\"two_rails_vs_mooncake_min\":{mlo:.3},\"two_rails_vs_mooncake_max\":{mhi:.3}",
                        stat(&figs[2], |f| f.gbps).0,
                        stat(&figs[2], |f| f.cpu_ms_per_gb).0
                    )
                };
                format!(
                    "{{\"shape\":\"{name}\",\"link\":\"veth\",\"one_rail_gbps\":{:.4},\"two_rails_gbps\":{:.4},\"ratio\":{r:.3},\"ratio_min\":{lo:.3},\"ratio_max\":{hi:.3},\"one_rail_cpu_ms_per_gb\":{c1:.1},\"two_rails_cpu_ms_per_gb\":{c2:.1}{mooncake}}}",
                    one.0, two.0
                )
            })
            .collect();
        println!("{{\"rows\":[{}]}}", items.join(","));
        return;
    }
    println!(
        "{:<26} {:>20} {:>20} {:>17} {:>20} {:>17} {:>20}",
        "veth pairs (tcp)",
        "1 rail GB/s",
        "2 rails GB/s",
        "2 / 1",
        "Mooncake GB/s",
        "2 rails / Mooncake",
        "CPU ms/GB 1 / 2 / M"
    );
    let range = |x: (f64, f64, f64), p: usize| format!("{:.p$} ({:.p$}-{:.p$})", x.0, x.1, x.2);
    for (name, figs) in rows {
        let cpu = |i: usize| {
            if figs[i].is_empty() {
                "-".to_owned()
            } else {
                format!("{:.0}", stat(&figs[i], |f| f.cpu_ms_per_gb).0)
            }
        };
        let (m, mr) = if figs[2].is_empty() {
            ("-".to_owned(), "-".to_owned())
        } else {
            (
                range(stat(&figs[2], |f| f.gbps), 3),
                range(ratio(&figs[2], &figs[1]), 2),
            )
        };
        println!(
            "{name:<26} {:>20} {:>20} {:>17} {m:>20} {mr:>17} {:>20}",
            range(stat(&figs[0], |f| f.gbps), 3),
            range(stat(&figs[1], |f| f.gbps), 3),
            range(ratio(&figs[0], &figs[1]), 2),
            format!("{} / {} / {}", cpu(0), cpu(1), cpu(2))
        );
    }
    if rows.iter().all(|(_, f)| f[2].is_empty()) {
        println!("Mooncake not measured (--peers-python none)");
    } else {
        println!(
            "Mooncake: its tcp transport reaches a segment at the one address the segment \
             gives, so of the two pairs it moves over one."
        );
    }
}
