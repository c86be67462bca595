//! ZooKeeper for the ZooKeeper backend's tests: server-side access (the
//! suite's [`Faults`]), a TCP proxy that cuts, black-holes or drops the reply
//! of a create, and a private server that a test may SIGKILL and restart.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::{Registry, ZooKeeperBackend};
use futures_util::future::BoxFuture;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
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
/// while its container has a child; revoking deletes its children (what an
/// operator deleting the holder's node does). A client is opened per call:
/// every `#[tokio::test]` has its own runtime.
pub struct ZkFaults {
    /// The backend under test (for where it keeps a key).
    pub backend: ZooKeeperBackend,
    /// Its URL.
    pub url: String,
}

impl Faults for ZkFaults {
    fn revoke<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let client = admin(&self.url).await;
            let container = self.backend.container_path(stored_key);
            for child in children(&client, &container).await {
                match client.delete(&format!("{container}/{child}"), None).await {
                    Ok(()) | Err(ZkError::NoNode) => {}
                    Err(e) => panic!("revoking {container}/{child}: {e}"),
                }
            }
        })
    }

    fn is_held<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let client = admin(&self.url).await;
            !children(&client, &self.backend.container_path(stored_key))
                .await
                .is_empty()
        })
    }
}

/// What the proxy does to the bytes of its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Forward at once.
    Pass,
    /// Hold everything, both ways, until the flow passes again (a network
    /// partition: the sockets stay open); new connections are held too.
    Blackhole,
}

/// The opcodes of creates of lock nodes (`create`, `create2`), not of
/// containers (`createContainer`, 19).
const CREATE_OPCODES: [i32; 2] = [1, 15];

/// The opcode of a delete.
const DELETE_OPCODE: i32 = 2;

struct ProxyShared {
    flow: watch::Sender<Flow>,
    resets: watch::Sender<u64>,
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

/// A TCP proxy on a loopback port in front of one ZooKeeper server. It
/// understands just enough of ZooKeeper's framing to find a create request.
pub struct ZkProxy {
    /// The port it listens on.
    pub port: u16,
    shared: Arc<ProxyShared>,
}

impl ZkProxy {
    /// Listens on a free loopback port and forwards to `127.0.0.1:upstream`,
    /// on a thread of its own (so that it outlives a test's runtime).
    pub async fn start(upstream: u16) -> ZkProxy {
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        std_listener.set_nonblocking(true).expect("nonblocking");
        let port = std_listener.local_addr().expect("address").port();
        let shared = Arc::new(ProxyShared {
            flow: watch::channel(Flow::Pass).0,
            resets: watch::channel(0).0,
            cut_after_create: AtomicBool::new(false),
            creates_cut: AtomicU64::new(0),
            cut_deletes: AtomicBool::new(false),
            deletes_cut: AtomicU64::new(0),
            requests: (0..128).map(|_| AtomicU64::new(0)).collect(),
        });
        let serving = shared.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("proxy runtime");
            runtime.block_on(async move {
                let listener = TcpListener::from_std(std_listener).expect("listener");
                while let Ok((client, _)) = listener.accept().await {
                    tokio::spawn(serve(client, upstream, serving.clone()));
                }
            });
        });
        ZkProxy { port, shared }
    }

    /// Sets what happens to the bytes.
    pub fn set(&self, flow: Flow) {
        self.shared.flow.send_replace(flow);
    }

    /// Closes every open connection (the client sees them reset).
    pub fn reset_all(&self) {
        self.shared.resets.send_modify(|n| *n += 1);
    }

    /// The next create of a lock node is forwarded to the server, its reply
    /// is dropped, and its connection is then closed: the client never
    /// learns whether the create happened.
    pub fn cut_after_next_create(&self) {
        self.shared.cut_after_create.store(true, Ordering::SeqCst);
    }

    /// How many creates had their reply dropped.
    pub fn creates_cut(&self) -> u64 {
        self.shared.creates_cut.load(Ordering::SeqCst)
    }

    /// While `on`, every delete is forwarded to the server, its reply is
    /// dropped and its connection closed: the client never learns whether
    /// the delete happened.
    pub fn cut_deletes(&self, on: bool) {
        self.shared.cut_deletes.store(on, Ordering::SeqCst);
    }

    /// How many deletes had their reply dropped.
    pub fn deletes_cut(&self) -> u64 {
        self.shared.deletes_cut.load(Ordering::SeqCst)
    }

    /// How many requests with this opcode were forwarded to the server
    /// (ZooKeeper's `OpCode`: 1 create, 2 delete, 4 getData, 8 and 12
    /// getChildren, 22 multiRead, …).
    pub fn requests(&self, opcode: i32) -> u64 {
        usize::try_from(opcode)
            .ok()
            .and_then(|i| self.shared.requests.get(i))
            .map_or(0, |n| n.load(Ordering::SeqCst))
    }
}

async fn serve(client: TcpStream, upstream: u16, shared: Arc<ProxyShared>) {
    // Subscribed at accept, before any await: a reset sent while this
    // connection is still being set up closes it too.
    let resets = shared.resets.subscribe();
    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
        return;
    };
    if resets.has_changed().unwrap_or(true) {
        return;
    }
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    // Set when this connection forwarded the create whose reply is dropped.
    let doomed = Arc::new(AtomicBool::new(false));
    let up = tokio::spawn(pump(
        client_read,
        server_write,
        shared.clone(),
        resets.clone(),
        doomed.clone(),
        true,
    ));
    let down = tokio::spawn(pump(
        server_read,
        client_write,
        shared,
        resets,
        doomed,
        false,
    ));
    let _ = up.await;
    down.abort();
}

