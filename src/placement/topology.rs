//! The machine as placement sees it: CPUs (with their physical core,
//! package and NUMA node), NUMA nodes, NICs and GPUs with their PCI
//! locality, and the isolation state — read with hwloc 2.x (`hwlocality`).
//!
//! [`Topology`] is plain data: `detect` fills it from hwloc and `/sys`, and
//! tests may build or edit one by hand (a two-socket machine with NICs, say)
//! to exercise validation and checks that this machine cannot show.

use std::fmt;
use std::fs;

use hwlocality::object::attributes::ObjectAttributes;
use hwlocality::object::types::{CacheType, OSDeviceType, ObjectType};
use hwlocality::object::TopologyObject;
use hwlocality::topology::builder::{BuildFlags, TypeFilter};
use hwlocality::Topology as Hwloc;

use super::cpulist::format_cpu_list;
use super::error::PlacementError;
use super::isolation::Isolation;

/// One logical CPU (a hardware thread, hwloc's PU), named by its Linux CPU
/// number — the number `taskset`, `/sys/devices/system/cpu/cpuN` and core
/// maps use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cpu {
    /// Linux CPU number (hwloc's PU OS index).
    pub id: usize,
    /// The physical core it belongs to (hwloc's logical core index, unique
    /// on the machine); CPUs with the same `core` are hyperthread siblings.
    /// `None` for an offline CPU, or when hwloc shows no cores (some VMs).
    pub core: Option<usize>,
    /// The package (socket), by OS index; `None` if unknown or offline.
    pub package: Option<usize>,
    /// The NUMA node whose memory is local, by OS index; `None` if unknown.
    pub numa: Option<usize>,
    /// Whether the CPU is online.
    pub online: bool,
    /// Whether this process may run on it (cgroup cpuset, `taskset`).
    pub allowed: bool,
}

/// A NUMA node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaNode {
    /// OS index (as in `/sys/devices/system/node/nodeN`).
    pub id: usize,
    /// The CPUs local to it.
    pub cpus: Vec<usize>,
    /// Local memory in bytes (0 when unknown).
    pub memory: u64,
}

/// What a PCI device is, as far as placement cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// A network adapter (Ethernet or InfiniBand/RoCE; PCI class 0x02).
    Nic,
    /// A GPU (PCI class 0x03).
    Gpu,
    /// Another accelerator (PCI class 0x12).
    Accelerator,
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Self::Nic => "nic",
            Self::Gpu => "gpu",
            Self::Accelerator => "accelerator",
        })
    }
}

/// A NIC or GPU and where it sits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// What it is.
    pub kind: DeviceKind,
    /// PCI address, `dddd:bb:dd.f`.
    pub pci: String,
    /// PCI vendor and device ids.
    pub vendor_device: (u16, u16),
    /// The OS names of its functions: `eth0`, `mlx5_0` (the RDMA device a
    /// UCX worker names as `mlx5_0:1`), `cuda0`…
    pub names: Vec<String>,
    /// The subset of `names` that are RDMA (OpenFabrics) devices: what
    /// UCX workers name with a port, `mlx5_0:1`.
    pub rdma: Vec<String>,
    /// The NUMA node it is attached to, when hwloc can tell.
    pub numa: Option<usize>,
    /// The CPUs close to it.
    pub local_cpus: Vec<usize>,
}

/// A node of the readable topology tree that `kvpoll topo` prints.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreeNode {
    /// What the node is (`Package P#0`, `L3 32 MiB`, `PU P#1 [isolated]`).
    pub label: String,
    /// Its children.
    pub children: Vec<TreeNode>,
}

impl TreeNode {
    fn write(
        &self,
        f: &mut fmt::Formatter<'_>,
        prefix: &str,
        last: bool,
        root: bool,
    ) -> fmt::Result {
        if root {
            writeln!(f, "{}", self.label)?;
        } else {
            writeln!(
                f,
                "{prefix}{}{}",
                if last { "└─ " } else { "├─ " },
                self.label
            )?;
        }
        let child_prefix = if root {
            String::new()
        } else {
            format!("{prefix}{}", if last { "   " } else { "│  " })
        };
        for (i, child) in self.children.iter().enumerate() {
            child.write(f, &child_prefix, i + 1 == self.children.len(), false)?;
        }
        Ok(())
    }
}

impl fmt::Display for TreeNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f, "", true, true)
    }
}

