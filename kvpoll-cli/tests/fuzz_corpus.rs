//! The fuzz targets' checked-in corpus (`fuzz/corpus/<target>/`), replayed
//! through the same decoders and the same checks as the targets in `fuzz/`,
//! so that `make test` covers every decoder of outside bytes even where the
//! fuzzer itself does not run. A crash the fuzzer found goes into the
//! corpus with its fix, and stays a test.
//!
//! `KVPOLL_FUZZ_SEED=1 cargo test -p kvpoll-cli --test fuzz_corpus` (re)writes
//! the seed inputs (`seed-*`) from the encoders and a real engine.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvpoll::metadata::PeerMetadata;
use kvpoll::notification::{split, NoteKind, Notification, Sealer};
use kvpoll::placement::CoreMapFile;
use kvpoll::transport::ucx::{PackedRkey, WorkerAddress};
use kvpoll::wire::{self, Kind};
use kvpoll::{Engine, RequestId};
use kvpoll_cli::control::{FrameReader, Layout, Msg, Session};

fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target)
}

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = corpus(target);
    let mut v: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no corpus in {}", dir.display());
    v
}

fn seed(target: &str, seeds: &[Vec<u8>]) {
    if std::env::var_os("KVPOLL_FUZZ_SEED").is_none() {
        return;
    }
    let dir = corpus(target);
    std::fs::create_dir_all(&dir).unwrap();
    for (i, s) in seeds.iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i}")), s).unwrap();
    }
}

#[test]
fn control_corpus_decodes_without_panic_and_valid_frames_round_trip() {
    let layout = Layout {
        block_size: 16384,
        layers: 2,
        blocks: 512,
    };
    let msgs = [
        Msg::Hello(layout),
        Msg::Meta(vec![0x4b, 0x56, 0x50, 0x4c, 3, 1]),
        Msg::Prepare { req: 7, n: 4 },
        Msg::Ready {
            req: 7,
            lease_ms: 2000,
            lend: 0x5eed_1e4d,
            blocks: vec![1, 2, 3, 4],
        },
        Msg::Busy { req: 7 },
        Msg::Push {
            req: 8,
            lend: 0x5eed_de57,
            blocks: vec![9, 10],
        },
        Msg::Pushed { req: 8, done: true },
        Msg::Stall { ms: 400 },
        Msg::Stats,
        Msg::StatsReply {
            total: 512,
            free: 500,
            busy: 1,
            idle: 2,
            transfer_errors: 3,
            release_failures: 4,
            refused_clients: 5,
            unauthenticated_clients: 6,
        },
        Msg::Refused("STALL refused".into()),
    ];
    let mut seeds: Vec<Vec<u8>> = msgs.iter().map(|m| m.encode().unwrap()).collect();
    seeds.push(seeds.concat());
    seeds.push(b"STALL 3600000\n".to_vec());
    // A keyed client's first frames (HELLO, then STATS).
    let key = kvpoll::auth::AuthKey::from_secret(b"fuzzing's shared secret").unwrap();
    let client = Session::new(Some(&key));
    let hello = client.encode(&msgs[0]).unwrap();
    seeds.push([hello, client.encode(&Msg::Stats).unwrap()].concat());
    seed("control", &seeds);
    for (path, data) in inputs("control") {
        let mut r = FrameReader::new(&data[..], Duration::from_secs(1), None)
            .with_session(Session::new(Some(&key)));
        while r.read_msg().is_ok() {}
        if let Ok(m) = Msg::decode(&data) {
            assert_eq!(m.encode().as_deref(), Ok(&data[..]), "{}", path.display());
        }
        let mut r = FrameReader::new(&data[..], Duration::from_secs(1), None);
        while r.read_msg().is_ok() {}
    }
}

#[test]
fn peer_metadata_rkey_and_address_corpus_decodes_without_panic() {
    if std::env::var_os("KVPOLL_FUZZ_SEED").is_some() {
        let mut engine = Engine::builder().block_size(4096).build().unwrap();
        engine.register(8).unwrap();
        engine.register(8).unwrap();
        let meta = engine.local_metadata().unwrap();
        let m = PeerMetadata::decode(&meta).unwrap();
        let key = kvpoll::auth::AuthKey::from_secret(b"fuzzing's shared secret").unwrap();
        seed("peer_metadata", &[meta.clone(), m.encode_keyed(Some(&key))]);
        seed(
            "rkey_address",
            &[
                m.worker.as_bytes().to_vec(),
                m.regions[0].rkey.as_bytes().to_vec(),
                wire::encode(Kind::Notification, b"x"),
            ],
        );
        engine.shutdown();
    }
    let key = kvpoll::auth::AuthKey::from_secret(b"fuzzing's shared secret").unwrap();
    for (path, data) in inputs("peer_metadata") {
        let _ = PeerMetadata::decode(&data);
        let _ = PeerMetadata::decode_with_key(&data, Some(&key));
        if let Ok(m) = PeerMetadata::decode_with_key(&data, None) {
            assert_eq!(m.encode(), data, "{}", path.display());
        }
    }
    for (path, data) in inputs("rkey_address") {
        let _ = PackedRkey::from_bytes(&data);
        let _ = WorkerAddress::from_bytes(&data);
        for kind in [
            Kind::WorkerAddress,
            Kind::RemoteKey,
            Kind::PeerMetadata,
            Kind::Notification,
        ] {
            if let Ok(p) = wire::decode(&data, kind) {
                assert_eq!(wire::encode(kind, p), data, "{}", path.display());
            }
        }
    }
}

#[test]
fn notification_corpus_decodes_without_panic_and_valid_ones_round_trip() {
    let mut seeds: Vec<Vec<u8>> = [NoteKind::ReadDone, NoteKind::WriteDone, NoteKind::Ack]
        .iter()
        .map(|&kind| {
            Notification {
                kind,
                id: RequestId(42),
                incarnation: kvpoll::Incarnation(0x1eed_5eed_0042),
                nonce: kvpoll::Incarnation(9),
                sender: 7,
                blocks: Default::default(),
            }
            .encode()
            .to_vec()
        })
        .collect();
    // And a message of two (the coalesced form), untagged and tagged.
    seeds.push([seeds[0].clone(), seeds[1].clone()].concat());
    let key = kvpoll::auth::AuthKey::from_secret(b"fuzzing's shared secret").unwrap();
    let two = seeds[3].clone();
    seeds.push([&two[..], &Sealer::new(key.clone()).seal(7, &two)].concat());
    seed("notification", &seeds);
    for (path, data) in inputs("notification") {
        let _ = Sealer::new(key.clone()).open(7, &data);
        let Ok(parts) = split(&data) else { continue };
        for part in parts {
            if let Ok(n) = Notification::decode(part) {
                assert_eq!(&n.encode()[..], part, "{}", path.display());
            }
        }
    }
}

#[test]
fn core_map_corpus_parses_without_panic() {
    let tuning = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tuning");
    let mut seeds = Vec::new();
    for e in std::fs::read_dir(&tuning).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            seeds.push(std::fs::read(&p).unwrap());
        }
    }
    seeds.sort();
    seed("core_map", &seeds);
    for (_, data) in inputs("core_map") {
        if let Ok(text) = std::str::from_utf8(&data) {
            let _ = CoreMapFile::parse(text, "corpus.toml");
        }
    }
}
