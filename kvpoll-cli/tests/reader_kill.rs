//! A reader's death must never take its lender down: a decode rank
//! (`kvpoll connect`) is killed (SIGKILL) mid-transfer again and again while
//! two prefill ranks (`kvpoll serve`) lend to it; after every kill both
//! lenders must still run, get every block of the dead reader back, and
//! serve the next reader.
//!
//! Over tcp UCX emulates a get: the lender's worker answers the reader's
//! request from inside UCX (`ucp_get_req_handler`, `src/ucp/rma/rma_sw.c`)
//! with `ucp_request_send`, which aborts the process when the reply fails
//! because the reader's connection was reset or timed out ("Fatal:
//! unexpected error", `ucp_request.inl`, on 1.13 and on 1.22 alike). kvpoll
//! does not use that path: its gets over tcp are soft reads, which the
//! lender answers with sends of its own that fail like any send
//! (`src/transport/ucx/soft.rs`), on endpoints of its own to the reader
//! (`src/transport/ucx/returns.rs`), never on the reply endpoint UCX may
//! destroy in the progress that brought the request or found the reader
//! dead (lenders died so, SIGSEGV in `ucp_am_send_nbx`: at kill 49 of 50
//! in one run of three, and in the case that kills readers while their
//! lenders are stopped, where an answer that could not open its return
//! endpoint fell back to UCX's).
//!
//! One abort is UCX's own and stays: UCX 1.13 (built with assertions, as
//! Debian's is) aborts a lender whose wire-up reply to a new connection
//! still waits when the reader dies (`ucp_request.c:684 ... got REP
//! message`; 1.14 removed the assertion). A reader killed while its
//! lenders are stopped meets it nearly every time, one killed at random
//! now and then, so the tcp pull cases are ignored where it holds
//! (`cfg(ucx_wireup_reply_purged_quietly)`, ucx-sys/dependent_build.rs);
//! `cargo test --test reader_kill -- --ignored` runs them there.
//!
//! Over shared memory a reader killed inside an active-message send (after
//! it took a slot of its lender's receive FIFO, before it marked the slot
//! written: `uct_mm_ep_am_common_send`, `src/uct/sm/mm/base/mm_ep.c`)
//! leaves the lender's UCX worker deaf on that transport: it reads no
//! message from anyone again. The engine finds that with its probe, and
//! `serve` replaces it with a new engine whose metadata its readers get
//! when they connect again. A kill at a random time lands there now and
//! then; the case that kills inside a send every time (gdb stops the reader
//! just after the slot is taken; a test-only package, without which the
//! case says so and checks nothing) checks that the next reader is served.
//!
//! The other way round: a prefill rank killed inside an active-message
//! send to the decode rank it writes to (push) leaves the decode rank's
//! worker deaf. `connect` finds it the same way, replaces its engine and
//! connects to both prefill ranks again (the killed one restarted at its
//! address); the case that kills a writer inside a send checks that the
//! decode rank goes on transferring, with every block checked and none
//! leaked.
//!
//! A push destination that stops draining (stopped, or starved of CPU)
//! and then dies, while its writers' words fill its shared-memory queue,
//! leaves writes whose flush waits behind that queue: they end only when
//! the writer finds the destination dead. UCX's keepalive check did not
//! always find it, and kept blocks held (the case that kills after a stop
//! did in most runs; the mid-transfer case now and then on a loaded
//! machine); kvpoll reads a probe word of each peer on its host every
//! second and fails the connection of one that is gone. The case that
//! kills after a stop turns UCX's check off in its lenders
//! (`UCX_KEEPALIVE_INTERVAL=inf`), so that kvpoll's check is what must
//! find each death.
//!
//! Time bounds here are guards against a hang, not measurements.

use std::io::Write;
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvpoll_cli::control::{FrameReader, Layout, Msg};

mod procs;

