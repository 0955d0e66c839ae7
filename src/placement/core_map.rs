//! Core maps: which CPU runs which poller, which UCX workers each poller
//! owns, how it idles, and where the engine threads run.
//!
//! # Format
//!
//! A core map is a TOML file (see `tuning/` for shipped ones):
//!
//! ```toml
//! # The engine threads (the serving engine's scheduler/connector threads
//! # that submit requests and poll outcomes) run on these CPUs.
//! [engine]
//! cores = [0]
//!
//! # One table per poller thread.
//! [[poller]]
//! core = 1                 # Linux CPU number (as in taskset, /sys/devices/system/cpu/cpuN)
//! workers = ["mlx5_0:1"]   # one UCX worker per entry, restricted to that device
//! idle = "adaptive"        # "busy" (dedicated isolated CPU) or "adaptive"
//! ```
//!
//! A worker entry is a `UCX_NET_DEVICES` value: an RDMA device and port
//! (`mlx5_0:1`), a network interface (`eth0`, `lo`), or `all` to let UCX use
//! every device it finds (and shared memory on one host).
//!
//! Instead of pollers, a file may say `auto = true` (and nothing else):
//! derive the map from the machine's topology when it is loaded, as
//! [`CoreMap::auto`] does. Passing the word `auto` where a path is expected
//! means the same.
//!
//! Keys the format does not have are errors, not ignored: a misspelt
//! `idel = "busy"` must not silently leave a poller adaptive.

use std::fmt;
use std::ops::Range;
use std::path::Path;
use std::str::FromStr;

use serde::Deserialize;
use toml::Spanned;

use super::cpulist::format_cpu_list;
use super::error::PlacementError;
use super::topology::Topology;

/// The largest core-map file read, in bytes: a map names a few lines per
/// poller, so even a machine of thousands of cores needs far less.
pub const MAX_CORE_MAP_BYTES: u64 = 1 << 20;

/// How a poller waits when there is nothing to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IdlePolicy {
    /// Spin forever: lowest latency, burns its CPU at 100 %. For a
    /// dedicated, isolated CPU only; failing to pin is an error.
    Busy,
    /// Spin briefly, then block until work is submitted or the transport
    /// has an event (UCX's worker event fd): near-zero idle CPU at the cost
    /// of a wake-up on the first event after a quiet spell. Failing to pin
    /// is a warning.
    Adaptive,
}

impl IdlePolicy {
    /// The name used in core maps: `busy` or `adaptive`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Busy => "busy",
            Self::Adaptive => "adaptive",
        }
    }
}

impl fmt::Display for IdlePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for IdlePolicy {
    type Err = String;

    /// ```
    /// use kvpoll::placement::IdlePolicy;
    /// assert_eq!("busy".parse(), Ok(IdlePolicy::Busy));
    /// assert!("lazy".parse::<IdlePolicy>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "busy" => Ok(Self::Busy),
            "adaptive" => Ok(Self::Adaptive),
            other => Err(format!("idle policy {other:?} is not `busy` or `adaptive`")),
        }
    }
}

/// One poller thread: where it runs, what it progresses, how it idles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PollerSpec {
    /// The Linux CPU number it is pinned to.
    pub core: usize,
    /// One UCX worker per entry; each entry is a `UCX_NET_DEVICES` value
    /// (`mlx5_0:1`, `eth0`, `all`).
    pub workers: Vec<String>,
    /// How it waits when idle.
    pub idle: IdlePolicy,
}

/// Where each line of a map is, for error messages and warnings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Lines {
    engine: usize,
    engine_cores: Vec<usize>,
    pollers: Vec<usize>,
}

/// A parsed core map: the pollers and the engine's CPUs. Parsing checks
/// what needs no machine (no pollers, duplicates, overlaps);
/// [`CoreMap::validate`] checks it against a [`Topology`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoreMap {
    name: String,
    pollers: Vec<PollerSpec>,
    engine_cores: Vec<usize>,
    lines: Lines,
}

/// What a core-map file says: an explicit map, or `auto = true`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreMapFile {
    /// Derive the map from the machine when it is resolved.
    Auto {
        /// The file's name.
        name: String,
    },
    /// An explicit map.
    Map(CoreMap),
}

