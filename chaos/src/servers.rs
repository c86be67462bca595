//! Redis servers the harness owns, so that the nemesis can kill and restart them,
//! with their data (append-only file, fsync on every write) or without it.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::process::{Child, Command};

/// One `redis-server` on a loopback port of ours.
pub(crate) struct RedisServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts `redis-server` on `port`, keeping its files in `dir`.
    pub(crate) async fn start(port: u16, dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut server = Self {
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

    /// Starts it again, from its append-only file (`keep_data`) or empty.
    pub(crate) async fn restart(&mut self, keep_data: bool) -> anyhow::Result<()> {
        self.kill().await?;
        if !keep_data {
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
