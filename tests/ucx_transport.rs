//! The UCX transport under the protocol core, over real UCX in one process:
//! what a forced close keeps alive, and what a foreign peer cannot do to a
//! poller.

mod common;

use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, Outcomes};
use kvpoll::ledger::{BlockId, PeerId, RequestId};
use kvpoll::metadata::PeerMetadata;
use kvpoll::notification::{NoteKind, Notification};
use kvpoll::transport::ucx::{ContextOptions, Endpoint, UcxTransport, Worker, NOTIFY_AM_ID};
use kvpoll::transport::{Direction, Ep, Transport, TransportEvent, CANCELED};

const BS: u64 = 4096;
const BLOCKS: u64 = 64;
const GUARD: Duration = Duration::from_secs(10);

fn transport() -> (UcxTransport, PeerMetadata) {
    let mut t = UcxTransport::new(&ContextOptions::with_transports("tcp"), BS).unwrap();
    // SAFETY: no caller memory: UCX allocates the region.
    unsafe { t.register(BLOCKS, (BLOCKS * BS) as usize, None).unwrap() };
    let meta = PeerMetadata::decode(&t.metadata(7).unwrap()).unwrap();
    (t, meta)
}

/// Remote keys must outlive every operation that uses them. A
/// forced close keeps the connection (its rkeys and endpoint) until UCX
/// completed the close; only then are they released. Here the target is
/// never progressed, so over tcp the gets stay outstanding until the forced
/// close cancels them.
#[test]
fn a_force_closed_connection_keeps_its_rkeys_until_the_close_completed() {
    let (mut a, _) = transport();
    let (_b, b_meta) = transport();
    let peer = PeerId(0);
    a.add_peer(peer, &b_meta).unwrap();
    let ep = Ep {
        peer,
        generation: 1,
    };
    // Remote blocks apart, so that every pair is an operation of its own.
    let pairs: Vec<(BlockId, BlockId)> = (0..32).map(|i| (BlockId(i), BlockId(2 * i))).collect();
    let posted = a.post(ep, Direction::Get, &pairs, 42).unwrap();
    assert_eq!(posted, 32);
    a.close(ep);
    assert!(
        a.closing(),
        "the closed connection (and its rkeys) must be kept until the close completes"
    );
    let (mut completed, mut cancelled) = (0, 0);
    let t = Instant::now();
    while a.closing() || completed < posted {
        a.progress();
        a.drain(&mut |ev| {
            if let TransportEvent::Completion { token, status } = ev {
                assert_eq!(token, 42);
                completed += 1;
                if status == CANCELED {
                    cancelled += 1;
                }
            }
        });
        if !a.closing() {
            // Released only now: every operation on it has completed.
            assert_eq!(
                completed, posted,
                "rkeys released with operations outstanding"
            );
        }
        assert!(t.elapsed() < GUARD, "the close never completed");
    }
    assert!(
        cancelled > 0,
        "the target was never progressed: gets must be cancelled"
    );
    // The closed generation refuses more work; a newer one connects afresh.
    assert_eq!(a.flush(ep, 1), Err(CANCELED));
    assert_eq!(
        a.post(ep, Direction::Get, &pairs[..1], 43)
            .map_err(|f| f.status),
        Err(CANCELED)
    );
}

