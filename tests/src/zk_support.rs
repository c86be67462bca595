//! ZooKeeper for the ZooKeeper backend's tests: server-side access (the
//! suite's [`Faults`]), the shared fault proxy taught ZooKeeper's framing
//! (it black-holes or resets connections, and cuts one after a create or a
//! delete, dropping the reply), a private server that a test may SIGKILL and
//! restart, and the Java programs (Curator, a server whose sequence counters
//! can be set).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use dlock_runtime::{Registry, ZooKeeperBackend};
use dlock_testkit::{Fault, FaultProxy, RequestFilter, Verdict, zookeeper_server};
use futures_util::future::BoxFuture;
use tokio::io::AsyncWriteExt as _;
use zookeeper_client::{Client, Error as ZkError};

use crate::Faults;

/// The test server's URL (`scripts/servers.sh`), e.g. `zk://127.0.0.1:42181/dlock-test`.
pub fn url() -> String {
    crate::server_url("DLOCK_TEST_ZK_URL", "zk://127.0.0.1:42181/dlock-test")
}

/// `host:port[,host:port]` of a `zk://` URL (no credentials, no chroot).
pub fn hosts(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    rest[..end].to_owned()
}

/// The port of the first host of a `zk://` URL.
pub fn port(url: &str) -> u16 {
    let hosts = hosts(url);
    let first = hosts.split(',').next().unwrap_or("");
    first
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(2181)
}

/// A plain client at the root of the ensemble of `url`, on the caller's
/// runtime (a test's own: open one per test, never keep one across tests).
pub async fn admin(url: &str) -> Client {
    Client::connector()
        .with_session_timeout(Duration::from_secs(5))
        .with_fail_eagerly()
        .connect(&hosts(url))
        .await
        .unwrap_or_else(|e| crate::servers_missing(url, e))
}

/// The children of a node (none if it does not exist).
pub async fn children(client: &Client, path: &str) -> Vec<String> {
    match client.list_children(path).await {
        Ok(children) => children,
        Err(ZkError::NoNode) => Vec::new(),
        Err(e) => panic!("listing {path}: {e}"),
    }
}

/// The suite's server-side controls on the ZooKeeper backend: a key is held
/// while its container has a lock child or its `leases` child a lease;
/// revoking deletes them (what an operator deleting the holders' nodes
/// does). A client is opened per call: every `#[tokio::test]` has its own
/// runtime.
pub struct ZkFaults {
    /// The backend under test (for where it keeps a key).
    pub backend: ZooKeeperBackend,
    /// Its URL.
    pub url: String,
}

/// The holders' nodes of a key's container: its lock children and the
/// leases under its `leases` child (a semaphore's; Curator's semaphore
/// also has a `locks` child, the queue of its acquirers, not holders).
async fn holder_nodes(client: &Client, container: &str) -> Vec<String> {
    let mut nodes = Vec::new();
    for child in children(client, container).await {
        if child == "locks" {
            continue;
        }
        if child == "leases" {
            let leases = format!("{container}/leases");
            for lease in children(client, &leases).await {
                nodes.push(format!("{leases}/{lease}"));
            }
        } else {
            nodes.push(format!("{container}/{child}"));
        }
    }
    nodes
}

impl Faults for ZkFaults {
    fn revoke<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let client = admin(&self.url).await;
            let container = self.backend.container_path(stored_key);
            for node in holder_nodes(&client, &container).await {
                match client.delete(&node, None).await {
                    Ok(()) | Err(ZkError::NoNode) => {}
                    Err(e) => panic!("revoking {node}: {e}"),
                }
            }
        })
    }

    fn is_held<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let client = admin(&self.url).await;
            !holder_nodes(&client, &self.backend.container_path(stored_key))
                .await
                .is_empty()
        })
    }
}

/// The opcodes of creates of lock nodes (`create`, `create2`), not of
/// containers (`createContainer`, 19).
const CREATE_OPCODES: [i32; 2] = [1, 15];

/// The opcode of a delete.
const DELETE_OPCODE: i32 = 2;

