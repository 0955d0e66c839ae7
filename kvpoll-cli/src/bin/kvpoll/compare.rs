//! `kvpoll bench compare`: the serving shapes against the physical limits
//! and the peer systems (kvpoll_cli::bench::shapes), as table rows with
//! targets, a table per group, JSON and an SVG.
//!
//! The tcp groups run over a veth link between two network namespaces
//! ([`crate::link`]) where one can be made, and over loopback; a group
//! over veth runs in a process of its own inside the near namespace
//! (`ip netns exec`, so that UCX sees that namespace's devices), its
//! peers in the far one, and hands its figures back as lines.

use std::fmt::Write as _;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use kvpoll_cli::bench::memory::huge_pages;
use kvpoll_cli::bench::shapes::{
    default_groups, run_group, Group, GroupFigures, Link, Peers, RoundSize, VethEnds, KVPOLL,
    KVPOLL_BATCHED, KVPOLL_BEST, KVPOLL_KEYED, KVPOLL_SERVING, KVPOLL_UNCONFIRMED, MEMCPY,
    MOONCAKE, NIXL, NIXL_BATCHED, NIXL_BEST, PVREADV, RAW, TCP_STREAM,
};

use crate::cli::{CliError, CompareArgs};
use crate::link::{self, VethLink};
use crate::report::{json_text, Met, Row};

/// The driver of the peer systems, carried inside the binary.
const PEER_BENCH_PY: &str = include_str!("../../../benches/peers/peer_bench.py");

/// What a comparison run measured, and under which conditions.
pub struct Comparison {
    pub groups: Vec<GroupFigures>,
    /// Groups that did not run at all, and why.
    pub failed: Vec<(String, String)>,
    pub huge_pages: String,
    pub fault_injection: bool,
    pub peers: String,
    /// The link the tcp rows' figures are of: veth, or loopback where a
    /// veth link could not be made.
    pub tcp_link: Link,
    /// Why the tcp rows are over loopback, where they are.
    pub link_note: String,
    /// How long each round was asked to be.
    pub round_size: RoundSize,
}

/// The Python of the peer systems: the one given, `$KVPOLL_BENCH_PYTHON`,
/// or the venv `make bench-peers` makes beside this binary's directory.
pub(crate) fn peers_python(given: Option<&Path>) -> Option<PathBuf> {
    match given {
        Some(p) if p == Path::new("none") => return None,
        Some(p) => return Some(p.to_owned()),
        None => {}
    }
    if let Some(p) = std::env::var_os("KVPOLL_BENCH_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let venv = exe.parent()?.parent()?.join("bench-peers/venv/bin/python");
    venv.is_file().then_some(venv)
}

fn parse_alt_ucx(alt: Option<&str>) -> Result<Vec<(String, String)>, CliError> {
    let Some(list) = alt else {
        return Ok(Vec::new());
    };
    list.split(',')
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .ok_or_else(|| CliError::Failed(format!("--alt-ucx: {kv:?} is not NAME=VALUE")))
        })
        .collect()
}

/// A temporary directory holding the peer driver, removed on drop.
pub(crate) struct Driver {
    dir: PathBuf,
    pub(crate) script: PathBuf,
}

