//! `kvpoll bench compare`: the serving shapes against the physical limits
//! and the peer systems (kvpoll_cli::bench::shapes), as table rows with
//! targets, a table per group, JSON and an SVG.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kvpoll_cli::bench::memory::huge_pages;
use kvpoll_cli::bench::shapes::{
    default_groups, run_group, GroupFigures, Peers, SystemFigures, KVPOLL, KVPOLL_BATCHED,
    KVPOLL_KEYED, KVPOLL_UNCONFIRMED, MEMCPY, MOONCAKE, NIXL, NIXL_BATCHED, PVREADV, RAW,
};

use crate::bench::{Met, Row};
use crate::cli::CliError;

/// kvpoll's better confirmed setting (per request or batched) in a group:
/// what a row compares with NIXL's better setting.
const KVPOLL_BEST: &str = "kvpoll (best)";

/// The driver of the peer systems, carried inside the binary.
const PEER_BENCH_PY: &str = include_str!("../../../benches/peers/peer_bench.py");

/// What a comparison run measured, and under which conditions.
pub struct Comparison {
    pub groups: Vec<GroupFigures>,
    /// Groups that did not run, and why.
    pub failed: Vec<(String, String)>,
    pub huge_pages: String,
    pub fault_injection: bool,
    pub peers: String,
}