/// The word that means "derive the map from this machine" where a core-map
/// path is expected.
pub const AUTO: &str = "auto";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMap {
    auto: Option<Spanned<bool>>,
    engine: Option<Spanned<RawEngine>>,
    poller: Option<Vec<Spanned<RawPoller>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEngine {
    cores: Vec<Spanned<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPoller {
    core: Spanned<usize>,
    workers: Spanned<Vec<String>>,
    idle: IdlePolicy,
}

/// 1-based line of a byte offset.
fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

fn toml_error(text: &str, name: &str, e: &toml::de::Error, syntax: bool) -> PlacementError {
    let line = e.span().map_or(1, |s: Range<usize>| line_of(text, s.start));
    let message = e.message().trim().to_owned();
    if syntax {
        return PlacementError::Syntax {
            file: name.to_owned(),
            line,
            message,
        };
    }
    // serde words it "unknown field `x`, expected one of `a`, `b`" (or
    // "expected `a`" when there is one).
    if let Some(rest) = message.strip_prefix("unknown field `") {
        if let Some((key, tail)) = rest.split_once('`') {
            let expected = tail
                .trim_start_matches(',')
                .trim()
                .trim_start_matches("expected one of")
                .trim_start_matches("expected")
                .trim()
                .replace('`', "");
            return PlacementError::UnknownKey {
                file: name.to_owned(),
                line,
                key: key.to_owned(),
                expected,
            };
        }
    }
    PlacementError::Schema {
        file: name.to_owned(),
        line,
        message,
    }
}

impl CoreMapFile {
    /// Parses core-map text; `name` (usually the path) appears in errors.
    pub fn parse(text: &str, name: &str) -> Result<Self, PlacementError> {
        // Syntax first, so that a broken file is reported as such and not
        // as a schema mismatch.
        toml::from_str::<toml::Table>(text).map_err(|e| toml_error(text, name, &e, true))?;
        let raw: RawMap = toml::from_str(text).map_err(|e| toml_error(text, name, &e, false))?;
        let file = name.to_owned();
        if let Some(auto) = &raw.auto {
            if *auto.get_ref() {
                if raw.engine.is_some() || raw.poller.is_some() {
                    return Err(PlacementError::Schema {
                        file,
                        line: line_of(text, auto.span().start),
                        message: "`auto = true` derives the whole map: remove [engine] and [[poller]], or remove `auto`".to_owned(),
                    });
                }
                return Ok(Self::Auto { name: file });
            }
        }

        let pollers_raw = raw.poller.unwrap_or_default();
        if pollers_raw.is_empty() {
            return Err(PlacementError::EmptyMap {
                file,
                what: "no [[poller]] entries",
            });
        }
        let Some(engine) = raw.engine else {
            return Err(PlacementError::EmptyMap {
                file,
                what: "no [engine] table (say where the engine threads run: [engine] cores = [0])",
            });
        };
        let engine_line = line_of(text, engine.span().start);
        let engine = engine.into_inner();
        if engine.cores.is_empty() {
            return Err(PlacementError::EmptyMap {
                file,
                what: "[engine] cores is empty",
            });
        }

        let mut lines = Lines {
            engine: engine_line,
            ..Lines::default()
        };
        let mut engine_cores = Vec::new();
        for core in &engine.cores {
            let line = line_of(text, core.span().start);
            let core = *core.get_ref();
            if let Some(i) = engine_cores.iter().position(|&c| c == core) {
                return Err(PlacementError::DuplicateCore {
                    file,
                    line,
                    core,
                    first_line: lines.engine_cores[i],
                });
            }
            engine_cores.push(core);
            lines.engine_cores.push(line);
        }

        let mut pollers: Vec<PollerSpec> = Vec::new();
        for p in pollers_raw {
            let p = p.into_inner();
            let line = line_of(text, p.core.span().start);
            let core = *p.core.get_ref();
            if p.workers.get_ref().is_empty() {
                return Err(PlacementError::NoWorkers {
                    file,
                    line: line_of(text, p.workers.span().start),
                    core,
                });
            }
            if let Some(i) = pollers.iter().position(|q| q.core == core) {
                return Err(PlacementError::DuplicateCore {
                    file,
                    line,
                    core,
                    first_line: lines.pollers[i],
                });
            }
            if engine_cores.contains(&core) {
                return Err(PlacementError::PollerOnEngineCore {
                    file,
                    line,
                    core,
                    engine_line: lines.engine,
                });
            }
            pollers.push(PollerSpec {
                core,
                workers: p.workers.into_inner(),
                idle: p.idle,
            });
            lines.pollers.push(line);
        }
        Ok(Self::Map(CoreMap {
            name: file,
            pollers,
            engine_cores,
            lines,
        }))
    }

    /// Reads and parses a core-map file. At most
    /// [`MAX_CORE_MAP_BYTES`] are read: a larger file (or a device that
    /// never ends, such as `/dev/zero`) is refused with
    /// [`PlacementError::TooLarge`].
    pub fn load(path: impl AsRef<Path>) -> Result<Self, PlacementError> {
        use std::io::Read as _;
        let path = path.as_ref();
        let read = |source| PlacementError::Read {
            file: path.to_owned(),
            source,
        };
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_CORE_MAP_BYTES + 1).read_to_string(&mut text))
            .map_err(read)?;
        if text.len() as u64 > MAX_CORE_MAP_BYTES {
            return Err(PlacementError::TooLarge {
                file: path.to_owned(),
                limit: MAX_CORE_MAP_BYTES,
            });
        }
        Self::parse(&text, &path.display().to_string())
    }

    /// The map to use on `topology`: the derived one for `auto`, else the
    /// explicit map once it validates.
    pub fn resolve(self, topology: &Topology) -> Result<CoreMap, PlacementError> {
        match self {
            Self::Auto { .. } => CoreMap::auto(topology),
            Self::Map(map) => {
                map.validate(topology)?;
                Ok(map)
            }
        }
    }
}