impl Driver {
    pub(crate) fn write() -> Result<Self, CliError> {
        let dir = std::env::temp_dir().join(format!("kvpoll-compare-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| CliError::Failed(format!("temp dir: {e}")))?;
        let script = dir.join("peer_bench.py");
        std::fs::write(&script, PEER_BENCH_PY)
            .map_err(|e| CliError::Failed(format!("writing the peer driver: {e}")))?;
        Ok(Driver { dir, script })
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn exe() -> Result<PathBuf, CliError> {
    std::env::current_exe()
        .map_err(|e| CliError::Failed(format!("locating the kvpoll binary: {e}")))
}

fn check_scale(scale: f64) -> Result<RoundSize, CliError> {
    if !(0.001..=10.0).contains(&scale) {
        return Err(CliError::Failed("--scale must be within 0.001..=10".into()));
    }
    Ok(RoundSize::scaled(scale))
}

/// Runs every group (those whose key contains `--only`).
pub fn run(args: &CompareArgs) -> Result<Comparison, CliError> {
    let alt_ucx = parse_alt_ucx(args.alt_ucx.as_deref())?;
    let exe = exe()?;
    let size = check_scale(args.scale)?;
    let driver = Driver::write()?;
    let python = peers_python(args.peers_python.as_deref());
    let peers_note = match &python {
        Some(p) => format!("peer systems through {}", p.display()),
        None => {
            "peer systems not measured: no Python with NIXL and Mooncake (make bench-peers)".into()
        }
    };
    let only = args.only.as_deref();
    let wanted = |g: &Group| only.is_none_or(|o| g.key().contains(o));
    let wants_veth = default_groups(&args.shm, true)
        .iter()
        .any(|g| g.link == Link::Veth && wanted(g));
    let (veth, link_note) = if args.loopback_only {
        (None, "tcp over loopback only (--loopback-only)".to_owned())
    } else if !wants_veth {
        (None, String::new())
    } else {
        match VethLink::create() {
            Ok(l) => (Some(l), String::new()),
            Err(why) => (
                None,
                format!("tcp rows over loopback: no veth link here ({why})"),
            ),
        }
    };
    let peers = Peers {
        python: python.clone(),
        script: Some(driver.script.clone()),
        alt_ucx,
        veth: None,
    };
    let mut groups = Vec::new();
    let mut failed = Vec::new();
    for mut g in default_groups(&args.shm, veth.is_some()) {
        if !wanted(&g) {
            continue;
        }
        g.requests = ((f64::from(g.requests) * args.scale).round() as u32).max(1);
        let result = match (&veth, g.link) {
            (Some(l), Link::Veth) => run_over(&exe, l, &g, args, python.as_deref()),
            _ => run_group(&exe, &g, &peers, args.rounds, size).map_err(|e| e.to_string()),
        };
        match result {
            Ok(f) => groups.push(f),
            Err(e) => {
                tracing::warn!(group = %g.key(), "did not run: {e}");
                failed.push((g.key(), e));
            }
        }
    }
    Ok(Comparison {
        groups,
        failed,
        huge_pages: huge_pages(),
        fault_injection: kvpoll_cli::FAULT_INJECTION,
        peers: peers_note,
        tcp_link: if veth.is_some() {
            Link::Veth
        } else {
            Link::Loopback
        },
        link_note,
        round_size: size,
    })
}

/// Runs group `g` over `link`: this binary again, inside the near
/// namespace, with `--peer-netns` naming the far one.
fn run_over(
    exe: &Path,
    link: &VethLink,
    g: &Group,
    args: &CompareArgs,
    python: Option<&Path>,
) -> Result<GroupFigures, String> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &link.near])
        .arg(exe)
        .args(["bench", "compare", "--only", &g.key()])
        .args(["--peer-netns", &link.far])
        .args(["--rounds", &args.rounds.to_string()])
        .args(["--scale", &args.scale.to_string()])
        .args(["--shm", &args.shm])
        .arg("--peers-python")
        .arg(python.unwrap_or(Path::new("none")))
        // Every UCX of the group (kvpoll's, the raw loop's, NIXL's) on
        // the veth device alone.
        .env("UCX_NET_DEVICES", link::DEVICE)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(alt) = &args.alt_ucx {
        cmd.args(["--alt-ucx", alt]);
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("ip netns exec {}: {e}", link.near))?;
    // Standard error is read beside standard output, so that neither
    // fills its pipe while the other is read.
    let err = child.stderr.take().map(|mut e| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = e.read_to_string(&mut s);
            s
        })
    });
    let mut out = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    let status = child
        .wait()
        .map_err(|e| format!("waiting for the group: {e}"))?;
    let err = err.and_then(|t| t.join().ok()).unwrap_or_default();
    if std::env::var_os("KVPOLL_BENCH_THREADS").is_some() {
        // Its standard error as it was (the rounds' split by thread among
        // it), as the groups run in this process print theirs.
        eprint!("{err}");
    }
    let figures = GroupFigures::from_lines(g.clone(), &out);
    match figures {
        Some(f) if status.success() || !f.systems.is_empty() || !f.failed.is_empty() => Ok(f),
        _ => {
            let tail: Vec<&str> = err.lines().rev().take(3).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            Err(format!(
                "the group's process over veth ended ({status}): {}",
                tail.join(" | ")
            ))
        }
    }
}