/// Short enough that a dead reader's lends end soon after each kill, long
/// enough that the next reader's reads fit in it on a loaded 2-core machine
/// (400 ms did not: latencies there reached 470 ms; 1000 ms did not with a
/// load average of 19 to 23: request latencies reached 2.4 s at the 99th
/// percentile, and reads failed `LeaseLost` or were not posted for want of
/// lease left, in 3 of 16 runs of the shared-memory pull case).
const LEASE_MS: u64 = 3000;
const LAYOUT: Layout = Layout {
    block_size: 65536,
    layers: 2,
    blocks: 256,
};

struct Lender {
    child: Child,
    addr: String,
    /// Where its standard error goes (UCX's last words if it dies).
    log: std::path::PathBuf,
}

impl Lender {
    /// What UCX said of its error, with the UCX frames of its backtrace.
    fn last_words(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let said: Vec<&str> = text
            .lines()
            .filter(|l| {
                ["Fatal", "Assert", "ucp_", "uct_", "panicked"]
                    .iter()
                    .any(|w| l.contains(w))
            })
            .take(12)
            .collect();
        said.join("\n")
    }
}

impl Drop for Lender {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

fn sizes() -> Vec<String> {
    [
        "--blocks",
        &LAYOUT.blocks.to_string(),
        "--block-size",
        &LAYOUT.block_size.to_string(),
        "--layers",
        &LAYOUT.layers.to_string(),
        "--lease-ms",
        &LEASE_MS.to_string(),
    ]
    .map(str::to_owned)
    .to_vec()
}

fn lender(rank: u32, tls: &str) -> Lender {
    lender_at(rank, tls, "127.0.0.1:0")
}

/// A lender whose control port listens at `listen`.
fn lender_at(rank: u32, tls: &str, listen: &str) -> Lender {
    lender_with(rank, tls, listen, &[])
}

/// A lender whose control port listens at `listen`, with `env` set.
fn lender_with(rank: u32, tls: &str, listen: &str, env: &[(&str, &str)]) -> Lender {
    // One file per lender: cases over the same transports run at once.
    static LENDERS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = LENDERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let log = std::env::temp_dir().join(format!(
        "kvpoll-reader-kill-{}-{tls}-{rank}-{n}.err",
        std::process::id()
    ));
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(["serve", "--rank", &rank.to_string(), "--tls", tls])
        .args(["--listen", listen, "--until-stdin-closes"])
        .args(sizes())
        .env("UCX_NET_DEVICES", "lo")
        // Each failed request and lost peer logged: what a lender that
        // kept blocks was still waiting for shows in its log.
        .env("RUST_LOG", "warn,kvpoll=debug")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).expect("lender log"))
        .spawn()
        .expect("spawn kvpoll serve");
    let addr = procs::listen_addr(&mut child);
    Lender { child, addr, log }
}

/// A reader's requests: 8 blocks from each lender, 8 in flight.
const NARROW: [&str; 4] = ["--blocks-per-handle", "8", "--window", "8"];
/// A block from each lender a request, up to all of them in flight.
const WIDE: [&str; 4] = ["--blocks-per-handle", "1", "--window", "128"];

/// A reader; `extra` holds its request shape (say [`NARROW`]); its output
/// (the JSON report and its log) goes to `out`.
fn reader(
    lenders: &[Lender; 2],
    tls: &str,
    mode: &str,
    requests: u64,
    extra: &[&str],
    out: Stdio,
    err: Stdio,
) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(["connect", "--mode", mode, "--tls", tls])
        .args(["--to", &format!("{},{}", lenders[0].addr, lenders[1].addr)])
        .args(sizes())
        .args(["--requests", &requests.to_string(), "--json"])
        .args(extra)
        .env("UCX_NET_DEVICES", "lo")
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("spawn kvpoll connect")
}

