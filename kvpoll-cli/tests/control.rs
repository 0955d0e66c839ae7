//! The control port on a network: `connect` against fake servers (garbage,
//! closing, silent, damaged) exits 1 within its give-up bound saying why,
//! and `serve` refuses over-long frames and fault injection it was not
//! started for, and keeps serving.
//!
//! Time bounds here are guards against a hang, not measurements.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvpoll_cli::control::{FrameReader, Layout, Msg, ReadError, HEADER, MAX_PAYLOAD};

mod procs;

/// `connect`'s and `serve`'s default layout.
const LAYOUT: Layout = Layout {
    block_size: 16384,
    layers: 2,
    blocks: 512,
};

/// Generous guard: a run that ends by giving up after `secs` must be done
/// well within this.
fn guard(secs: u64) -> Duration {
    Duration::from_secs(secs + 60)
}

/// A fake server on loopback: `serve_one` handles each connection.
fn fake_server(serve_one: fn(TcpStream)) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            std::thread::spawn(move || serve_one(s));
        }
    });
    addr
}

/// Runs `connect` against `addr` (both ranks) and returns its exit code
/// and standard error, killing it if it outlives the guard. Without a key,
/// whatever the environment says: the fake servers speak the unkeyed wire.
fn connect_to(addr: &str, give_up_after: u64) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .env_remove("KVPOLL_AUTH_KEY")
        .args(["connect", "--to", &format!("{addr},{addr}")])
        .args(["--requests", "20", "--give-up-after"])
        .arg(give_up_after.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvpoll connect");
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let st = procs::wait_exit(
        &mut child,
        guard(give_up_after),
        "connect (it did not give up)",
    );
    (st.code(), reader.join().unwrap())
}

/// Reads the client's hello (so the fake looks like it listens).
fn read_hello(s: &TcpStream) {
    let mut r = FrameReader::new(s, Duration::from_secs(5), Some(Duration::from_secs(5)));
    let _ = r.read_msg();
}

fn assert_gave_up(code: Option<i32>, err: &str, reason: &str) {
    assert_eq!(code, Some(1), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("kvpoll: ") && last.contains("gave up") && last.contains(reason),
        "last line should give the reason {reason:?}: {err}"
    );
    // Each failed attempt was logged with its typed error.
    assert!(
        err.lines()
            .any(|l| l.contains("WARN") && l.contains("failed") && l.contains(reason)),
        "{err}"
    );
}

#[test]
fn connect_to_a_server_sending_garbage_exits_1_naming_the_bad_magic() {
    let addr = fake_server(|mut s| {
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\nnot kvpoll at all");
    });
    let (code, err) = connect_to(&addr, 2);
    assert_gave_up(code, &err, "bad magic");
}

#[test]
fn connect_to_a_server_that_closes_at_once_exits_1_naming_the_close() {
    let addr = fake_server(drop);
    let (code, err) = connect_to(&addr, 2);
    assert_gave_up(code, &err, "closed");
}

#[test]
fn connect_to_a_silent_server_exits_1_naming_the_timeout() {
    let addr = fake_server(|s| {
        std::thread::sleep(Duration::from_secs(120));
        drop(s);
    });
    let (code, err) = connect_to(&addr, 2);
    assert_gave_up(code, &err, "timeout");
}

#[test]
fn connect_to_a_server_with_a_damaged_checksum_exits_1_naming_it() {
    let addr = fake_server(|mut s| {
        read_hello(&s);
        let mut f = Msg::Hello(LAYOUT).encode().unwrap();
        let last = f.len() - 1;
        f[last] ^= 1;
        let _ = s.write_all(&f);
    });
    let (code, err) = connect_to(&addr, 2);
    assert_gave_up(code, &err, "checksum mismatch");
}

#[test]
fn connect_to_a_server_with_truncated_metadata_exits_1_naming_it() {
    let addr = fake_server(|mut s| {
        read_hello(&s);
        let _ = s.write_all(&Msg::Hello(LAYOUT).encode().unwrap());
        let _ = s.write_all(&Msg::Meta(b"KVPL\x03\x01".to_vec()).encode().unwrap());
    });
    let (code, err) = connect_to(&addr, 2);
    assert_gave_up(code, &err, "frame truncated: 6 bytes, need 20");
}

#[test]
fn connect_to_a_server_of_another_layout_exits_1_at_once_naming_both() {
    let addr = fake_server(|mut s| {
        read_hello(&s);
        let theirs = Layout {
            layers: 3,
            ..LAYOUT
        };
        let _ = s.write_all(&Msg::Hello(theirs).encode().unwrap());
    });
    let (code, err) = connect_to(&addr, 30);
    assert_gave_up(code, &err, "layout mismatch");
    assert!(
        err.contains("3 layers") && err.contains("2 layers"),
        "{err}"
    );
}

use procs::Serve as Server;