/// Inside the near namespace: runs the one group `--only` names, its
/// peers in `--peer-netns`, and prints its figures as lines.
pub fn run_linked_group(args: &CompareArgs) -> Result<(), CliError> {
    let (Some(only), Some(far)) = (args.only.as_deref(), args.peer_netns.as_deref()) else {
        return Err(CliError::Failed("--peer-netns needs --only".into()));
    };
    let exe = exe()?;
    let size = check_scale(args.scale)?;
    let driver = Driver::write()?;
    let Some(mut g) = default_groups(&args.shm, true)
        .into_iter()
        .find(|g| g.link == Link::Veth && g.key() == only)
    else {
        return Err(CliError::Failed(format!("no group over veth is {only:?}")));
    };
    g.requests = ((f64::from(g.requests) * args.scale).round() as u32).max(1);
    let peers = Peers {
        python: peers_python(args.peers_python.as_deref()),
        script: Some(driver.script.clone()),
        alt_ucx: parse_alt_ucx(args.alt_ucx.as_deref())?,
        veth: Some(VethEnds {
            netns: far.to_owned(),
            near: link::NEAR.to_owned(),
            far: link::FAR.to_owned(),
        }),
    };
    let f = run_group(&exe, &g, &peers, args.rounds, size)
        .map_err(|e| CliError::Failed(e.to_string()))?;
    print!("{}", f.to_lines());
    Ok(())
}

/// One rate row: `who` (one of kvpoll's systems, or a best of) against
/// `baseline` in group `group`.
struct Spec<'a> {
    who: &'a str,
    key: String,
    group: String,
    figure: String,
    baseline: &'a str,
    base_name: &'a str,
    target: Option<f64>,
    bytes: bool,
}

impl Comparison {
    fn group(&self, key: &str) -> Option<&GroupFigures> {
        self.groups.iter().find(|g| g.group.key() == key)
    }

    /// Every group that failed: did not run, or a system of it failed.
    pub fn failed_groups(&self) -> Vec<String> {
        let mut v: Vec<String> = self.failed.iter().map(|(k, _)| k.clone()).collect();
        v.extend(
            self.groups
                .iter()
                .filter(|g| !g.failed.is_empty())
                .map(|g| g.group.key()),
        );
        v
    }

    /// Why the row of `who` against `baseline` in group `key` failed: the
    /// group did not run, or a system failed in it (one of the row's own
    /// named first): a group that failed fails each of its rows.
    fn row_failure(&self, key: &str, who: &str, baseline: &str) -> Option<String> {
        if let Some(why) = self.did_not_run(key) {
            return Some(why);
        }
        let g = self.group(key)?;
        [who, baseline]
            .into_iter()
            .find_map(|s| g.failure(s).map(|why| (s.to_owned(), why.to_owned())))
            .or_else(|| g.failed.first().cloned())
            .map(|(s, why)| format!("{key}: {s} FAILED: {why}"))
    }

