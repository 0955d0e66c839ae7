//! The `kvpoll` tool: a thin dispatcher over the library.

use std::process::ExitCode;

use kvpoll::ledger::bench::{self, BenchConfig, BenchError};

/// Interleaved runs of each tracker (about 25 ms a pair here).
const RUNS: u32 = 31;

const USAGE: &str = "usage: kvpoll bench ledger [--json]";

/// What was wrong with the command line, or with running it.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error("missing command")]
    MissingCommand,
    #[error("unknown command `{0}`")]
    UnknownCommand(String),
    #[error("missing bench name (expected `ledger`)")]
    MissingBench,
    #[error("unknown bench `{0}` (expected `ledger`)")]
    UnknownBench(String),
    #[error("unexpected argument `{0}`")]
    UnexpectedArgument(String),
    #[error("bench failed: {0}")]
    Bench(#[from] BenchError),
}

impl CliError {
    fn is_usage(&self) -> bool {
        !matches!(self, CliError::Bench(_))
    }
}

fn main() -> ExitCode {
    // Lossy: a non-UTF-8 argument is simply an unknown one.
    let args: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_usage() => {
            eprintln!("kvpoll: {e}\n{USAGE}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("kvpoll: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<(), CliError> {
    match args.first().map(String::as_str) {
        Some("bench") => bench(&args[1..]),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(CliError::UnknownCommand(other.to_owned())),
        None => Err(CliError::MissingCommand),
    }
}

fn bench(args: &[String]) -> Result<(), CliError> {
    let (what, flags) = args.split_first().ok_or(CliError::MissingBench)?;
    if what != "ledger" {
        return Err(CliError::UnknownBench(what.clone()));
    }
    let mut json = false;
    for f in flags {
        match f.as_str() {
            "--json" => json = true,
            other => return Err(CliError::UnexpectedArgument(other.to_owned())),
        }
    }
    let t = bench::compare(BenchConfig::default(), RUNS)?;
    if json {
        println!("{}", t.to_json());
    } else {
        println!(
            "ledger: {:.1} M completions/s\nlocked: {:.1} M completions/s\nratio:  {:.1}x  ({} completions a run, median of {} runs each)",
            t.ledger_completions_per_s / 1e6,
            t.locked_completions_per_s / 1e6,
            t.ratio,
            t.completions,
            t.runs
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn bad_command_lines_are_usage_errors_naming_the_wrong_word() {
        let cases = [
            (args(&[]), "missing command"),
            (args(&["bnech"]), "unknown command `bnech`"),
            (args(&["bench"]), "missing bench name (expected `ledger`)"),
            (
                args(&["bench", "ring"]),
                "unknown bench `ring` (expected `ledger`)",
            ),
            (
                args(&["bench", "ledger", "--jsn"]),
                "unexpected argument `--jsn`",
            ),
        ];
        for (line, want) in cases {
            let e = run(&line).expect_err("must be refused");
            assert!(e.is_usage());
            assert_eq!(e.to_string(), want);
        }
    }
}