/// ZooKeeper's framing and opcodes, for the fault proxy: each frame is a
/// 4-byte length and that many bytes; after the first (the connect
/// request), a request starts with its xid and its opcode.
struct ZkRequests {
    /// Armed: the next connection that forwards a create drops the reply and
    /// is cut.
    cut_after_create: AtomicBool,
    creates_cut: AtomicU64,
    /// While set, every connection that forwards a delete drops its reply
    /// and is cut.
    cut_deletes: AtomicBool,
    deletes_cut: AtomicU64,
    /// Requests forwarded, by opcode (0 to 127).
    requests: Vec<AtomicU64>,
}

/// How long a cut connection stays open after its request: time for the
/// server to take it in.
const CUT_AFTER: Duration = Duration::from_millis(200);

impl RequestFilter for ZkRequests {
    fn frame_len(&self, bytes: &[u8]) -> Option<usize> {
        let len = i32::from_be_bytes(bytes.get(..4)?.try_into().ok()?);
        Some(4 + usize::try_from(len).ok()?)
    }

    fn request(&self, index: usize, frame: &[u8]) -> Verdict {
        if index == 0 || frame.len() < 12 {
            return Verdict::Forward;
        }
        let opcode = i32::from_be_bytes([frame[8], frame[9], frame[10], frame[11]]);
        if let Some(n) = usize::try_from(opcode)
            .ok()
            .and_then(|i| self.requests.get(i))
        {
            n.fetch_add(1, Ordering::SeqCst);
        }
        let mut verdict = Verdict::Forward;
        if CREATE_OPCODES.contains(&opcode) && self.cut_after_create.swap(false, Ordering::SeqCst) {
            self.creates_cut.fetch_add(1, Ordering::SeqCst);
            verdict = Verdict::ForwardThenCut(CUT_AFTER);
        }
        if opcode == DELETE_OPCODE && self.cut_deletes.load(Ordering::SeqCst) {
            self.deletes_cut.fetch_add(1, Ordering::SeqCst);
            verdict = Verdict::ForwardThenCut(CUT_AFTER);
        }
        verdict
    }
}

/// The shared fault proxy ([`FaultProxy`]) on a loopback port in front of
/// one ZooKeeper server, reading just enough of ZooKeeper's framing to count
/// requests by opcode and to cut a connection after a create or a delete.
pub struct ZkProxy {
    proxy: FaultProxy,
    requests: Arc<ZkRequests>,
}

/// A ZooKeeper backend whose connection runs through a proxy of its own, so
/// that a test can end its session from outside as when its process dies
/// ([`end_session`](Self::end_session)).
pub struct ProxiedZk {
    /// The backend (session timeout 4 s).
    pub backend: ZooKeeperBackend,
    /// Its proxy.
    pub proxy: ZkProxy,
}

impl ProxiedZk {
    /// A backend on the test server through a new proxy.
    pub async fn connect() -> ProxiedZk {
        let proxy = ZkProxy::start(port(&url())).await;
        let proxied = format!(
            "{}?session_timeout=4s",
            url().replacen(&hosts(&url()), &format!("127.0.0.1:{}", proxy.port()), 1)
        );
        let backend = ZooKeeperBackend::connect(&proxied)
            .await
            .unwrap_or_else(|e| crate::servers_missing(&proxied, e));
        ProxiedZk { backend, proxy }
    }

    /// Ends the backend's session from outside: another client takes the
    /// session over and closes it. The backend's bytes are held meanwhile:
    /// otherwise its client reconnects with the same session at once, the
    /// server hands the session back and forth, and the close can miss it.
    pub async fn end_session(&self) {
        let stolen = self.backend.session_for_tests().expect("a session");
        self.proxy.set(Fault::Hold);
        let mut attempts = 0;
        let thief = loop {
            attempts += 1;
            match Client::connector()
                .with_session(stolen.clone())
                .with_session_timeout(Duration::from_secs(4))
                .with_connection_timeout(Duration::from_secs(3))
                .connect(&hosts(&url()))
                .await
            {
                Ok(thief) => break thief,
                Err(e) if attempts < 5 => eprintln!("taking the session over: {e}; again"),
                Err(e) => panic!("take the session over: {e}"),
            }
        };
        drop(thief); // closes the session: its nodes go.
        tokio::time::sleep(Duration::from_millis(300)).await;
        // The backend's client reconnects with the closed session and hears Expired.
        self.proxy.set(Fault::Pass);
    }
}