/// What the tests ask of a running server.
trait Ask {
    /// A connection past the handshake, and a reader of its replies.
    fn client(&self) -> (TcpStream, FrameReader<TcpStream>);
    /// Peak resident memory (VmHWM), in bytes.
    fn peak_rss(&self) -> u64;
}

impl Ask for Server {
    fn client(&self) -> (TcpStream, FrameReader<TcpStream>) {
        procs::client(&self.addr, LAYOUT)
    }

    fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    }
}

#[test]
fn stall_sent_to_a_server_not_started_for_testing_is_refused_and_it_keeps_serving() {
    let server = Server::start(&[]);
    let (mut s, mut r) = server.client();
    procs::send(&mut s, &r, &Msg::Stall { ms: 3_600_000 });
    match r.read_msg().unwrap() {
        Msg::Refused(why) => assert!(why.contains("--testing"), "{why}"),
        other => panic!("STALL was not refused: {other:?}"),
    }
    // The same connection and a new one are both still served.
    procs::send(&mut s, &r, &Msg::Stats);
    assert!(matches!(r.read_msg().unwrap(), Msg::StatsReply { .. }));
    let (mut s2, mut r2) = server.client();
    procs::send(&mut s2, &r2, &Msg::Stats);
    assert!(matches!(r2.read_msg().unwrap(), Msg::StatsReply { .. }));
}

#[test]
fn stall_sent_to_a_server_started_for_testing_is_taken() {
    let server = Server::start(&["--testing"]);
    let (mut s, mut r) = server.client();
    procs::send(&mut s, &r, &Msg::Stall { ms: 10 });
    procs::send(&mut s, &r, &Msg::Stats);
    // No refusal comes before the stats reply.
    assert!(matches!(r.read_msg().unwrap(), Msg::StatsReply { .. }));
}

#[test]
fn an_over_long_control_frame_is_refused_after_its_header_without_growing_memory() {
    let server = Server::start(&[]);
    let (mut s, mut r) = server.client();
    // A header announcing 1 GiB, and nothing of the payload yet: the refusal
    // comes from the header alone.
    let claimed: u64 = 1 << 30;
    let mut header = Msg::Stats.encode().unwrap();
    header.truncate(HEADER);
    header[8..12].copy_from_slice(&(claimed as u32).to_le_bytes());
    s.write_all(&header).unwrap();
    match r.read_msg().unwrap() {
        Msg::Refused(why) => assert!(why.contains(&MAX_PAYLOAD.to_string()), "{why}"),
        other => panic!("an over-long frame was not refused: {other:?}"),
    }
    assert!(matches!(
        r.read_msg(),
        Err(ReadError::Closed | ReadError::Io(_))
    ));
    // Streaming the announced payload goes nowhere: the connection is shut,
    // so the writes fail long before 256 MiB have gone.
    let chunk = vec![b'A'; 1 << 20];
    let mut sent: u64 = 0;
    while sent < 256 << 20 {
        if s.write_all(&chunk).is_err() {
            break;
        }
        sent += chunk.len() as u64;
    }
    assert!(
        sent < 256 << 20,
        "the server took {sent} bytes after refusing"
    );
    let peak = server.peak_rss();
    assert!(
        peak < claimed / 4,
        "serve's peak RSS {peak} bytes is not well below the {claimed} bytes announced"
    );
    // And it still serves others.
    let (mut s2, mut r2) = server.client();
    procs::send(&mut s2, &r2, &Msg::Stats);
    assert!(matches!(r2.read_msg().unwrap(), Msg::StatsReply { .. }));
}

#[test]
fn a_text_line_without_newline_is_refused_as_foreign_without_being_buffered() {
    let server = Server::start(&[]);
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut r = FrameReader::new(
        s.try_clone().unwrap(),
        Duration::from_secs(10),
        Some(Duration::from_secs(30)),
    );
    s.write_all(b"STALL 3600000 and no newline ").unwrap();
    match r.read_msg().unwrap() {
        Msg::Refused(why) => assert!(why.contains("bad magic"), "{why}"),
        other => panic!("a text line was not refused: {other:?}"),
    }
}

/// This process's engine metadata, as a decode rank would send it.
fn our_metadata() -> (kvpoll::Engine, Vec<u8>) {
    let mut e = kvpoll::Engine::builder()
        .block_size(LAYOUT.block_size)
        .ucx(kvpoll::ContextOptions::with_transports("tcp"))
        .build()
        .unwrap();
    for _ in 0..LAYOUT.layers {
        e.register(u64::from(LAYOUT.blocks)).unwrap();
    }
    let meta = e.local_metadata().unwrap();
    (e, meta)
}

use procs::stats;

