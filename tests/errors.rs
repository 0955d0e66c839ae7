//! Errors name the caller's values: the bytes given against the block size,
//! the region asked for against the regions there are, the transport list
//! against what UCX offers, the CPU against the machine's. Each phase has
//! its error type, and a stopped engine says so in each.

use kvpoll::transport::ucx::UcxError;
use kvpoll::{
    BlockId, BuildError, ContextOptions, Engine, Error, ErrorKind, PeerError, RegionError,
    RequestId, Stopped, SubmitError,
};

fn engine() -> Engine {
    Engine::builder()
        .block_size(4096)
        .ucx(ContextOptions::with_transports("tcp"))
        .build()
        .expect("engine")
}

fn build_error(builder: kvpoll::EngineBuilder) -> BuildError {
    match builder.build() {
        Ok(_) => panic!("the engine was built"),
        Err(e) => e,
    }
}

#[test]
fn writing_more_bytes_than_a_block_names_the_bytes_and_the_block_size() {
    let mut e = engine();
    e.register(8).unwrap();
    let err = e.write_block(0, BlockId(0), &[1u8; 5000]).unwrap_err();
    assert!(
        matches!(
            err,
            RegionError::TooManyBytes {
                given: 5000,
                block_size: 4096
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("5000 bytes") && msg.contains("4096 bytes"),
        "{msg}"
    );
    assert!(!msg.contains("out of range"), "{msg}");
    let mut out = [0u8; 4097];
    let msg = e
        .read_block(0, BlockId(0), &mut out)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("4097") && msg.contains("4096"), "{msg}");
}

#[test]
fn a_block_past_the_region_names_the_block_the_region_and_its_block_count() {
    let mut e = engine();
    e.register(8).unwrap();
    e.register(8).unwrap();
    let msg = e
        .write_block(1, BlockId(8), &[1u8; 16])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("block 8 ") && msg.contains("region 1 holds 8 blocks"),
        "{msg}"
    );
    let err = e
        .lend(
            RequestId(1),
            &[BlockId(3), BlockId(9)],
            1,
            std::time::Duration::from_secs(1),
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            SubmitError::BlockOutOfRange {
                block: BlockId(9),
                blocks: 8
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("block 9 ") && msg.contains("8 blocks"),
        "{msg}"
    );
}

#[test]
fn a_region_that_does_not_exist_is_named_with_the_regions_there_are() {
    let mut e = engine();
    e.register(8).unwrap();
    let mut out = [0u8; 4096];
    let err = e.read_block(7, BlockId(0), &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            RegionError::NoSuchRegion {
                region: 7,
                regions: 1
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("region 7") && msg.contains("1 region"),
        "{msg}"
    );
    assert!(!msg.contains("7 blocks"), "{msg}");
}

#[test]
fn caller_memory_of_part_of_a_block_names_its_bytes_and_the_block_size() {
    let mut e = engine();
    let mut memory = vec![0u8; 800];
    // SAFETY: refused before anything maps it; `memory` outlives `e`'s use.
    let err = unsafe { e.register_memory(memory.as_mut_ptr(), memory.len()) }.unwrap_err();
    assert!(
        matches!(
            err,
            RegionError::NotWholeBlocks {
                len: 800,
                block_size: 4096
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("800 bytes") && msg.contains("4096-byte"),
        "{msg}"
    );
    assert!(!msg.contains("0 blocks"), "{msg}");
    drop(e);
}

#[test]
fn regions_of_different_sizes_name_both_block_counts() {
    let mut e = engine();
    e.register(8).unwrap();
    let err = e.register(9).unwrap_err();
    assert!(
        matches!(
            err,
            RegionError::Uneven {
                blocks: 9,
                first: 8
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("9 blocks") && msg.contains("first, 8"),
        "{msg}"
    );
}

#[test]
fn a_duplicate_request_is_named_by_its_id() {
    let mut e = engine();
    e.register(8).unwrap();
    let lease = std::time::Duration::from_secs(5);
    e.lend(RequestId(77), &[BlockId(0)], 1, lease).unwrap();
    let err = e.lend(RequestId(77), &[BlockId(1)], 1, lease).unwrap_err();
    assert!(
        matches!(err, SubmitError::Duplicate(RequestId(77))),
        "{err:?}"
    );
    assert_eq!(err.to_string(), "request 77 is already in flight");
}

#[test]
fn a_transport_list_ucx_cannot_use_is_named_with_what_ucx_offers() {
    let err = build_error(
        Engine::builder()
            .block_size(4096)
            .ucx(ContextOptions::with_transports("nonsense_tl")),
    );
    assert!(
        matches!(&err, BuildError::Ucx(UcxError::NoUsableTransport { asked, .. }) if asked == "nonsense_tl"),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("nonsense_tl"), "{msg}");
    // tcp over loopback is always there.
    assert!(msg.contains("offers") && msg.contains("tcp"), "{msg}");
    assert!(!msg.contains("No such device"), "{msg}");
}

#[test]
fn a_poller_cpu_the_machine_does_not_have_is_refused_with_the_cpus_there_are() {
    let err = build_error(Engine::builder().block_size(4096).core(Some(999_999)));
    let BuildError::NoSuchCpu {
        core: 999_999,
        count,
        cpus,
    } = &err
    else {
        panic!("{err:?}");
    };
    let machine = kvpoll::placement::machine_cpus().expect("the machine's CPU list");
    assert_eq!(*count, machine.len());
    assert_eq!(*cpus, kvpoll::placement::format_cpu_list(&machine));
    let msg = err.to_string();
    assert!(
        msg.contains("CPU 999999")
            && msg.contains(&format!("it has {count} CPUs"))
            && msg.contains(cpus.as_str()),
        "{msg}"
    );
}

#[test]
fn a_zero_block_size_and_a_ring_without_room_name_what_was_given() {
    let err = build_error(Engine::builder().block_size(0));
    assert!(matches!(err, BuildError::BlockSize(0)), "{err:?}");
    assert!(err.to_string().contains("block size 0"), "{err}");
    let err = build_error(Engine::builder().command_ring(1));
    assert!(
        matches!(
            err,
            BuildError::RingTooSmall {
                ring: "command",
                entries: 1,
                min: 2
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("1 entries"), "{err}");
}

/// Every phase's error of a shut-down engine says it stopped, and one
/// `kvpoll::Error` of any of them says so too.
#[test]
fn a_shut_down_engine_says_so_in_every_phase() {
    let mut e = engine();
    e.register(8).unwrap();
    e.shutdown();
    let region = e.register(8).unwrap_err();
    assert!(
        matches!(region, RegionError::Stopped(Stopped::Shutdown)),
        "{region:?}"
    );
    let peer = e.local_metadata().unwrap_err();
    assert!(
        matches!(peer, PeerError::Stopped(Stopped::Shutdown)),
        "{peer:?}"
    );
    let submit = e.read(RequestId(1), &[]).unwrap_err();
    assert!(
        matches!(submit, SubmitError::Stopped(Stopped::Shutdown)),
        "{submit:?}"
    );
    assert_eq!(submit.to_string(), "the engine is shut down");
    for any in [Error::from(region), Error::from(peer), Error::from(submit)] {
        assert_eq!(any.stopped(), Some(Stopped::Shutdown), "{any:?}");
        assert_eq!(any.kind(), ErrorKind::Stopped, "{any:?}");
    }
    let refused = Error::from(SubmitError::NoRegions);
    assert_eq!(refused.stopped(), None);
    assert_eq!(refused.kind(), ErrorKind::Region);
}

/// A failure's transport status is typed: UCX's name and number, the
/// names as UCX's own headers give the numbers.
#[test]
fn a_failure_status_shows_the_name_ucx_gives_its_number() {
    use kvpoll::{Cause, Reason, Status};
    use ucx_sys::ucs_status_t as st;
    for (code, name) in [
        (st::UCS_OK, "UCS_OK"),
        (st::UCS_ERR_IO_ERROR, "UCS_ERR_IO_ERROR"),
        (st::UCS_ERR_INVALID_PARAM, "UCS_ERR_INVALID_PARAM"),
        (st::UCS_ERR_UNREACHABLE, "UCS_ERR_UNREACHABLE"),
        (st::UCS_ERR_NO_DEVICE, "UCS_ERR_NO_DEVICE"),
        (st::UCS_ERR_BUSY, "UCS_ERR_BUSY"),
        (st::UCS_ERR_CANCELED, "UCS_ERR_CANCELED"),
        (st::UCS_ERR_TIMED_OUT, "UCS_ERR_TIMED_OUT"),
        (st::UCS_ERR_REJECTED, "UCS_ERR_REJECTED"),
        (st::UCS_ERR_NOT_CONNECTED, "UCS_ERR_NOT_CONNECTED"),
        (st::UCS_ERR_CONNECTION_RESET, "UCS_ERR_CONNECTION_RESET"),
        (st::UCS_ERR_ENDPOINT_TIMEOUT, "UCS_ERR_ENDPOINT_TIMEOUT"),
    ] {
        let r = Reason::new(Cause::Transfer, code);
        assert_eq!((r.status.name(), r.status.code()), (name, code));
        assert_eq!(format!("{:?}", r.status), format!("{name} ({code})"));
    }
    assert_eq!(Reason::of(Cause::Deadline).status, Status::OK);
    assert_eq!(Status::new(-70).name(), "a UCX endpoint failure");
    assert_eq!(Status::new(-120).name(), "unknown");
}