/// The machine: CPUs, NUMA nodes, devices, isolation, and a printable tree.
#[derive(Debug, Clone, Default)]
pub struct Topology {
    /// Every CPU the machine has (online or not), by Linux CPU number.
    pub cpus: Vec<Cpu>,
    /// NUMA nodes, by OS index.
    pub numa_nodes: Vec<NumaNode>,
    /// NICs, GPUs and accelerators on PCI.
    pub devices: Vec<Device>,
    /// Network and RDMA interface names the kernel knows
    /// (`/sys/class/net`, `/sys/class/infiniband`), including virtual ones
    /// such as `lo` that have no PCI device.
    pub interfaces: Vec<String>,
    /// Isolation state, interrupts and governors.
    pub isolation: Isolation,
    /// The hwloc tree, for display.
    pub tree: TreeNode,
}

impl Topology {
    /// Reads this machine: hwloc (with I/O devices) plus `/sys` and `/proc`.
    pub fn detect() -> Result<Self, PlacementError> {
        let hw = Hwloc::builder()
            // Keep CPUs outside our cgroup in the picture (marked not
            // allowed) rather than have them look nonexistent.
            .with_flags(BuildFlags::INCLUDE_DISALLOWED)
            .map_err(|e| PlacementError::Topology(e.to_string()))?
            .with_io_type_filter(TypeFilter::KeepImportant)
            .map_err(|e| PlacementError::Topology(e.to_string()))?
            .build()
            .map_err(|e| PlacementError::Topology(e.to_string()))?;
        let ids: Vec<usize> = hw.complete_cpuset().iter_set().map(usize::from).collect();
        let isolation = Isolation::read(&ids);
        let mut topo = Self::from_hwloc(&hw, isolation);
        topo.interfaces = kernel_interfaces();
        tracing::debug!(
            cpus = topo.cpus.len(),
            numa_nodes = topo.numa_nodes.len(),
            devices = topo.devices.len(),
            isolated = topo.isolation.isolated.len(),
            "topology detected"
        );
        Ok(topo)
    }

    /// A machine described in hwloc's synthetic syntax, e.g.
    /// `"pack:2 [numa] core:4 pu:2"`, with nothing isolated and no devices.
    /// For tests and examples.
    ///
    /// ```
    /// let topo = kvpoll::placement::Topology::synthetic("pack:2 [numa] core:2 pu:2").unwrap();
    /// assert_eq!(topo.cpus.len(), 8);
    /// assert_eq!(topo.siblings(0), vec![1]);
    /// assert_eq!(topo.numa_nodes.len(), 2);
    /// ```
    pub fn synthetic(description: &str) -> Result<Self, PlacementError> {
        let hw = Hwloc::builder()
            .from_synthetic(description)
            .map_err(|e| PlacementError::Topology(e.to_string()))?
            .build()
            .map_err(|e| PlacementError::Topology(e.to_string()))?;
        Ok(Self::from_hwloc(&hw, Isolation::default()))
    }

    /// Builds the plain picture from an hwloc topology and an isolation state.
    pub fn from_hwloc(hw: &Hwloc, isolation: Isolation) -> Self {
        let numa_nodes: Vec<NumaNode> = hw
            .objects_with_type(ObjectType::NUMANode)
            .map(|n| NumaNode {
                id: n.os_index().unwrap_or(n.logical_index()),
                cpus: n
                    .cpuset()
                    .map(|s| s.iter_set().map(usize::from).collect())
                    .unwrap_or_default(),
                memory: match n.attributes() {
                    Some(ObjectAttributes::NUMANode(a)) => a.local_memory().map_or(0, |m| m.get()),
                    _ => 0,
                },
            })
            .collect();
        let numa_of = |cpu: usize| {
            numa_nodes
                .iter()
                .find(|n| n.cpus.contains(&cpu))
                .map(|n| n.id)
        };

        let online = hw.cpuset();
        let allowed = hw.allowed_cpuset();
        let mut cpus: Vec<Cpu> = hw
            .complete_cpuset()
            .iter_set()
            .map(usize::from)
            .map(|id| Cpu {
                id,
                core: None,
                package: None,
                numa: numa_of(id),
                online: online.is_set(id),
                allowed: allowed.is_set(id),
            })
            .collect();
        for pu in hw.objects_with_type(ObjectType::PU) {
            let Some(id) = pu.os_index() else { continue };
            let Some(cpu) = cpus.iter_mut().find(|c| c.id == id) else {
                continue;
            };
            // Some VMs expose no Core objects: then siblings are unknown.
            cpu.core = pu
                .first_ancestor_with_type(ObjectType::Core)
                .map(TopologyObject::logical_index);
            cpu.package = pu
                .first_ancestor_with_type(ObjectType::Package)
                .map(|p| p.os_index().unwrap_or(p.logical_index()));
        }

        let devices = hw
            .objects_with_type(ObjectType::PCIDevice)
            .filter_map(|pci| device(pci, &numa_nodes))
            .collect();
        let tree = tree_node(hw.root_object(), &isolation).unwrap_or_default();
        Self {
            cpus,
            numa_nodes,
            devices,
            interfaces: Vec::new(),
            isolation,
            tree,
        }
    }

