//! A small argument reader: `--name value` options after a command word, each
//! parsed into its type with an error that names the option.

use std::str::FromStr;

use thiserror::Error;

/// What was wrong with the command line, or what failed while running.
#[derive(Debug, Error)]
pub enum CliError {
    /// No command word.
    #[error("no command given")]
    NoCommand,
    /// A command word this tool does not know.
    #[error("unknown command {0:?}")]
    UnknownCommand(String),
    /// An option the command does not take.
    #[error("unknown option {0:?}")]
    UnknownOption(String),
    /// An option without its value.
    #[error("option {0} needs a value")]
    MissingValue(String),
    /// A value that does not parse.
    #[error("option {option}: {value:?} is not {expected}")]
    BadValue {
        /// The option.
        option: String,
        /// What was given.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
    /// The command ran and failed (not a usage error).
    #[error("{0}")]
    Failed(String),
}

/// The remaining command-line words.
pub struct Args {
    words: Vec<String>,
}

impl Args {
    pub fn from_env() -> Self {
        Self {
            words: std::env::args().skip(1).collect(),
        }
    }

    /// Takes the command word.
    pub fn command(&mut self) -> Result<String, CliError> {
        if self.words.is_empty() {
            return Err(CliError::NoCommand);
        }
        Ok(self.words.remove(0))
    }

    /// Takes the next word as a sub-command unless it is an option (or there
    /// is none); then `default`.
    pub fn subcommand_or(&mut self, default: &str) -> String {
        match self.words.first() {
            Some(w) if !w.starts_with("--") => self.words.remove(0),
            _ => default.to_owned(),
        }
    }

    /// Takes `--name VALUE` if present, parsed as `T`.
    pub fn option<T: FromStr>(
        &mut self,
        name: &str,
        expected: &'static str,
    ) -> Result<Option<T>, CliError> {
        let Some(i) = self.words.iter().position(|w| w == name) else {
            return Ok(None);
        };
        if i + 1 >= self.words.len() {
            return Err(CliError::MissingValue(name.to_owned()));
        }
        let value = self.words.remove(i + 1);
        self.words.remove(i);
        value.parse().map(Some).map_err(|_| CliError::BadValue {
            option: name.to_owned(),
            value,
            expected,
        })
    }

    /// Takes `--name` (a flag) if present.
    pub fn flag(&mut self, name: &str) -> bool {
        match self.words.iter().position(|w| w == name) {
            Some(i) => {
                self.words.remove(i);
                true
            }
            None => false,
        }
    }

    /// Fails on anything not taken.
    pub fn finish(self) -> Result<(), CliError> {
        match self.words.into_iter().next() {
            Some(w) => Err(CliError::UnknownOption(w)),
            None => Ok(()),
        }
    }
}