/// Copies one direction. The client-to-server direction parses frames: a
/// 4-byte length, then (after the first, the connect request) the xid and the
/// opcode. Once `doomed`, nothing more reaches the client.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: Arc<ProxyShared>,
    mut resets: watch::Receiver<u64>,
    doomed: Arc<AtomicBool>,
    client_side: bool,
) {
    let mut flow = shared.flow.subscribe();
    let mut buf = vec![0u8; 64 * 1024];
    // Client side: bytes of the frame being read, and whether the connect
    // request (the first frame) is past.
    let mut frame: Vec<u8> = Vec::new();
    let mut connected = false;
    loop {
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = resets.changed() => return,
        };
        while *flow.borrow_and_update() == Flow::Blackhole {
            tokio::select! {
                changed = flow.changed() => if changed.is_err() { return },
                _ = resets.changed() => return,
            }
        }
        let mut cut = false;
        if client_side {
            frame.extend_from_slice(&buf[..n]);
            while frame.len() >= 4 {
                let len = i32::from_be_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
                if frame.len() < 4 + len {
                    break;
                }
                if connected && len >= 8 {
                    let opcode = i32::from_be_bytes([frame[8], frame[9], frame[10], frame[11]]);
                    if let Some(n) = usize::try_from(opcode)
                        .ok()
                        .and_then(|i| shared.requests.get(i))
                    {
                        n.fetch_add(1, Ordering::SeqCst);
                    }
                    if CREATE_OPCODES.contains(&opcode)
                        && shared.cut_after_create.swap(false, Ordering::SeqCst)
                    {
                        shared.creates_cut.fetch_add(1, Ordering::SeqCst);
                        doomed.store(true, Ordering::SeqCst);
                        cut = true;
                    }
                    if opcode == DELETE_OPCODE && shared.cut_deletes.load(Ordering::SeqCst) {
                        shared.deletes_cut.fetch_add(1, Ordering::SeqCst);
                        doomed.store(true, Ordering::SeqCst);
                        cut = true;
                    }
                }
                connected = true;
                frame.drain(..4 + len);
            }
        } else if doomed.load(Ordering::SeqCst) {
            // The reply of the cut request, and anything after it: dropped.
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
        if cut {
            // Let the server take the create in, drop everything it answers,
            // then close both sides.
            tokio::time::sleep(Duration::from_millis(200)).await;
            return;
        }
    }
}

/// A ZooKeeper server of a test's own, on a free port, in a temporary
/// directory: it can be SIGKILLed and restarted on the same port and data.
/// Uses the Java and jars `scripts/servers.sh` installs; the server is
/// killed when dropped.
pub struct PrivateZk {
    /// Its client port.
    pub port: u16,
    dir: tempfile_dir::Dir,
    extra: Vec<String>,
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

const ZK_JARS: &str = "/usr/share/java/zookeeper.jar:/usr/share/java/slf4j-simple.jar";

impl PrivateZk {
    /// Starts a server with these extra JVM `-D` properties (for example
    /// `znode.container.checkIntervalMs=100`) and waits until it answers.
    pub async fn start(jvm_properties: &[&str]) -> PrivateZk {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let dir = tempfile_dir::Dir::new("zk");
        let data: PathBuf = dir.path().join("data");
        std::fs::create_dir_all(&data).expect("data dir");
        std::fs::write(
            dir.path().join("zoo.cfg"),
            format!(
                "tickTime=500\nminSessionTimeout=1000\nmaxSessionTimeout=30000\n\
                 dataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
                 maxClientCnxns=0\nforceSync=no\nadmin.enableServer=false\n\
                 4lw.commands.whitelist=ruok,srvr,stat,mntr\n",
                data.display()
            ),
        )
        .expect("zoo.cfg");
        let mut zk = PrivateZk {
            port,
            dir,
            extra: jvm_properties.iter().map(|p| format!("-D{p}")).collect(),
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
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("zookeeper.log"))
            .expect("log file");
        let child = Command::new("java")
            .arg("-Xmx128m")
            .arg("-XX:+UseSerialGC")
            .args(&self.extra)
            .arg("-cp")
            .arg(ZK_JARS)
            .arg("org.apache.zookeeper.server.ZooKeeperServerMain")
            .arg(self.dir.path().join("zoo.cfg"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                crate::servers_missing(&format!("java ZooKeeperServerMain on {}", self.port), e)
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if serving(self.port).await {
                return;
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(self.dir.path().join("zookeeper.log"))
                    .unwrap_or_default();
                crate::servers_missing(
                    &format!("private ZooKeeper on {}", self.port),
                    format!("did not start within 60 s:\n{log}"),
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
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

/// Whether a ZooKeeper server on this port serves requests (`srvr` reports
/// its mode; `ruok` answers `imok` already while the server still loads its
/// data and turns sessions away).
pub async fn serving(port: u16) -> bool {
    let attempt = async {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        stream.write_all(b"srvr").await.ok()?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.ok()?;
        Some(String::from_utf8_lossy(&answer).contains("Mode:"))
    };
    tokio::time::timeout(Duration::from_secs(2), attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
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