    /// The CPU with Linux number `id`.
    pub fn cpu(&self, id: usize) -> Option<&Cpu> {
        self.cpus.iter().find(|c| c.id == id)
    }

    /// The online CPUs, ascending.
    pub fn online_cpus(&self) -> Vec<usize> {
        self.cpus
            .iter()
            .filter(|c| c.online)
            .map(|c| c.id)
            .collect()
    }

    /// The other CPUs on the same physical core as `id` (its hyperthread
    /// siblings); empty when it has none or is unknown.
    pub fn siblings(&self, id: usize) -> Vec<usize> {
        let Some(core) = self.cpu(id).and_then(|c| c.core) else {
            return Vec::new();
        };
        self.cpus
            .iter()
            .filter(|c| c.id != id && c.core == Some(core))
            .map(|c| c.id)
            .collect()
    }

    /// The device a UCX worker spec names: `mlx5_0:1` (RDMA device and
    /// port) or `eth0` match the device with that OS name.
    pub fn device_for_worker(&self, worker: &str) -> Option<&Device> {
        let name = worker_device_name(worker);
        self.devices
            .iter()
            .find(|d| d.names.iter().any(|n| n == name))
    }

    /// Whether the worker spec names something this machine has: `all`
    /// (UCX picks), a PCI device's OS name, or a kernel interface.
    pub fn knows_worker(&self, worker: &str) -> bool {
        let name = worker_device_name(worker);
        worker == ALL_DEVICES
            || self.device_for_worker(worker).is_some()
            || self.interfaces.iter().any(|i| i == name)
    }

    /// The NICs, in PCI order.
    pub fn nics(&self) -> impl Iterator<Item = &Device> {
        self.devices.iter().filter(|d| d.kind == DeviceKind::Nic)
    }
}

/// The worker spec meaning "every device UCX finds" (UCX's own default for
/// `UCX_NET_DEVICES`).
pub const ALL_DEVICES: &str = "all";

/// `mlx5_0:1` → `mlx5_0`; `eth0` → `eth0`.
fn worker_device_name(worker: &str) -> &str {
    worker.split_once(':').map_or(worker, |(name, _)| name)
}

fn device(pci: &TopologyObject, numa_nodes: &[NumaNode]) -> Option<Device> {
    let Some(ObjectAttributes::PCIDevice(attr)) = pci.attributes() else {
        return None;
    };
    let kind = match attr.class_id() >> 8 {
        0x02 => DeviceKind::Nic,
        0x03 => DeviceKind::Gpu,
        0x12 => DeviceKind::Accelerator,
        _ => return None,
    };
    let mut names = Vec::new();
    let mut rdma = Vec::new();
    for os in pci
        .io_children()
        .filter(|c| c.object_type() == ObjectType::OSDevice)
    {
        let Some(name) = os.name().map(|n| n.to_string_lossy().into_owned()) else {
            continue;
        };
        if let Some(ObjectAttributes::OSDevice(a)) = os.attributes() {
            if a.device_type() == OSDeviceType::OpenFabrics {
                rdma.push(name.clone());
            }
        }
        names.push(name);
    }
    let local = pci.first_non_io_ancestor();
    let local_cpus: Vec<usize> = local
        .and_then(|a| a.cpuset())
        .map(|s| s.iter_set().map(usize::from).collect())
        .unwrap_or_default();
    // Attached to one node when its local CPUs are exactly one node's (a
    // device under the machine root is equally far from all nodes).
    let numa = match local.and_then(|a| a.nodeset()) {
        Some(set) if set.weight() == Some(1) => set.first_set().map(usize::from),
        _ => None,
    }
    .or_else(|| {
        numa_nodes
            .iter()
            .find(|n| !n.cpus.is_empty() && n.cpus == local_cpus)
            .map(|n| n.id)
    });
    Some(Device {
        kind,
        pci: format!(
            "{:04x}:{:02x}:{:02x}.{:x}",
            attr.domain(),
            attr.bus_id(),
            attr.bus_device(),
            attr.function()
        ),
        vendor_device: (attr.vendor_id(), attr.device_id()),
        names,
        rdma,
        numa,
        local_cpus,
    })
}

