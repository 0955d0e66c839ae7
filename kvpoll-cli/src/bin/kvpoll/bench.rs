//! `kvpoll bench [all|ledger|engine|e2e|trace]`: the comparison figures, each measured in one
//! run against its baseline. With no word (or `all`) the whole suite runs
//! and prints one table.

use std::path::Path;
use std::time::{Duration, Instant};

use kvpoll::engine::IdlePolicy;
use kvpoll_cli::bench::e2e::{self as bench_e2e, E2eConfig, E2eFigures};
use kvpoll_cli::bench::engine as engine_bench;
use kvpoll_cli::bench::ledger::{compare, BenchConfig, Schedule};

use crate::cli::{
    BenchArgs, BenchWhat, CliError, CompareArgs, E2eArgs, JsonArgs, SuiteArgs, TraceArgs,
};
use crate::compare::Comparison;
use crate::report::{human, json_text, num, Curves, Met, Row, Verdict};

/// Interleaved runs of each tracker (about 25 ms a pair here).
const RUNS: u32 = 31;
/// Rounds of the hand-off figures (round trips, then completions) and
/// completions a round: 20 000 completions in all.
const HANDOFF_ROUNDS: usize = 50;
const HANDOFF_PER_ROUND: usize = 400;

/// The Python reference, carried inside the binary so that `kvpoll bench`
/// runs from anywhere.
const VLLM_STYLE_PY: &str = include_str!("../../../benches/reference/vllm_style.py");

fn failed(e: impl std::fmt::Display) -> CliError {
    CliError::Failed(e.to_string())
}

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
                tracing::warn!(tls = %cfg.tls, "e2e did not run: {e}");
                last = Some(e);
            }
        }
    }
    Err(CliError::Failed(
        last.map_or_else(|| "no transports".into(), |e| e.to_string()),
    ))
}

