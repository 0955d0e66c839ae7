//! An engine built without remote writes (`EngineBuilder::remote_write`),
//! over real UCX through the public API: it opens no receive, and a peer
//! that writes into its lent blocks under a token it made up — what any
//! holder of its metadata can do — is refused where the transport lets
//! kvpoll refuse it (tcp alone: nothing lands, and the writer is never told
//! its write finished)
//! and lands where it cannot (shared memory: the writer's own copy).

mod common;

use std::time::Duration;

use kvpoll::engine::{Engine, ErrorKind, Outcomes, SubmitError};
use kvpoll::ledger::{BlockId, Incarnation, RequestId};
use kvpoll::transport::ucx::ContextOptions;

use common::{fill_block as fill, holds_block as holds, one, reported, try_wait as wait};

const BS: u64 = 4096;
const BLOCKS: u64 = 8;
/// The forged write's lease.
const LEASE: Duration = Duration::from_secs(2);
/// The lender's pattern, and the forger's.
const LENDER: u64 = 7;
const FORGER: u64 = 8;

fn engine(tls: &str, remote_write: bool) -> Engine {
    let mut e = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports(tls))
        .remote_write(remote_write)
        .build()
        .expect("engine");
    e.register(BLOCKS).unwrap();
    e
}

fn blocks(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().copied().map(BlockId).collect()
}

#[test]
fn a_receive_on_an_engine_without_remote_write_is_refused_remote_write_off_and_over_tcp_a_write_no_puts(
) {
    let mut e = engine("tcp", false);
    let mut peer = engine("tcp", true);
    let writer = e.add_peer(&peer.local_metadata().unwrap()).unwrap();
    let hour = Duration::from_secs(3600);
    let err = e.receive(RequestId(1), &blocks(&[0]), 1, hour).unwrap_err();
    assert!(matches!(err, SubmitError::RemoteWriteOff), "{err:?}");
    assert_eq!(kvpoll::Error::from(err).kind(), ErrorKind::Config);
    let err = e
        .receive_from(RequestId(2), &blocks(&[1]), &[writer], hour)
        .unwrap_err();
    assert!(matches!(err, SubmitError::RemoteWriteOff), "{err:?}");
    // Over tcp alone it has no UCX remote memory access: no puts either.
    let (local, remote) = (blocks(&[2]), blocks(&[2]));
    let err = e
        .write(
            RequestId(3),
            &one(writer, &local, &remote, Incarnation::draw()),
            1,
            hour,
        )
        .unwrap_err();
    assert!(matches!(err, SubmitError::NoPuts), "{err:?}");
    // Lending is what such an engine is for; nothing was taken.
    e.lend(RequestId(1), &blocks(&[0]), 1, hour).unwrap();
    assert_eq!(e.in_flight(), 1);
    // The same receive on an engine that allows remote writes opens.
    peer.receive(RequestId(1), &blocks(&[0]), 1, hour).unwrap();
}

/// A lender without remote writes, its blocks 0 and 1 lent under an hour's
/// lease, and a forger (an engine that allows writes, as any peer may be)
/// that writes its own pattern into them under a token it drew itself.
/// Returns the lender, what the forger was told of its write within twice
/// its lease, and the lend.
fn forged_write(tls: &str) -> (Engine, Outcomes, Incarnation) {
    let mut lender = engine(tls, false);
    for b in 0..BLOCKS as u32 {
        fill(&lender, LENDER, b);
    }
    let lend = lender
        .lend(RequestId(1), &blocks(&[0, 1]), 1, Duration::from_secs(3600))
        .unwrap();
    let mut forger = engine(tls, true);
    for b in 0..BLOCKS as u32 {
        fill(&forger, FORGER, b);
    }
    let peer = forger.add_peer(&lender.local_metadata().unwrap()).unwrap();
    let (local, remote) = (blocks(&[4, 5]), blocks(&[0, 1]));
    forger
        .write(
            RequestId(9),
            &one(peer, &local, &remote, Incarnation::draw()),
            1,
            LEASE,
        )
        .unwrap();
    let mut out = Outcomes::default();
    // Its lease, and then some: the lender's poller progresses meanwhile
    // (over tcp that is what applies a software put).
    let done = |o: &Outcomes| reported(o, RequestId(9));
    // Over tcp a put its target's UCX dropped is never acknowledged: the
    // write's flush waits, and nothing is reported while the peer stays.
    wait(&mut forger, &mut out, LEASE * 2, done);
    (lender, out, lend)
}