/// A rendezvous active message is UCX's to release. A foreign peer
/// sending the notification id large (rendezvous) messages — here with a
/// well-formed read-done inside — neither crashes the poller (a double
/// release) nor counts as a notification; the engine goes on working.
#[test]
fn rendezvous_messages_to_the_notification_id_are_refused_and_released_once() {
    let mut p = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports("tcp"))
        .build()
        .unwrap();
    p.register(BLOCKS).unwrap();
    let id = RequestId(5);
    let lend = p.lend(id, &[BlockId(1)], 1, GUARD).unwrap();
    let meta = PeerMetadata::decode(&p.local_metadata().unwrap()).unwrap();

    let ctx =
        kvpoll::transport::ucx::Context::new(&ContextOptions::with_transports("tcp")).unwrap();
    let w = Worker::new(&ctx).unwrap();
    let ep = Endpoint::connect(&w, &meta.worker, 1).unwrap();
    let note = Notification {
        kind: NoteKind::ReadDone,
        id,
        incarnation: lend,
        nonce: kvpoll::Incarnation(6),
        sender: 99,
        blocks: kvpoll::notification::BlocksRead::of(std::iter::once(BlockId(1))),
    }
    .encode();
    // Sealed when the suite runs keyed: refused for how it came, not for
    // want of a tag.
    let mut seal = common::RawSeal::new();
    let mut sent = Vec::new();
    for i in 0..20u64 {
        let message = seal.wrap(meta.instance, &note);
        ep.send_active_message_rendezvous(NOTIFY_AM_ID, &message, i)
            .unwrap();
        sent.push(i);
    }
    let mut done = Vec::new();
    let t = Instant::now();
    while done.len() < sent.len() {
        w.progress();
        w.take_completions(&mut done);
        assert!(t.elapsed() < GUARD, "the rendezvous sends never completed");
    }
    let mut out = Outcomes::default();
    p.poll(&mut out);
    assert!(
        out.is_empty(),
        "a rendezvous message released the lend: {out:?}"
    );
    assert_eq!(p.in_flight(), 1);

    // The same note, sent as kvpoll sends it, releases it.
    let message = seal.wrap(meta.instance, &note);
    ep.send_active_message(NOTIFY_AM_ID, &message, 100).unwrap();
    let t = Instant::now();
    while out.finished_sending.is_empty() {
        w.progress();
        p.poll(&mut out);
        assert!(t.elapsed() < GUARD, "the poller stopped working: {out:?}");
    }
    assert_eq!(out.finished_sending, vec![id]);
}

/// The mapping of `/proc/self/smaps` that holds `addr`: its header line
/// (range, permissions, … path) and its fields.
fn mapping_of(addr: usize) -> (String, String) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut current: Option<(String, String)> = None;
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = head.split_once('-') {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                if let Some(found) = current.take() {
                    return found;
                }
                if (lo..hi).contains(&addr) {
                    current = Some((line.to_owned(), String::new()));
                }
                continue;
            }
        }
        if let Some((_, fields)) = current.as_mut() {
            fields.push_str(line);
            fields.push('\n');
        }
    }
    current.expect("the region's mapping")
}

/// Where UCX moves one-sided operations on one host through cma (UCX 1.20
/// and later, with rendezvous off), a region the engine allocates is
/// anonymous memory asked to be on huge pages: cma pins every page it
/// copies. Elsewhere it is UCX's shared-memory segment, which a reader on
/// the host maps and reads directly.
#[test]
fn a_region_the_engine_allocates_is_anonymous_huge_page_memory_where_cma_moves_it() {
    let options = ContextOptions::with_transports("posix,sysv,cma");
    let by_cma = kvpoll::transport::ucx::Context::new(&options)
        .unwrap()
        .reads_by_cma();
    assert_eq!(by_cma, cfg!(ucx_cma_with_peer_errors));
    let mut t = UcxTransport::new(&options, BS).unwrap();
    // SAFETY: no caller memory: the transport allocates the region.
    let (base, len) = unsafe { t.register(BLOCKS, (BLOCKS * BS) as usize, None).unwrap() };
    assert!(len >= (BLOCKS * BS) as usize);
    let (head, fields) = mapping_of(base);
    let path = head.split_whitespace().nth(5).unwrap_or("");
    if by_cma {
        assert_eq!(path, "", "not an anonymous mapping: {head}");
        // `hg`: the mapping carries MADV_HUGEPAGE (proc(5), VmFlags).
        let flags = fields
            .lines()
            .find_map(|l| l.strip_prefix("VmFlags:"))
            .unwrap_or("");
        assert!(
            flags.split_whitespace().any(|f| f == "hg"),
            "huge pages not asked for: {head}\n{fields}"
        );
    } else {
        assert_ne!(path, "", "UCX's shared memory has a name: {head}");
    }
}

