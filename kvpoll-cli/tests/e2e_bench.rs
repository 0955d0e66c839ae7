//! The end-to-end comparison runs against real peer processes and produces
//! figures (no timing is asserted: benches measure, tests check they run).

use std::path::Path;

use kvpoll_cli::bench::e2e::{compare, E2eConfig};

fn small(tls: &str) -> E2eConfig {
    E2eConfig {
        tls: tls.into(),
        reads: 300,
        requests: 8,
        runs: 1,
        ..E2eConfig::default()
    }
}

#[test]
fn e2e_comparison_over_tcp_produces_positive_rates_for_both_sides() {
    let f = compare(Path::new(env!("CARGO_BIN_EXE_kvpoll")), &small("tcp")).unwrap();
    assert!(
        f.reads.kvpoll_per_s > 0.0 && f.reads.raw_per_s > 0.0,
        "{f:?}"
    );
    assert!(f.requests.kvpoll_per_s > 0.0 && f.requests.raw_per_s > 0.0);
    assert_eq!(f.kvpoll_read_latency_ns.len(), 300);
    // With read confirmation, against the peer that lends each id.
    assert!(f.confirm_reads.confirmed_per_s > 0.0 && f.confirm_requests.confirmed_per_s > 0.0);
    assert_eq!(f.confirmed_read_latency_ns.len(), 300);
    assert_eq!(f.raw_read_latency_ns.len(), 300);
    assert!(f.to_json().starts_with("{\"tls\":\"tcp\""));
}

#[test]
fn e2e_comparison_reports_a_peer_that_cannot_start() {
    let err = compare(Path::new("/nonexistent/kvpoll"), &small("tcp")).unwrap_err();
    assert!(err.to_string().contains("spawning"), "{err}");
}

mod compare {
    use std::path::Path;

    use kvpoll_cli::bench::shapes::{
        run_group, Group, Link, Memory, Op, Peers, RoundSize, KVPOLL, KVPOLL_SERVING,
        KVPOLL_UNCONFIRMED, LAYERS, MEMCPY, NIXL, PVREADV, RAW, SMALL, TCP_STREAM,
    };

    fn exe() -> &'static Path {
        Path::new(env!("CARGO_BIN_EXE_kvpoll"))
    }

    #[test]
    fn small_reads_of_caller_memory_run_every_local_system_and_check_their_bytes() {
        let mut g = Group::new(SMALL, Link::Shm, "posix,sysv,cma", Memory::Caller, Op::Read);
        g.requests = 256;
        // A round: 256 reads' bytes, however short.
        let size = RoundSize {
            min_bytes: 256.0 * 16384.0,
            min_secs: 0.0,
        };
        let f = run_group(exe(), &g, &Peers::default(), 1, size).unwrap();
        for s in [
            KVPOLL,
            KVPOLL_SERVING,
            KVPOLL_UNCONFIRMED,
            RAW,
            PVREADV,
            MEMCPY,
        ] {
            let s = f.get(s).unwrap_or_else(|| panic!("{s} missing: {f:?}"));
            assert!(s.per_s > 0.0 && s.cpu_s_per_gb > 0.0, "{s:?}");
            // A round of 256 requests or more, every 64th checked.
            assert!(s.checked >= 4 && s.bad == 0, "{s:?}");
        }
        // No Python given: the peers are said not to be measured, and why.
        let (_, why) = f.absent.iter().find(|(s, _)| s == NIXL).unwrap();
        assert!(why.contains("make bench-peers"), "{why}");
        let json = f.to_json();
        assert!(json.contains("{\"system\":\"NIXL\",\"why\":"), "{json}");
        assert!(json.contains("\"failed\":[]"), "{json}");
    }

    #[test]
    fn a_multi_layer_push_over_tcp_is_checked_by_its_destination() {
        let mut g = Group::new(LAYERS, Link::Loopback, "", Memory::Ucx, Op::Write);
        g.requests = 8;
        // Checked every 4th here (the shape's every 32nd would check none
        // of a round this short): what is asked is that the destination
        // checks, not how often.
        g.shape.check_every = 4;
        let size = RoundSize {
            min_bytes: 8.0 * 8.0 * 1048576.0,
            min_secs: 0.0,
        };
        let f = run_group(exe(), &g, &Peers::default(), 1, size).unwrap();
        let k = f.get(KVPOLL).unwrap();
        assert!(k.gb_per_s > 0.0, "{k:?}");
        assert!(k.checked >= 1 && k.bad == 0, "{k:?}");
        assert!(f.get(TCP_STREAM).is_some_and(|l| l.gb_per_s > 0.0));
        assert!(f.failed.is_empty(), "{:?}", f.failed);
    }
}
