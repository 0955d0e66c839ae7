//! Force-closing an endpoint to a peer that is alive (and has its own
//! endpoint back) and connecting to it again at once, over tcp, round after
//! round: messages keep flowing both ways on the new endpoints and UCX
//! never aborts. An engine-level path once tripped an assertion of UCX
//! 1.13's endpoint pairing here (`ucp_ep.inl`: `remote_id ==
//! remote_ep_id`, docs/design.md §4), so the scenario runs in child
//! processes and the parent reads their fate.
//! It runs in one process (two workers) and across two processes (each
//! side its own process, as two engines are). Time bounds are guards
//! against a hang, not measurements.

mod ucx_common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvpoll::transport::ucx::{
    BlockOp, Endpoint, MemoryRegion, PackedRkey, RemoteKey, Worker, WorkerAddress,
};
use kvpoll::wire::{from_hex, to_hex};
use ucx_common::worker;

const CHILD: &str = "KVPOLL_RECONNECT_CHILD";
const AM: u16 = 9;
const ROUNDS: u32 = 1000;
const BLOCK: u64 = 64 * 1024;
const BLOCKS: u64 = 16;

/// Progresses both workers until `w` received an active message carrying
/// `want`; panics (a failed round) after 20 s.
fn receive(a: &Worker, b: &Worker, w: &Worker, want: &[u8]) {
    let t = Instant::now();
    loop {
        a.progress();
        b.progress();
        let mut seen = false;
        w.take_active_messages(|m| seen |= m.payload == want);
        if seen {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{:?} never arrived",
            String::from_utf8_lossy(want)
        );
    }
}