/// Blocks free and in the pool of the lender at `addr` (its STATS).
fn free_blocks(addr: &str) -> Option<(u64, u64)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(200))).ok()?;
    // Keyed as the lenders are (`KVPOLL_AUTH_KEY`, if set).
    let session = procs::session();
    let mut r = FrameReader::new(
        s.try_clone().ok()?,
        Duration::from_secs(5),
        Some(Duration::from_secs(5)),
    )
    .with_session(session.clone());
    s.write_all(&session.encode(&Msg::Hello(LAYOUT)).ok()?)
        .ok()?;
    r.read_msg().ok()?;
    r.read_msg().ok()?;
    s.write_all(&session.encode(&Msg::Stats).ok()?).ok()?;
    match r.read_msg().ok()? {
        Msg::StatsReply { total, free, .. } => Some((free, total)),
        _ => None,
    }
}

/// How a reader is killed.
#[derive(Clone, Copy)]
enum Kill {
    /// SIGKILL 200 to 700 ms into its run, wherever it is.
    MidRead,
    /// SIGKILL inside a shared-memory message send, once it reads from
    /// both lenders (see [`procs::kill_inside_send`]).
    InsideSend,
    /// SIGKILL while both lenders are stopped (SIGSTOP), once it reads
    /// from both: its last requests and its connection's end wait in the
    /// lenders' sockets, and each lender's next progress finds both.
    WhileLendersStopped,
    /// SIGKILL after a spell stopped (SIGSTOP), once it reads from both
    /// with a wide window: what the lenders send it meanwhile (a word
    /// for each of its many writes) fills its shared-memory queues, and
    /// what does not fit waits in the lenders' UCX when it dies.
    AfterAStop,
}

fn kill_readers(tls: &str, mode: &str, kills: u32, how: Kill) {
    // A destination killed after a stop leaves writes whose flush waits
    // behind its full queue: they end once the writer finds it dead and
    // their lease is over. UCX's keepalive check does not always find it
    // (module docs); here it never runs, so that kvpoll's own check of
    // peers on its host is what must.
    let env: &[(&str, &str)] = match how {
        Kill::AfterAStop => &[("UCX_KEEPALIVE_INTERVAL", "inf")],
        _ => &[],
    };
    let lenders = [
        lender_with(0, tls, "127.0.0.1:0", env),
        lender_with(1, tls, "127.0.0.1:0", env),
    ];
    // The readers' shape, and how soon the lenders get their blocks back:
    // a second or two after the lease, once found dead, for a destination
    // killed after a stop; other kills end every lend or write at its
    // lease at the latest. 20 s allows for a loaded machine.
    let (shape, within) = match how {
        Kill::AfterAStop => (WIDE, Duration::from_millis(LEASE_MS + 7_000)),
        _ => (NARROW, Duration::from_secs(20)),
    };
    let mut rng = u64::from(std::process::id()) | 1;
    for k in 0..kills {
        let mut r = reader(
            &lenders,
            tls,
            mode,
            1_000_000_000,
            &shape,
            Stdio::null(),
            Stdio::null(),
        );
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        match how {
            Kill::MidRead => {
                std::thread::sleep(Duration::from_millis(200 + rng % 500));
                let _ = r.kill();
            }
            Kill::InsideSend => {
                // Reading (both lenders lent to it): its wire-up, and its
                // engine's with its own probe worker, are behind it.
                reading_from_both(&lenders);
                if let Err(why) = procs::kill_inside_send(r.id()) {
                    let _ = r.kill();
                    let _ = r.wait();
                    panic!("{tls} {mode}: {why}");
                }
            }
            Kill::WhileLendersStopped => {
                reading_from_both(&lenders);
                for l in &lenders {
                    procs::stop(l.child.id());
                }
                std::thread::sleep(Duration::from_millis(50 + rng % 200));
                let _ = r.kill();
                let _ = r.wait();
                std::thread::sleep(Duration::from_millis(20));
                for l in &lenders {
                    procs::cont(l.child.id());
                }
            }
            Kill::AfterAStop => {
                reading_from_both(&lenders);
                procs::stop(r.id());
                std::thread::sleep(Duration::from_millis(300 + rng % 200));
                let _ = r.kill();
            }
        }
        let _ = r.wait();
        lenders_took_back(&lenders, k, within, &format!("{tls} {mode}"));
    }
    if let Kill::InsideSend = how {
        lender_rebuilt(&lenders, &format!("{tls} {mode}"));
    }
    next_reader_served(&lenders, tls, mode, kills);
}

