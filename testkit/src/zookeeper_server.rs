//! Launching a standalone ZooKeeper server of one's own on a loopback port
//! (the Java and jars of Debian's `zookeeper` package, which
//! `scripts/servers.sh` installs), and waiting until it serves.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// The class path of the server.
pub const CLASS_PATH: &str = "/usr/share/java/zookeeper.jar:/usr/share/java/slf4j-simple.jar";

/// Writes `dir/zoo.cfg` for a standalone server on `127.0.0.1:port`, its
/// snapshot and transaction log in `dir/data` (created): a tick of 500 ms
/// lets sessions time out from 1 s (up to 30 s); the transaction log is
/// written before every answer but not fsynced (`forceSync=no`: a killed
/// process loses nothing the kernel has); no admin server; the four-letter
/// words `ruok`, `srvr`, `stat` and `mntr`.
pub fn configure(port: u16, dir: &Path) -> std::io::Result<()> {
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
    )
}

/// The command that runs the server [`configure`]d in `dir` in the
/// foreground: a JVM of `max_heap_mb` MB at most, with these `-D`
/// `properties` (such as `znode.container.checkIntervalMs=100`), its output
/// appended to `dir/zookeeper.log`.
pub fn command(dir: &Path, max_heap_mb: u32, properties: &[&str]) -> std::io::Result<Command> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("zookeeper.log"))?;
    let mut command = Command::new("java");
    command
        .arg(format!("-Xmx{max_heap_mb}m"))
        .arg("-XX:+UseSerialGC")
        .args(properties.iter().map(|p| format!("-D{p}")))
        .args(["-cp", CLASS_PATH])
        .arg("org.apache.zookeeper.server.ZooKeeperServerMain")
        .arg(dir.join("zoo.cfg"))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    Ok(command)
}

/// Whether the server on `127.0.0.1:port` serves requests, asked within 1 s:
/// `srvr` reports its mode (`ruok` answers `imok` already while the server
/// still loads its data and turns sessions away).
pub async fn serving(port: u16) -> bool {
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(b"srvr").await?;
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await?;
        std::io::Result::Ok(String::from_utf8_lossy(&answer).contains("Mode:"))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), attempt).await,
        Ok(Ok(true))
    )
}

/// Waits until the server on `port` serves (up to `within`); whether it did.
pub async fn wait_until_serving(port: u16, within: Duration) -> bool {
    crate::poll(within, Duration::from_millis(50), || serving(port)).await
}