/// Posts `pairs` as a get on `t` and collects the statuses of its
/// completions, progressing `t` alone, for `within` at most.
fn get_alone(
    t: &mut UcxTransport,
    ep: Ep,
    pairs: &[(BlockId, BlockId)],
    within: Duration,
) -> (u32, Vec<i8>) {
    let posted = t.post(ep, Direction::Get, pairs, 42).unwrap();
    let mut statuses = Vec::new();
    let start = Instant::now();
    while statuses.len() < posted as usize && start.elapsed() < within {
        t.progress();
        t.drain(&mut |ev| {
            if let TransportEvent::Completion { token: 42, status } = ev {
                statuses.push(status);
            }
        });
    }
    (posted, statuses)
}

/// A lender on this host offers the memory it registered (not UCX's) to
/// direct reads: a reader's get of it completes while the lender never
/// progresses, with the lender's bytes; bytes past its region are refused
/// with `INVALID_PARAM`. On a UCX that gives `cma` no lane beside peer
/// error handling, the same get without direct reads waits for the
/// lender's progress (UCX emulates it there), so it is the direct read
/// that completed it.
#[test]
fn a_get_of_caller_memory_on_this_host_completes_while_its_lender_never_progresses() {
    use kvpoll::transport::ucx::UserMemory;
    use kvpoll::transport::INVALID_PARAM;
    let len = (BLOCKS * BS) as usize;
    let mut mem: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
    let run = |direct: bool, within: Duration, mem: &mut Vec<u8>| {
        let options = ContextOptions::with_transports("posix,sysv,cma").direct_reads(direct);
        let mut lender = UcxTransport::new(&options, BS).unwrap();
        // SAFETY: `mem` outlives the lender, which drops at the end of
        // this closure.
        let host = UserMemory::Host(mem.as_mut_ptr() as usize);
        unsafe { lender.register(BLOCKS, len, Some(host)).unwrap() };
        let meta = PeerMetadata::decode(&lender.metadata(7).unwrap()).unwrap();
        // The offer names the process either way (its peers on this host
        // check it lives); regions only when direct reads are asked.
        let offered = meta.direct.as_ref().map(|d| !d.regions.is_empty());
        assert_eq!(offered, Some(direct), "regions offered only when asked");
        let mut reader = UcxTransport::new(&options, BS).unwrap();
        // SAFETY: no caller memory.
        let (base, rlen) = unsafe { reader.register(BLOCKS, len, None).unwrap() };
        reader.add_peer(PeerId(0), &meta).unwrap();
        let ep = Ep {
            peer: PeerId(0),
            generation: 1,
        };
        let pairs = [
            (BlockId(0), BlockId(5)),
            (BlockId(1), BlockId(6)),
            (BlockId(9), BlockId(2)),
        ];
        let (posted, statuses) = get_alone(&mut reader, ep, &pairs, within);
        // SAFETY: the reader's region, mapped while it lives; its gets
        // completed (or are checked not to have).
        let got = unsafe { std::slice::from_raw_parts(base as *const u8, rlen) };
        let same = |l: u64, r: u64| {
            got[(l * BS) as usize..((l + 1) * BS) as usize]
                == mem[(r * BS) as usize..((r + 1) * BS) as usize]
        };
        let landed = statuses.len() == posted as usize
            && statuses.iter().all(|&s| s == 0)
            && pairs
                .iter()
                .all(|&(l, r)| same(u64::from(l.0), u64::from(r.0)));
        let past = reader
            .post(
                ep,
                Direction::Get,
                &[(BlockId(3), BlockId(BLOCKS as u32))],
                43,
            )
            .map_err(|f| f.status);
        // What is still out is cancelled before the transports go.
        reader.close(ep);
        let t = Instant::now();
        while reader.closing() && t.elapsed() < GUARD {
            reader.progress();
            reader.drain(&mut |_| {});
        }
        (landed, past)
    };
    let (landed, past) = run(true, GUARD, &mut mem);
    assert!(landed, "the direct read did not land the lender's bytes");
    assert_eq!(past, Err(INVALID_PARAM), "a read past the region");
    if !cfg!(ucx_cma_with_peer_errors) {
        let (landed, past) = run(false, Duration::from_millis(300), &mut mem);
        assert!(
            !landed,
            "without direct reads this UCX emulates the get through the lender's progress"
        );
        assert_eq!(past, Err(INVALID_PARAM), "UCX refuses it too");
    }
}