/// Waits until both lenders lend to the reader (it reads from both).
fn reading_from_both(lenders: &[Lender; 2]) {
    let t = Instant::now();
    while !lenders
        .iter()
        .all(|l| free_blocks(&l.addr).is_some_and(|(free, total)| free < total))
    {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the reader never read"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A lender was deafened by the kill inside a send (else the case proves
/// nothing) and replaced its engine: it says so in its log. Waited for,
/// since the dead reader's lends may all have ended already, and a reader
/// connecting before the lender found out would be cut off by the rebuild.
fn lender_rebuilt(lenders: &[Lender; 2], case: &str) {
    let t = Instant::now();
    while !lenders.iter().any(|l| {
        std::fs::read_to_string(&l.log).is_ok_and(|t| t.contains("serving from a new engine"))
    }) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{case}: no lender was deafened by the kill (or none said it replaced its engine); \
             their logs:\n{}",
            lenders
                .iter()
                .map(|l| std::fs::read_to_string(&l.log).unwrap_or_default())
                .collect::<Vec<_>>()
                .join("\n--\n")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// After kill `k`: every lender lives and gets the dead reader's blocks
/// back `within` that long.
fn lenders_took_back(lenders: &[Lender; 2], k: u32, within: Duration, case: &str) {
    let mut deaths = Vec::new();
    let t = Instant::now();
    for (i, l) in lenders.iter().enumerate() {
        loop {
            if let Some(st) = exited(&l.child) {
                deaths.push(format!(
                    "kill {k}: lender {i} died ({st}); its last words:\n{}",
                    l.last_words()
                ));
                break;
            }
            let stats = free_blocks(&l.addr);
            match stats {
                Some((free, total)) if free == total => break,
                _ if t.elapsed() > within => {
                    // What it held and what it logged: enough to tell a
                    // write waiting on UCX for its puts from a lost event.
                    let held = stats.map_or("?".into(), |(f, n)| format!("{} of {n}", n - f));
                    let log = std::fs::read_to_string(&l.log).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(12).collect();
                    deaths.push(format!(
                        "kill {k}: lender {i} kept the dead reader's blocks ({held} held \
                         after {:?}); its log, last lines first:\n{}",
                        t.elapsed(),
                        tail.join("\n")
                    ));
                    break;
                }
                _ => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
    assert!(deaths.is_empty(), "{case}: {deaths:?}");
}

/// The next reader is served in full.
fn next_reader_served(lenders: &[Lender; 2], tls: &str, mode: &str, kills: u32) {
    let (st, said) = next_reader(lenders, tls, mode);
    let tail: Vec<&str> = said
        .lines()
        .rev()
        .filter(|l| !l.contains("UCX  WARN"))
        .take(6)
        .collect();
    assert!(
        st.success(),
        "{tls} {mode}: the reader after {kills} kills: {st}; it said (last lines first):\n{}",
        tail.join("\n")
    );
}

/// A reader of 200 requests, run to its end: how it exited and what it
/// said (its JSON report and its log).
fn next_reader(lenders: &[Lender; 2], tls: &str, mode: &str) -> (ExitStatus, String) {
    let log = std::env::temp_dir().join(format!(
        "kvpoll-reader-kill-{}-{tls}-{mode}-last.err",
        std::process::id()
    ));
    let out = std::fs::File::create(&log).expect("reader log");
    let err = out.try_clone().expect("reader log");
    let mut r = reader(lenders, tls, mode, 200, &NARROW, out.into(), err.into());
    let st = procs::wait_within(&mut r, Duration::from_secs(120)).expect("the last reader hung");
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    (st, said)
}

/// Whether `child` exited (it is a zombie: /proc tells without reaping it).
fn exited(child: &Child) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id())).ok()?;
    let state = stat.rsplit(')').next().unwrap_or("").trim_start();
    state.starts_with('Z').then(|| "it exited".to_owned())
}

#[test]
#[cfg_attr(
    not(ucx_wireup_reply_purged_quietly),
    ignore = "UCX before 1.14 asserts against a wire-up reply purged by a reader's death (module docs)"
)]
fn over_tcp_in_pull_mode_fifty_killed_readers_leave_every_lender_serving() {
    kill_readers("tcp", "pull", 50, Kill::MidRead);
}

#[test]
#[cfg_attr(
    not(ucx_wireup_reply_purged_quietly),
    ignore = "UCX before 1.14 asserts against a wire-up reply purged by a reader's death (module docs)"
)]
fn over_tcp_in_pull_mode_readers_killed_while_their_lenders_are_stopped_leave_every_lender_serving()
{
    kill_readers("tcp", "pull", 20, Kill::WhileLendersStopped);
}