impl CoreMap {
    /// Loads the core map at `path` — or derives one when `path` is the word
    /// `auto` or the file says `auto = true` — and validates it against
    /// `topology`. This is the one call an engine needs.
    pub fn load(path: impl AsRef<Path>, topology: &Topology) -> Result<Self, PlacementError> {
        let path = path.as_ref();
        let map = if path.as_os_str() == AUTO {
            Self::auto(topology)
        } else {
            CoreMapFile::load(path).and_then(|f| f.resolve(topology))
        };
        match &map {
            Ok(m) => tracing::debug!(
                path = %path.display(),
                pollers = m.pollers().len(),
                engine_cores = ?m.engine_cores(),
                "core map loaded"
            ),
            Err(e) => tracing::debug!(path = %path.display(), error = %e, "core map refused"),
        }
        map
    }

    /// Parses an explicit map (not `auto = true`); `name` appears in errors.
    /// Checks everything that needs no machine; see [`CoreMap::validate`].
    ///
    /// ```
    /// use kvpoll::placement::{CoreMap, IdlePolicy};
    /// let map = CoreMap::parse(
    ///     "[engine]\ncores = [0]\n[[poller]]\ncore = 1\nworkers = [\"all\"]\nidle = \"adaptive\"\n",
    ///     "example.toml",
    /// ).unwrap();
    /// assert_eq!(map.pollers()[0].idle, IdlePolicy::Adaptive);
    /// assert_eq!(map.engine_cores(), &[0]);
    /// ```
    pub fn parse(text: &str, name: &str) -> Result<Self, PlacementError> {
        match CoreMapFile::parse(text, name)? {
            CoreMapFile::Map(map) => Ok(map),
            CoreMapFile::Auto { name } => Err(PlacementError::Schema {
                file: name,
                line: 1,
                message: "this map says `auto = true`: resolve it against a topology (CoreMapFile::resolve)".to_owned(),
            }),
        }
    }

    /// Checks the map against a machine: every CPU it names must exist and
    /// be online.
    pub fn validate(&self, topology: &Topology) -> Result<(), PlacementError> {
        let online = topology.online_cpus();
        let known: Vec<usize> = topology.cpus.iter().map(|c| c.id).collect();
        let used = self
            .engine_cores
            .iter()
            .zip(&self.lines.engine_cores)
            .chain(
                self.pollers
                    .iter()
                    .map(|p| &p.core)
                    .zip(&self.lines.pollers),
            );
        for (&core, &line) in used {
            match topology.cpu(core) {
                None => {
                    return Err(PlacementError::UnknownCpu {
                        file: self.name.clone(),
                        line,
                        core,
                        known: format_cpu_list(&known),
                    })
                }
                Some(cpu) if !cpu.online => {
                    return Err(PlacementError::OfflineCpu {
                        file: self.name.clone(),
                        line,
                        core,
                        online: format_cpu_list(&online),
                    })
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// The map's name (its path, or `auto`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The pollers, in file order.
    pub fn pollers(&self) -> &[PollerSpec] {
        &self.pollers
    }

    /// The CPUs the engine threads run on.
    pub fn engine_cores(&self) -> &[usize] {
        &self.engine_cores
    }

    /// The line of poller `index`'s `core` (for messages about it).
    pub fn poller_line(&self, index: usize) -> usize {
        self.lines.pollers.get(index).copied().unwrap_or(0)
    }

    /// The line of the `[engine]` table.
    pub fn engine_line(&self) -> usize {
        self.lines.engine
    }

    /// The map as core-map TOML that parses back to the same map.
    pub fn to_toml(&self) -> String {
        render(&self.engine_cores, &self.pollers, &[])
    }
}

/// Renders a map as TOML, with an optional comment above each poller.
pub(crate) fn render(engine_cores: &[usize], pollers: &[PollerSpec], notes: &[String]) -> String {
    let list = |v: &[usize]| {
        v.iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut out = format!("[engine]\ncores = [{}]\n", list(engine_cores));
    for (i, p) in pollers.iter().enumerate() {
        out.push('\n');
        if let Some(note) = notes.get(i) {
            for line in note.lines() {
                out.push_str(&format!("# {line}\n"));
            }
        }
        // toml's own quoting, so any name round-trips.
        let workers: Vec<String> = p
            .workers
            .iter()
            .map(|w| toml::Value::String(w.clone()).to_string())
            .collect();
        out.push_str(&format!(
            "[[poller]]\ncore = {}\nworkers = [{}]\nidle = \"{}\"\n",
            p.core,
            workers.join(", "),
            p.idle
        ));
    }
    out
}
