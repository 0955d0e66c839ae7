//! Advice on a valid core map: placements that work but cost latency or
//! CPU. `kvpoll topo --check` prints these; none of them makes a map
//! invalid.

use std::fmt;

use super::core_map::{CoreMap, IdlePolicy};
use super::topology::Topology;

/// One piece of advice about a core map, tied to the poller's line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    /// The map's name.
    pub file: String,
    /// The line of the poller concerned.
    pub line: usize,
    /// What is wrong.
    pub kind: WarningKind,
}

/// What a [`Warning`] is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WarningKind {
    /// A busy poller on a CPU the scheduler still balances other tasks onto
    /// (`isolcpus`): they will preempt it, and it will starve them.
    BusyNotIsolated {
        /// The poller's CPU.
        core: usize,
    },
    /// A poller's CPU is a hyperthread sibling of another poller's or an
    /// engine thread's CPU: they share one core's execution units and L1/L2.
    SharesPhysicalCore {
        /// The poller's CPU.
        core: usize,
        /// The sibling CPU.
        sibling: usize,
        /// Who runs there: `poller` or `engine`.
        with: &'static str,
    },
    /// A poller drives a NIC attached to another NUMA node: every
    /// completion crosses the socket interconnect.
    RemoteNic {
        /// The poller's CPU.
        core: usize,
        /// The worker spec naming the NIC.
        worker: String,
        /// The CPU's NUMA node.
        cpu_numa: usize,
        /// The NIC's NUMA node.
        nic_numa: usize,
    },
    /// A worker names a device this machine does not show.
    UnknownDevice {
        /// The poller's CPU.
        core: usize,
        /// The worker spec.
        worker: String,
    },
    /// The CPU exists but this process may not run there (cgroup cpuset or
    /// `taskset`): pinning will fail.
    NotAllowed {
        /// The CPU.
        core: usize,
    },
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: warning: ", self.file, self.line)?;
        match &self.kind {
            WarningKind::BusyNotIsolated { core } => write!(
                f,
                "busy poller on CPU {core}, which is not isolated (isolcpus/nohz_full): \
                 other tasks will share it; isolate it or use idle = \"adaptive\""
            ),
            WarningKind::SharesPhysicalCore { core, sibling, with } => write!(
                f,
                "poller CPU {core} shares a physical core with CPU {sibling} ({with}): \
                 hyperthread siblings compete for one core; leave the sibling idle"
            ),
            WarningKind::RemoteNic {
                core,
                worker,
                cpu_numa,
                nic_numa,
            } => write!(
                f,
                "poller CPU {core} is on NUMA node {cpu_numa} but its worker {worker:?} is a \
                 NIC on NUMA node {nic_numa}: pick a CPU on node {nic_numa}"
            ),
            WarningKind::UnknownDevice { core, worker } => write!(
                f,
                "poller CPU {core}: worker {worker:?} names no device on this machine \
                 (see `kvpoll topo` for devices and interfaces)"
            ),
            WarningKind::NotAllowed { core } => write!(
                f,
                "CPU {core} is not in this process's allowed CPUs (cgroup or taskset): pinning will fail"
            ),
        }
    }
}

/// Checks a map (already valid on `topology`) for costly placements.
pub fn check(map: &CoreMap, topology: &Topology) -> Vec<Warning> {
    let mut warnings = Vec::new();
    let mut warn = |line: usize, kind: WarningKind| {
        warnings.push(Warning {
            file: map.name().to_owned(),
            line,
            kind,
        })
    };
    for &core in map.engine_cores() {
        if topology.cpu(core).is_some_and(|c| !c.allowed) {
            warn(map.engine_line(), WarningKind::NotAllowed { core });
        }
    }
    for (i, p) in map.pollers().iter().enumerate() {
        let line = map.poller_line(i);
        let core = p.core;
        let cpu = topology.cpu(core);
        if cpu.is_some_and(|c| !c.allowed) {
            warn(line, WarningKind::NotAllowed { core });
        }
        if p.idle == IdlePolicy::Busy && !topology.isolation.is_isolated(core) {
            warn(line, WarningKind::BusyNotIsolated { core });
        }
        for sibling in topology.siblings(core) {
            let with = if map.engine_cores().contains(&sibling) {
                "engine"
            } else if map.pollers().iter().any(|q| q.core == sibling) {
                "poller"
            } else {
                continue;
            };
            warn(
                line,
                WarningKind::SharesPhysicalCore {
                    core,
                    sibling,
                    with,
                },
            );
        }
        for worker in &p.workers {
            if !topology.knows_worker(worker) {
                warn(
                    line,
                    WarningKind::UnknownDevice {
                        core,
                        worker: worker.clone(),
                    },
                );
                continue;
            }
            let nic_numa = topology.device_for_worker(worker).and_then(|d| d.numa);
            let cpu_numa = cpu.and_then(|c| c.numa);
            if let (Some(nic_numa), Some(cpu_numa)) = (nic_numa, cpu_numa) {
                if nic_numa != cpu_numa {
                    warn(
                        line,
                        WarningKind::RemoteNic {
                            core,
                            worker: worker.clone(),
                            cpu_numa,
                            nic_numa,
                        },
                    );
                }
            }
        }
    }
    warnings
}