impl ZkProxy {
    /// Listens on a free loopback port and forwards to `127.0.0.1:upstream`,
    /// on the test's runtime.
    pub async fn start(upstream: u16) -> ZkProxy {
        let requests = Arc::new(ZkRequests {
            cut_after_create: AtomicBool::new(false),
            creates_cut: AtomicU64::new(0),
            cut_deletes: AtomicBool::new(false),
            deletes_cut: AtomicU64::new(0),
            requests: (0..128).map(|_| AtomicU64::new(0)).collect(),
        });
        let proxy = FaultProxy::start_filtered(format!("127.0.0.1:{upstream}"), requests.clone())
            .await
            .expect("start the proxy");
        ZkProxy { proxy, requests }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.proxy.port()
    }

    /// Sets what happens to the bytes from now on ([`Fault::Hold`]: a
    /// network partition, the sockets stay open).
    pub fn set(&self, fault: Fault) {
        self.proxy.set(fault);
    }

    /// Resets every open connection.
    pub fn reset_all(&self) {
        self.proxy.reset_all();
    }

    /// The next create of a lock node is forwarded to the server, its reply
    /// is dropped, and its connection is then closed: the client never
    /// learns whether the create happened.
    pub fn cut_after_next_create(&self) {
        self.requests.cut_after_create.store(true, Ordering::SeqCst);
    }

    /// How many creates had their reply dropped.
    pub fn creates_cut(&self) -> u64 {
        self.requests.creates_cut.load(Ordering::SeqCst)
    }

    /// While `on`, every delete is forwarded to the server, its reply is
    /// dropped and its connection closed: the client never learns whether
    /// the delete happened.
    pub fn cut_deletes(&self, on: bool) {
        self.requests.cut_deletes.store(on, Ordering::SeqCst);
    }

    /// How many deletes had their reply dropped.
    pub fn deletes_cut(&self) -> u64 {
        self.requests.deletes_cut.load(Ordering::SeqCst)
    }

    /// Holds back, for `hold`, the next chunk a client sends that contains
    /// every one of `needles` ([`FaultProxy::hold_next`]).
    pub fn hold_next(&self, needles: &[&[u8]], hold: Duration) {
        self.proxy.hold_next(needles, hold);
    }

    /// The connection on which the last [`Self::hold_next`] held a chunk
    /// back, if it did ([`FaultProxy::held_on`]).
    pub fn held_on(&self) -> Option<usize> {
        self.proxy.held_on()
    }

    /// How many requests with this opcode were forwarded to the server
    /// (ZooKeeper's `OpCode`: 1 create, 2 delete, 4 getData, 8 and 12
    /// getChildren, 22 multiRead, …).
    pub fn requests(&self, opcode: i32) -> u64 {
        usize::try_from(opcode)
            .ok()
            .and_then(|i| self.requests.requests.get(i))
            .map_or(0, |n| n.load(Ordering::SeqCst))
    }
}

/// A ZooKeeper server of a test's own, on a free port, in a temporary
/// directory (launched by [`zookeeper_server`]): it can be SIGKILLed and
/// restarted on the same port and data. The server is killed when dropped.
pub struct PrivateZk {
    /// Its client port.
    pub port: u16,
    dir: tempfile_dir::Dir,
    properties: Vec<String>,
    child: Option<Child>,
}

/// A temporary directory removed on drop (without another dependency).
mod tempfile_dir {
    use std::path::{Path, PathBuf};

    pub(super) struct Dir(PathBuf);

    impl Dir {
        pub(super) fn new(name: &str) -> Dir {
            let path = std::env::temp_dir().join(format!(
                "dlock-{name}-{}-{:x}",
                std::process::id(),
                rand::random::<u64>()
            ));
            std::fs::create_dir_all(&path).expect("temporary directory");
            Dir(path)
        }