#[test]
fn over_tcp_a_peers_write_into_an_engine_without_remote_write_lands_nothing_and_never_finishes() {
    // UCX drops the put (no handler: its target has no RMA) and says so
    // on stderr with a backtrace; the writer never hears back.
    let (lender, out, _) = forged_write("tcp");
    assert!(
        !out.finished_sending.contains(&RequestId(9)),
        "the forger was told its write landed: {out:?}"
    );
    for b in [0, 1] {
        assert!(
            holds(&lender, b, LENDER, b),
            "block {b} of the lender holds what the forger wrote"
        );
    }
}

#[test]
fn over_shared_memory_a_peers_write_into_an_engine_without_remote_write_lands() {
    // The forger's own copy (cma's process_vm_writev, or its store into
    // UCX's segment mapped in its process): nothing of the lender's runs,
    // so nothing of the lender's can refuse it. The write still fails —
    // no receive takes its word — but its bytes are in the lent blocks.
    let (lender, out, _) = forged_write("posix,sysv,cma");
    assert!(reported(&out, RequestId(9)), "{out:?}");
    assert!(!out.finished_sending.contains(&RequestId(9)), "{out:?}");
    assert!(holds(&lender, 0, FORGER, 4) && holds(&lender, 1, FORGER, 5));
}

/// A writer that takes a lend's incarnation for a receive's (a mixed-up
/// router, a pull response read as a push one) writes into the lent
/// blocks: over shared memory its bytes land, but its word names the lend
/// it wrote into. The lender refuses the word (the write fails `NotLent`)
/// and takes no reader's word for that lend from then on: the honest
/// reader of the lend fails `NotLent`, never finished with the writer's
/// bytes.
#[test]
fn over_shared_memory_a_write_under_a_lends_incarnation_fails_that_lends_reader_not_lent() {
    let tls = "posix,sysv,cma";
    let mut lender = engine(tls, true);
    for b in 0..BLOCKS as u32 {
        fill(&lender, LENDER, b);
    }
    let lend = lender
        .lend(RequestId(1), &blocks(&[0, 1]), 1, Duration::from_secs(3600))
        .unwrap();
    let mut writer = engine(tls, true);
    for b in 0..BLOCKS as u32 {
        fill(&writer, FORGER, b);
    }
    let to_lender = writer.add_peer(&lender.local_metadata().unwrap()).unwrap();
    lender.add_peer(&writer.local_metadata().unwrap()).unwrap();
    let (local, remote) = (blocks(&[4, 5]), blocks(&[0, 1]));
    writer
        .write(
            RequestId(9),
            &one(to_lender, &local, &remote, lend),
            1,
            LEASE,
        )
        .unwrap();
    let mut out = Outcomes::default();
    assert!(wait(&mut writer, &mut out, LEASE * 2, |o| reported(
        o,
        RequestId(9)
    )));
    assert_eq!(
        out.failed_sending.first().map(|f| f.reason.cause),
        Some(kvpoll::Cause::NotLent),
        "{out:?}"
    );
    assert!(holds(&lender, 0, FORGER, 4), "the write did land");
    // The lend's reader reads the writer's bytes and must not be told
    // they are the lend's.
    let mut reader = engine(tls, true);
    let to_lender = reader.add_peer(&lender.local_metadata().unwrap()).unwrap();
    let (local, remote) = (blocks(&[2, 3]), blocks(&[0, 1]));
    reader
        .read(RequestId(1), &one(to_lender, &local, &remote, lend))
        .unwrap();
    let mut out = Outcomes::default();
    assert!(wait(&mut reader, &mut out, LEASE * 5, |o| reported(
        o,
        RequestId(1)
    )));
    assert!(
        !out.finished_recving.contains(&RequestId(1)),
        "the reader was told the writer's bytes were the lend's: {out:?}"
    );
    assert_eq!(out.failed_recving[0].reason.cause, kvpoll::Cause::NotLent);
}
