//! `kvpoll serve --metrics`: a real HTTP client scrapes a serving prefill
//! rank while a decode rank (`kvpoll connect`) reads from it; the counters
//! move with the transfer and Prometheus's own `promtool check metrics`
//! accepts the text (when promtool is installed: Debian package
//! `prometheus`, which `make test` installs).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const REQUESTS: u64 = 200;
const GUARD: Duration = Duration::from_secs(120);

struct Server {
    child: Child,
    listen: String,
    metrics: Option<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(rank: u32, metrics: bool) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvpoll"));
    cmd.args([
        "serve",
        "--rank",
        &rank.to_string(),
        "--listen",
        "127.0.0.1:0",
        "--until-stdin-closes",
    ]);
    if metrics {
        cmd.args(["--metrics", "127.0.0.1:0"]);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn kvpoll serve");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let listen = line.strip_prefix("LISTEN ").unwrap().trim().to_owned();
    let metrics = metrics.then(|| {
        line.clear();
        out.read_line(&mut line).unwrap();
        line.strip_prefix("METRICS ")
            .unwrap_or_else(|| panic!("serve said {line:?}"))
            .trim()
            .to_owned()
    });
    Server {
        child,
        listen,
        metrics,
    }
}

/// One scrape: (content type, body).
fn scrape(addr: &str, accept: Option<&str>) -> (String, String) {
    let mut req = ureq::get(format!("http://{addr}/metrics"));
    if let Some(a) = accept {
        req = req.header("Accept", a);
    }
    let mut resp = req.call().expect("scrape /metrics");
    assert_eq!(resp.status(), 200);
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = resp.body_mut().read_to_string().expect("read the body");
    (ct, body)
}

/// The value of the sample line that starts with `series` followed by a
/// space (name and labels exactly as rendered).
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{series} missing in:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// `promtool check metrics` on `text`: Some(output) when it ran.
fn promtool(text: &str) -> Option<std::process::Output> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    Some(child.wait_with_output().unwrap())
}

#[test]
fn scrapes_during_a_transfer_show_its_requests_and_pass_promtool() {
    let watched = serve(0, true);
    let other = serve(1, false);
    let addr = watched.metrics.clone().unwrap();

    // Until the engine is up and has published once, the figures are 0.
    let t = Instant::now();
    let (ct, before) = loop {
        let (ct, text) = scrape(&addr, None);
        if value(&text, "kvpoll_ledger_slots{state=\"capacity\"}") > 0.0 {
            break (ct, text);
        }
        assert!(t.elapsed() < GUARD, "the engine never published: {text}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    assert_eq!(
        value(
            &before,
            "kvpoll_requests_total{outcome=\"finished_sending\"}"
        ),
        0.0
    );
    assert_eq!(
        value(&before, "kvpoll_ledger_slots{state=\"capacity\"}"),
        1024.0
    );

    let mut connect = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args([
            "connect",
            "--to",
            &format!("{},{}", watched.listen, other.listen),
        ])
        .args([
            "--mode",
            "pull",
            "--requests",
            &REQUESTS.to_string(),
            "--json",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn kvpoll connect");
    let t = Instant::now();
    let mut during = Vec::new();
    let status = loop {
        if let Some(st) = connect.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < GUARD, "connect did not finish in {GUARD:?}");
        during.push(scrape(&addr, None).1);
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut json = String::new();
    connect
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut json)
        .unwrap();
    assert!(status.success(), "{json}");
    assert!(!during.is_empty(), "no scrape while the transfer ran");

    // The rank republishes every 100 ms: wait for the last reports.
    let done = |text: &str| {
        value(text, "kvpoll_requests_total{outcome=\"finished_sending\"}")
            + value(text, "kvpoll_requests_total{outcome=\"expired\"}")
    };
    let t = Instant::now();
    let after = loop {
        let (_, text) = scrape(&addr, None);
        if done(&text) >= REQUESTS as f64 || t.elapsed() > Duration::from_secs(10) {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Every request lent blocks on this rank once, and each lend ended.
    assert_eq!(done(&after), REQUESTS as f64, "{after}");
    assert!(
        value(
            &after,
            "kvpoll_requests_total{outcome=\"finished_sending\"}"
        ) > 0.0,
        "{after}"
    );
    assert_eq!(
        value(
            &after,
            "kvpoll_request_latency_seconds_count{kind=\"lend\"}"
        ),
        REQUESTS as f64,
        "{after}"
    );
    assert!(
        value(
            &after,
            "kvpoll_poller_iterations_total{poller=\"0\",state=\"busy\"}"
        ) > value(
            &before,
            "kvpoll_poller_iterations_total{poller=\"0\",state=\"busy\"}"
        ),
        "{after}"
    );
    // Counters never go down between scrapes.
    let mut last = 0.0;
    for text in during.iter().chain([&after]) {
        let v = done(text);
        assert!(v >= last, "{v} after {last}");
        last = v;
    }

    match promtool(&after) {
        Some(out) => {
            assert!(
                out.status.success(),
                "promtool check metrics: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            let mid = &during[during.len() / 2];
            let out = promtool(mid).unwrap();
            assert!(out.status.success(), "{mid}");
        }
        None => eprintln!("promtool not installed: the exposition was not validated by it"),
    }
}

#[test]
fn a_scraper_asking_for_openmetrics_gets_it_and_other_paths_are_404() {
    let s = serve(0, true);
    let addr = s.metrics.clone().unwrap();
    let (ct, text) = scrape(
        &addr,
        Some("application/openmetrics-text; version=1.0.0,text/plain;q=0.5"),
    );
    assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert!(text.contains("# TYPE kvpoll_requests counter\n"), "{text}");

    let err = ureq::get(format!("http://{addr}/nothing-here"))
        .call()
        .unwrap_err();
    assert!(matches!(err, ureq::Error::StatusCode(404)), "{err}");
}
