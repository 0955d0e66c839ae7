//! `kvpoll bench ledger|engine [--json]`: the comparison figures, measured
//! in one run against their baselines.

use kvpoll::bench_e2e::{self, E2eConfig, E2eFigures};
use kvpoll::engine_bench;
use kvpoll::ledger::bench::{compare, BenchConfig};

use crate::cli::{Args, CliError};

/// Shared memory first (both processes are on this machine); tcp when UCX
/// cannot use it here. `tls` forces one list.
fn e2e(tls: Option<&str>) -> Result<E2eFigures, CliError> {
    let exe = std::env::current_exe()
        .map_err(|e| CliError::Failed(format!("locating the kvpoll binary: {e}")))?;
    let lists = match tls {
        Some(t) => vec![t.to_owned()],
        None => vec!["posix,sysv,cma".to_owned(), "tcp".to_owned()],
    };
    let mut last = None;
    for t in lists {
        let cfg = E2eConfig {
            tls: t,
            ..E2eConfig::default()
        };
        match bench_e2e::compare(&exe, &cfg) {
            Ok(f) => return Ok(f),
            Err(e) => {
                eprintln!("kvpoll: e2e over {} did not run: {e}", cfg.tls);
                last = Some(e);
            }
        }
    }
    Err(CliError::Failed(
        last.map_or_else(|| "no transports".into(), |e| e.to_string()),
    ))
}

/// Interleaved runs of each tracker (about 25 ms a pair here).
const RUNS: u32 = 31;

pub fn run(mut args: Args) -> Result<(), CliError> {
    let what = args
        .command()
        .map_err(|_| CliError::MissingValue("bench".into()))?;
    let json = args.flag("--json");
    let tls: Option<String> = args.option("--tls", "a UCX transport list")?;
    args.finish()?;
    match what.as_str() {
        "ledger" => {
            let t = compare(BenchConfig::default(), RUNS)
                .map_err(|e| CliError::Failed(e.to_string()))?;
            if json {
                println!("{}", t.to_json());
            } else {
                println!(
                    "ledger: {:.1} M completions/s\nlocked: {:.1} M completions/s\nratio:  {:.2}x  ({} completions a run, median of {} runs each)",
                    t.ledger_completions_per_s / 1e6,
                    t.locked_completions_per_s / 1e6,
                    t.ratio,
                    t.completions,
                    t.runs
                );
            }
        }
        "engine" => {
            let f = engine_bench::measure(20_000).map_err(|e| CliError::Failed(e.to_string()))?;
            if json {
                println!("{}", f.to_json());
            } else {
                println!(
                    "cache-line round trip:        {:8.0} ns\ncompletion -> visible p50:    {:8.0} ns ({:.2}x the round trip; target <= 1.5x)\ncompletion -> visible p99:    {:8.0} ns\nEngine::poll, nothing new:    {:8.1} ns (target <= 20 ns)\nthreads pinned:               {}",
                    f.cache_line_round_trip_ns,
                    f.completion_visible_p50_ns,
                    f.ratio_p50,
                    f.completion_visible_p99_ns,
                    f.poll_idle_ns,
                    f.pinned
                );
            }
        }
        "e2e" => {
            let f = e2e(tls.as_deref())?;
            if json {
                println!("{}", f.to_json());
            } else {
                println!(
                    "transports: {}\nsingle-block reads: kvpoll {:.0}/s, raw UCX {:.0}/s, overhead {:.1} % (target <= 10 %)\n{}-block requests: kvpoll {:.0}/s, raw UCX {:.0}/s, overhead {:.1} %",
                    f.tls, f.reads.kvpoll_per_s, f.reads.raw_per_s, f.reads.overhead_pct,
                    E2eConfig::default().request_blocks,
                    f.requests.kvpoll_per_s, f.requests.raw_per_s, f.requests.overhead_pct
                );
            }
        }
        other => {
            return Err(CliError::BadValue {
                option: "bench".into(),
                value: other.to_owned(),
                expected: "ledger, engine or e2e",
            })
        }
    }
    Ok(())
}