#[test]
fn over_shared_memory_in_pull_mode_killed_readers_leave_every_lender_serving() {
    kill_readers("posix,sysv,cma", "pull", 10, Kill::MidRead);
}

#[test]
fn over_tcp_in_push_mode_killed_destinations_leave_every_writer_serving() {
    kill_readers("tcp", "push", 10, Kill::MidRead);
}

#[test]
fn over_shared_memory_in_push_mode_killed_destinations_leave_every_writer_serving() {
    kill_readers("posix,sysv,cma", "push", 10, Kill::MidRead);
}

#[test]
fn over_shared_memory_in_push_mode_destinations_killed_after_a_stop_leave_every_writer_serving() {
    kill_readers("posix,sysv,cma", "push", 5, Kill::AfterAStop);
}

#[test]
fn over_shared_memory_a_reader_killed_inside_a_message_send_leaves_its_lenders_serving() {
    if !procs::have_gdb() {
        eprintln!("skipped: needs gdb to stop the reader inside a send");
        return;
    }
    kill_readers("posix,sysv,cma", "pull", 1, Kill::InsideSend);
}

/// Lends that a lender still holds for an earlier reader's requests (one
/// killed just after it asked, whose lends last until their lease ends)
/// refuse nothing of the next reader: each reader's request ids are its
/// own, as a serving engine's are.
#[test]
fn lends_still_held_for_an_earlier_readers_requests_refuse_nothing_of_the_next_reader() {
    let tls = "posix,sysv,cma";
    let lenders = [lender(0, tls), lender(1, tls)];
    // The earlier reader: an engine of lender 1's metadata on a control
    // connection to lender 0, asking for the first requests a reader
    // issues (decode rank 1, sequence 0 to 7) again whenever their lends
    // end, until the next reader is done.
    let (_s, mut r) = procs::hello(&lenders[1].addr, LAYOUT);
    let _ = r.read_msg().unwrap();
    let Msg::Meta(meta) = r.read_msg().unwrap() else {
        panic!("lender 1 sent no META");
    };
    let (mut s, r) = procs::client(&lenders[0].addr, LAYOUT);
    procs::send(&mut s, &r, &Msg::Meta(meta));
    let session = r.session().clone();
    // Its answers are read (and dropped) until the connection ends.
    let answers = std::thread::spawn(move || {
        let mut r = r;
        while r.read_msg().is_ok() {}
    });
    let end = s.try_clone().unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let asking = {
        let done = done.clone();
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                for seq in 0..8u64 {
                    // One block each: the pool stays as free as a
                    // reader needs it on a loaded machine.
                    let ask = Msg::Prepare {
                        req: (1 << 40) | seq,
                        n: 1,
                    };
                    if s.write_all(&session.encode(&ask).unwrap()).is_err() {
                        return;
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    // Its lends are out before the next reader starts.
    let t = Instant::now();
    while free_blocks(&lenders[0].addr).is_none_or(|(free, _)| free > 256 - 8) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "lender 0 lent nothing"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Refusals only: on a loaded machine a read may pass its deadline,
    // which says nothing of request ids.
    let (_, said) = next_reader(&lenders, tls, "pull");
    done.store(true, std::sync::atomic::Ordering::Release);
    asking.join().unwrap();
    let _ = end.shutdown(std::net::Shutdown::Both);
    answers.join().unwrap();
    let json = said
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("the reader printed no report:\n{said}"));
    let reported: u64 = ["transferred", "failed", "expired", "refused"]
        .iter()
        .map(|f| procs::json_field(json, f))
        .sum();
    assert_eq!(reported, 200, "{json}");
    assert_eq!(procs::json_field(json, "refused"), 0, "{json}");
}

/// A prefill rank killed inside a shared-memory message send to the decode
/// rank it writes to deafens that rank's engine (its worker reads no
/// message again); the decode rank replaces its engine, connects to both
/// prefill ranks again (the killed one restarted at its address) and
/// transfers the rest. gdb holds the writer from before the decode rank
/// starts, so its first message to it is the one it dies in: every request
/// transferred went through a new engine.
#[test]
fn over_shared_memory_a_writer_killed_inside_a_message_send_leaves_its_destination_serving() {
    if !procs::have_gdb() {
        eprintln!("skipped: needs gdb to stop the writer inside a send");
        return;
    }
    const REQUESTS: u64 = 100;
    let tls = "posix,sysv,cma";
    let mut lenders = [lender(0, tls), lender(1, tls)];
    let pid = lenders[0].child.id();
    let killer = std::thread::spawn(move || procs::kill_inside_send(pid));
    let t = Instant::now();
    while !procs::traced(pid) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "gdb never attached to the writer"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = std::env::temp_dir().join(format!("kvpoll-writer-kill-{}.err", std::process::id()));
    let out = std::fs::File::create(&log).expect("destination log");
    let err = out.try_clone().expect("destination log");
    let mut d = reader(
        &lenders,
        tls,
        "push",
        REQUESTS,
        &[&NARROW[..], &["--allow-failures"]].concat(),
        out.into(),
        err.into(),
    );
    let said = |d: &mut Child| {
        let _ = d.kill();
        let _ = d.wait();
        std::fs::read_to_string(&log).unwrap_or_default()
    };
    if let Err(why) = killer.join().expect("the gdb thread") {
        panic!("{why}\nthe destination said:\n{}", said(&mut d));
    }
    let _ = lenders[0].child.wait();
    let addr = lenders[0].addr.clone();
    lenders[0] = lender_at(0, tls, &addr);
    let Some(st) = procs::wait_within(&mut d, Duration::from_secs(180)) else {
        panic!("the destination hung; it said:\n{}", said(&mut d));
    };
    let text = said(&mut d);
    let _ = std::fs::remove_file(&log);
    let json = text
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("the destination printed no report ({st}):\n{text}"));
    let rebuilt = json.contains("\"decode_engines_rebuilt\":")
        && procs::json_field(json, "decode_engines_rebuilt") >= 1;
    // Only the requests in flight when the writer died fail (a window's
    // worth, the failure found within about a second).
    let finished = procs::json_field(json, "finished");
    assert!(
        st.success() && rebuilt && finished >= REQUESTS / 2,
        "exit {st}, engine rebuilt: {rebuilt}, {finished} of {REQUESTS} transferred; it said:\n{text}"
    );
}
