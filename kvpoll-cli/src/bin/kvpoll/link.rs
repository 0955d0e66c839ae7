//! The veth link of `kvpoll bench compare`'s tcp groups: two network
//! namespaces joined by a veth pair (MTU 1500), so that the two sides of
//! a tcp transfer each go through their own network stack, as between
//! two hosts, rather than through one host's loopback device.
//!
//! Making it needs root (`ip netns add`, `ip link add type veth`). The
//! namespaces go when the link is dropped — at the end of the run, and
//! when the run fails — and a later run removes those a killed run left
//! (their names carry the pid that made them).

use std::process::Command;

/// The device on both sides (each in its own namespace).
pub const DEVICE: &str = "kvpoll0";
/// The address of the side the bench runs in.
pub const NEAR: &str = "10.77.0.1";
/// The address of the peers' side.
pub const FAR: &str = "10.77.0.2";
/// What every namespace this module makes is called before its pid.
const PREFIX: &str = "kvpoll-bench-";

/// Two network namespaces joined by veth pairs; removed on drop.
pub struct VethLink {
    /// Where the bench's own side of a group runs.
    pub near: String,
    /// Where the peers run.
    pub far: String,
    /// The pairs: device `kvpoll<i>` on both sides, addresses
    /// `10.77.<i>.1` (near) and `10.77.<i>.2` (far).
    pairs: usize,
}

/// Pair `i`'s device (the same name on both sides).
pub fn device(i: usize) -> String {
    format!("kvpoll{i}")
}

/// Pair `i`'s address on the near side.
pub fn near_address(i: usize) -> String {
    format!("10.77.{i}.1")
}

/// Pair `i`'s address on the far side.
pub fn far_address(i: usize) -> String {
    format!("10.77.{i}.2")
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip not runnable: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}

impl VethLink {
    /// Makes the link (one pair), or says why it cannot be made here.
    pub fn create() -> Result<Self, String> {
        Self::create_pairs(1)
    }

    /// Makes the namespaces joined by `pairs` veth pairs (1 to 200), or
    /// says why they cannot be made here.
    pub fn create_pairs(pairs: usize) -> Result<Self, String> {
        if !(1..=200).contains(&pairs) {
            return Err(format!("{pairs} veth pairs: 1 to 200 can be made"));
        }
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("making network namespaces needs root".into());
        }
        remove_stale();
        let pid = std::process::id();
        let near = format!("{PREFIX}{pid}-a");
        let far = format!("{PREFIX}{pid}-b");
        ip(&["netns", "add", &near])?;
        // From here on, dropping the link removes what was made.
        let link = VethLink { near, far, pairs };
        ip(&["netns", "add", &link.far])?;
        for i in 0..pairs {
            let dev = device(i);
            ip(&[
                "link", "add", &dev, "netns", &link.near, "type", "veth", "peer", "name", &dev,
                "netns", &link.far,
            ])?;
            for (ns, host) in [(&link.near, 1), (&link.far, 2)] {
                let addr = format!("10.77.{i}.{host}/24");
                ip(&["-n", ns, "addr", "add", &addr, "dev", &dev])?;
                ip(&["-n", ns, "link", "set", &dev, "up"])?;
            }
        }
        for ns in [&link.near, &link.far] {
            // UCX offers no tcp transport in a namespace whose loopback
            // device is down; the data still goes over the pairs' devices
            // alone (UCX_NET_DEVICES, and the peers' addresses).
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        // A veth end takes a moment to have carrier; UCX takes a device
        // without it for absent, and would find no tcp transport.
        let t = std::time::Instant::now();
        while !(link.up(&link.near) && link.up(&link.far)) {
            if t.elapsed() > std::time::Duration::from_secs(10) {
                return Err("the veth pairs have no carrier after 10 s".into());
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Ok(link)
    }

    /// Whether every pair's device in namespace `ns` is up with carrier.
    fn up(&self, ns: &str) -> bool {
        (0..self.pairs).all(|i| {
            Command::new("ip")
                .args(["-n", ns, "-o", "link", "show", &device(i)])
                .output()
                .is_ok_and(|o| {
                    let s = String::from_utf8_lossy(&o.stdout);
                    s.contains("LOWER_UP") && s.contains("state UP")
                })
        })
    }
}

impl Drop for VethLink {
    fn drop(&mut self) {
        // Removing a namespace removes its end of the pair, and the pair.
        for ns in [&self.near, &self.far] {
            if let Err(e) = ip(&["netns", "del", ns]) {
                tracing::warn!("removing network namespace {ns}: {e}");
            }
        }
    }
}

/// Removes the namespaces of runs whose process is gone (killed before
/// it could remove them).
fn remove_stale() {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", &name]);
        }
    }
}