/// B tells A `what` on `b_to_a`. A's force-close may reset the connection
/// under B's endpoint (UCX 1.22 does): UCX then fails that endpoint, and B
/// connects again, as an engine replaces a failed endpoint. Returns how
/// many times B had to.
fn b_tells_a(
    a: &Worker,
    b: &Worker,
    b_to_a: &mut Endpoint,
    addr_a: &WorkerAddress,
    what: &[u8],
) -> u32 {
    let t = Instant::now();
    let mut reconnects = 0;
    loop {
        if b_to_a.send_active_message(AM, what, 1).is_ok() {
            while b_to_a.failure().is_none() && t.elapsed() < Duration::from_secs(20) {
                a.progress();
                b.progress();
                let mut seen = false;
                a.take_active_messages(|m| seen |= m.payload == what);
                if seen {
                    return reconnects;
                }
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{:?} never arrived",
            String::from_utf8_lossy(what)
        );
        *b_to_a = Endpoint::connect(b, addr_a, 2).unwrap();
        reconnects += 1;
    }
}

fn force_close_and_reconnect(tls: &str) {
    let (_ca, a) = worker(tls);
    let (_cb, b) = worker(tls);
    a.listen_active_messages(AM).unwrap();
    b.listen_active_messages(AM).unwrap();
    let addr_a = WorkerAddress::from_bytes(a.address().unwrap().as_bytes()).unwrap();
    let addr_b = WorkerAddress::from_bytes(b.address().unwrap().as_bytes()).unwrap();
    // B keeps its endpoint to A while UCX lets it; A's endpoint to B is
    // the one force-closed and remade every round.
    let mut b_to_a = Endpoint::connect(&b, &addr_a, 1).unwrap();
    let mut b_reconnects = 0;
    let mut a_to_b = Endpoint::connect(&a, &addr_b, 100).unwrap();
    let src = MemoryRegion::allocate(&_ca, (BLOCK * BLOCKS) as usize).unwrap();
    let dst = MemoryRegion::allocate(&_cb, (BLOCK * BLOCKS) as usize).unwrap();
    let packed = PackedRkey::from_bytes(dst.pack_rkey().unwrap().as_bytes()).unwrap();
    let mut token = 1000;
    for round in 0..ROUNDS {
        let to_b = format!("a->b {round}");
        a_to_b
            .send_active_message(AM, to_b.as_bytes(), token)
            .unwrap();
        receive(&a, &b, &b, to_b.as_bytes());
        let to_a = format!("b->a {round}");
        b_reconnects += b_tells_a(&a, &b, &mut b_to_a, &addr_a, to_a.as_bytes());
        // Puts in flight, B talking back, then A force-closes its endpoint
        // to a live B and reconnects at once: no progress in between.
        let rkey = RemoteKey::unpack(&a_to_b, &packed).unwrap();
        let puts: Vec<BlockOp> = (0..BLOCKS)
            .map(|i| BlockOp {
                local_offset: i * BLOCK,
                remote_offset: i * BLOCK,
                len: BLOCK as usize,
                token: 1 << 40 | u64::from(round) << 8 | i,
            })
            .collect();
        a_to_b
            .put_batch(&src, &rkey, &puts)
            .unwrap_or_else(|e| panic!("{e:?}"));
        let _ = b_to_a.send_active_message(AM, b"busy", token + 2);
        b.progress();
        drop(rkey);
        a_to_b.force_close(token + 2).unwrap();
        a_to_b = Endpoint::connect(&a, &addr_b, 101 + u64::from(round)).unwrap();
        token += 3;
    }
    let mut done = Vec::new();
    a.take_completions(&mut done);
    b.take_completions(&mut done);
    eprintln!(
        "{ROUNDS} rounds over {tls}: force-closed and reconnected, messages both ways \
         (B's endpoint failed and was remade {b_reconnects} times)"
    );
}

/// One line from standard input: a peer's worker address in hex.
fn read_address() -> WorkerAddress {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("stdin");
    WorkerAddress::from_bytes(&from_hex(line.trim()).expect("hex")).expect("address")
}

/// Side B of the two-process run: keeps one endpoint to A (and talks on
/// it), answers every message A sends on A's endpoint of the moment, until
/// its standard input closes.
fn side_b(tls: &str) {
    let (_c, b) = worker(tls);
    b.listen_active_messages(AM).unwrap();
    println!("{}", to_hex(b.address().unwrap().as_bytes()));
    let to_a = Endpoint::connect(&b, &read_address(), 1).unwrap();
    static EOF: AtomicBool = AtomicBool::new(false);
    std::thread::spawn(|| {
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
        EOF.store(true, Ordering::Release);
    });
    let mut token = 0u64;
    while !EOF.load(Ordering::Acquire) {
        b.progress();
        let mut answers = Vec::new();
        b.take_active_messages(|m| {
            if let Some(r) = m.reply {
                answers.push((r, m.payload.to_vec()));
            }
        });
        for (r, payload) in answers {
            token += 2;
            // A's endpoint may be closed by now: then the answer is lost,
            // which A allows for; an abort is what is looked for.
            let _ = b.reply(r, AM, &payload, token);
            let _ = to_a.send_active_message(AM, b"busy", token + 1);
        }
    }
}

/// Side A of the two-process run: the round loop, answers over B's reply
/// endpoints.
fn side_a(tls: &str) {
    let (_c, a) = worker(tls);
    a.listen_active_messages(AM).unwrap();
    println!("{}", to_hex(a.address().unwrap().as_bytes()));
    let addr_b = read_address();
    let mut to_b = Endpoint::connect(&a, &addr_b, 100).unwrap();
    let mut token = 1000u64;
    for round in 0..ROUNDS {
        let want = format!("a->b {round}");
        to_b.send_active_message_with_reply(AM, want.as_bytes(), token)
            .unwrap();
        let t = Instant::now();
        let mut seen = false;
        while !seen {
            a.progress();
            a.take_active_messages(|m| seen |= m.payload == want.as_bytes());
            assert!(t.elapsed() < Duration::from_secs(20), "{want} unanswered");
        }
        // B's answer and its own message may still be on the wire:
        // force-close and reconnect at once.
        to_b.force_close(token + 1).unwrap();
        to_b = Endpoint::connect(&a, &addr_b, 101 + u64::from(round)).unwrap();
        token += 2;
    }
    eprintln!("{ROUNDS} rounds over {tls}: force-closed and reconnected, messages both ways");
}

/// The scenarios themselves; do nothing unless run as a child.
#[test]
fn child() {
    match std::env::var(CHILD).as_deref() {
        Ok(v) if v.starts_with("a:") => side_a(&v[2..]),
        Ok(v) if v.starts_with("b:") => side_b(&v[2..]),
        Ok(tls) => force_close_and_reconnect(tls),
        Err(_) => {}
    }
}

fn spawn_side(role: &str) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env(CHILD, role)
        .env("UCX_NET_DEVICES", "lo")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The hex address a side prints (after libtest's "test child ... ").
fn address_line(child: &mut std::process::Child) -> String {
    let out = child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    let addr = lines
        .find_map(|l| {
            let l = l.ok()?;
            let word = l.split_whitespace().last()?.to_owned();
            (word.len() > 16 && from_hex(&word).is_ok()).then_some(word)
        })
        .expect("the side printed its address");
    // Keep reading, so that the side's later output has somewhere to go.
    std::thread::spawn(move || lines.for_each(drop));
    addr
}

#[test]
fn over_tcp_force_closing_a_live_peer_and_reconnecting_at_once_keeps_messages_flowing() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env(CHILD, "tcp")
        .env("UCX_NET_DEVICES", "lo")
        .output()
        .unwrap();
    assert_finished(&out);
}

#[test]
fn over_tcp_across_processes_force_closing_a_live_peer_and_reconnecting_keeps_both_alive() {
    let (mut a, mut b) = (spawn_side("a:tcp"), spawn_side("b:tcp"));
    let (addr_a, addr_b) = (address_line(&mut a), address_line(&mut b));
    writeln!(b.stdin.as_mut().unwrap(), "{addr_a}").unwrap();
    writeln!(a.stdin.as_mut().unwrap(), "{addr_b}").unwrap();
    let out_a = a.wait_with_output().unwrap();
    drop(b.stdin.take());
    let out_b = b.wait_with_output().unwrap();
    assert_survived(&out_b);
    assert_finished(&out_a);
}

/// The child lived; else what it (UCX) said as it died.
fn assert_survived(out: &std::process::Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the child died ({}):\n{}",
        out.status,
        stderr.lines().take(20).collect::<Vec<_>>().join("\n")
    );
}

/// The child lived and said it finished every round.
fn assert_finished(out: &std::process::Output) {
    assert_survived(out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{ROUNDS} rounds over tcp")),
        "{stderr}"
    );
}
