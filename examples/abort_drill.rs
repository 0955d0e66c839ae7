//! The abort drill: one decode engine reads 2000 requests × 4 handles from
//! 8 prefill engines over real UCX (tcp, one process), aborts about 2 % of
//! them right after submitting, and stalls one prefill rank past the read
//! deadline in the middle of the run. It counts how many requests that were
//! neither aborted nor on the stalled rank failed (the contract says 0: an
//! abort affects only its own request, a stall only the requests it
//! touches), and checks every finished read's bytes.
//!
//! `cargo run --release --features fault-injection --example abort_drill`

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, Outcomes, Transfer};
use kvpoll::ledger::{BlockId, Cause, RequestId};
use kvpoll::transport::ucx::ContextOptions;

const BS: u64 = 1024;
const BLOCKS: u64 = 256;
const PRODUCERS: usize = 8;
const REQUESTS: u64 = 2000;
const HANDLES: usize = 4;
const STALLED: usize = 3;

fn engine(deadline: Duration) -> Engine {
    let mut e = Engine::builder()
        .block_size(BS)
        .ledger(4096, 64)
        .ucx(ContextOptions::with_transports("tcp"))
        .read_deadline(deadline)
        .build()
        .expect("engine");
    e.register(BLOCKS).expect("register");
    e
}

/// A request: the producers it reads from, whether it was aborted, and per
/// handle (producer, remote block, local block).
type Plan = (Vec<usize>, bool, Vec<(usize, u64, u32)>);

fn byte(producer: usize, block: u64) -> u8 {
    (producer as u64 * 31 + block * 7) as u8 | 1
}

fn main() {
    let mut producers: Vec<Engine> = (0..PRODUCERS)
        .map(|_| engine(Duration::from_secs(30)))
        .collect();
    for (p, e) in producers.iter().enumerate() {
        for b in 0..BLOCKS {
            e.write_block(0, BlockId(b as u32), &vec![byte(p, b); BS as usize])
                .expect("fill");
        }
    }
    let mut decode = engine(Duration::from_millis(500));
    let peers: Vec<_> = producers
        .iter()
        .map(|p| {
            decode
                .add_peer(&p.local_metadata().expect("meta"))
                .expect("peer")
        })
        .collect();
    for p in producers.iter_mut() {
        let meta = decode.local_metadata().expect("meta");
        p.add_peer(&meta).expect("peer");
    }

    let mut out = Outcomes::default();
    let mut prod_out = Outcomes::default();
    let mut plan: HashMap<RequestId, Plan> = HashMap::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let start = Instant::now();
    let mut issued = 0u64;
    let mut reported = 0u64;
    let mut failed_innocent = Vec::new();
    let (mut finished, mut failed, mut aborted, mut on_stalled, mut corrupt) = (0, 0, 0, 0, 0);
    // Local blocks come from a pool and go back only when their request was
    // reported: no two requests in flight share a block.
    let mut free: Vec<u32> = (0..BLOCKS as u32).collect();
    while reported < REQUESTS {
        while issued < REQUESTS && decode.in_flight() < 64 && free.len() >= HANDLES {
            let id = RequestId(issued + 1);
            let first = (next() % PRODUCERS as u64) as usize;
            let used: Vec<usize> = (0..HANDLES).map(|h| (first + h * 2) % PRODUCERS).collect();
            let mut lens = Vec::new();
            let mut locals = Vec::new();
            let mut remotes = Vec::new();
            for &p in &used {
                let remote = next() % BLOCKS;
                let Some(local) = free.pop() else {
                    unreachable!("checked above")
                };
                lens.push((p, remote, local));
                locals.push([BlockId(local)]);
                remotes.push([BlockId(remote as u32)]);
            }
            let lends: Vec<_> = used
                .iter()
                .map(|&p| {
                    producers[p]
                        .lend(id, &[BlockId(0)], 1, Duration::from_secs(60))
                        .expect("lend")
                })
                .collect();
            let transfers: Vec<Transfer> = used
                .iter()
                .enumerate()
                .map(|(i, &p)| Transfer {
                    peer: peers[p],
                    local: &locals[i],
                    remote: &remotes[i],
                    lend: lends[i],
                })
                .collect();
            decode.read(id, &transfers).expect("read");
            let abort = next() % 50 == 0;
            if abort {
                decode.abort(id).expect("abort");
            }
            plan.insert(id, (used, abort, lens));
            issued += 1;
            if issued == REQUESTS / 2 {
                producers[STALLED]
                    .stall(Duration::from_secs(2))
                    .expect("stall");
            }
        }
        out.clear();
        decode.poll(&mut out);
        for p in producers.iter_mut() {
            prod_out.clear();
            p.poll(&mut prod_out);
        }
        for &id in &out.finished_recving {
            reported += 1;
            finished += 1;
            let (_, _, lens) = &plan[&id];
            let mut buf = vec![0u8; BS as usize];
            for &(p, remote, local) in lens {
                decode
                    .read_block(0, BlockId(local), &mut buf)
                    .expect("read back");
                if buf.iter().any(|&b| b != byte(p, remote)) {
                    corrupt += 1;
                }
                free.push(local);
            }
        }
        for f in &out.failed_recving {
            reported += 1;
            failed += 1;
            let (used, was_aborted, lens) = &plan[&f.id];
            free.extend(lens.iter().map(|&(_, _, local)| local));
            if *was_aborted {
                aborted += 1;
            } else if used.contains(&STALLED) {
                on_stalled += 1;
            } else {
                failed_innocent.push((f.id, f.reason));
            }
        }
        if start.elapsed() > Duration::from_secs(120) {
            eprintln!("gave up after 120 s: {reported} of {REQUESTS} reported");
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let deadline_or_stalled = failed_innocent
        .iter()
        .filter(|(_, r)| matches!(r.cause, Cause::PeerStalled | Cause::Deadline))
        .count();
    println!(
        "requests {REQUESTS} x {HANDLES} handles over {PRODUCERS} producers, rank {STALLED} stalled 2 s mid-run, read deadline 500 ms"
    );
    println!(
        "finished {finished}, failed {failed}: aborted {aborted}, on the stalled rank {on_stalled}, others {} ({} of them PeerStalled/Deadline)",
        failed_innocent.len(),
        deadline_or_stalled
    );
    println!("corrupted finished blocks: {corrupt}");
    println!("elapsed {:.1} s", start.elapsed().as_secs_f64());
    for (id, r) in failed_innocent.iter().take(5) {
        println!("  innocent failure: {id:?} {r:?}");
    }
    if !failed_innocent.is_empty() || corrupt != 0 {
        std::process::exit(1);
    }
}
