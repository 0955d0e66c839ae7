//! Core maps: every parse and validation error names file, line and
//! problem; `auto` derives maps that validate; `check` warns about costly
//! placements; every shipped `tuning/*.toml` parses.

use kvpoll::placement::{
    check, CoreMap, CoreMapFile, Device, DeviceKind, IdlePolicy, PlacementError, Topology,
    WarningKind,
};

/// A two-socket machine like the one `tuning/example-2s-8gpu-8nic.toml`
/// describes: 2 x 32 cores x 2 threads, CPU n's sibling is n + 64, NICs
/// mlx5_0..3 on NUMA 0 and mlx5_4..7 on NUMA 1, CPUs 8-15 and 40-47 isolated.
fn two_socket_node() -> Topology {
    let mut indexes = Vec::new();
    for pack in 0..2 {
        for core in 0..32 {
            indexes.push(pack * 32 + core);
            indexes.push(64 + pack * 32 + core);
        }
    }
    let list: Vec<String> = indexes.iter().map(usize::to_string).collect();
    let mut topo = Topology::synthetic(&format!(
        "pack:2 [numa] core:32 pu:2(indexes={})",
        list.join(",")
    ))
    .unwrap();
    for i in 0..8 {
        let numa = i / 4;
        topo.devices.push(Device {
            kind: DeviceKind::Nic,
            pci: format!("0000:{:02x}:00.0", 0x10 * (i + 1)),
            vendor_device: (0x15b3, 0x101b),
            names: vec![format!("ibp{i}"), format!("mlx5_{i}")],
            rdma: vec![format!("mlx5_{i}")],
            numa: Some(numa),
            local_cpus: (numa * 32..numa * 32 + 32).collect(),
        });
    }
    topo.isolation.isolated = (8..16).chain(40..48).collect();
    topo.isolation.nohz_full = topo.isolation.isolated.clone();
    topo
}

/// A small machine: 1 package, 2 cores x 2 threads (CPUs 0-3, siblings 0/1
/// and 2/3), nothing isolated.
fn small_ht() -> Topology {
    Topology::synthetic("pack:1 [numa] core:2 pu:2").unwrap()
}

const GOOD: &str = "\
[engine]
cores = [0]