/// A reader of a lender on this host whose regions and lend words UCX
/// allocated in shared memory (the lend words always; the engine's own
/// regions on UCX 1.13) copies them through the mapping UCX made of them
/// here: a get completes, with the lender's bytes, and a lend word reads
/// back, in the drain right after the post, without the reader ever
/// progressing its worker; bytes past the region are refused with
/// `INVALID_PARAM`, nothing copied. With mapped reads off the same get
/// goes through UCX and lands the same bytes. (Where the engine allocates
/// its regions itself, for `cma`, UCX maps no region: direct reads take
/// it, or with those off UCX's get, and then the words are got through
/// UCX too: a reader that loaded its words beside UCX's `cma` gets
/// aborted in UCX 1.22 when its worker was destroyed.)
#[test]
fn a_get_of_ucx_allocated_memory_on_this_host_is_copied_through_its_mapping() {
    use kvpoll::ledger::Incarnation;
    use kvpoll::transport::{lend_word_of, INVALID_PARAM, T_WORD};
    // A word read's token, as the core makes them.
    const WORD: u64 = 43 | T_WORD;
    let mapped_here = !cfg!(ucx_cma_with_peer_errors);
    for (mapped, direct) in [(true, true), (false, true), (true, false)] {
        // Direct reads take the regions the engine maps itself (UCX 1.20
        // and later); UCX's segments are left to mapped reads or UCX.
        let options = ContextOptions::with_transports("posix,sysv,cma")
            .mapped_reads(mapped)
            .direct_reads(direct);
        // Words are loaded only where no read of the connection goes
        // through UCX's gets (UCX 1.22 aborted at teardown otherwise).
        let words_loaded = mapped && (mapped_here || direct);
        let mut lender = UcxTransport::new(&options, BS).unwrap();
        let len = (BLOCKS * BS) as usize;
        // SAFETY: no caller memory: the transport allocates the region.
        let (lbase, llen) = unsafe { lender.register(BLOCKS, len, None).unwrap() };
        // SAFETY: the lender's region, mapped while it lives.
        let src = unsafe { std::slice::from_raw_parts_mut(lbase as *mut u8, llen) };
        for (i, b) in src.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let inc = Incarnation(0x5eed_0000_0000_0041);
        let words = lender.lend_words().expect("lend words over shared memory");
        let w = lend_word_of(inc, words.len()).unwrap();
        words.set(w, inc.0);
        let meta = PeerMetadata::decode(&lender.metadata(7).unwrap()).unwrap();
        let mut reader = UcxTransport::new(&options, BS).unwrap();
        // SAFETY: no caller memory.
        let (base, rlen) = unsafe { reader.register(BLOCKS, len, None).unwrap() };
        reader.add_peer(PeerId(0), &meta).unwrap();
        let ep = Ep {
            peer: PeerId(0),
            generation: 1,
        };
        let pairs = [
            (BlockId(0), BlockId(5)),
            (BlockId(1), BlockId(6)),
            (BlockId(9), BlockId(2)),
        ];
        let posted = reader.post(ep, Direction::Get, &pairs, 42).unwrap();
        assert_eq!(
            reader.mapped_reads_of(PeerId(0)),
            (usize::from(mapped && mapped_here), words_loaded),
            "the region and words mapped here (mapped reads {mapped})"
        );
        let (mut statuses, mut word) = (Vec::new(), None);
        let drain =
            |reader: &mut UcxTransport, statuses: &mut Vec<i8>, word: &mut Option<(i8, u64)>| {
                reader.drain(&mut |ev| match ev {
                    TransportEvent::Completion { token: 42, status } => statuses.push(status),
                    TransportEvent::Word {
                        token: WORD,
                        status,
                        word: v,
                    } => *word = Some((status, v)),
                    _ => {}
                })
            };
        drain(&mut reader, &mut statuses, &mut word);
        let at_once = statuses.len() == posted as usize;
        if mapped && mapped_here {
            assert!(
                at_once,
                "a mapped get completes when it is posted: {statuses:?}"
            );
        }
        let start = Instant::now();
        while statuses.len() < posted as usize && start.elapsed() < GUARD {
            reader.progress();
            drain(&mut reader, &mut statuses, &mut word);
        }
        assert!(statuses.iter().all(|&s| s == 0), "{statuses:?}");
        assert_eq!(statuses.len(), posted as usize);
        // SAFETY: the reader's region, mapped while it lives; its gets
        // completed.
        let got = unsafe { std::slice::from_raw_parts(base as *const u8, rlen) };
        for &(l, r) in &pairs {
            let (l, r) = (l.0 as usize * BS as usize, r.0 as usize * BS as usize);
            assert!(
                got[l..l + BS as usize] == src[r..r + BS as usize],
                "block {r} of the lender did not land (mapped reads {mapped})"
            );
        }
        reader.read_word(ep, inc, WORD).unwrap();
        drain(&mut reader, &mut statuses, &mut word);
        if words_loaded {
            assert_eq!(
                word,
                Some((0, inc.0)),
                "a mapped word is loaded when it is read"
            );
        }
        let start = Instant::now();
        while word.is_none() && start.elapsed() < GUARD {
            reader.progress();
            drain(&mut reader, &mut statuses, &mut word);
        }
        assert_eq!(
            word,
            Some((0, inc.0)),
            "the lend word (mapped reads {mapped})"
        );
        let past = reader
            .post(
                ep,
                Direction::Get,
                &[(BlockId(3), BlockId(BLOCKS as u32))],
                44,
            )
            .map_err(|f| f.status);
        assert_eq!(
            past,
            Err(INVALID_PARAM),
            "a read past the region (mapped reads {mapped})"
        );
        reader.close(ep);
        let t = Instant::now();
        while reader.closing() && t.elapsed() < GUARD {
            reader.progress();
            reader.drain(&mut |_| {});
        }
    }
}