fn kernel_interfaces() -> Vec<String> {
    let mut names = Vec::new();
    for dir in ["/sys/class/net", "/sys/class/infiniband"] {
        if let Ok(entries) = fs::read_dir(dir) {
            names.extend(
                entries
                    .flatten()
                    .filter_map(|e| e.file_name().into_string().ok()),
            );
        }
    }
    names.sort();
    names
}

/// Formats a byte count as `7.7 GiB`, `32 MiB`.
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The tree node for `obj`; `None` for objects shown through their children
/// only (bridges) or not at all (misc).
fn tree_node(obj: &TopologyObject, iso: &Isolation) -> Option<TreeNode> {
    let children = |obj: &TopologyObject| -> Vec<TreeNode> {
        let mut out = Vec::new();
        for child in obj
            .memory_children()
            .chain(obj.normal_children())
            .chain(obj.io_children())
        {
            if child.object_type() == ObjectType::Bridge {
                // Bridges only say how devices hang together: show their
                // devices in their place.
                out.extend(child.io_children().filter_map(|c| tree_node(c, iso)));
            } else if let Some(node) = tree_node(child, iso) {
                out.push(node);
            }
        }
        out
    };
    let os = obj.os_index().map_or("?".to_owned(), |i| i.to_string());
    let label = match obj.object_type() {
        ObjectType::Machine => format!("Machine ({} memory)", human_bytes(obj.total_memory())),
        ObjectType::Package => format!("Package P#{os}"),
        ObjectType::Die => format!("Die P#{os}"),
        ObjectType::Group => "Group".to_owned(),
        ObjectType::NUMANode => format!("NUMANode P#{os} ({})", human_bytes(obj.total_memory())),
        ObjectType::Core => format!("Core L#{} (P#{os})", obj.logical_index()),
        ObjectType::PU => {
            let mut label = format!("PU P#{os}");
            if let Some(id) = obj.os_index() {
                if iso.is_isolated(id) {
                    label.push_str(" [isolated]");
                }
                if iso.is_nohz_full(id) {
                    label.push_str(" [nohz_full]");
                }
            }
            label
        }
        ObjectType::PCIDevice => match obj.attributes() {
            Some(ObjectAttributes::PCIDevice(a)) => format!(
                "PCI {:04x}:{:02x}:{:02x}.{:x} class {:04x} [{:04x}:{:04x}]",
                a.domain(),
                a.bus_id(),
                a.bus_device(),
                a.function(),
                a.class_id(),
                a.vendor_id(),
                a.device_id()
            ),
            _ => "PCI".to_owned(),
        },
        ObjectType::OSDevice => {
            let kind = match obj.attributes() {
                Some(ObjectAttributes::OSDevice(a)) => match a.device_type() {
                    OSDeviceType::Network => "net",
                    OSDeviceType::OpenFabrics => "rdma",
                    OSDeviceType::GPU => "gpu",
                    OSDeviceType::CoProcessor => "coproc",
                    OSDeviceType::Storage => "storage",
                    OSDeviceType::DMA => "dma",
                    _ => "os",
                },
                _ => "os",
            };
            let name = obj
                .name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned());
            format!("{kind} {name:?}")
        }
        ObjectType::Misc => return None,
        ty if ty.is_cpu_cache() => match obj.attributes() {
            Some(ObjectAttributes::Cache(c)) => {
                let suffix = match c.cache_type() {
                    CacheType::Data => "d",
                    CacheType::Instruction => "i",
                    _ => "",
                };
                let size = c.size().map_or("?".to_owned(), |s| human_bytes(s.get()));
                format!("L{}{suffix} {size}", c.depth())
            }
            _ => format!("{ty}"),
        },
        ty => format!("{ty}"),
    };
    Some(TreeNode {
        label,
        children: children(obj),
    })
}

