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
