//! The `kvpoll` tool: `demo` (the main job), `serve`/`connect` (its two
//! sides on two hosts), `transfer`, `bench`, `topo`, shell completions, and
//! peer processes for the tests.

mod bench;
mod cli;
mod compare;
mod demo;
mod faults;
mod link;
mod metrics_http;
mod peer;
mod plot;
mod rails;
mod report;
mod signals;
mod topo;
mod transfer;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

use cli::{Cli, CliError, Command};

fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Demo(a) => demo::run(&a),
        Command::Serve(a) => demo::serve(&a),
        Command::Connect(a) => demo::connect(&a),
        Command::Transfer(a) => transfer::run(&a),
        Command::Topo(a) => topo::run(&a),
        Command::Bench(a) => bench::run(a),
        Command::UcxPeer(a) => peer::run(&a),
        Command::EnginePeer(a) => peer::run_engine(&a),
        Command::MemPeer(a) => peer::run_mem(&a),
        Command::RailsPeer(a) => rails::run_peer(&a),
        Command::Completions(a) => {
            clap_complete::generate(
                a.shell,
                &mut Cli::command(),
                "kvpoll",
                &mut std::io::stdout(),
            );
            Ok(())
        }
    }
}

/// Logs go to standard error, filtered by RUST_LOG (default `warn`), so
/// standard output stays the command's own (tables, JSON, READY lines).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
}

fn main() -> ExitCode {
    signals::ucx_defaults();
    // `--version` names the UCX loaded (as it reports itself), the one
    // built against, and whether they go together.
    let version: &'static str = Box::leak(
        format!(
            "{}, {}",
            env!("CARGO_PKG_VERSION"),
            kvpoll::transport::ucx::version_line()
        )
        .into_boxed_str(),
    );
    let matches = Cli::command().version(version).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    init_logging();
    signals::install();
    let name = subcommand_name(&cli.command);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError::Failed(msg)) => {
            eprintln!("kvpoll: {msg}");
            ExitCode::from(1)
        }
        Err(CliError::Signal(sig)) => {
            eprintln!("kvpoll: stopped by signal {sig}");
            ExitCode::from(signals::exit_code(sig))
        }
        // Options that do not fit together: reported like a parse error.
        Err(CliError::Usage(msg)) => {
            let mut cmd = Cli::command();
            cmd.build();
            match cmd.find_subcommand_mut(name) {
                Some(sub) => sub.error(clap::error::ErrorKind::ArgumentConflict, msg),
                None => cmd.error(clap::error::ErrorKind::ArgumentConflict, msg),
            }
            .exit()
        }
    }
}

/// The subcommand's name as the command line spells it.
fn subcommand_name(c: &Command) -> &'static str {
    match c {
        Command::Demo(_) => "demo",
        Command::Serve(_) => "serve",
        Command::Connect(_) => "connect",
        Command::Transfer(_) => "transfer",
        Command::Bench(_) => "bench",
        Command::Topo(_) => "topo",
        Command::Completions(_) => "completions",
        Command::UcxPeer(_) => "ucx-peer",
        Command::EnginePeer(_) => "engine-peer",
        Command::MemPeer(_) => "mem-peer",
        Command::RailsPeer(_) => "rails-peer",
    }
}