/// Runs the Python reference over the ledger bench's trace; completions/s,
/// or why it is unavailable.
fn python_reference(config: BenchConfig) -> Result<f64, String> {
    let dir = std::env::temp_dir().join(format!("kvpoll-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("temp dir: {e}"))?;
    let result = (|| {
        let trace = dir.join("trace.txt");
        let script = dir.join("vllm_style.py");
        write_trace(config, &trace)?;
        std::fs::write(&script, VLLM_STYLE_PY).map_err(|e| format!("writing the script: {e}"))?;
        let out = std::process::Command::new("python3")
            .arg(&script)
            .arg("--trace")
            .arg(&trace)
            .output()
            .map_err(|e| format!("python3 not runnable: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "python3 failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        json_number(&text, "completions_per_s").ok_or_else(|| format!("python3 printed {text:?}"))
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn write_trace(config: BenchConfig, path: &Path) -> Result<(), String> {
    let s = Schedule::new(config).map_err(|e| e.to_string())?;
    let file = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    s.write_trace(&mut w)
        .and_then(|_| std::io::Write::flush(&mut w))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// The number after `"key":` in a flat JSON object.
fn json_number(text: &str, key: &str) -> Option<f64> {
    let at = text.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = text[at..].trim_start();
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || "+-.eE".contains(c)))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Everything `bench all` measured.
pub struct Suite {
    rows: Vec<Row>,
    compare: Option<Comparison>,
    e2e: Option<E2eFigures>,
    completion_visible_ns: Vec<u64>,
    cache_line_ns: Vec<u64>,
    seconds: f64,
}

fn suite(tls: Option<&str>, with_compare: Option<Option<&Path>>) -> Result<Suite, CliError> {
    let t0 = Instant::now();
    let mut rows = Vec::new();
    let cfg = BenchConfig::default();

    let ledger = compare(cfg, RUNS).map_err(failed)?;
    rows.push(Row {
        key: "ledger_vs_locked".into(),
        figure: "handle completions/s, ledger vs Mutex<HashMap>".into(),
        unit: "/s",
        kvpoll: Some(ledger.ledger_completions_per_s),
        baseline_name: "Mutex+HashMap".into(),
        baseline: Some(ledger.locked_completions_per_s),
        ratio: Some(ledger.ratio),
        spread: None,
        target: ">= 10x",
        met: (ledger.ratio >= 10.0).into(),
        note: format!("median of {RUNS} interleaved runs"),
    });
    let (py, py_note) = match python_reference(cfg) {
        Ok(v) => (Some(v), "same trace, one engine step per window".to_owned()),
        Err(why) => (None, format!("unavailable: {why}")),
    };
    let py_ratio = py.map(|p| ledger.ledger_completions_per_s / p);
    rows.push(Row {
        key: "ledger_vs_python".into(),
        figure: "handle completions/s, ledger vs vLLM-style Python".into(),
        unit: "/s",
        kvpoll: Some(ledger.ledger_completions_per_s),
        baseline_name: "Python dict of handle lists".into(),
        baseline: py,
        ratio: py_ratio,
        spread: None,
        target: ">= 200x",
        met: py_ratio.map(|r| r >= 200.0).into(),
        note: py_note,
    });

    let handoff = engine_bench::handoff(HANDOFF_ROUNDS, 2_000, HANDOFF_PER_ROUND);
    let (rtt, pinned) = (handoff.round_trip_p50(), handoff.pinned);
    let cv = handoff.samples();
    let p50 = engine_bench::quantile(&cv, 0.5);
    // Round-trip samples for the CDF: one per round.
    let cache_line_ns: Vec<u64> = handoff.round_trip_ns.iter().map(|&ns| ns as u64).collect();
    let r = handoff.ratio_p50();
    rows.push(Row {
        key: "completion_visible_vs_cache_line".into(),
        figure: "completion -> visible p50 vs cache-line round trip".into(),
        unit: "ns",
        kvpoll: Some(p50),
        baseline_name: "cache-line round trip".into(),
        baseline: Some(rtt),
        ratio: Some(r),
        spread: None,
        target: "<= 1.5x",
        met: (r <= 1.5).into(),
        note: format!(
            "ratio: median over {HANDOFF_ROUNDS} rounds of each round's p50 / its round trip, same two threads; pinned: {pinned}"
        ),
    });
    let poll = engine_bench::poll_idle(2_000_000).map_err(failed)?;
    rows.push(Row {
        key: "poll_idle_ns".into(),
        figure: "Engine::poll, nothing new".into(),
        unit: "ns",
        kvpoll: Some(poll),
        baseline_name: "".into(),
        baseline: None,
        ratio: None,
        spread: None,
        target: "<= 20 ns",
        met: (poll <= 20.0).into(),
        note: String::new(),
    });

    let e2e = e2e(tls).map_err(|e| {
        tracing::warn!("e2e figures unavailable: {e}");
        format!("e2e did not run: {e}")
    });
    // The rows of the e2e figures: judged, or failed with why.
    let e2e_met = |judged: Option<bool>| match &e2e {
        Ok(_) => Met::from(judged),
        Err(why) => Met::Failed(why.clone()),
    };
    for (key, figure, pick) in [
        (
            "e2e_single_block_reads",
            "16 KiB reads/s, 64 in flight, 2 processes",
            (|f: &E2eFigures| f.reads) as fn(&E2eFigures) -> bench_e2e::Rates,
        ),
        (
            "e2e_64_block_requests",
            "64 x 16 KiB requests/s, 4 in flight, 2 processes",
            |f: &E2eFigures| f.requests,
        ),
    ] {
        let rates = e2e.as_ref().ok().map(pick);
        rows.push(Row {
            key: key.into(),
            figure: figure.into(),
            unit: "/s",
            kvpoll: rates.map(|r| r.kvpoll_per_s),
            baseline_name: "raw UCX loop".into(),
            baseline: rates.map(|r| r.raw_per_s),
            ratio: rates.map(|r| r.kvpoll_per_s / r.raw_per_s),
            spread: None,
            target: "overhead <= 10 % (>= 0.91x)",
            met: e2e_met(rates.map(|r| r.overhead_pct <= 10.0)),
            note: match &e2e {
                Ok(f) => format!("over {}; overhead {:.1} %", f.tls, pick(f).overhead_pct),
                Err(why) => why.clone(),
            },
        });
    }

    for (key, figure, baseline_name, pick) in [
        (
            "confirm_single_block_reads",
            "16 KiB reads/s, read confirmation on vs off",
            "kvpoll, confirm_reads(false)",
            (|f: &E2eFigures| f.confirm_reads) as fn(&E2eFigures) -> bench_e2e::ConfirmCost,
        ),
        (
            "confirm_64_block_requests",
            "64 x 16 KiB requests/s, read confirmation on vs off",
            "kvpoll, confirm_reads(false)",
            |f: &E2eFigures| f.confirm_requests,
        ),
        (
            "confirm_single_block_reads_same_lends",
            "16 KiB reads/s, read confirmation on vs off, both of lends",
            "kvpoll, confirm_reads(false), same lends",
            |f: &E2eFigures| f.confirm_reads_same_lends,
        ),
        (
            "confirm_64_block_requests_same_lends",
            "64 x 16 KiB requests/s, read confirmation on vs off, both of lends",
            "kvpoll, confirm_reads(false), same lends",
            |f: &E2eFigures| f.confirm_requests_same_lends,
        ),
    ] {
        let c = e2e.as_ref().ok().map(pick);
        rows.push(Row {
            key: key.into(),
            figure: figure.into(),
            unit: "/s",
            kvpoll: c.map(|c| c.confirmed_per_s),
            baseline_name: baseline_name.into(),
            baseline: c.map(|c| c.unconfirmed_per_s),
            ratio: c.map(|c| c.ratio),
            spread: None,
            target: "(measured, no target)",
            met: e2e_met(None),
            note: match (&e2e, c) {
                (Ok(f), Some(c)) => format!(
                    "over {}; {:+.2} us per request ({:.2}x the raw loop's rate); the producer lends each id",
                    f.tls,
                    c.us_per_request,
                    if key.starts_with("confirm_single_block_reads") {
                        c.confirmed_per_s / f.reads.raw_per_s
                    } else {
                        c.confirmed_per_s / f.requests.raw_per_s
                    }
                ),
                (Err(why), _) => why.clone(),
                (Ok(_), None) => "unavailable".into(),
            },
        });
    }

    let quiet = Duration::from_secs(1);
    let adaptive = engine_bench::idle_cpu(IdlePolicy::Adaptive, quiet).map_err(failed)?;
    let busy = engine_bench::idle_cpu(IdlePolicy::Busy, quiet).map_err(failed)?;
    let pct = |x: Option<f64>| x.map(|v| v * 100.0);
    rows.push(Row {
        key: "idle_cpu_pct".into(),
        figure: "idle CPU of the poller, adaptive vs busy policy".into(),
        unit: "% core",
        kvpoll: pct(adaptive),
        baseline_name: "busy-poll thread".into(),
        baseline: pct(busy),
        ratio: adaptive.zip(busy).map(|(a, b)| a / b),
        spread: None,
        target: "<= 2 % of a core",
        met: adaptive.map(|a| a <= 0.02).into(),
        note: "one quiet second each".into(),
    });
    let quiet = Duration::from_millis(20);
    let park = engine_bench::park_unpark(20, quiet);
    let park50 = engine_bench::quantile(&park, 0.5);
    let wake = engine_bench::wake_up(20, quiet).map_err(failed)?;
    let w50 = engine_bench::quantile(&wake, 0.5);
    rows.push(Row {
        key: "wake_up_us".into(),
        figure: "wake-up on a submit after 20 ms quiet, p50".into(),
        unit: "us",
        kvpoll: Some(w50 / 1e3),
        baseline_name: "thread park/unpark".into(),
        baseline: Some(park50 / 1e3),
        ratio: Some(w50 / park50),
        spread: None,
        target: "<= 20 us, <= 2x park/unpark",
        met: (w50 <= 20_000.0 && w50 <= 2.0 * park50).into(),
        note: format!(
            "engine -> poller -> engine; p99 {:.1} us (park/unpark p99 {:.1} us), 20 samples",
            engine_bench::quantile(&wake, 0.99) / 1e3,
            engine_bench::quantile(&park, 0.99) / 1e3
        ),
    });
    let remote_tls = tls.unwrap_or("posix,sysv,cma");
    rows.push(remote_wake_row(
        "remote_wake_up_us",
        "wake-up on a remote notification after 20 ms quiet, p50",
        engine_bench::remote_wake_up(20, quiet, remote_tls),
        "peer's notify_only -> lend released (2 wake-ups: peer, then this poller)",
        remote_tls,
        park50,
    ));
    rows.push(remote_wake_row(
        "remote_wake_up_direct_us",
        "wake-up on a remote notification alone, p50",
        engine_bench::remote_wake_up_direct(20, quiet, remote_tls),
        "a UCX sender's notification -> lend released (1 kvpoll wake-up; over tcp UCX's async thread relays it)",
        remote_tls,
        park50,
    ));
    let compare = match with_compare {
        Some(python) => {
            let c = crate::compare::run(&CompareArgs {
                shm: "posix,sysv,cma".into(),
                rounds: 3,
                scale: 1.0,
                peers_python: python.map(Path::to_path_buf),
                ..CompareArgs::default()
            })?;
            rows.extend(c.rows());
            Some(c)
        }
        None => None,
    };
    Ok(Suite {
        rows,
        compare,
        e2e: e2e.ok(),
        completion_visible_ns: cv,
        cache_line_ns,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

fn print_table(s: &Suite) {
    println!(
        "{:<58} {:>14} {:>14} {:>19}  {:<28} met",
        "figure", "kvpoll", "baseline", "ratio (spread)", "target"
    );
    for r in &s.rows {
        let ratio = match (r.ratio.filter(|x| x.is_finite()), r.spread) {
            (Some(x), Some((lo, hi))) => format!("{x:.2}x ({lo:.2}-{hi:.2})"),
            (Some(x), None) => format!("{x:.2}x"),
            (None, _) => "-".into(),
        };
        println!(
            "{:<58} {:>14} {:>14} {:>19}  {:<28} {}",
            r.figure,
            human(r.kvpoll, r.unit),
            if r.baseline_name.is_empty() {
                "-".into()
            } else {
                human(r.baseline, r.unit)
            },
            ratio,
            r.target,
            r.met.word()
        );
    }
    println!("\nbaselines and notes:");
    for r in &s.rows {
        if !r.baseline_name.is_empty() || !r.note.is_empty() {
            let failed = match &r.met {
                Met::Failed(why) => format!(" -- FAILED: {why}"),
                _ => String::new(),
            };
            println!(
                "  {:<34} baseline: {}; {}{failed}",
                r.key, r.baseline_name, r.note
            );
        }
    }
    if let Some(c) = &s.compare {
        c.print_groups();
    }
    println!("\n{}", s.verdict().line());
    println!("suite ran in {:.1} s", s.seconds);
}

fn print_json(s: &Suite) {
    let rows: Vec<String> = s
        .rows
        .iter()
        .map(|r| {
            format!(
                "\"{}\":{{\"figure\":\"{}\",\"unit\":\"{}\",\"kvpoll\":{},\"baseline\":\"{}\",\"baseline_value\":{},\"ratio\":{},\"ratio_min\":{},\"ratio_max\":{},\"target\":\"{}\",\"met\":{},\"failed\":{},\"note\":\"{}\"}}",
                r.key,
                json_text(&r.figure),
                r.unit,
                num(r.kvpoll),
                json_text(&r.baseline_name),
                num(r.baseline),
                num(r.ratio),
                num(r.spread.map(|s| s.0)),
                num(r.spread.map(|s| s.1)),
                r.target,
                match r.met {
                    Met::Yes => "true",
                    Met::Missed => "false",
                    Met::NotJudged | Met::Failed(_) => "null",
                },
                match &r.met {
                    Met::Failed(why) => format!("\"{}\"", json_text(why)),
                    _ => "null".into(),
                },
                json_text(&r.note)
            )
        })
        .collect();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "{{\"cores\":{cores},\"load_average\":\"{}\",\"seconds\":{:.1},\"verdict\":{},\"e2e\":{},\"compare\":{},{}}}",
        load_average(),
        s.seconds,
        s.verdict().to_json(),
        s.e2e.as_ref().map_or("null".into(), |f| f.to_json()),
        s.compare.as_ref().map_or("null".into(), Comparison::to_json),
        rows.join(",")
    );
}

pub fn run(args: BenchArgs) -> Result<(), CliError> {
    match args.what.unwrap_or(BenchWhat::All(args.all)) {
        BenchWhat::All(SuiteArgs {
            json,
            tls,
            svg,
            no_compare,
            peers_python,
        }) => {
            let load = load_average();
            let s = suite(
                tls.as_deref(),
                (!no_compare).then_some(peers_python.as_deref()),
            )?;
            if json {
                print_json(&s);
            } else {
                print_table(&s);
                println!("load average at the start: {load}");
            }
            if let Some(path) = svg {
                crate::plot::cdf(&path, &s.curves()).map_err(failed)?;
                eprintln!("kvpoll: latency CDFs written to {}", path.display());
                if let Some(c) = &s.compare {
                    let p = compare_svg_path(&path);
                    c.svg(&p).map_err(failed)?;
                    eprintln!("kvpoll: the comparison written to {}", p.display());
                }
            }
            s.verdict().result()?;
        }
        BenchWhat::Compare(args) if args.peer_netns.is_some() => {
            // One group inside a network namespace, for the process that
            // made the link: its figures as lines, no table.
            crate::compare::run_linked_group(&args)?;
        }
        BenchWhat::Compare(args) => {
            let load = load_average();
            let t0 = Instant::now();
            let c = crate::compare::run(&args)?;
            let (json, svg) = (args.json, args.svg);
            let s = Suite {
                rows: c.rows(),
                compare: Some(c),
                e2e: None,
                completion_visible_ns: Vec::new(),
                cache_line_ns: Vec::new(),
                seconds: t0.elapsed().as_secs_f64(),
            };
            if json {
                print_json(&s);
            } else {
                print_table(&s);
                println!("load average at the start: {load}");
            }
            if let (Some(path), Some(c)) = (svg, &s.compare) {
                c.svg(&path).map_err(failed)?;
                eprintln!("kvpoll: the comparison written to {}", path.display());
            }
            s.verdict().result()?;
        }
        BenchWhat::Rails(a) => crate::rails::run_bench(&a)?,
        BenchWhat::Trace(TraceArgs { out }) => {
            write_trace(BenchConfig::default(), &out).map_err(CliError::Failed)?;
        }
        BenchWhat::Ledger(JsonArgs { json }) => {
            let t = compare(BenchConfig::default(), RUNS).map_err(failed)?;
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
        BenchWhat::Engine(JsonArgs { json }) => {
            let f = engine_bench::measure(HANDOFF_ROUNDS, HANDOFF_PER_ROUND).map_err(failed)?;
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
        BenchWhat::E2e(E2eArgs { json, tls }) => {
            let f = e2e(tls.as_deref())?;
            if json {
                println!("{}", f.to_json());
            } else {
                println!(
                    "transports: {}\nsingle-block reads: kvpoll {:.0}/s, raw UCX {:.0}/s, overhead {:.1} % (target <= 10 %)\n{}-block requests: kvpoll {:.0}/s, raw UCX {:.0}/s, overhead {:.1} %",
                    f.tls,
                    f.reads.kvpoll_per_s,
                    f.reads.raw_per_s,
                    f.reads.overhead_pct,
                    E2eConfig::default().request_blocks,
                    f.requests.kvpoll_per_s,
                    f.requests.raw_per_s,
                    f.requests.overhead_pct
                );
                for (what, c) in [
                    ("single-block reads", f.confirm_reads),
                    ("requests", f.confirm_requests),
                    ("single-block reads, same lends", f.confirm_reads_same_lends),
                    ("requests, same lends", f.confirm_requests_same_lends),
                ] {
                    println!(
                        "read confirmation, {what}: {:.0}/s with, {:.0}/s without ({:.2}x, {:+.2} us per request)",
                        c.confirmed_per_s, c.unconfirmed_per_s, c.ratio, c.us_per_request
                    );
                }
            }
        }
    }
    Ok(())
}

/// `/proc/loadavg`'s three averages.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// `cdf.svg` -> `cdf-compare.svg`.
fn compare_svg_path(p: &Path) -> std::path::PathBuf {
    let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or("bench");
    p.with_file_name(format!("{stem}-compare.svg"))
}

impl Suite {
    /// The verdict of its rows, and of the comparison's groups.
    fn verdict(&self) -> Verdict<'_> {
        let groups = self
            .compare
            .as_ref()
            .map_or_else(Vec::new, Comparison::failed_groups);
        Verdict::of(&self.rows, groups)
    }

    fn curves(&self) -> Vec<Curves<'_>> {
        let mut v = vec![Curves {
            title: "completion -> visible vs cache-line round trip",
            unit: "ns",
            series: vec![
                ("kvpoll completion -> visible", &self.completion_visible_ns),
                ("cache-line round trip", &self.cache_line_ns),
            ],
        }];
        if let Some(f) = &self.e2e {
            v.push(Curves {
                title: "16 KiB read latency, 64 in flight, 2 processes",
                unit: "ns",
                series: vec![
                    ("kvpoll read (submit -> visible)", &f.kvpoll_read_latency_ns),
                    (
                        "kvpoll confirmed read (submit -> visible)",
                        &f.confirmed_read_latency_ns,
                    ),
                    ("raw UCX get (post -> completion)", &f.raw_read_latency_ns),
                ],
            });
        }
        v
    }
}

/// A remote wake-up row: its samples' p50 against the park/unpark p50
/// (`park50`, ns), or why it could not be measured.
fn remote_wake_row(
    key: &'static str,
    figure: &'static str,
    samples: Result<Vec<u64>, kvpoll_cli::RunError>,
    what: &str,
    tls: &str,
    park50: f64,
) -> Row {
    let (p50, note, failed) = match samples {
        Ok(r) => (
            Some(engine_bench::quantile(&r, 0.5)),
            format!(
                "{what}, over {tls}; p99 {:.1} us, {} samples",
                engine_bench::quantile(&r, 0.99) / 1e3,
                r.len()
            ),
            None,
        ),
        Err(e) => {
            let why = format!("did not run: {e}");
            (None, why.clone(), Some(why))
        }
    };
    Row {
        key: key.into(),
        figure: figure.into(),
        unit: "us",
        kvpoll: p50.map(|v| v / 1e3),
        baseline_name: "thread park/unpark".into(),
        baseline: Some(park50 / 1e3),
        ratio: p50.map(|v| v / park50),
        spread: None,
        target: "<= 2x park/unpark",
        met: failed.map_or_else(|| p50.map(|v| v <= 2.0 * park50).into(), Met::Failed),
        note,
    }
}