impl fmt::Display for Topology {
    /// The tree, then a CPU table, the devices, and the isolation state.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.tree)?;
        writeln!(f)?;
        writeln!(f, "cpus:")?;
        writeln!(
            f,
            "  {:>4} {:>5} {:>7} {:>4} {:>6} {:>8} {:>9} {:>12}  governor",
            "cpu", "core", "package", "numa", "online", "isolated", "nohz_full", "interrupts"
        )?;
        let opt = |v: Option<usize>| v.map_or("-".to_owned(), |v| v.to_string());
        let yes = |b: bool| if b { "yes" } else { "no" };
        for c in &self.cpus {
            writeln!(
                f,
                "  {:>4} {:>5} {:>7} {:>4} {:>6} {:>8} {:>9} {:>12}  {}",
                c.id,
                opt(c.core),
                opt(c.package),
                opt(c.numa),
                yes(c.online),
                yes(self.isolation.is_isolated(c.id)),
                yes(self.isolation.is_nohz_full(c.id)),
                self.isolation
                    .interrupts
                    .get(&c.id)
                    .map_or("-".to_owned(), |n| n.to_string()),
                self.isolation
                    .governors
                    .get(&c.id)
                    .map_or("-", String::as_str),
            )?;
        }
        writeln!(f)?;
        writeln!(f, "devices:")?;
        if self.devices.is_empty() {
            writeln!(f, "  (no PCI NICs or GPUs visible to hwloc)")?;
        }
        for d in &self.devices {
            writeln!(
                f,
                "  {:<11} {}  [{:04x}:{:04x}]  numa {}  local cpus {}  {}",
                d.kind,
                d.pci,
                d.vendor_device.0,
                d.vendor_device.1,
                opt(d.numa),
                format_cpu_list(&d.local_cpus),
                d.names.join(" ")
            )?;
        }
        writeln!(
            f,
            "  interfaces: {}",
            if self.interfaces.is_empty() {
                "(none)".to_owned()
            } else {
                self.interfaces.join(" ")
            }
        )?;
        writeln!(f)?;
        let iso = &self.isolation;
        let boot = |v: &Option<String>| v.clone().unwrap_or_else(|| "(not set)".to_owned());
        writeln!(f, "isolation:")?;
        writeln!(
            f,
            "  isolated cpus (/sys/devices/system/cpu/isolated):  {}",
            format_cpu_list(&iso.isolated)
        )?;
        writeln!(
            f,
            "  nohz_full cpus (/sys/devices/system/cpu/nohz_full): {}",
            format_cpu_list(&iso.nohz_full)
        )?;
        writeln!(
            f,
            "  kernel command line: isolcpus={} nohz_full={} rcu_nocbs={} irqaffinity={}",
            boot(&iso.boot.isolcpus),
            boot(&iso.boot.nohz_full),
            boot(&iso.boot.rcu_nocbs),
            boot(&iso.boot.irqaffinity)
        )?;
        for note in &iso.notes {
            writeln!(f, "  note: {note}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_two_socket_machine_has_siblings_packages_and_numa() {
        let topo = Topology::synthetic("pack:2 [numa] core:2 pu:2").unwrap();
        assert_eq!(topo.cpus.len(), 8);
        assert!(topo.cpus.iter().all(|c| c.online));
        assert_eq!(topo.siblings(2), vec![3]);
        assert_eq!(topo.cpu(5).and_then(|c| c.package), Some(1));
        assert_eq!(topo.cpu(5).and_then(|c| c.numa), Some(1));
        assert_eq!(topo.cpu(0).and_then(|c| c.numa), Some(0));
        assert_eq!(topo.numa_nodes.len(), 2);
    }

    #[test]
    fn this_machine_is_read_with_at_least_one_online_cpu() {
        let topo = Topology::detect().unwrap();
        assert!(!topo.online_cpus().is_empty());
        assert!(topo.cpus.iter().any(|c| c.core.is_some()));
        assert!(topo.tree.to_string().contains("PU P#"));
    }

    #[test]
    fn worker_spec_with_port_finds_its_rdma_device() {
        let mut topo = Topology::synthetic("pack:1 core:2 pu:1").unwrap();
        topo.devices.push(Device {
            kind: DeviceKind::Nic,
            pci: "0000:3b:00.0".to_owned(),
            vendor_device: (0x15b3, 0x1017),
            names: vec!["ens1f0".to_owned(), "mlx5_0".to_owned()],
            rdma: vec!["mlx5_0".to_owned()],
            numa: Some(0),
            local_cpus: vec![0, 1],
        });
        assert_eq!(
            topo.device_for_worker("mlx5_0:1").map(|d| d.pci.as_str()),
            Some("0000:3b:00.0")
        );
        assert!(topo.knows_worker("all"));
        assert!(!topo.knows_worker("mlx5_9:1"));
    }

    #[test]
    fn byte_counts_read_as_binary_units() {
        assert_eq!(human_bytes(32 * 1024 * 1024), "32 MiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
    }
}
