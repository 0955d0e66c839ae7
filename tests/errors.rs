//! Errors name the caller's values: the bytes given against the block size,
//! the region asked for against the regions there are, the transport list
//! against what UCX offers, the CPU against the machine's.

use kvpoll::{BlockId, ContextOptions, Engine, EngineError};

fn engine() -> Engine {
    Engine::builder()
        .block_size(4096)
        .ucx(ContextOptions::with_transports("tcp"))
        .build()
        .expect("engine")
}

fn build_error(builder: kvpoll::EngineBuilder) -> String {
    match builder.build() {
        Ok(_) => panic!("the engine was built"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn writing_more_bytes_than_a_block_names_the_bytes_and_the_block_size() {
    let mut e = engine();
    e.register(8).unwrap();
    let err = e.write_block(0, BlockId(0), &[1u8; 5000]).unwrap_err();
    assert!(matches!(err, EngineError::TooManyBytes { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("5000") && msg.contains("4096"), "{msg}");
    let mut out = [0u8; 4097];
    let msg = e
        .read_block(0, BlockId(0), &mut out)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("4097") && msg.contains("4096"), "{msg}");
    // A block past the region's end still says so.
    let msg = e
        .write_block(0, BlockId(8), &[1u8; 16])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("BlockId(8)") && msg.contains("8 blocks"),
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
            EngineError::NoSuchRegion {
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
fn a_transport_list_ucx_cannot_use_is_named_with_what_ucx_offers() {
    let msg = build_error(
        Engine::builder()
            .block_size(4096)
            .ucx(ContextOptions::with_transports("nonsense_tl")),
    );
    assert!(msg.contains("nonsense_tl"), "{msg}");
    // tcp over loopback is always there.
    assert!(msg.contains("tcp"), "{msg}");
}

#[test]
fn a_poller_cpu_the_machine_does_not_have_is_refused() {
    let msg = build_error(Engine::builder().block_size(4096).core(Some(999_999)));
    assert!(msg.contains("999999"), "{msg}");
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