        pub(super) fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl PrivateZk {
    /// Starts a server with these extra JVM `-D` properties (for example
    /// `znode.container.checkIntervalMs=100`) and waits until it answers.
    pub async fn start(jvm_properties: &[&str]) -> PrivateZk {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let dir = tempfile_dir::Dir::new("zk");
        zookeeper_server::configure(port, dir.path()).expect("zoo.cfg");
        let mut zk = PrivateZk {
            port,
            dir,
            properties: jvm_properties.iter().map(|p| p.to_string()).collect(),
            child: None,
        };
        zk.launch().await;
        zk
    }

    /// `zk://127.0.0.1:{port}{chroot}`.
    pub fn url(&self, chroot_and_query: &str) -> String {
        format!("zk://127.0.0.1:{}{chroot_and_query}", self.port)
    }

    async fn launch(&mut self) {
        let properties: Vec<&str> = self.properties.iter().map(String::as_str).collect();
        let child = zookeeper_server::command(self.dir.path(), 128, &properties)
            .expect("log file")
            .spawn()
            .unwrap_or_else(|e| {
                crate::servers_missing(&format!("java ZooKeeperServerMain on {}", self.port), e)
            });
        self.child = Some(child);
        if !zookeeper_server::wait_until_serving(self.port, Duration::from_secs(60)).await {
            let log =
                std::fs::read_to_string(self.dir.path().join("zookeeper.log")).unwrap_or_default();
            crate::servers_missing(
                &format!("private ZooKeeper on {}", self.port),
                format!("did not start within 60 s:\n{log}"),
            );
        }
    }

    /// SIGKILLs the server (no clean shutdown).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and data.
    pub async fn restart(&mut self) {
        self.kill();
        self.launch().await;
    }
}

impl Drop for PrivateZk {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The jars the Java programs of the tests (`tests/java`) run with: Debian's
/// ZooKeeper and Curator (`scripts/servers.sh` installs them).
const JAVA_JARS: [&str; 8] = [
    "/usr/share/java/zookeeper.jar",
    "/usr/share/java/zookeeper-jute.jar",
    "/usr/share/java/curator-client.jar",
    "/usr/share/java/curator-framework.jar",
    "/usr/share/java/curator-recipes.jar",
    "/usr/share/java/guava.jar",
    "/usr/share/java/slf4j-api.jar",
    "/usr/share/java/slf4j-nop.jar",
];

/// The test's Java programs (`tests/java/*.java`), compiled.
#[derive(Debug, Clone)]
pub struct JavaPrograms {
    classpath: String,
}

/// Something a test needs is not installed: in CI (`CI=true`) the test
/// fails; elsewhere it is skipped with the reason printed.
fn missing(what: &str) -> Option<JavaPrograms> {
    let reason = format!(
        "{what}; install it with scripts/servers.sh (Debian's default-jdk-headless, \
         zookeeper and libcurator-recipes-java)"
    );
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{reason}");
    }
    println!("skipped: {reason}");
    None
}

/// Compiles the Java programs of `tests/java` into `out_dir` (once per
/// version of their sources), or answers `None` — after printing why — when `javac`,
/// `java` or a jar is missing outside CI. In CI a missing one fails.
pub fn java_programs(out_dir: &std::path::Path) -> Option<JavaPrograms> {
    static COMPILED: std::sync::Mutex<Option<JavaPrograms>> = std::sync::Mutex::new(None);
    let mut compiled = COMPILED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(programs) = compiled.as_ref() {
        return Some(programs.clone());
    }
    for tool in ["java", "javac"] {
        let found = Command::new(tool)
            .arg("-version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return missing(&format!("`{tool}` is not installed"));
        }
    }
    if let Some(jar) = JAVA_JARS
        .iter()
        .find(|jar| !std::path::Path::new(jar).exists())
    {
        return missing(&format!("{jar} is missing"));
    }
    let sources_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("java");
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&sources_dir)
        .expect("tests/java")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "java"))
        .collect();
    sources.sort();
    // Compiled once per version of the sources: into a directory of this
    // process, then renamed (test binaries may compile at the same time).
    let digest = sources.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, source| {
        std::fs::read(source)
            .expect("a Java source")
            .iter()
            .fold(h, |h, b| {
                (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
            })
    });
    let classes = out_dir.join(format!("java-{digest:016x}"));
    let jars = JAVA_JARS.join(":");
    if !classes.exists() {
        let building = out_dir.join(format!("java-{digest:016x}-{}", std::process::id()));
        std::fs::create_dir_all(&building).expect("classes directory");
        let output = Command::new("javac")
            .arg("-nowarn")
            .arg("-d")
            .arg(&building)
            .arg("-cp")
            .arg(&jars)
            .args(&sources)
            .output()
            .expect("run javac");
        assert!(
            output.status.success(),
            "javac failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        if std::fs::rename(&building, &classes).is_err() {
            // Another process got there first, with the same classes.
            let _ = std::fs::remove_dir_all(&building);
        }
    }
    let programs = JavaPrograms {
        classpath: format!("{}:{jars}", classes.display()),
    };
    *compiled = Some(programs.clone());
    Some(programs)
}