/// A lender of caller memory (`blocks` of `bs` bytes, byte `i` holding
/// `i % modulus`) that offers direct reads, and a reader of as many blocks
/// of its own connected to it as peer 0.
struct DirectPair {
    // Field order is drop order: both transports before the memory.
    reader: UcxTransport,
    _lender: UcxTransport,
    mem: Vec<u8>,
    /// The reader's region: base address and length.
    landed: (usize, usize),
    bs: usize,
}

const DIRECT_EP: Ep = Ep {
    peer: PeerId(0),
    generation: 1,
};

fn direct_pair(blocks: u64, bs: u64, modulus: usize) -> DirectPair {
    use kvpoll::transport::ucx::UserMemory;
    let len = (blocks * bs) as usize;
    let mut mem: Vec<u8> = (0..len).map(|i| (i % modulus) as u8).collect();
    let options = ContextOptions::with_transports("posix,sysv,cma");
    let mut lender = UcxTransport::new(&options, bs).unwrap();
    let host = UserMemory::Host(mem.as_mut_ptr() as usize);
    // SAFETY: `mem` outlives the lender (field order of `DirectPair`), and
    // moving the vector does not move its heap buffer.
    unsafe { lender.register(blocks, len, Some(host)).unwrap() };
    let meta = PeerMetadata::decode(&lender.metadata(7).unwrap()).unwrap();
    assert!(meta.direct.is_some(), "the lender offers direct reads");
    let mut reader = UcxTransport::new(&options, bs).unwrap();
    // SAFETY: no caller memory.
    let landed = unsafe { reader.register(blocks, len, None).unwrap() };
    reader.add_peer(PeerId(0), &meta).unwrap();
    DirectPair {
        reader,
        _lender: lender,
        mem,
        landed,
        bs: bs as usize,
    }
}

impl DirectPair {
    /// Asserts that every (local, remote) pair's remote block landed in
    /// its local block.
    fn assert_landed(&self, pairs: &[(BlockId, BlockId)]) {
        // SAFETY: the reader's region, mapped while it lives; its reads ended.
        let landed =
            unsafe { std::slice::from_raw_parts(self.landed.0 as *const u8, self.landed.1) };
        let bs = self.bs;
        for &(l, r) in pairs {
            let (l, r) = (l.0 as usize * bs, r.0 as usize * bs);
            assert!(
                landed[l..l + bs] == self.mem[r..r + bs],
                "remote block {} did not land",
                r / bs
            );
        }
    }