[[poller]]
core = 2
workers = [\"all\"]
idle = \"adaptive\"
";

fn parse_err(text: &str) -> PlacementError {
    match CoreMapFile::parse(text, "m.toml") {
        Ok(m) => panic!("expected an error, parsed {m:?}"),
        Err(e) => e,
    }
}

#[test]
fn good_map_parses_into_pollers_and_engine_cores() {
    let map = CoreMap::parse(GOOD, "m.toml").unwrap();
    assert_eq!(map.engine_cores(), &[0]);
    assert_eq!(map.pollers().len(), 1);
    assert_eq!(map.pollers()[0].core, 2);
    assert_eq!(map.pollers()[0].workers, vec!["all".to_owned()]);
    assert_eq!(map.pollers()[0].idle, IdlePolicy::Adaptive);
    assert_eq!(map.poller_line(0), 5);
    map.validate(&small_ht()).unwrap();
}

#[test]
fn unknown_cpu_is_rejected_with_file_line_and_known_cpus() {
    let map = CoreMap::parse(&GOOD.replace("core = 2", "core = 9"), "m.toml").unwrap();
    let err = map.validate(&small_ht()).unwrap_err();
    assert!(
        matches!(&err, PlacementError::UnknownCpu { file, line: 5, core: 9, known } if file == "m.toml" && known == "0-3"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "m.toml:5: CPU 9 does not exist on this machine (CPUs: 0-3)"
    );
}

#[test]
fn unknown_engine_cpu_is_rejected_at_its_line() {
    let map = CoreMap::parse(&GOOD.replace("cores = [0]", "cores = [0,\n  7]"), "m.toml").unwrap();
    let err = map.validate(&small_ht()).unwrap_err();
    assert!(
        matches!(
            err,
            PlacementError::UnknownCpu {
                line: 3,
                core: 7,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn offline_cpu_is_rejected() {
    let mut topo = small_ht();
    for cpu in topo.cpus.iter_mut().filter(|c| c.id == 2) {
        cpu.online = false;
    }
    let map = CoreMap::parse(GOOD, "m.toml").unwrap();
    let err = map.validate(&topo).unwrap_err();
    assert!(
        matches!(&err, PlacementError::OfflineCpu { line: 5, core: 2, online, .. } if online == "0-1,3"),
        "{err:?}"
    );
}

#[test]
fn same_core_for_two_pollers_is_rejected_naming_both_lines() {
    let text = format!("{GOOD}\n[[poller]]\ncore = 2\nworkers = [\"lo\"]\nidle = \"busy\"\n");
    let err = parse_err(&text);
    assert!(
        matches!(
            err,
            PlacementError::DuplicateCore {
                line: 10,
                core: 2,
                first_line: 5,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn same_engine_core_twice_is_rejected() {
    let err = parse_err(&GOOD.replace("cores = [0]", "cores = [0, 0]"));
    assert!(
        matches!(
            err,
            PlacementError::DuplicateCore {
                line: 2,
                core: 0,
                first_line: 2,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn poller_on_an_engine_core_is_rejected() {
    let err = parse_err(&GOOD.replace("cores = [0]", "cores = [0, 2]"));
    assert!(
        matches!(
            err,
            PlacementError::PollerOnEngineCore {
                line: 5,
                core: 2,
                engine_line: 1,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn map_without_pollers_is_empty() {
    let err = parse_err("[engine]\ncores = [0]\n");
    assert!(
        matches!(
            err,
            PlacementError::EmptyMap {
                what: "no [[poller]] entries",
                ..
            }
        ),
        "{err:?}"
    );
    let err = parse_err("");
    assert!(matches!(err, PlacementError::EmptyMap { .. }), "{err:?}");
}

#[test]
fn map_without_engine_cores_is_empty() {
    let err = parse_err(&GOOD.replace("cores = [0]", "cores = []"));
    assert!(
        matches!(
            err,
            PlacementError::EmptyMap {
                what: "[engine] cores is empty",
                ..
            }
        ),
        "{err:?}"
    );
    let err = parse_err(&GOOD.replace("[engine]\ncores = [0]\n", ""));
    assert!(matches!(err, PlacementError::EmptyMap { .. }), "{err:?}");
}

#[test]
fn poller_without_workers_is_rejected() {
    let err = parse_err(&GOOD.replace("[\"all\"]", "[]"));
    assert!(
        matches!(
            err,
            PlacementError::NoWorkers {
                line: 6,
                core: 2,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn unknown_key_in_a_poller_is_reported_with_its_line() {
    let err = parse_err(&GOOD.replace(
        "idle = \"adaptive\"",
        "idle = \"adaptive\"\nidel = \"busy\"",
    ));
    match &err {
        PlacementError::UnknownKey {
            file,
            line,
            key,
            expected,
        } => {
            assert_eq!((file.as_str(), *line, key.as_str()), ("m.toml", 8, "idel"));
            assert!(expected.contains("idle"), "{expected}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        err.to_string().starts_with("m.toml:8: unknown key `idel`"),
        "{err}"
    );
}

#[test]
fn unknown_top_level_key_is_reported_with_its_line() {
    let err = parse_err(&format!("pollers = 3\n{GOOD}"));
    assert!(
        matches!(&err, PlacementError::UnknownKey { line: 1, key, .. } if key == "pollers"),
        "{err:?}"
    );
}

#[test]
fn bad_toml_syntax_is_reported_with_its_line() {
    let err = parse_err(&GOOD.replace("core = 2", "core = = 2"));
    assert!(
        matches!(&err, PlacementError::Syntax { file, line: 5, .. } if file == "m.toml"),
        "{err:?}"
    );
}

#[test]
fn unknown_idle_policy_is_a_schema_error_at_its_line() {
    let err = parse_err(&GOOD.replace("\"adaptive\"", "\"lazy\""));
    assert!(
        matches!(err, PlacementError::Schema { line: 7, .. }),
        "{err:?}"
    );
}

#[test]
fn negative_core_is_a_schema_error() {
    let err = parse_err(&GOOD.replace("core = 2", "core = -1"));
    assert!(
        matches!(err, PlacementError::Schema { line: 5, .. }),
        "{err:?}"
    );
}

#[test]
fn auto_file_cannot_also_list_pollers() {
    let err = parse_err(&format!("auto = true\n{GOOD}"));
    assert!(
        matches!(err, PlacementError::Schema { line: 1, .. }),
        "{err:?}"
    );
    assert!(matches!(
        CoreMapFile::parse("auto = true\n", "a.toml"),
        Ok(CoreMapFile::Auto { .. })
    ));
}

#[test]
fn missing_file_is_a_read_error_naming_the_path() {
    let err = CoreMapFile::load("/nonexistent/kvpoll/map.toml").unwrap_err();
    assert!(
        err.to_string()
            .starts_with("/nonexistent/kvpoll/map.toml: cannot read"),
        "{err}"
    );
}

#[test]
fn auto_on_this_machine_validates_and_round_trips() {
    let topo = Topology::detect().unwrap();
    if topo.online_cpus().len() < 2 {
        // One CPU leaves no room for a poller apart from the engine.
        assert!(matches!(
            CoreMap::auto(&topo),
            Err(PlacementError::NoFreeCpu(_))
        ));
        return;
    }
    let map = CoreMap::auto(&topo).unwrap();
    map.validate(&topo).unwrap();
    assert!(!map.pollers().is_empty());
    let again = CoreMap::parse(&map.to_toml(), "auto").unwrap();
    assert_eq!(again.pollers(), map.pollers());
    assert_eq!(again.engine_cores(), map.engine_cores());
}

#[test]
fn auto_with_one_cpu_has_no_room_for_a_poller() {
    let topo = Topology::synthetic("pack:1 core:1 pu:1").unwrap();
    assert!(matches!(
        CoreMap::auto(&topo),
        Err(PlacementError::NoFreeCpu(_))
    ));
}

#[test]
fn auto_puts_pollers_on_isolated_cpus_of_each_nics_numa_node() {
    let topo = two_socket_node();
    let map = CoreMap::auto(&topo).unwrap();
    map.validate(&topo).unwrap();
    assert_eq!(map.engine_cores(), &[0]);
    assert_eq!(map.pollers().len(), 8);
    for p in map.pollers() {
        let nic = topo.device_for_worker(&p.workers[0]).unwrap();
        assert_eq!(topo.cpu(p.core).unwrap().numa, nic.numa, "{p:?}");
        assert!(topo.isolation.is_isolated(p.core), "{p:?}");
        assert_eq!(p.idle, IdlePolicy::Busy);
    }
    assert_eq!(check(&map, &topo), vec![]);
}

#[test]
fn auto_avoids_the_engine_cpus_hyperthread_sibling() {
    let topo = small_ht();
    let map = CoreMap::auto(&topo).unwrap();
    assert_eq!(map.engine_cores(), &[0]);
    assert_eq!(map.pollers()[0].core, 2, "CPU 1 is CPU 0's sibling");
    assert_eq!(map.pollers()[0].idle, IdlePolicy::Adaptive);
}

#[test]
fn busy_poller_on_a_non_isolated_cpu_warns() {
    let map = CoreMap::parse(&GOOD.replace("adaptive", "busy"), "m.toml").unwrap();
    let warnings = check(&map, &small_ht());
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].kind, WarningKind::BusyNotIsolated { core: 2 });
    assert!(warnings[0]
        .to_string()
        .starts_with("m.toml:5: warning: busy poller on CPU 2, which is not isolated"));

    let mut isolated = small_ht();
    isolated.isolation.isolated = vec![2, 3];
    assert_eq!(check(&map, &isolated), vec![]);
}

#[test]
fn adaptive_poller_on_a_non_isolated_cpu_does_not_warn() {
    let map = CoreMap::parse(GOOD, "m.toml").unwrap();
    assert_eq!(check(&map, &small_ht()), vec![]);
}

#[test]
fn poller_on_the_engines_hyperthread_sibling_warns() {
    let map = CoreMap::parse(&GOOD.replace("core = 2", "core = 1"), "m.toml").unwrap();
    let kinds: Vec<_> = check(&map, &small_ht())
        .into_iter()
        .map(|w| w.kind)
        .collect();
    assert_eq!(
        kinds,
        vec![WarningKind::SharesPhysicalCore {
            core: 1,
            sibling: 0,
            with: "engine"
        }]
    );
}

#[test]
fn two_pollers_on_sibling_cpus_warn() {
    let text = format!("{GOOD}\n[[poller]]\ncore = 3\nworkers = [\"all\"]\nidle = \"adaptive\"\n");
    let map = CoreMap::parse(&text, "m.toml").unwrap();
    let kinds: Vec<_> = check(&map, &small_ht())
        .into_iter()
        .map(|w| w.kind)
        .collect();
    assert_eq!(
        kinds,
        vec![
            WarningKind::SharesPhysicalCore {
                core: 2,
                sibling: 3,
                with: "poller"
            },
            WarningKind::SharesPhysicalCore {
                core: 3,
                sibling: 2,
                with: "poller"
            },
        ]
    );
}

#[test]
fn poller_driving_a_nic_on_another_numa_node_warns() {
    let text =
        "[engine]\ncores = [4]\n[[poller]]\ncore = 8\nworkers = [\"mlx5_5:1\"]\nidle = \"busy\"\n";
    let map = CoreMap::parse(text, "m.toml").unwrap();
    let topo = two_socket_node();
    map.validate(&topo).unwrap();
    let warnings = check(&map, &topo);
    assert_eq!(
        warnings.iter().map(|w| w.kind.clone()).collect::<Vec<_>>(),
        vec![WarningKind::RemoteNic {
            core: 8,
            worker: "mlx5_5:1".into(),
            cpu_numa: 0,
            nic_numa: 1
        }]
    );
    assert!(warnings[0].to_string().contains("pick a CPU on node 1"));
}

#[test]
fn worker_naming_no_device_warns() {
    let map = CoreMap::parse(&GOOD.replace("\"all\"", "\"mlx5_O:1\""), "m.toml").unwrap();
    let kinds: Vec<_> = check(&map, &small_ht())
        .into_iter()
        .map(|w| w.kind)
        .collect();
    assert_eq!(
        kinds,
        vec![WarningKind::UnknownDevice {
            core: 2,
            worker: "mlx5_O:1".into()
        }]
    );
}

#[test]
fn every_shipped_tuning_map_parses() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tuning");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            CoreMapFile::load(&path).unwrap_or_else(|e| panic!("{e}"));
            seen += 1;
        }
    }
    assert!(
        seen >= 3,
        "expected auto, two-core and the 8-NIC example, found {seen}"
    );
}

#[test]
fn two_core_map_validates_on_this_machine() {
    let topo = Topology::detect().unwrap();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tuning/two-core.toml");
    let map = CoreMap::load(path, &topo).unwrap();
    assert_eq!(map.pollers()[0].core, 1);
    assert_eq!(map.pollers()[0].idle, IdlePolicy::Adaptive);
    assert_eq!(map.engine_cores(), &[0]);
}

#[test]
fn auto_tuning_file_resolves_on_this_machine() {
    let topo = Topology::detect().unwrap();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tuning/auto.toml");
    if topo.online_cpus().len() >= 2 {
        CoreMap::load(path, &topo).unwrap();
    }
}

#[test]
fn eight_nic_example_is_clean_on_the_machine_it_describes() {
    let topo = two_socket_node();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tuning/example-2s-8gpu-8nic.toml"
    );
    let map = CoreMap::load(path, &topo).unwrap();
    assert_eq!(map.pollers().len(), 8);
    assert_eq!(check(&map, &topo), vec![]);
}

proptest::proptest! {
    /// Core maps come from operators' files: any text gives a map or a
    /// typed error, never a panic, and every error names a line in the file.
    #[test]
    fn parsing_arbitrary_text_never_panics_and_errors_point_into_the_file(
        cut in 0usize..GOOD.len(),
        junk in "[a-z0-9 =\\[\\]\"\n,.-]{0,40}",
    ) {
        let mut text = GOOD.to_owned();
        text.insert_str(cut, &junk);
        let lines = text.lines().count().max(1);
        match CoreMapFile::parse(&text, "fuzz.toml") {
            Ok(_) => {}
            Err(PlacementError::Syntax { line, .. })
            | Err(PlacementError::UnknownKey { line, .. })
            | Err(PlacementError::Schema { line, .. })
            | Err(PlacementError::DuplicateCore { line, .. })
            | Err(PlacementError::PollerOnEngineCore { line, .. })
            | Err(PlacementError::NoWorkers { line, .. }) => {
                proptest::prop_assert!(line >= 1 && line <= lines + 1, "line {} of {}", line, lines);
            }
            Err(PlacementError::EmptyMap { .. }) => {}
            Err(other) => proptest::prop_assert!(false, "unexpected {:?}", other),
        }
    }
}
