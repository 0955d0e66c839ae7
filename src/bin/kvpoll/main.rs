//! The `kvpoll` tool: `demo` (the main job), and a UCX peer process used by
//! the two-process tests.

mod bench;
mod cli;
mod demo;
mod peer;
mod plot;
mod topo;
mod transfer;

use std::process::ExitCode;

use cli::{Args, CliError};

const USAGE: &str = "\
usage: kvpoll <command> [options]

commands:
  demo                  move KV blocks between two UCX workers and report bytes and rate
        --tls LIST        UCX transports (default: posix,sysv,cma)
        --blocks N        blocks per round (default 4096)
        --block-size B    bytes per block (default 16384)
        --rounds N        rounds (default 8)
  bench [all|ledger|engine|e2e|trace]
                        measure against baselines in the same run (default: all,
                        the whole suite as one table, under 2 minutes)
        --json            one JSON object
        --svg FILE        (all) draw latency CDFs of kvpoll and its baselines
        --tls LIST        (all, e2e) UCX transports (default: posix,sysv,cma, then tcp)
        --out FILE        (trace) write the ledger bench's completion trace
  topo                  show CPUs, caches, NUMA nodes, NICs/GPUs and isolation; suggest a core map
        --check MAP       validate a core map (a path, or `auto`) on this machine and warn
                          about costly placements (exit 0 valid, 1 invalid)
        --map             print only the suggested core map
  ucx-peer              serve a UCX region to a parent process (used by tests)
  engine-peer           run a kvpoll engine serving patterned blocks (used by tests)
";

fn run(mut args: Args) -> Result<(), CliError> {
    match args.command()?.as_str() {
        "demo" => demo::run(args),
        "serve" => demo::serve(args),
        "connect" => demo::connect(args),
        "transfer" => transfer::run(args),
        "topo" => topo::run(args),
        "bench" => bench::run(args),
        "ucx-peer" => peer::run(args),
        "engine-peer" => peer::run_engine(args),
        "help" | "--help" | "-h" => {
            print!("{USAGE}");
            Ok(())
        }
        other => Err(CliError::UnknownCommand(other.to_owned())),
    }
}

fn main() -> ExitCode {
    match run(Args::from_env()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError::Failed(msg)) => {
            eprintln!("kvpoll: {msg}");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("kvpoll: {e}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}