    fn close(&mut self) {
        self.reader.close(DIRECT_EP);
        let t = Instant::now();
        while self.reader.closing() && t.elapsed() < GUARD {
            self.reader.progress();
            self.reader.drain(&mut |_| {});
        }
    }
}

/// Direct reads posted to one lender before the reader next progresses
/// are read together (one system call) and each still completes with its
/// own token, its own operation count and its own bytes.
#[test]
fn direct_reads_posted_together_complete_each_with_its_own_token_and_bytes() {
    let mut pair = direct_pair(BLOCKS, BS, 241);
    let reader = &mut pair.reader;
    let posts: [(u64, &[(BlockId, BlockId)]); 3] = [
        (50, &[(BlockId(0), BlockId(7))]),
        (51, &[(BlockId(1), BlockId(3)), (BlockId(2), BlockId(4))]),
        (52, &[(BlockId(5), BlockId(60)), (BlockId(9), BlockId(1))]),
    ];
    let mut expected = std::collections::HashMap::new();
    for (token, pairs) in posts {
        let n = reader
            .post(DIRECT_EP, Direction::Get, pairs, token)
            .unwrap();
        expected.insert(token, n as usize);
    }
    assert_eq!(expected[&51], 1, "consecutive blocks are one run");
    let mut got: std::collections::HashMap<u64, Vec<i8>> = Default::default();
    reader.progress();
    reader.drain(&mut |ev| {
        if let TransportEvent::Completion { token, status } = ev {
            got.entry(token).or_default().push(status);
        }
    });
    for (token, n) in &expected {
        assert_eq!(
            got.get(token).map(|s| s.len()),
            Some(*n),
            "token {token}: {got:?}"
        );
        assert!(got[token].iter().all(|&s| s == 0), "token {token}: {got:?}");
    }
    for (_, pairs) in posts {
        pair.assert_landed(pairs);
    }
    pair.close();
}

/// One progress reads at most a few MiB of direct reads (a whole post's
/// run of a region at least), in post order; the rest waits for the next
/// progress, and a drain reads none. So the first of two large reads
/// completes (and is confirmed and reported, in the poller's turn) before
/// the second is copied, instead of both ending together: two 8 MiB
/// requests in flight kept the copy going only so.
#[test]
fn direct_reads_past_one_progress_budget_complete_in_post_order_over_several_progresses() {
    let mut pair = direct_pair(16, 1 << 20, 251);
    // Three reads of 4 MiB each (4 blocks of 1 MiB, not consecutive on the
    // lender: 4 operations each).
    let posts: Vec<(u64, Vec<(BlockId, BlockId)>)> = (0..3u32)
        .map(|p| {
            let pairs = (0..4u32)
                .map(|j| (BlockId(p * 4 + j), BlockId(15 - (p * 4 + j))))
                .collect();
            (80 + u64::from(p), pairs)
        })
        .collect();
    for (token, pairs) in &posts {
        pair.reader
            .post(DIRECT_EP, Direction::Get, pairs, *token)
            .unwrap();
    }
    let mut order: Vec<Vec<u64>> = Vec::new();
    let take = |reader: &mut UcxTransport, order: &mut Vec<Vec<u64>>| {
        let mut tokens = Vec::new();
        reader.drain(&mut |ev| {
            if let TransportEvent::Completion { token, status } = ev {
                assert_eq!(status, 0, "token {token}");
                tokens.push(token);
            }
        });
        tokens.dedup();
        order.push(tokens);
    };
    // A drain alone reads nothing.
    take(&mut pair.reader, &mut order);
    for _ in 0..3 {
        pair.reader.progress();
        take(&mut pair.reader, &mut order);
    }
    assert_eq!(
        order,
        vec![vec![], vec![80], vec![81], vec![82]],
        "one 4 MiB read a progress, in post order"
    );
    for (_, pairs) in &posts {
        pair.assert_landed(pairs);
    }
    pair.close();
}
