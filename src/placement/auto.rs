//! Deriving a core map from the machine (`auto`).
//!
//! The rules, in order:
//! 1. The engine gets the lowest usable CPU that is not isolated (CPU 0 on
//!    most machines): the housekeeping CPU where interrupts and kernel
//!    threads land anyway.
//! 2. Pollers get the other usable CPUs, never the engine CPU's hyperthread
//!    sibling when another CPU is free, and preferring isolated CPUs, then
//!    CPUs that have taken fewer interrupts.
//! 3. One poller per RDMA NIC, on a CPU of the NIC's NUMA node when one is
//!    free; with more NICs than CPUs, NICs share a poller on their node.
//!    Without RDMA NICs, one poller whose worker uses every device (`all`).
//! 4. A poller on an isolated CPU is `busy`; elsewhere `adaptive`, since a
//!    spinning thread on a shared CPU steals time from everything else.

use super::core_map::{render, CoreMap, IdlePolicy, PollerSpec};
use super::cpulist::format_cpu_list;
use super::error::PlacementError;
use super::topology::{Topology, ALL_DEVICES};

impl CoreMap {
    /// Derives a core map for `topology` (see the module docs for the
    /// rules). The map is the one [`CoreMap::auto_toml`] prints, parsed.
    pub fn auto(topology: &Topology) -> Result<Self, PlacementError> {
        Self::parse(&Self::auto_toml(topology)?, super::core_map::AUTO)
    }

    /// The derived core map as annotated TOML, as `kvpoll topo` suggests it.
    pub fn auto_toml(topology: &Topology) -> Result<String, PlacementError> {
        let usable: Vec<usize> = topology
            .cpus
            .iter()
            .filter(|c| c.online && c.allowed)
            .map(|c| c.id)
            .collect();
        let iso = &topology.isolation;
        let Some(&engine) = usable
            .iter()
            .find(|&&c| !iso.is_isolated(c))
            .or(usable.first())
        else {
            return Err(PlacementError::NoFreeCpu(
                "no CPU is online and allowed for this process".to_owned(),
            ));
        };

        let engine_siblings = topology.siblings(engine);
        let mut candidates: Vec<usize> = usable
            .iter()
            .copied()
            .filter(|&c| c != engine && !engine_siblings.contains(&c))
            .collect();
        if candidates.is_empty() {
            candidates = usable.iter().copied().filter(|&c| c != engine).collect();
        }
        if candidates.is_empty() {
            return Err(PlacementError::NoFreeCpu(format!(
                "only CPU {engine} is usable, and a poller needs a CPU apart from the engine's"
            )));
        }
        let irqs = |c: usize| iso.interrupts.get(&c).copied().unwrap_or(0);
        candidates.sort_by_key(|&c| (!iso.is_isolated(c), irqs(c), c));

        // (worker, NUMA node of its device, why) for each poller to place.
        let mut wanted: Vec<(String, Option<usize>, String)> = topology
            .nics()
            .filter_map(|nic| {
                let rdma = nic.rdma.first()?;
                Some((
                    format!("{rdma}:1"),
                    nic.numa,
                    format!("{rdma} at {} (NUMA {})", nic.pci, opt(nic.numa)),
                ))
            })
            .collect();
        if wanted.is_empty() {
            wanted.push((
                ALL_DEVICES.to_owned(),
                None,
                "every device UCX finds (no RDMA NIC found)".to_owned(),
            ));
        }

        let mut pollers: Vec<PollerSpec> = Vec::new();
        let mut notes: Vec<String> = Vec::new();
        let mut used_cores: Vec<usize> = Vec::new(); // physical cores taken
        for (worker, numa, why) in wanted {
            let numa_of = |c: usize| topology.cpu(c).and_then(|cpu| cpu.numa);
            let physical = |c: usize| topology.cpu(c).and_then(|cpu| cpu.core);
            let free = |c: &&usize| !pollers.iter().any(|p| p.core == **c);
            let fresh_core = |c: &&usize| physical(**c).is_none_or(|k| !used_cores.contains(&k));
            let local = |c: &&usize| numa.is_none() || numa_of(**c) == numa;
            let pick = candidates
                .iter()
                .filter(free)
                .filter(local)
                .find(fresh_core)
                .or_else(|| candidates.iter().filter(free).find(local))
                .or_else(|| candidates.iter().filter(free).find(fresh_core))
                .or_else(|| candidates.iter().find(free))
                .copied();
            match pick {
                Some(core) => {
                    let idle = if iso.is_isolated(core) {
                        IdlePolicy::Busy
                    } else {
                        IdlePolicy::Adaptive
                    };
                    if let Some(k) = physical(core) {
                        used_cores.push(k);
                    }
                    notes.push(format!(
                        "CPU {core}: NUMA {}, {}, {} interrupts so far.\ndrives {why}",
                        opt(numa_of(core)),
                        if iso.is_isolated(core) {
                            "isolated, so busy"
                        } else {
                            "not isolated, so adaptive"
                        },
                        irqs(core)
                    ));
                    pollers.push(PollerSpec {
                        core,
                        workers: vec![worker],
                        idle,
                    });
                }
                None => {
                    // More NICs than CPUs: share the least-loaded poller,
                    // on the NIC's node if there is one there.
                    let target = (0..pollers.len())
                        .filter(|&i| numa.is_none() || numa_of(pollers[i].core) == numa)
                        .min_by_key(|&i| pollers[i].workers.len())
                        .or_else(|| (0..pollers.len()).min_by_key(|&i| pollers[i].workers.len()));
                    if let Some(i) = target {
                        pollers[i].workers.push(worker);
                        notes[i].push_str(&format!("\nalso drives {why}"));
                    }
                }
            }
        }

        let header = format!(
            "# Core map derived by kvpoll from this machine's topology.\n\
             # Engine threads on CPU {engine} (the first non-isolated CPU);\n\
             # pollers on CPU(s) {} (isolated CPUs: {}).\n\n",
            format_cpu_list(&pollers.iter().map(|p| p.core).collect::<Vec<_>>()),
            format_cpu_list(&iso.isolated)
        );
        Ok(header + &render(&[engine], &pollers, &notes))
    }
}

fn opt(v: Option<usize>) -> String {
    v.map_or("?".to_owned(), |v| v.to_string())
}
