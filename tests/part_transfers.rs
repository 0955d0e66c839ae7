//! Part-of-block transfers over real UCX, in one process: engines whose
//! blocks differ in size (tensor-parallel ranks holding different shares
//! of each block's heads) move byte ranges of every block, and bad ranges
//! are refused with a typed error that changes nothing.

use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, Outcomes, SubmitError, Transfer};
use kvpoll::ledger::{BlockId, Incarnation, PeerId, RequestId};
use kvpoll::transport::ucx::ContextOptions;

/// One head's bytes of a block (the smallest block here).
const HEAD: u64 = 512;
const BLOCKS: u64 = 8;
const REGIONS: usize = 2;
const GUARD: Duration = Duration::from_secs(60);
const LEASE: Duration = Duration::from_secs(30);

fn engine(heads: u64) -> Engine {
    let mut e = Engine::builder()
        .block_size(heads * HEAD)
        .ucx(ContextOptions::with_transports("tcp"))
        .read_deadline(GUARD)
        .build()
        .expect("engine");
    for _ in 0..REGIONS {
        e.register(BLOCKS).unwrap();
    }
    e
}

/// The byte at `at` of a block: differs between engines, regions and blocks.
fn byte(tag: u8, region: usize, block: u32, at: usize) -> u8 {
    (tag as usize * 131 + region * 37 + block as usize * 17 + at * 7 % 251) as u8
}

fn fill(e: &Engine, tag: u8) {
    let bs = e.block_size() as usize;
    for r in 0..REGIONS {
        for b in 0..BLOCKS as u32 {
            let buf: Vec<u8> = (0..bs).map(|i| byte(tag, r, b, i)).collect();
            e.write_block(r, BlockId(b), &buf).unwrap();
        }
    }
}

fn block(e: &Engine, region: usize, b: u32) -> Vec<u8> {
    let mut buf = vec![0u8; e.block_size() as usize];
    e.read_block(region, BlockId(b), &mut buf).unwrap();
    buf
}

fn ids(v: &[u32]) -> Vec<BlockId> {
    v.iter().map(|&b| BlockId(b)).collect()
}

