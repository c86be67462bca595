//! The axum example's `GET /metrics`, scraped as Prometheus would: the
//! example serves on a free port, takes a few requests (two at once for one
//! order: one paid, one busy; then another order), and the scrape parses as
//! the Prometheus text format with dlock's counters and histograms labelled
//! with the key template.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// The example's binary, next to this test's `target/<profile>/deps/`.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    let profile = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    profile.join("examples").join(name)
}

/// Kills the server when the test ends, passed or not.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One HTTP/1.1 request; the status and the body.
fn request(addr: &str, method: &str, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    let (head, body) = response.split_once("\r\n\r\n").expect("headers");
    let status = head
        .split_whitespace()
        .nth(1)
        .expect("status")
        .parse()
        .expect("code");
    (status, body.to_owned())
}

/// A sample: its name and labels.
type Series = (String, BTreeMap<String, String>);

/// Parses the Prometheus text format: `name{k="v",…} value` lines, `#`
/// comments. Panics on a line that is neither.
fn parse(text: &str) -> BTreeMap<Series, f64> {
    let mut samples = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("no value: {line}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value: {line}"));
        let (name, labels) = match series.split_once('{') {
            None => (series.to_owned(), BTreeMap::new()),
            Some((name, rest)) => {
                let inner = rest
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("unclosed: {line}"));
                let mut labels = BTreeMap::new();
                let mut rest = inner;
                while !rest.is_empty() {
                    let (key, after) = rest
                        .split_once("=\"")
                        .unwrap_or_else(|| panic!("label: {line}"));
                    let end = after.find('"').unwrap_or_else(|| panic!("quote: {line}"));
                    labels.insert(key.to_owned(), after[..end].to_owned());
                    rest = after[end + 1..].trim_start_matches(',');
                }
                (name.to_owned(), labels)
            }
        };
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "metric name {name:?}"
        );
        samples.insert((name, labels), value);
    }
    samples
}

fn value(samples: &BTreeMap<Series, f64>, name: &str, labels: &[(&str, &str)]) -> f64 {
    let labels: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    *samples
        .get(&(name.to_owned(), labels.clone()))
        .unwrap_or_else(|| panic!("no {name} {labels:?} in the scrape"))
}

#[test]
fn the_axum_example_serves_its_dlock_metrics_to_prometheus() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("metrics-scrape");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test dir");
    let url = format!("sqlite://{}", dir.join("locks.db").display());
    let child = Command::new(example("axum_handler"))
        .args(["--addr", "127.0.0.1:0"])
        .env("DLOCK_URL", &url)
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run the axum_handler example (built by `cargo test` beside this test)");
    let mut server = Server(child);
    let stdout = server.0.stdout.take().expect("stdout");
    // Read on for the server's whole life: a closed pipe would end it at
    // its next line.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix("listening on http://") {
                let _ = tx.send(addr.to_owned());
            }
        }
    });
    let addr = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the example says where it listens");

    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| request(&addr, "POST", "/orders/7/pay"));
        let b = s.spawn(|| request(&addr, "POST", "/orders/7/pay"));
        (a.join().expect("a"), b.join().expect("b"))
    });
    let mut statuses = [a.0, b.0];
    statuses.sort();
    assert_eq!(statuses, [200, 409], "{a:?} {b:?}");
    assert_eq!(request(&addr, "POST", "/orders/8/pay").0, 200);

    let (status, text) = request(&addr, "GET", "/metrics");
    assert_eq!(status, 200);
    let samples = parse(&text);
    let key = [("backend", "default"), ("key", "order:{id}")];
    assert_eq!(value(&samples, "dlock_acquired_total", &key), 2.0, "{text}");
    assert_eq!(value(&samples, "dlock_released_total", &key), 2.0);
    assert_eq!(value(&samples, "dlock_busy_total", &key), 1.0);
    assert_eq!(value(&samples, "dlock_held_leases", &key), 0.0);
    let acquired = [key[0], key[1], ("outcome", "acquired")];
    assert_eq!(value(&samples, "dlock_wait_seconds_count", &acquired), 2.0);
    let busy = [key[0], key[1], ("outcome", "busy")];
    assert_eq!(value(&samples, "dlock_wait_seconds_count", &busy), 1.0);
    let waited = value(&samples, "dlock_wait_seconds_sum", &busy);
    assert!(
        waited >= 0.2,
        "the busy request waited its 200 ms: {waited}"
    );
    let released = [key[0], key[1], ("outcome", "released")];
    assert_eq!(value(&samples, "dlock_hold_seconds_count", &released), 2.0);
    let all = [key[0], key[1], ("outcome", "released"), ("le", "+Inf")];
    assert_eq!(value(&samples, "dlock_hold_seconds_bucket", &all), 2.0);
    assert!(
        text.contains("# TYPE dlock_hold_seconds histogram"),
        "{text}"
    );
    assert!(
        !text.contains("order:7") && !text.contains("order:8"),
        "{text}"
    );
}