    fn target_text(t: f64) -> &'static str {
        match t {
            t if t >= 1.9 => ">= 2x",
            t if t >= 1.0 => ">= 1.0x",
            t if t >= 0.9 => ">= 0.9x",
            t if t >= 0.8 => ">= 0.8x",
            _ => ">= 0.5x",
        }
    }

    fn rate_row(&self, s: Spec<'_>) -> Row {
        let g = self.group(&s.group);
        let k = g.and_then(|g| g.pick(s.who));
        let b = g.and_then(|g| g.pick(s.baseline));
        let scale = match g {
            Some(g) if s.bytes => g.group.shape.bytes() as f64,
            _ => 1.0,
        };
        let ratio = k.zip(b).map(|(k, b)| k.per_s / b.per_s);
        // Round i of both ran back to back: the ratio of each pair.
        let spread = k.zip(b).and_then(|(k, b)| {
            let r: Vec<f64> = k.rates.iter().zip(&b.rates).map(|(k, b)| k / b).collect();
            let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            (!r.is_empty()).then_some((lo, hi))
        });
        let base_name = match (s.baseline, b) {
            (NIXL_BEST, Some(b)) => format!("NIXL best: {}", b.system),
            _ => s.base_name.to_owned(),
        };
        let met = match self.row_failure(&s.group, s.who, s.baseline) {
            Some(why) => Met::Failed(why),
            None => s.target.and_then(|t| ratio.map(|r| r >= t)).into(),
        };
        Row {
            key: s.key,
            figure: s.figure,
            unit: if s.bytes { "B/s" } else { "/s" },
            kvpoll: k.map(|k| k.per_s * scale),
            baseline_name: base_name,
            baseline: b.map(|b| b.per_s * scale),
            ratio,
            spread,
            target: s.target.map_or("(measured, no target)", Self::target_text),
            met,
            note: self.note(&s.group, s.who, s.baseline),
        }
    }

    /// CPU seconds per GB of `who` against the path's limit `baseline`.
    fn cpu_row(
        &self,
        key: String,
        group: &str,
        figure: String,
        who: &str,
        baseline: &str,
        target: Option<f64>,
    ) -> Row {
        let g = self.group(group);
        let k = g.and_then(|g| g.pick(who)).map(|s| s.cpu_s_per_gb);
        let b = g.and_then(|g| g.pick(baseline)).map(|s| s.cpu_s_per_gb);
        let ratio = k.zip(b).map(|(k, b)| k / b);
        let met = match self.row_failure(group, who, baseline) {
            Some(why) => Met::Failed(why),
            None => target.and_then(|t| ratio.map(|r| r <= t)).into(),
        };
        Row {
            key,
            figure,
            unit: "s/GB",
            kvpoll: k,
            baseline_name: baseline.to_owned(),
            baseline: b,
            ratio,
            spread: None,
            target: match target {
                Some(_) => "<= 1.1x",
                None => "(measured, no target)",
            },
            met,
            note: self.note(group, who, baseline),
        }
    }

    /// The rows with targets, then informational ones.
    pub fn rows(&self) -> Vec<Row> {
        let mut rows = Vec::new();
        let l = self.tcp_link.name();
        let tcp = |shape: &str, op: &str| format!("{shape}_{l}_caller_{op}");
        let over = format!("tcp over {l}");
        let spec = |who, key: &str, group: &str, figure: &str, baseline, base_name, target| Spec {
            who,
            key: key.to_owned(),
            group: group.to_owned(),
            figure: figure.to_owned(),
            baseline,
            base_name,
            target,
            bytes: true,
        };
        rows.push(self.rate_row(spec(
            KVPOLL,
            "caller_shm_8mib_vs_process_vm_readv",
            "layers_shm_caller_pull",
            "8 MiB requests, caller memory, shm: vs process_vm_readv",
            PVREADV,
            "process_vm_readv",
            Some(0.9),
        )));
        for (key, group, figure) in [
            (
                "caller_shm_8mib_vs_nixl",
                "layers_shm_caller_pull",
                "8 MiB requests, caller memory, shm: vs NIXL best",
            ),
            (
                "caller_shm_64mib_vs_nixl",
                "large_shm_caller_pull",
                "64 MiB read, caller memory, shm: vs NIXL best",
            ),
            (
                "ucx_shm_64mib_vs_nixl",
                "large_shm_ucx_pull",
                "64 MiB read, UCX memory, shm: vs NIXL best",
            ),
        ] {
            rows.push(self.rate_row(spec(
                KVPOLL,
                key,
                group,
                figure,
                NIXL_BEST,
                "NIXL best",
                Some(1.0),
            )));
        }
        for (key, group, figure) in [
            (
                "confirm_small_ucx_shm",
                "small_shm_ucx_pull",
                "16 KiB reads, UCX memory, shm: confirmation on vs off",
            ),
            (
                "confirm_small_caller_shm",
                "small_shm_caller_pull",
                "16 KiB reads, caller memory, shm: confirmation on vs off",
            ),
        ] {
            rows.push(self.rate_row(Spec {
                bytes: false,
                ..spec(
                    KVPOLL,
                    key,
                    group,
                    figure,
                    KVPOLL_UNCONFIRMED,
                    "kvpoll, no confirmation",
                    Some(0.8),
                )
            }));
        }
        for (key, group, figure) in [
            (
                "small_ucx_shm_vs_nixl",
                "small_shm_ucx_pull",
                "16 KiB reads, UCX memory, shm: best settings, vs NIXL best",
            ),
            (
                "small_caller_shm_vs_nixl",
                "small_shm_caller_pull",
                "16 KiB reads, caller memory, shm: best settings, vs NIXL best",
            ),
        ] {
            rows.push(self.rate_row(Spec {
                bytes: false,
                ..spec(
                    KVPOLL_BEST,
                    key,
                    group,
                    figure,
                    NIXL_BEST,
                    "NIXL best",
                    Some(2.0),
                )
            }));
        }
        for (what, shape, op, target) in [
            ("8mib_pull", "layers", "pull", Some(1.0)),
            ("8mib_push", "layers", "push", Some(1.0)),
            ("64mib", "large", "pull", Some(1.0)),
            ("small", "small", "pull", None),
        ] {
            let figure = match shape {
                "layers" => format!("8 MiB requests, {over}, {op}: vs Mooncake"),
                "large" => format!("64 MiB read, {over}: vs Mooncake"),
                _ => format!("16 KiB reads, {over}: vs Mooncake"),
            };
            rows.push(self.rate_row(Spec {
                bytes: shape != "small",
                ..spec(
                    KVPOLL,
                    &format!("{l}_{what}_vs_mooncake"),
                    &tcp(shape, op),
                    &figure,
                    MOONCAKE,
                    "Mooncake",
                    target,
                )
            }));
        }
        for (what, shape, label) in [
            ("8mib", "layers", "8 MiB requests"),
            ("64mib", "large", "64 MiB read"),
        ] {
            rows.push(self.rate_row(spec(
                KVPOLL,
                &format!("{l}_{what}_vs_tcp_stream"),
                &tcp(shape, "pull"),
                &format!("{label}, {over}: vs a tcp stream over it"),
                TCP_STREAM,
                "tcp stream",
                Some(0.5),
            )));
        }
        // The caller that polls once a step (a serving loop) against the
        // one that blocks in Engine::wait.
        for (key, group, figure) in [
            (
                "serving_loop_8mib_caller_shm".to_owned(),
                "layers_shm_caller_pull".to_owned(),
                "8 MiB requests, caller memory, shm: serving loop vs blocking".to_owned(),
            ),
            (
                "serving_loop_64mib_caller_shm".into(),
                "large_shm_caller_pull".into(),
                "64 MiB read, caller memory, shm: serving loop vs blocking".into(),
            ),
            (
                format!("serving_loop_8mib_{l}"),
                tcp("layers", "pull"),
                format!("8 MiB requests, {over}: serving loop vs blocking"),
            ),
            (
                format!("serving_loop_64mib_{l}"),
                tcp("large", "pull"),
                format!("64 MiB read, {over}: serving loop vs blocking"),
            ),
        ] {
            rows.push(self.rate_row(Spec {
                key,
                group,
                figure,
                ..spec(
                    KVPOLL_SERVING,
                    "",
                    "",
                    "",
                    KVPOLL,
                    "kvpoll, blocking caller",
                    Some(0.9),
                )
            }));
        }
        // CPU per GB, both processes, against the path's limit.
        for (key, group, figure, target) in [
            (
                "cpu_per_gb_8mib_caller_shm",
                "layers_shm_caller_pull",
                "CPU s/GB, 8 MiB requests, caller memory, shm: vs process_vm_readv",
                Some(1.1),
            ),
            (
                "cpu_per_gb_64mib_caller_shm",
                "large_shm_caller_pull",
                "CPU s/GB, 64 MiB read, caller memory, shm: vs process_vm_readv",
                Some(1.1),
            ),
            (
                "cpu_per_gb_8mib_ucx_shm",
                "layers_shm_ucx_pull",
                "CPU s/GB, 8 MiB requests, UCX memory, shm: vs process_vm_readv",
                None,
            ),
        ] {
            rows.push(self.cpu_row(key.into(), group, figure.into(), KVPOLL, PVREADV, target));
        }
        rows.push(self.cpu_row(
            "cpu_per_gb_nixl_8mib_caller_shm".into(),
            "layers_shm_caller_pull",
            "CPU s/GB, NIXL best, 8 MiB requests, caller memory, shm: vs process_vm_readv".into(),
            NIXL_BEST,
            PVREADV,
            None,
        ));
        for (what, shape, label) in [
            ("8mib", "layers", "8 MiB requests"),
            ("64mib", "large", "64 MiB read"),
        ] {
            for (sys, name) in [(KVPOLL, "kvpoll"), (MOONCAKE, "Mooncake")] {
                rows.push(self.cpu_row(
                    format!("cpu_per_gb_{}_{what}_{l}", name.to_lowercase()),
                    &tcp(shape, "pull"),
                    format!("CPU s/GB, {name}, {label}, {over}: vs a tcp stream"),
                    sys,
                    TCP_STREAM,
                    None,
                ));
            }
        }
        // Informational: what a shared key costs, loopback where the tcp
        // rows are of veth, settings for settings.
        for (key, group, what, bytes) in [
            (
                "key_small_caller_shm".to_owned(),
                "small_shm_caller_pull".to_owned(),
                "16 KiB reads, caller memory, shm: keyed vs no key".to_owned(),
                false,
            ),
            (
                format!("key_small_{l}"),
                tcp("small", "pull"),
                format!("16 KiB reads, {over}: keyed vs no key"),
                false,
            ),
            (
                "key_8mib_caller_shm".into(),
                "layers_shm_caller_pull".into(),
                "8 MiB requests, caller memory, shm: keyed vs no key".into(),
                true,
            ),
            (
                format!("key_8mib_{l}"),
                tcp("layers", "pull"),
                format!("8 MiB requests, {over}: keyed vs no key"),
                true,
            ),
        ] {
            rows.push(self.rate_row(Spec {
                key,
                group,
                figure: what,
                bytes,
                ..spec(KVPOLL_KEYED, "", "", "", KVPOLL, "kvpoll, no key", None)
            }));
        }
        if self.tcp_link == Link::Veth {
            for (what, group, figure) in [
                (
                    "8mib_pull",
                    "layers_loopback_caller_pull",
                    "8 MiB requests, tcp over loopback, pull: vs Mooncake",
                ),
                (
                    "64mib",
                    "large_loopback_caller_pull",
                    "64 MiB read, tcp over loopback: vs Mooncake",
                ),
            ] {
                rows.push(self.rate_row(spec(
                    KVPOLL,
                    &format!("loopback_{what}_vs_mooncake"),
                    group,
                    figure,
                    MOONCAKE,
                    "Mooncake",
                    None,
                )));
            }
        }
        rows.push(self.rate_row(spec(
            KVPOLL,
            "ucx_shm_8mib_vs_process_vm_readv",
            "layers_shm_ucx_pull",
            "8 MiB requests, UCX memory, shm: vs process_vm_readv",
            PVREADV,
            "process_vm_readv",
            None,
        )));
        for (who, key, group, figure, baseline, base_name) in [
            (
                KVPOLL,
                "small_ucx_shm_per_request_vs_nixl",
                "small_shm_ucx_pull",
                "16 KiB reads, UCX memory, shm: kvpoll per request vs NIXL best",
                NIXL_BEST,
                "NIXL best",
            ),
            (
                KVPOLL_BATCHED,
                "small_ucx_shm_batched_vs_nixl_batched",
                "small_shm_ucx_pull",
                "16 KiB reads, UCX memory, shm: batched, vs NIXL batched",
                NIXL_BATCHED,
                "NIXL, batched",
            ),
            (
                KVPOLL,
                "small_caller_shm_per_request_vs_nixl",
                "small_shm_caller_pull",
                "16 KiB reads, caller memory, shm: kvpoll per request vs NIXL best",
                NIXL_BEST,
                "NIXL best",
            ),
            (
                KVPOLL_BATCHED,
                "small_caller_shm_batched_vs_nixl_batched",
                "small_shm_caller_pull",
                "16 KiB reads, caller memory, shm: batched, vs NIXL batched",
                NIXL_BATCHED,
                "NIXL, batched",
            ),
        ] {
            rows.push(self.rate_row(Spec {
                bytes: false,
                ..spec(who, key, group, figure, baseline, base_name, None)
            }));
        }
        rows.push(self.rate_row(spec(
            KVPOLL,
            "caller_shm_8mib_push_vs_nixl",
            "layers_shm_caller_push",
            "8 MiB requests, caller memory, shm, push: vs NIXL best",
            NIXL_BEST,
            "NIXL best",
            None,
        )));
        let (checked, bad) = self
            .groups
            .iter()
            .flat_map(|g| &g.systems)
            .fold((0, 0), |(c, b), s| (c + s.checked, b + s.bad));
        rows.push(Row::new(
            "data_checked",
            "requests whose bytes were checked, wrong ones",
            "",
            Some(bad as f64),
            "requests checked",
            Some(checked as f64),
            None,
            "0 wrong",
            (bad == 0 && checked > 0).into(),
            "every system, every group; a sample of each round's requests",
        ));
        rows
    }

    /// Why group `key` did not run, if it was run and failed.
    fn did_not_run(&self, key: &str) -> Option<String> {
        self.failed
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, why)| format!("{key} did not run: {why}"))
    }

    /// The group, `who`'s figures and the baseline's, or why one is
    /// missing.
    fn note(&self, group: &str, who: &str, baseline: &str) -> String {
        let Some(g) = self.group(group) else {
            return self
                .did_not_run(group)
                .unwrap_or_else(|| format!("{group} not run"));
        };
        let mut n = group.to_string();
        for (name, fig) in [(who, g.pick(who)), (baseline, g.pick(baseline))] {
            match fig {
                Some(s) => {
                    let _ = write!(
                        n,
                        "; {} {:.2} GB/s ({:.2}-{:.2}), rounds of {:.2} GB / {:.2} s, {:.3} CPU s/GB",
                        s.system,
                        s.gb_per_s,
                        s.per_s_min * g.group.shape.bytes() as f64 / 1e9,
                        s.per_s_max * g.group.shape.bytes() as f64 / 1e9,
                        s.round_gb,
                        s.round_secs,
                        s.cpu_s_per_gb
                    );
                }
                None => {
                    let why = g
                        .failure(name)
                        .map(|w| format!("FAILED: {w}"))
                        .or_else(|| {
                            g.absent
                                .iter()
                                .find(|(s, _)| {
                                    s.starts_with(name) || name == NIXL_BEST && s.starts_with(NIXL)
                                })
                                .map(|(_, w)| w.clone())
                        })
                        .unwrap_or_else(|| "not measured".into());
                    let _ = write!(n, "; {name} not measured: {why}");
                }
            }
        }
        n
    }

    /// Every group as a small table: each system's rate (median, slowest
    /// and fastest round), GB/s, ratio to kvpoll, CPU (and against the
    /// path's limit), checks; systems not measured, and those that failed.
    pub fn print_groups(&self) {
        println!(
            "\ncomparison (indicative absolute figures; ratios are to kvpoll in the same group, same run):"
        );
        println!("  {}", self.huge_pages);
        println!(
            "  this binary {} fault injection; {}",
            if self.fault_injection {
                "HAS"
            } else {
                "has no"
            },
            self.peers
        );
        println!(
            "  rounds of at least {:.2} GB and {:.2} s each, interleaved across a group's systems",
            self.round_size.min_bytes / 1e9,
            self.round_size.min_secs
        );
        if !self.link_note.is_empty() {
            println!("  {}", self.link_note);
        }
        for g in &self.groups {
            println!("\n  {} [{}]", g.group.title(), g.group.key());
            let k = g.get(KVPOLL).map(|s| s.per_s);
            let limit = g
                .get(PVREADV)
                .or_else(|| g.get(TCP_STREAM))
                .map(|s| (s.system.as_str(), s.cpu_s_per_gb));
            for s in &g.systems {
                println!(
                    "    {:<34} {:>12} ({:>10} - {:>10}) {:>8.2} GB/s {:>8} {:>8.3} CPU s/GB{} {:>9.1} CPU us/req  checked {} wrong {}",
                    s.system,
                    human(s.per_s),
                    human(s.per_s_min),
                    human(s.per_s_max),
                    s.gb_per_s,
                    k.map_or("-".into(), |k| format!("{:.2}x", s.per_s / k)),
                    s.cpu_s_per_gb,
                    limit.map_or(String::new(), |(_, l)| format!(" ({:.2}x limit)", s.cpu_s_per_gb / l)),
                    s.cpu_us_per_request,
                    s.checked,
                    s.bad
                );
            }
            if let Some(b) = g.nixl_best() {
                println!("    NIXL best here: {}", b.system);
            }
            for (s, why) in &g.absent {
                println!("    {s:<34} not measured: {why}");
            }
            for (s, why) in &g.failed {
                println!("    {s:<34} FAILED: {why}");
            }
        }
        for (k, why) in &self.failed {
            println!("\n  {k}: FAILED, did not run: {why}");
        }
    }

    /// One JSON object.
    pub fn to_json(&self) -> String {
        let groups: Vec<String> = self.groups.iter().map(GroupFigures::to_json).collect();
        let failed: Vec<String> = self
            .failed
            .iter()
            .map(|(k, why)| format!("{{\"group\":\"{k}\",\"why\":\"{}\"}}", json_text(why)))
            .collect();
        format!(
            "{{\"huge_pages\":\"{}\",\"fault_injection\":{},\"peers\":\"{}\",\"tcp_link\":\"{}\",\"link_note\":\"{}\",\"round_min_gb\":{:.3},\"round_min_secs\":{:.3},\"groups\":[{}],\"failed\":[{}]}}",
            self.huge_pages,
            self.fault_injection,
            json_text(&self.peers),
            self.tcp_link.name(),
            json_text(&self.link_note),
            self.round_size.min_bytes / 1e9,
            self.round_size.min_secs,
            groups.join(","),
            failed.join(",")
        )
    }

    /// Bars: each system's GB/s in each group, as a share of the group's
    /// fastest, labelled with the rate and its ratio to kvpoll.
    pub fn svg(&self, path: &Path) -> std::io::Result<()> {
        const W: usize = 980;
        const BAR: usize = 16;
        const LABEL: usize = 230;
        let mut body = String::new();
        let mut y = 40;
        for g in &self.groups {
            let _ = writeln!(
                body,
                "<text x=\"10\" y=\"{}\" font-weight=\"bold\">{}</text>",
                y + 14,
                esc(&g.group.title())
            );
            y += 22;
            let max = g
                .systems
                .iter()
                .map(|s| s.gb_per_s)
                .fold(0.0, f64::max)
                .max(1e-9);
            let k = g.get(KVPOLL).map(|s| s.per_s);
            for s in &g.systems {
                let w = ((W - LABEL - 250) as f64 * s.gb_per_s / max).round() as usize;
                let colour = match s.system.as_str() {
                    KVPOLL | KVPOLL_SERVING | KVPOLL_UNCONFIRMED | KVPOLL_BATCHED
                    | KVPOLL_KEYED => "#1f77b4",
                    RAW => "#7f7f7f",
                    MEMCPY | PVREADV | TCP_STREAM => "#2ca02c",
                    n if n.starts_with(NIXL) => "#d62728",
                    MOONCAKE => "#9467bd",
                    _ => "#17becf",
                };
                let _ = writeln!(
                    body,
                    "<text x=\"20\" y=\"{}\">{}</text><rect x=\"{LABEL}\" y=\"{y}\" width=\"{w}\" height=\"{}\" fill=\"{colour}\"/><text x=\"{}\" y=\"{}\">{:.2} GB/s ({}), {:.2} CPU s/GB</text>",
                    y + 12,
                    esc(&s.system),
                    BAR - 3,
                    LABEL + w + 6,
                    y + 12,
                    s.gb_per_s,
                    k.map_or("-".into(), |k| format!("{:.2}x kvpoll", s.per_s / k)),
                    s.cpu_s_per_gb
                );
                y += BAR;
            }
            for (s, why) in &g.absent {
                let _ = writeln!(
                    body,
                    "<text x=\"20\" y=\"{}\" fill=\"#999\">{}: not measured ({})</text>",
                    y + 12,
                    esc(s),
                    esc(&why.chars().take(90).collect::<String>())
                );
                y += BAR;
            }
            y += 12;
        }
        let svg = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"20\" font-size=\"15\">kvpoll bench compare: GB/s per system and group (one run; bars to scale within a group)</text>\n{body}</svg>\n",
            y + 10
        );
        std::fs::write(path, svg)
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn human(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M/s", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.1} k/s", v / 1e3)
    } else {
        format!("{v:.1} /s")
    }
}