impl JavaPrograms {
    /// `java` running the program `class` with these arguments.
    pub fn command(&self, class: &str) -> tokio::process::Command {
        let mut command = tokio::process::Command::new("java");
        command
            .arg("-Xmx96m")
            .arg("-XX:+UseSerialGC")
            .arg("-XX:TieredStopAtLevel=1")
            .arg("-cp")
            .arg(&self.classpath)
            .arg(class)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        command
    }

    /// Apache Curator's `InterProcessMutex` on `lock_path` (a path from the
    /// root), in a process of its own (`tests/java/CuratorLocker.java`):
    /// `mode` and its arguments after the session timeout.
    pub fn curator(
        &self,
        hosts: &str,
        lock_path: &str,
        session: Duration,
        mode: &str,
        args: &[&str],
    ) -> JavaProcess {
        let mut command = self.command("CuratorLocker");
        command
            .arg(mode)
            .arg(hosts)
            .arg(lock_path)
            .arg(session.as_millis().to_string())
            .args(args);
        JavaProcess::spawn(command)
    }
}

/// A running Java program whose stdout is read line by line. Killed when
/// dropped.
pub struct JavaProcess {
    child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    stdin: Option<tokio::process::ChildStdin>,
}

impl JavaProcess {
    fn spawn(mut command: tokio::process::Command) -> JavaProcess {
        use tokio::io::AsyncBufReadExt as _;
        let mut child = command.spawn().expect("start java");
        let stdout = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take();
        JavaProcess {
            child,
            lines: tokio::io::BufReader::new(stdout).lines(),
            stdin,
        }
    }

    /// The next line it prints, within `within` (panics on end or timeout).
    pub async fn line(&mut self, within: Duration) -> String {
        match self.try_line(within).await {
            Some(line) => line,
            None => panic!(
                "no line from the Java program within {within:?}: {:?}",
                self.child.try_wait()
            ),
        }
    }

    /// The next line it prints within `within`, if any (none once it ended).
    async fn try_line(&mut self, within: Duration) -> Option<String> {
        match tokio::time::timeout(within, self.lines.next_line()).await {
            Ok(Ok(line)) => line,
            Ok(Err(e)) => panic!("reading the Java program's output: {e}"),
            Err(_) => None,
        }
    }

    /// Waits for it to end; its exit code.
    pub async fn wait(&mut self, within: Duration) -> Option<i32> {
        tokio::time::timeout(within, self.child.wait())
            .await
            .expect("the Java program did not end in time")
            .expect("wait for java")
            .code()
    }

    /// SIGKILLs it (a crash: no clean close of its session).
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

/// A ZooKeeper server of a test's own (`tests/java/CounterEndZooKeeper.java`,
/// in-process in one JVM, no container reaping) on a free loopback port,
/// whose containers' child counters can be set to any value — such as just
/// below their end, `2147483647`.
pub struct CounterEndZk {
    /// Its client port.
    pub port: u16,
    process: JavaProcess,
    _dir: tempfile_dir::Dir,
}

impl CounterEndZk {
    /// Starts it on a free port in 47000-47999 and waits until it serves
    /// (on another port if that one was taken meanwhile).
    pub async fn start(programs: &JavaPrograms) -> CounterEndZk {
        for _ in 0..5 {
            let port = loop {
                let port = rand::random_range(47000..48000);
                if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                    break port;
                }
            };
            let dir = tempfile_dir::Dir::new("zk-counter-end");
            let mut command = programs.command("CounterEndZooKeeper");
            command
                .arg(dir.path())
                .arg(port.to_string())
                .stdin(Stdio::piped());
            let mut process = JavaProcess::spawn(command);
            if process.try_line(Duration::from_secs(60)).await.as_deref() == Some("ready") {
                return CounterEndZk {
                    port,
                    process,
                    _dir: dir,
                };
            }
        }
        panic!("the counter-end ZooKeeper server did not start (5 tries)")
    }

