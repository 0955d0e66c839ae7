//! What a bench run reports, apart from how it was measured: a table's
//! rows and what each says of its target, the closing verdict, and the
//! latency curves the plot draws. `bench` (the suite), `compare` (the
//! comparison's rows) and `plot` all use these, and this module uses
//! none of them: the three depend on it, never on each other in a circle.

use crate::cli::CliError;

/// One line of the table.
pub struct Row {
    pub key: String,
    pub figure: String,
    pub unit: &'static str,
    pub kvpoll: Option<f64>,
    pub baseline_name: String,
    pub baseline: Option<f64>,
    /// kvpoll / baseline, or the figure's own ratio: the median.
    pub ratio: Option<f64>,
    /// The lowest and highest of the ratio round by round (rounds of the
    /// two systems run back to back), where the figure has rounds.
    pub spread: Option<(f64, f64)>,
    pub target: &'static str,
    pub met: Met,
    pub note: String,
}

impl Row {
    /// A row with no spread (figures that are not made of rounds).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        key: impl Into<String>,
        figure: impl Into<String>,
        unit: &'static str,
        kvpoll: Option<f64>,
        baseline_name: impl Into<String>,
        baseline: Option<f64>,
        ratio: Option<f64>,
        target: &'static str,
        met: Met,
        note: impl Into<String>,
    ) -> Self {
        Row {
            key: key.into(),
            figure: figure.into(),
            unit,
            kvpoll,
            baseline_name: baseline_name.into(),
            baseline,
            ratio,
            spread: None,
            target,
            met,
            note: note.into(),
        }
    }
}

/// What a row says of its target.
#[derive(Debug, Clone, PartialEq)]
pub enum Met {
    Yes,
    Missed,
    /// No target, or nothing measured to hold it against: a baseline that
    /// is not installed, a group that `--only` left out.
    NotJudged,
    /// The row's measurement (or one of its systems) did not run, and
    /// why: the run failed.
    Failed(String),
}

impl From<bool> for Met {
    fn from(met: bool) -> Self {
        if met {
            Met::Yes
        } else {
            Met::Missed
        }
    }
}

impl From<Option<bool>> for Met {
    fn from(met: Option<bool>) -> Self {
        met.map_or(Met::NotJudged, Met::from)
    }
}

impl Met {
    /// The table's word for it.
    pub fn word(&self) -> &'static str {
        match self {
            Met::Yes => "yes",
            Met::Missed => "MISSED",
            Met::NotJudged => "n/a",
            Met::Failed(_) => "FAILED",
        }
    }
}

/// The closing verdict: targets met and missed, rows that did not run,
/// and measurement groups in which a system failed (whether or not a row
/// reads them).
pub struct Verdict<'a> {
    met: usize,
    missed: usize,
    failed: Vec<&'a Row>,
    failed_groups: Vec<String>,
}

impl<'a> Verdict<'a> {
    pub fn of(rows: &'a [Row], failed_groups: Vec<String>) -> Self {
        let count = |m: Met| rows.iter().filter(|r| r.met == m).count();
        Verdict {
            met: count(Met::Yes),
            missed: count(Met::Missed),
            failed: rows
                .iter()
                .filter(|r| matches!(r.met, Met::Failed(_)))
                .collect(),
            failed_groups,
        }
    }

    fn keys(&self) -> String {
        let keys: Vec<&str> = self.failed.iter().map(|r| r.key.as_str()).collect();
        keys.join(", ")
    }

    fn failed_any(&self) -> bool {
        !self.failed.is_empty() || !self.failed_groups.is_empty()
    }

    pub fn line(&self) -> String {
        let mut line = format!("targets: {} met, {} missed", self.met, self.missed);
        match self.failed.len() {
            0 => {}
            1 => line += &format!("; 1 row FAILED: {}", self.keys()),
            n => line += &format!("; {n} rows FAILED: {}", self.keys()),
        }
        match self.failed_groups.len() {
            0 => {}
            1 => line += &format!("; 1 group FAILED: {}", self.failed_groups[0]),
            n => line += &format!("; {n} groups FAILED: {}", self.failed_groups.join(", ")),
        }
        if self.failed_any() {
            line += " -- the run FAILED: not every target was measured";
        } else if self.missed == 0 && self.met > 0 {
            line += " -- all targets met";
        }
        line
    }

    pub fn to_json(&self) -> String {
        let groups: Vec<String> = self
            .failed_groups
            .iter()
            .map(|g| format!("\"{g}\""))
            .collect();
        format!(
            "{{\"met\":{},\"missed\":{},\"failed_rows\":{},\"failed_groups\":[{}],\"run_failed\":{}}}",
            self.met,
            self.missed,
            self.failed.len(),
            groups.join(","),
            self.failed_any()
        )
    }

    /// A run with a row or a group that did not run failed (exit 1);
    /// missed targets are figures, not failures.
    pub fn result(&self) -> Result<(), CliError> {
        if !self.failed_any() {
            return Ok(());
        }
        let mut why = Vec::new();
        if !self.failed.is_empty() {
            why.push(format!(
                "{} of the rows did not run ({})",
                self.failed.len(),
                self.keys()
            ));
        }
        if !self.failed_groups.is_empty() {
            why.push(format!(
                "a system failed in {} group(s) ({})",
                self.failed_groups.len(),
                self.failed_groups.join(", ")
            ));
        }
        Err(CliError::Failed(format!(
            "{}; the notes and group tables say why",
            why.join("; ")
        )))
    }
}

/// A figure for JSON: `null` when there is none.
pub fn num(x: Option<f64>) -> String {
    match x {
        Some(v) if v.is_finite() => format!("{v:.4}"),
        _ => "null".into(),
    }
}

/// A figure for the table, with an SI prefix.
pub fn human(x: Option<f64>, unit: &str) -> String {
    match x {
        Some(v) if v.is_finite() => {
            if v >= 1e9 {
                format!("{:.2} G{unit}", v / 1e9)
            } else if v >= 1e6 {
                format!("{:.2} M{unit}", v / 1e6)
            } else if v >= 1e4 {
                format!("{:.1} k{unit}", v / 1e3)
            } else {
                format!("{v:.1} {unit}")
            }
        }
        _ => "n/a".into(),
    }
}

/// Text for JSON: quotes and backslashes replaced.
pub fn json_text(s: &str) -> String {
    s.replace(['"', '\\'], "'").replace(['\n', '\t'], " ")
}

/// A panel of latency curves for the plot.
pub struct Curves<'a> {
    pub title: &'a str,
    pub unit: &'a str,
    pub series: Vec<(&'a str, &'a [u64])>,
}