fn wait_for(engines: &mut [&mut Engine], out: &mut [Outcomes], done: impl Fn(&[Outcomes]) -> bool) {
    let t = Instant::now();
    while !done(out) {
        for (e, o) in engines.iter_mut().zip(out.iter_mut()) {
            e.poll(o);
        }
        assert!(t.elapsed() < GUARD, "timed out: {out:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn has(o: &Outcomes, list: fn(&Outcomes) -> &[RequestId], id: RequestId) -> bool {
    list(o).contains(&id)
}

/// Two ranks of one head each lend; one engine of two heads reads each
/// rank's head into its place in every block of every region.
#[test]
fn a_two_head_reader_gathers_each_head_from_its_own_rank() {
    let mut p0 = engine(1);
    let mut p1 = engine(1);
    let mut d = engine(2);
    fill(&p0, 1);
    fill(&p1, 2);
    fill(&d, 3);
    let a = d
        .add_peer_any_block_size(&p0.local_metadata().unwrap())
        .unwrap();
    let b = d
        .add_peer_any_block_size(&p1.local_metadata().unwrap())
        .unwrap();
    let id = RequestId(7);
    let (remote0, remote1, local) = (ids(&[3, 5]), ids(&[6, 0]), ids(&[1, 4]));
    let lend0 = p0.lend(id, &remote0, 1, LEASE).unwrap();
    let lend1 = p1.lend(id, &remote1, 1, LEASE).unwrap();
    let handles = [
        Transfer {
            peer: a,
            local: &local,
            remote: &remote0,
            lend: lend0,
        }
        .part(0..HEAD, 0..HEAD),
        Transfer {
            peer: b,
            local: &local,
            remote: &remote1,
            lend: lend1,
        }
        .part(HEAD..2 * HEAD, 0..HEAD),
    ];
    d.read_parts(id, &handles, None).unwrap();
    let mut out = vec![
        Outcomes::default(),
        Outcomes::default(),
        Outcomes::default(),
    ];
    wait_for(&mut [&mut d, &mut p0, &mut p1], &mut out, |o| {
        has(&o[0], |o| &o.finished_recving, id)
            && has(&o[1], |o| &o.finished_sending, id)
            && has(&o[2], |o| &o.finished_sending, id)
    });
    assert!(out[0].failed_recving.is_empty(), "{:?}", out[0]);
    let h = HEAD as usize;
    for r in 0..REGIONS {
        for (i, &l) in local.iter().enumerate() {
            let got = block(&d, r, l.0);
            assert_eq!(
                &got[..h],
                &block(&p0, r, remote0[i].0)[..],
                "head 0, region {r}"
            );
            assert_eq!(
                &got[h..],
                &block(&p1, r, remote1[i].0)[..],
                "head 1, region {r}"
            );
        }
        // A block nobody read is untouched.
        let untouched: Vec<u8> = (0..2 * h).map(|i| byte(3, r, 2, i)).collect();
        assert_eq!(block(&d, r, 2), untouched);
    }
}

/// One rank of two heads lends to two readers of one head each: each
/// reads its head out of every block, and the lend ends after both.
#[test]
fn two_one_head_readers_each_take_their_head_of_one_lend() {
    let mut p = engine(2);
    let mut d0 = engine(1);
    let mut d1 = engine(1);
    fill(&p, 4);
    let meta = p.local_metadata().unwrap();
    let a = d0.add_peer_any_block_size(&meta).unwrap();
    let b = d1.add_peer_any_block_size(&meta).unwrap();
    let id = RequestId(9);
    let remote = ids(&[2, 7, 1]);
    let local = ids(&[0, 1, 2]);
    let lend = p.lend(id, &remote, 2, LEASE).unwrap();
    for (d, peer, head) in [(&mut d0, a, 0), (&mut d1, b, 1)] {
        let t = Transfer {
            peer,
            local: &local,
            remote: &remote,
            lend,
        };
        d.read_parts(id, &[t.part(0..HEAD, head * HEAD..(head + 1) * HEAD)], None)
            .unwrap();
    }
    let mut out = vec![
        Outcomes::default(),
        Outcomes::default(),
        Outcomes::default(),
    ];
    wait_for(&mut [&mut p, &mut d0, &mut d1], &mut out, |o| {
        has(&o[0], |o| &o.finished_sending, id)
            && has(&o[1], |o| &o.finished_recving, id)
            && has(&o[2], |o| &o.finished_recving, id)
    });
    let h = HEAD as usize;
    for r in 0..REGIONS {
        for (i, &l) in local.iter().enumerate() {
            let whole = block(&p, r, remote[i].0);
            assert_eq!(block(&d0, r, l.0), &whole[..h], "head 0, region {r}");
            assert_eq!(block(&d1, r, l.0), &whole[h..], "head 1, region {r}");
        }
    }
}

/// A write of part of each block lands in that part of the destination's
/// blocks and nowhere else.
#[test]
fn a_part_write_lands_in_its_range_only() {
    let mut p = engine(1);
    let mut d = engine(2);
    fill(&p, 5);
    fill(&d, 6);
    let to_d = p
        .add_peer_any_block_size(&d.local_metadata().unwrap())
        .unwrap();
    let writer = d
        .add_peer_any_block_size(&p.local_metadata().unwrap())
        .unwrap();
    let id = RequestId(11);
    let (src, dst) = (ids(&[4]), ids(&[6]));
    let dest = d.receive_from(id, &dst, &[writer], LEASE).unwrap();
    let t = Transfer {
        peer: to_d,
        local: &src,
        remote: &dst,
        lend: dest,
    };
    p.write_parts(id, &[t.part(0..HEAD, HEAD..2 * HEAD)], 1, LEASE)
        .unwrap();
    let mut out = vec![Outcomes::default(), Outcomes::default()];
    wait_for(&mut [&mut p, &mut d], &mut out, |o| {
        has(&o[0], |o| &o.finished_sending, id) && has(&o[1], |o| &o.finished_recving, id)
    });
    let h = HEAD as usize;
    for r in 0..REGIONS {
        let got = block(&d, r, 6);
        let before: Vec<u8> = (0..h).map(|i| byte(6, r, 6, i)).collect();
        assert_eq!(&got[..h], &before[..], "the other head, region {r}");
        assert_eq!(
            &got[h..],
            &block(&p, r, 4)[..],
            "the written head, region {r}"
        );
    }
}

/// Empty, unequal, out-of-block ranges, whole blocks of different sizes
/// and parts for a peer never added: each a typed error, nothing started.
#[test]
fn bad_parts_are_refused_and_change_nothing() {
    let p = engine(1);
    let mut d = engine(2);
    let peer = d
        .add_peer_any_block_size(&p.local_metadata().unwrap())
        .unwrap();
    let (l, r) = (ids(&[1]), ids(&[1]));
    let t = Transfer {
        peer,
        local: &l,
        remote: &r,
        lend: Incarnation(0x5eed),
    };
    let cases = [
        (0..0, 0..0, "an empty byte range"),
        (
            0..HEAD,
            0..HEAD - 1,
            "the local and remote ranges differ in length",
        ),
        (
            HEAD..3 * HEAD,
            0..2 * HEAD,
            "the local range ends past this engine's block size",
        ),
        (
            0..2 * HEAD,
            0..2 * HEAD,
            "the remote range ends past the peer's block size",
        ),
        (
            HEAD..2 * HEAD,
            1..HEAD + 1,
            "the remote range ends past the peer's block size",
        ),
    ];
    for (i, (local, remote, why)) in cases.into_iter().enumerate() {
        let got = d.read_parts(
            RequestId(i as u64),
            &[t.part(local.clone(), remote.clone())],
            None,
        );
        match got {
            Err(SubmitError::BadPart {
                handle: 0,
                local: gl,
                remote: gr,
                why: w,
            }) => {
                assert_eq!((gl, gr, w), (local, remote, why));
            }
            other => panic!("{local:?}, {remote:?}: {other:?}"),
        }
    }
    assert!(matches!(
        d.read(RequestId(20), &[t]),
        Err(SubmitError::BadPart { handle: 0, .. })
    ));
    let stranger = Transfer {
        peer: PeerId(peer.0 + 1),
        ..t
    };
    assert!(matches!(
        d.read_parts(RequestId(21), &[stranger.part(0..HEAD, 0..HEAD)], None),
        Err(SubmitError::UnknownPeer { handle: 0, .. })
    ));
    assert!(matches!(
        d.read_parts(RequestId(22), &[], None),
        Err(SubmitError::NoHandles)
    ));
    // Nothing was started: the same ids are free, a valid part goes in.
    assert_eq!(d.in_flight(), 0);
    d.read_parts(RequestId(0), &[t.part(0..HEAD, 0..HEAD)], None)
        .unwrap();
    assert_eq!(d.in_flight(), 1);
    d.abort(RequestId(0)).unwrap();
}
