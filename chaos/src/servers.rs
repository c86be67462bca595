//! Servers the harness owns, so that the nemesis can kill and restart them:
//! Redis, with its data (append-only file, fsync on every write) or without
//! it, and ZooKeeper (standalone, its snapshot and transaction log kept in its
//! directory: it always comes back with its data and its sessions).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::process::{Child, Command};

/// The class path of the ZooKeeper server (Debian's `zookeeper` package).
const ZK_CLASS_PATH: &str = "/usr/share/java/zookeeper.jar:/usr/share/java/slf4j-simple.jar";

/// What runs on the port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavor {
    Redis,
    ZooKeeper,
}

/// One `redis-server`, or one standalone ZooKeeper, on a loopback port of ours.
pub(crate) struct Server {
    flavor: Flavor,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Server {
    /// Starts `redis-server` on `port`, keeping its files in `dir`.
    pub(crate) async fn redis(port: u16, dir: &Path) -> anyhow::Result<Self> {
        Self::start(Flavor::Redis, port, dir).await
    }

    /// Starts a standalone ZooKeeper on `port` (a JVM of 256 MB at most), keeping
    /// its configuration, data and log in `dir`. A tick of 500 ms lets sessions
    /// time out from 1 s. The transaction log is written before every answer but
    /// not fsynced (`forceSync=no`): the nemesis kills the process, not the
    /// machine, and the kernel keeps what was written.
    pub(crate) async fn zookeeper(port: u16, dir: &Path) -> anyhow::Result<Self> {
        let data = dir.join("data");
        std::fs::create_dir_all(&data)?;
        std::fs::write(
            dir.join("zoo.cfg"),
            format!(
                "tickTime=500\nminSessionTimeout=1000\nmaxSessionTimeout=30000\n\
                 dataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
                 maxClientCnxns=0\nforceSync=no\nadmin.enableServer=false\n\
                 4lw.commands.whitelist=ruok,srvr,stat,mntr\n",
                data.display()
            ),
        )?;
        Self::start(Flavor::ZooKeeper, port, dir).await
    }

    async fn start(flavor: Flavor, port: u16, dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut server = Self {
            flavor,
            port,
            dir: dir.to_owned(),
            child: None,
        };
        server.spawn().await?;
        Ok(server)
    }

    /// The port it listens on.
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        // A server left on the port by someone else would answer our pings and make
        // every kill a no-op.
        if let Err(e) = std::net::TcpListener::bind(("127.0.0.1", self.port)) {
            bail!(
                "port {} is taken ({e}); pass another --port-base",
                self.port
            );
        }
        match self.flavor {
            Flavor::Redis => self.spawn_redis().await,
            Flavor::ZooKeeper => self.spawn_zookeeper().await,
        }
    }

    async fn spawn_zookeeper(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("zookeeper.log"))?;
        let child = Command::new("java")
            .args(["-Xmx256m", "-XX:+UseSerialGC", "-cp", ZK_CLASS_PATH])
            .arg("org.apache.zookeeper.server.ZooKeeperServerMain")
            .arg(self.dir.join("zoo.cfg"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("cannot run java (install the test servers: scripts/servers.sh up)")?;
        self.child = Some(child);
        // A JVM, then the data and the sessions to load.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if zk_serving(self.port).await {
                return Ok(());
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "ZooKeeper on port {} exited ({status}; is it installed? scripts/servers.sh up; see {}/zookeeper.log)",
                    self.port,
                    self.dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!(
            "ZooKeeper on port {} did not serve within 60 s (see {}/zookeeper.log)",
            self.port,
            self.dir.display()
        )
    }

    async fn spawn_redis(&mut self) -> anyhow::Result<()> {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--dir", &self.dir.display().to_string()])
            .args([
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ])
            .args(["--protected-mode", "no", "--daemonize", "no"])
            .args([
                "--logfile",
                &self.dir.join("redis.log").display().to_string(),
            ])
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("cannot run redis-server (install the test servers: scripts/servers.sh up)")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if ping(self.port).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        bail!(
            "redis-server on port {} did not answer within 10 s (see {}/redis.log)",
            self.port,
            self.dir.display()
        )
    }

    /// SIGKILL: no shutdown, no last save.
    pub(crate) async fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().await?;
        }
        Ok(())
    }

    /// Starts it again, from its append-only file (`keep_data`) or empty. ZooKeeper
    /// always keeps its data.
    pub(crate) async fn restart(&mut self, keep_data: bool) -> anyhow::Result<()> {
        self.kill().await?;
        if !keep_data && self.flavor == Flavor::Redis {
            for name in ["appendonlydir", "appendonly.aof", "dump.rdb"] {
                let path = self.dir.join(name);
                if path.is_dir() {
                    std::fs::remove_dir_all(&path)?;
                } else if path.exists() {
                    std::fs::remove_file(&path)?;
                }
            }
        }
        self.spawn().await
    }

    /// Whether it is running.
    pub(crate) fn is_up(&self) -> bool {
        self.child.is_some()
    }
}

/// `PING` over a bare socket (`+PONG`), no client library needed.
async fn ping(port: u16) -> bool {
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(b"PING\r\n").await?;
        let mut buf = [0u8; 7];
        s.read_exact(&mut buf).await?;
        std::io::Result::Ok(&buf == b"+PONG\r\n")
    };
    matches!(
        tokio::time::timeout(Duration::from_millis(500), attempt).await,
        Ok(Ok(true))
    )
}

/// Whether the ZooKeeper on `port` serves requests: `srvr` reports its mode
/// (`ruok` answers `imok` already while the server still loads its data and
/// turns sessions away).
async fn zk_serving(port: u16) -> bool {
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(b"srvr").await?;
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await?;
        std::io::Result::Ok(String::from_utf8_lossy(&answer).contains("Mode:"))
    };
    matches!(
        tokio::time::timeout(Duration::from_millis(500), attempt).await,
        Ok(Ok(true))
    )
}
