//! The `kvpoll` tool: `demo` (the main job), `serve`/`connect` (its two
//! sides on two hosts), `bench`, `topo`, and peer processes for the tests.

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
  demo                  prefill TP=4 and decode TP=2 over real UCX, pull then push, with
                        faults; every block checked; exit 1 on corruption or a leak
        --ranks processes|threads   prefill ranks as processes (default) or threads
        --policy safe|eager         eager frees blocks at the first handle failure:
                                    UNSAFE, for comparison only
        --requests N                requests per decode rank and mode (default 3000)
        --no-faults, --no-kill      turn the fault mix, or the rank kill, off
        --handle-error-every N, --release-failure-every N, --setup-failure-every N
        --stall-every-ms N, --stall-ms N
        --tls LIST, --blocks N, --block-size B, --layers N, --blocks-per-handle N,
        --window N, --json
  serve                 one prefill rank: --rank R --listen ADDR (prints LISTEN addr)
  connect               one decode rank: --to ADDR,ADDR --mode pull|push [demo options]
  transfer              move blocks between two UCX workers; report bytes and rate
        --tls LIST        UCX transports (default: posix,sysv,cma)
        --blocks N        blocks per round (default 4096)
        --block-size B    bytes per block (default 16384)
        --rounds N        rounds (default 8)
        --json            one JSON object
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