    /// `zk://127.0.0.1:{port}{chroot_and_query}`.
    pub fn url(&self, chroot_and_query: &str) -> String {
        format!("zk://127.0.0.1:{}{chroot_and_query}", self.port)
    }

    /// Creates the container `path` (a path from the root) if missing and
    /// sets its child counter: its next sequential child gets `next`.
    pub async fn set_counter(&mut self, path: &str, next: i32) {
        let stdin = self.process.stdin.as_mut().expect("stdin");
        stdin
            .write_all(format!("counter {path} {next}\n").as_bytes())
            .await
            .expect("write to the counter-end server");
        stdin.flush().await.expect("flush");
        let answer = self.process.line(Duration::from_secs(30)).await;
        assert_eq!(
            answer,
            format!("ok {next}"),
            "setting the counter of {path}"
        );
    }
}

/// What the contenders share: a counter in a file, incremented by
/// read-sleep-write, and a marker file that exists while someone holds the
/// key (created with "must not exist": a second holder finds it).
pub struct Shared {
    dir: PathBuf,
    /// Turns that found another holder inside.
    pub overlaps: Mutex<u32>,
    /// The fencing tokens of the acquisitions, in the order they held.
    pub tokens: Mutex<Vec<u64>>,
}

impl Shared {
    /// Starts the counter at 0 in `dir`.
    pub fn new(dir: &std::path::Path) -> Arc<Shared> {
        std::fs::write(dir.join("counter"), "0").expect("counter file");
        Arc::new(Shared {
            dir: dir.to_owned(),
            overlaps: Mutex::new(0),
            tokens: Mutex::new(Vec::new()),
        })
    }

    /// How often the holder changed between dlock and Curator: the
    /// `turns` file has a `d` per dlock turn, a `c` per Curator turn.
    pub fn switches(&self) -> usize {
        let turns = std::fs::read(self.dir.join("turns")).unwrap_or_default();
        turns.windows(2).filter(|w| w[0] != w[1]).count()
    }

    /// The counter's value.
    pub fn counter(&self) -> u64 {
        std::fs::read_to_string(self.dir.join("counter"))
            .expect("counter file")
            .trim()
            .parse()
            .expect("a number")
    }

    /// One turn of a holder: false if another holder was inside.
    pub async fn turn(&self, hold: Duration) -> bool {
        let inside = self.dir.join("inside");
        if std::fs::File::create_new(&inside).is_err() {
            *self.overlaps.lock().unwrap() += 1;
            return false;
        }
        let n = self.counter();
        tokio::time::sleep(hold).await;
        std::fs::write(self.dir.join("counter"), (n + 1).to_string()).expect("counter file");
        let mut turns = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("turns"))
            .expect("turns file");
        std::io::Write::write_all(&mut turns, b"d").expect("turns file");
        std::fs::remove_file(&inside).expect("marker file");
        true
    }
}

/// `tasks` tasks on `backend`, each taking `key` `rounds` times and taking
/// a [`Shared::turn`] while it holds it.
pub fn contenders(
    backend: &ZooKeeperBackend,
    key: &str,
    tasks: usize,
    rounds: usize,
    shared: &Arc<Shared>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let registry = Registry::builder().default_backend(backend.clone()).build();
    (0..tasks)
        .map(|_| {
            let (registry, key, shared) = (registry.clone(), key.to_owned(), shared.clone());
            tokio::spawn(async move {
                for _ in 0..rounds {
                    let guard = registry
                        .lock(&key)
                        .wait(Duration::from_secs(60))
                        .acquire()
                        .await
                        .expect("acquire");
                    let token = guard.fencing_token().map(u64::from).expect("a token");
                    shared.tokens.lock().unwrap().push(token);
                    shared.turn(Duration::from_millis(3)).await;
                    guard.release().await.expect("release");
                }
            })
        })
        .collect()
}
