//! `kvpoll bench ledger|engine [--json]`: the comparison figures, measured
//! in one run against their baselines.

use kvpoll::engine_bench;
use kvpoll::ledger::bench::{compare, BenchConfig};

use crate::cli::{Args, CliError};

/// Interleaved runs of each tracker (about 25 ms a pair here).
const RUNS: u32 = 31;

pub fn run(mut args: Args) -> Result<(), CliError> {
    let what = args
        .command()
        .map_err(|_| CliError::MissingValue("bench".into()))?;
    let json = args.flag("--json");
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
        other => {
            return Err(CliError::BadValue {
                option: "bench".into(),
                value: other.to_owned(),
                expected: "ledger or engine",
            })
        }
    }
    Ok(())
}