#[test]
fn prepare_before_meta_and_prepare_for_no_blocks_are_refused_and_lend_nothing() {
    let server = Server::start(&[]);
    let (mut s, mut r) = server.client();
    for req in 0..200u64 {
        procs::send(&mut s, &r, &Msg::Prepare { req, n: 4 });
    }
    for _ in 0..200 {
        match r.read_msg().unwrap() {
            Msg::Refused(why) => assert!(why.contains("META"), "{why}"),
            other => panic!("a PREPARE before META was answered {other:?}"),
        }
    }
    let (total, free) = stats(&mut s, &mut r);
    assert_eq!(free, total, "PREPAREs before META lent blocks");
    let (_engine, meta) = our_metadata();
    procs::send(&mut s, &r, &Msg::Meta(meta));
    procs::send(&mut s, &r, &Msg::Prepare { req: 7, n: 0 });
    match r.read_msg().unwrap() {
        Msg::Refused(why) => assert!(why.contains("0 blocks"), "{why}"),
        other => panic!("a PREPARE for 0 blocks was answered {other:?}"),
    }
    // A proper one is served.
    procs::send(&mut s, &r, &Msg::Prepare { req: 8, n: 4 });
    assert!(
        matches!(r.read_msg().unwrap(), Msg::Ready { req: 8, ref blocks, .. } if blocks.len() == 4)
    );
}

#[test]
fn a_stalled_poller_leaves_the_control_plane_answering_stats_and_handshakes() {
    let server = Server::start(&["--testing"]);
    let (_engine, meta) = our_metadata();
    let (mut a, ra) = server.client();
    procs::send(&mut a, &ra, &Msg::Stall { ms: 20_000 });
    std::thread::sleep(Duration::from_millis(300));
    // A client whose metadata the stalled engine cannot take yet.
    let (mut b, rb) = server.client();
    procs::send(&mut b, &rb, &Msg::Meta(meta));
    procs::send(&mut b, &rb, &Msg::Prepare { req: 1, n: 4 });
    std::thread::sleep(Duration::from_millis(300));
    // New handshakes and STATS are still answered (the client's reader
    // gives up after 10 s: well before the stall ends).
    let t = Instant::now();
    let (mut c, mut rc) = server.client();
    let (total, _) = stats(&mut c, &mut rc);
    assert_eq!(total, u64::from(LAYOUT.blocks));
    assert!(t.elapsed() < Duration::from_secs(15));
}

#[test]
fn a_connection_past_the_cap_is_refused_saying_so() {
    let server = Server::start(&["--max-connections", "3"]);
    let held: Vec<_> = (0..3).map(|_| server.client()).collect();
    let (_s, mut r) = procs::hello(&server.addr, LAYOUT);
    match r.read_msg().unwrap() {
        Msg::Refused(why) => assert!(why.contains("server full"), "{why}"),
        other => panic!("a connection past the cap was answered {other:?}"),
    }
    drop(held);
    // Room again once one closed.
    std::thread::sleep(Duration::from_millis(300));
    let (mut s2, mut r2) = server.client();
    let _ = stats(&mut s2, &mut r2);
}

/// Threads, open descriptors and resident memory (bytes) of process `pid`.
fn resources(pid: u32) -> (usize, usize, u64) {
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .count();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap()
        * 1024;
    (threads, fds, rss)
}

#[test]
fn a_flood_of_idle_and_half_open_connections_keeps_serve_flat_and_a_client_served() {
    const FLOOD: usize = 3000;
    let server = Server::start(&[]);
    let pid = server.child.id();
    let before = resources(pid);
    // Half of them silent, half stopped inside a frame's header.
    let mut flood = Vec::with_capacity(FLOOD);
    for i in 0..FLOOD {
        let Ok(mut s) = TcpStream::connect(&server.addr) else {
            continue;
        };
        if i % 2 == 1 {
            let _ = s.write_all(&Msg::Hello(LAYOUT).encode().unwrap()[..5]);
        }
        flood.push(s);
    }
    // Past their handshakes' bounds, some still open on our side.
    std::thread::sleep(Duration::from_millis(500));
    let during = resources(pid);
    // A real client is served while the flood holds its sockets.
    let (mut s, mut r) = server.client();
    let (total, free) = stats(&mut s, &mut r);
    assert_eq!(free, total);
    eprintln!(
        "flood of {} connections: serve threads {} -> {}, fds {} -> {}, RSS {} -> {} KiB",
        flood.len(),
        before.0,
        during.0,
        before.1,
        during.1,
        before.2 / 1024,
        during.2 / 1024
    );
    assert!(flood.len() >= FLOOD / 2, "the flood opened {}", flood.len());
    assert!(during.0 <= before.0 + 2, "threads {before:?} -> {during:?}");
    assert!(during.1 <= before.1 + 128, "fds {before:?} -> {during:?}");
    assert!(
        during.2 <= before.2 + (64 << 20),
        "RSS {before:?} -> {during:?}"
    );
}