/// The Python of the peer systems: the one given, `$KVPOLL_BENCH_PYTHON`,
/// or the venv `make bench-peers` makes beside this binary's directory.
fn peers_python(given: Option<&Path>) -> Option<PathBuf> {
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

/// Runs every group (those whose key contains `only`).
pub fn run(
    shm: &str,
    rounds: u32,
    scale: f64,
    only: Option<&str>,
    python: Option<&Path>,
    alt_ucx: Option<&str>,
) -> Result<Comparison, CliError> {
    let alt_ucx = match alt_ucx {
        None => Vec::new(),
        Some(list) => list
            .split(',')
            .map(|kv| {
                kv.split_once('=')
                    .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                    .ok_or_else(|| CliError::Failed(format!("--alt-ucx: {kv:?} is not NAME=VALUE")))
            })
            .collect::<Result<_, _>>()?,
    };
    let exe = std::env::current_exe()
        .map_err(|e| CliError::Failed(format!("locating the kvpoll binary: {e}")))?;
    if !(0.01..=10.0).contains(&scale) {
        return Err(CliError::Failed("--scale must be within 0.01..=10".into()));
    }
    let dir = std::env::temp_dir().join(format!("kvpoll-compare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| CliError::Failed(format!("temp dir: {e}")))?;
    let script = dir.join("peer_bench.py");
    std::fs::write(&script, PEER_BENCH_PY)
        .map_err(|e| CliError::Failed(format!("writing the peer driver: {e}")))?;
    let python = peers_python(python);
    let peers_note = match &python {
        Some(p) => format!("peer systems through {}", p.display()),
        None => {
            "peer systems not measured: no Python with NIXL and Mooncake (make bench-peers)".into()
        }
    };
    let peers = Peers {
        python,
        script: Some(script),
        alt_ucx,
    };
    let mut groups = Vec::new();
    let mut failed = Vec::new();
    for mut g in default_groups(shm) {
        if only.is_some_and(|o| !g.key().contains(o)) {
            continue;
        }
        g.requests = ((f64::from(g.requests) * scale).round() as u32).max(1);
        match run_group(&exe, &g, &peers, rounds) {
            Ok(f) => groups.push(f),
            Err(e) => {
                tracing::warn!(group = %g.key(), "did not run: {e}");
                failed.push((g.key(), e.to_string()));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Comparison {
        groups,
        failed,
        huge_pages: huge_pages(),
        fault_injection: kvpoll_cli::FAULT_INJECTION,
        peers: peers_note,
    })
}

impl Comparison {
    fn group(&self, key: &str) -> Option<&GroupFigures> {
        self.groups.iter().find(|g| g.group.key() == key)
    }

    /// `a / b` of two systems' rates in group `key`.
    fn rate_ratio(&self, key: &str, a: &str, b: &str) -> (Option<f64>, Option<f64>) {
        let g = self.group(key);
        let pick = |name: &str| -> Option<&SystemFigures> {
            let g = g?;
            match name {
                NIXL => g.nixl_best(),
                KVPOLL_BEST => g.kvpoll_best(),
                _ => g.get(name),
            }
        };
        (pick(a).map(|s| s.per_s), pick(b).map(|s| s.per_s))
    }

    /// The rows with targets, then informational ones.
    pub fn rows(&self) -> Vec<Row> {
        let mut rows = Vec::new();
        // `who`: which of kvpoll's systems is compared ([`KVPOLL`]; for
        // small reads against NIXL's best setting, kvpoll's best).
        let mut rate_of = |who: &'static str,
                           key: &'static str,
                           group: &str,
                           figure: &'static str,
                           baseline: &'static str,
                           base_name: &'static str,
                           target: Option<f64>,
                           bytes: bool| {
            let (k, b) = self.rate_ratio(group, who, baseline);
            let (unit, k, b) = match self.group(group) {
                Some(g) if bytes => {
                    let gb = g.group.shape.bytes() as f64 / 1e9;
                    ("GB/s", k.map(|v| v * gb * 1e9), b.map(|v| v * gb * 1e9))
                }
                _ => ("/s", k, b),
            };
            let ratio = k.zip(b).map(|(k, b)| k / b);
            rows.push(Row {
                key,
                figure,
                unit: if unit == "GB/s" { "B/s" } else { unit },
                kvpoll: k,
                baseline_name: base_name,
                baseline: b,
                ratio,
                target: match target {
                    Some(t) if t >= 1.9 => ">= 2x",
                    Some(t) if t >= 1.0 => ">= 1.0x",
                    Some(t) if t >= 0.9 => ">= 0.9x",
                    Some(_) => ">= 0.8x",
                    None => "(measured, no target)",
                },
                met: self.met(group, target.and_then(|t| ratio.map(|r| r >= t))),
                note: self.note(group, who, baseline),
            });
        };
        rate_of(
            KVPOLL,
            "caller_shm_8mib_vs_process_vm_readv",
            "layers_shm_caller_pull",
            "8 MiB requests, caller memory, shm: vs process_vm_readv",
            PVREADV,
            "process_vm_readv",
            Some(0.9),
            true,
        );
        rate_of(
            KVPOLL,
            "caller_shm_8mib_vs_nixl",
            "layers_shm_caller_pull",
            "8 MiB requests, caller memory, shm: vs NIXL",
            NIXL,
            "NIXL (best)",
            Some(1.0),
            true,
        );
        rate_of(
            KVPOLL,
            "caller_shm_64mib_vs_nixl",
            "large_shm_caller_pull",
            "64 MiB read, caller memory, shm: vs NIXL",
            NIXL,
            "NIXL (best)",
            Some(1.0),
            true,
        );
        rate_of(
            KVPOLL,
            "ucx_shm_64mib_vs_nixl",
            "large_shm_ucx_pull",
            "64 MiB read, UCX memory, shm: vs NIXL",
            NIXL,
            "NIXL (best)",
            Some(1.0),
            true,
        );
        rate_of(
            KVPOLL,
            "confirm_small_ucx_shm",
            "small_shm_ucx_pull",
            "16 KiB reads, UCX memory, shm: confirmation on vs off",
            KVPOLL_UNCONFIRMED,
            "kvpoll, no confirmation",
            Some(0.8),
            false,
        );
        rate_of(
            KVPOLL,
            "confirm_small_caller_shm",
            "small_shm_caller_pull",
            "16 KiB reads, caller memory, shm: confirmation on vs off",
            KVPOLL_UNCONFIRMED,
            "kvpoll, no confirmation",
            Some(0.8),
            false,
        );
        // What a shared key costs: the keyed engine against the same
        // shapes without one.
        for (key, group, what, bytes) in [
            (
                "key_small_caller_shm",
                "small_shm_caller_pull",
                "16 KiB reads, caller memory, shm: keyed vs no key",
                false,
            ),
            (
                "key_small_tcp",
                "small_tcp_caller_pull",
                "16 KiB reads, tcp: keyed vs no key",
                false,
            ),
            (
                "key_8mib_caller_shm",
                "layers_shm_caller_pull",
                "8 MiB requests, caller memory, shm: keyed vs no key",
                true,
            ),
            (
                "key_8mib_tcp",
                "layers_tcp_caller_pull",
                "8 MiB requests, tcp: keyed vs no key",
                true,
            ),
        ] {
            rate_of(
                KVPOLL_KEYED,
                key,
                group,
                what,
                KVPOLL,
                "kvpoll, no key",
                None,
                bytes,
            );
        }
        rate_of(
            KVPOLL_BEST,
            "small_ucx_shm_vs_nixl",
            "small_shm_ucx_pull",
            "16 KiB reads, UCX memory, shm: best settings, vs NIXL",
            NIXL,
            "NIXL (best)",
            Some(2.0),
            false,
        );
        rate_of(
            KVPOLL_BEST,
            "small_caller_shm_vs_nixl",
            "small_shm_caller_pull",
            "16 KiB reads, caller memory, shm: best settings, vs NIXL",
            NIXL,
            "NIXL (best)",
            Some(2.0),
            false,
        );
        rate_of(
            KVPOLL,
            "tcp_8mib_pull_vs_mooncake",
            "layers_tcp_caller_pull",
            "8 MiB requests, tcp, pull: vs Mooncake",
            MOONCAKE,
            "Mooncake",
            Some(1.0),
            true,
        );
        rate_of(
            KVPOLL,
            "tcp_8mib_push_vs_mooncake",
            "layers_tcp_caller_push",
            "8 MiB requests, tcp, push: vs Mooncake",
            MOONCAKE,
            "Mooncake",
            Some(1.0),
            true,
        );
        rate_of(
            KVPOLL,
            "tcp_64mib_vs_mooncake",
            "large_tcp_caller_pull",
            "64 MiB read, tcp: vs Mooncake",
            MOONCAKE,
            "Mooncake",
            Some(1.0),
            true,
        );
        rate_of(
            KVPOLL,
            "tcp_small_vs_mooncake",
            "small_tcp_caller_pull",
            "16 KiB reads, tcp: vs Mooncake",
            MOONCAKE,
            "Mooncake",
            None,
            false,
        );
        rate_of(
            KVPOLL,
            "ucx_shm_8mib_vs_process_vm_readv",
            "layers_shm_ucx_pull",
            "8 MiB requests, UCX memory, shm: vs process_vm_readv",
            PVREADV,
            "process_vm_readv",
            None,
            true,
        );
        // Small reads setting for setting, without targets: kvpoll a
        // request a read against NIXL's best, and batched against batched.
        for (who, key, group, figure, baseline, base_name) in [
            (
                KVPOLL,
                "small_ucx_shm_per_request_vs_nixl",
                "small_shm_ucx_pull",
                "16 KiB reads, UCX memory, shm: kvpoll per request vs NIXL",
                NIXL,
                "NIXL (best)",
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
                "16 KiB reads, caller memory, shm: kvpoll per request vs NIXL",
                NIXL,
                "NIXL (best)",
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
            rate_of(who, key, group, figure, baseline, base_name, None, false);
        }
        rate_of(
            KVPOLL,
            "caller_shm_8mib_push_vs_nixl",
            "layers_shm_caller_push",
            "8 MiB requests, caller memory, shm, push: vs NIXL",
            NIXL,
            "NIXL (best)",
            None,
            true,
        );
        for (key, group, figure) in [
            (
                "cpu_per_gb_8mib_caller_shm",
                "layers_shm_caller_pull",
                "CPU s/GB, 8 MiB requests, caller memory, shm",
            ),
            (
                "cpu_per_gb_64mib_caller_shm",
                "large_shm_caller_pull",
                "CPU s/GB, 64 MiB read, caller memory, shm",
            ),
            (
                "cpu_per_gb_8mib_ucx_shm",
                "layers_shm_ucx_pull",
                "CPU s/GB, 8 MiB requests, UCX memory, shm",
            ),
            (
                "cpu_per_gb_8mib_tcp",
                "layers_tcp_caller_pull",
                "CPU s/GB, 8 MiB requests, tcp",
            ),
            (
                "cpu_per_gb_64mib_tcp",
                "large_tcp_caller_pull",
                "CPU s/GB, 64 MiB read, tcp",
            ),
        ] {
            let g = self.group(group);
            let k = g.and_then(|g| g.get(KVPOLL)).map(|s| s.cpu_s_per_gb);
            let b = g.and_then(|g| g.get(RAW)).map(|s| s.cpu_s_per_gb);
            let ratio = k.zip(b).map(|(k, b)| k / b);
            rows.push(Row {
                key,
                figure,
                unit: "s/GB",
                kvpoll: k,
                baseline_name: "raw UCX loop",
                baseline: b,
                ratio,
                target: "<= 1.2x",
                met: self.met(group, ratio.map(|r| r <= 1.2)),
                note: self.note(group, KVPOLL, RAW),
            });
        }
        let (checked, bad) = self
            .groups
            .iter()
            .flat_map(|g| &g.systems)
            .fold((0, 0), |(c, b), s| (c + s.checked, b + s.bad));
        rows.push(Row {
            key: "data_checked",
            figure: "requests whose bytes were checked, wrong ones",
            unit: "",
            kvpoll: Some(bad as f64),
            baseline_name: "requests checked",
            baseline: Some(checked as f64),
            ratio: None,
            target: "0 wrong",
            met: (bad == 0 && checked > 0).into(),
            note: "every system, every group; a sample of each round's requests".into(),
        });
        rows
    }

    /// Why group `key` did not run, if it was run and failed.
    fn did_not_run(&self, key: &str) -> Option<String> {
        self.failed
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, why)| format!("{key} did not run: {why}"))
    }

    /// A row of group `key`: `judged` (met, missed, or no target), or
    /// failed when the group did not run.
    fn met(&self, key: &str, judged: Option<bool>) -> Met {
        self.did_not_run(key).map_or(judged.into(), Met::Failed)
    }

    /// The group, `who`'s figures (one of kvpoll's systems) and the
    /// baseline's, or why one is missing.
    fn note(&self, group: &str, who: &str, baseline: &str) -> String {
        let Some(g) = self.group(group) else {
            return self
                .did_not_run(group)
                .unwrap_or_else(|| format!("{group} not run"));
        };
        let base = if baseline == NIXL {
            g.nixl_best()
        } else {
            g.get(baseline)
        };
        let mut n = group.to_string();
        let k = if who == KVPOLL_BEST {
            g.kvpoll_best()
        } else {
            g.get(who)
        };
        if let Some(k) = k {
            let _ = write!(
                n,
                "; {} {:.2} GB/s, {:.3} CPU s/GB",
                k.system, k.gb_per_s, k.cpu_s_per_gb
            );
        }
        match base {
            Some(b) => {
                let _ = write!(
                    n,
                    "; {} {:.2} GB/s, {:.3} CPU s/GB",
                    b.system, b.gb_per_s, b.cpu_s_per_gb
                );
            }
            None => {
                let why = g
                    .absent
                    .iter()
                    .find(|(s, _)| s.starts_with(baseline))
                    .map_or("not measured", |(_, w)| w.as_str());
                let _ = write!(n, "; {baseline} not measured: {why}");
            }
        }
        n
    }

    /// Every group as a small table: each system's rate, GB/s, ratio to
    /// kvpoll, CPU, checks.
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
        for g in &self.groups {
            println!("\n  {} [{}]", g.group.title(), g.group.key());
            let k = g.get(KVPOLL).map(|s| s.per_s);
            for s in &g.systems {
                println!(
                    "    {:<26} {:>12} {:>9.2} GB/s {:>8} {:>8.3} CPU s/GB {:>10.1} CPU us/req  checked {} wrong {}",
                    s.system,
                    human(s.per_s),
                    s.gb_per_s,
                    k.map_or("-".into(), |k| format!("{:.2}x", s.per_s / k)),
                    s.cpu_s_per_gb,
                    s.cpu_us_per_request,
                    s.checked,
                    s.bad
                );
            }
            for (s, why) in &g.absent {
                println!("    {s:<26} not measured: {why}");
            }
        }
        for (k, why) in &self.failed {
            println!("\n  {k}: did not run: {why}");
        }
    }

    /// One JSON object.
    pub fn to_json(&self) -> String {
        let groups: Vec<String> = self.groups.iter().map(GroupFigures::to_json).collect();
        let failed: Vec<String> = self
            .failed
            .iter()
            .map(|(k, why)| {
                format!(
                    "{{\"group\":\"{k}\",\"why\":\"{}\"}}",
                    why.replace(['"', '\\'], "'")
                )
            })
            .collect();
        format!(
            "{{\"huge_pages\":\"{}\",\"fault_injection\":{},\"peers\":\"{}\",\"groups\":[{}],\"failed\":[{}]}}",
            self.huge_pages,
            self.fault_injection,
            self.peers.replace(['"', '\\'], "'"),
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
                    KVPOLL | KVPOLL_UNCONFIRMED | KVPOLL_BATCHED | KVPOLL_KEYED => "#1f77b4",
                    RAW => "#7f7f7f",
                    MEMCPY | PVREADV => "#2ca02c",
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
