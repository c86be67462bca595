//! The benchmark's own PostgreSQL and MariaDB: a fresh cluster or data
//! directory each, under `target/`, on loopback ports of the benchmark's,
//! stopped and removed at the end (also when the run fails).

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::Connection as _;

use crate::common::cpu::on_path;

/// Where Debian's PostgreSQL 15 programs are (`scripts/servers.sh` installs them).
const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// PostgreSQL or MariaDB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Flavor {
    Postgres,
    MariaDb,
}

impl Flavor {
    pub(super) fn name(self) -> &'static str {
        match self {
            Flavor::Postgres => "PostgreSQL",
            Flavor::MariaDb => "MariaDB",
        }
    }
}

/// A server of the benchmark's own: killed (all its processes) and its
/// directory removed when dropped.
pub(super) struct OwnServer {
    flavor: Flavor,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl OwnServer {
    /// The database `dlock` as the user `dlock`.
    pub(super) fn url(&self) -> String {
        match self.flavor {
            Flavor::Postgres => format!("postgres://dlock:dlock@127.0.0.1:{}/dlock", self.port),
            Flavor::MariaDb => format!("mysql://dlock:dlock@127.0.0.1:{}/dlock", self.port),
        }
    }

    /// The port it listens on.
    pub(super) fn port(&self) -> u16 {
        self.port
    }

    /// The server's process: PostgreSQL's postmaster (its backends are its
    /// children), MariaDB's one process.
    pub(super) fn pid(&self) -> anyhow::Result<u32> {
        self.child
            .as_ref()
            .map(Child::id)
            .ok_or_else(|| anyhow::anyhow!("the {} server is not running", self.flavor.name()))
    }

    /// Starts PostgreSQL 15 on `port` (or a free port near it, see
    /// [`free_port`]): a cluster made by `initdb
    /// --auth=trust` under `root` (PostgreSQL refuses to run as root: it
    /// runs as the `postgres` user), the role and database `dlock`, the test
    /// servers' settings (`fsync=off`, `full_page_writes=off`,
    /// `synchronous_commit=on`), no Unix socket.
    pub(super) async fn postgres(port: u16, root: &Path) -> anyhow::Result<OwnServer> {
        for program in ["initdb", "postgres"] {
            let path = Path::new(PG_BIN).join(program);
            anyhow::ensure!(
                path.exists(),
                "{} is missing: scripts/servers.sh up installs PostgreSQL 15",
                path.display()
            );
        }
        let (uid, gid) = (id("-u")?, id("-g")?);
        let port = free_port(port)?;
        let dir = fresh_dir(root, &format!("postgres-{port}"))?;
        chown(&dir, uid, gid)?;
        let status = Command::new(Path::new(PG_BIN).join("initdb"))
            .arg("-D")
            .arg(dir.join("data"))
            .args(["--auth=trust", "--username=postgres", "--encoding=UTF8"])
            .args(["--locale=C", "--no-sync"])
            .uid(uid)
            .gid(gid)
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(log(&dir, "initdb.log")?)
            .stderr(log(&dir, "initdb.log")?)
            .status()?;
        anyhow::ensure!(
            status.success(),
            "initdb failed ({status}; see {}/initdb.log)",
            dir.display()
        );
        let mut command = Command::new(Path::new(PG_BIN).join("postgres"));
        command.arg("-D").arg(dir.join("data"));
        for setting in [
            "listen_addresses=127.0.0.1".to_owned(),
            format!("port={port}"),
            "unix_socket_directories=".to_owned(),
            "fsync=off".to_owned(),
            "full_page_writes=off".to_owned(),
            "synchronous_commit=on".to_owned(),
            "max_connections=300".to_owned(),
        ] {
            command.args(["-c", &setting]);
        }
        command
            .uid(uid)
            .gid(gid)
            .current_dir("/")
            .stdout(log(&dir, "postgres.log")?)
            .stderr(log(&dir, "postgres.log")?);
        let mut server = OwnServer::spawn(Flavor::Postgres, port, dir, command)?;
        let admin = format!("postgres://postgres@127.0.0.1:{port}/postgres");
        server.await_ready(&admin).await?;
        let mut conn = sqlx::PgConnection::connect(&admin).await?;
        let data: String = sqlx::query_scalar("SHOW data_directory")
            .fetch_one(&mut conn)
            .await?;
        anyhow::ensure!(
            Path::new(&data) == server.dir.join("data"),
            "the PostgreSQL on port {port} serves {data}, not the cluster this benchmark made"
        );
        for sql in [
            "CREATE ROLE dlock LOGIN PASSWORD 'dlock'",
            "CREATE DATABASE dlock OWNER dlock",
        ] {
            sqlx::raw_sql(sql).execute(&mut conn).await?;
        }
        conn.close().await?;
        Ok(server)
    }

    /// Starts MariaDB on `port` (or a free port near it, see [`free_port`]):
    /// a data directory made by `mariadb-install-db` under `root`, the user
    /// `dlock` (all rights on the database `dlock`), the test servers'
    /// settings (`innodb_flush_log_at_trx_commit=2`, no binary log).
    pub(super) async fn mariadb(port: u16, root: &Path) -> anyhow::Result<OwnServer> {
        for program in ["mariadbd", "mariadb-install-db"] {
            anyhow::ensure!(
                on_path(program),
                "{program} is not on PATH: scripts/servers.sh up installs MariaDB"
            );
        }
        let port = free_port(port)?;
        let dir = fresh_dir(root, &format!("mariadb-{port}"))?;
        let status = Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.join("data").display()))
            .args([
                "--user=root",
                "--auth-root-authentication-method=socket",
                "--skip-test-db",
            ])
            .stdin(Stdio::null())
            .stdout(log(&dir, "install-db.log")?)
            .stderr(log(&dir, "install-db.log")?)
            .status()?;
        anyhow::ensure!(
            status.success(),
            "mariadb-install-db failed ({status}; see {}/install-db.log)",
            dir.display()
        );
        std::fs::write(
            dir.join("init.sql"),
            "CREATE DATABASE IF NOT EXISTS dlock;\n\
             CREATE USER IF NOT EXISTS 'dlock'@'%' IDENTIFIED BY 'dlock';\n\
             GRANT ALL PRIVILEGES ON dlock.* TO 'dlock'@'%';\n",
        )?;
        let mut command = Command::new("mariadbd");
        command
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg("--user=root")
            .arg(format!("--port={port}"))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", dir.join("mariadb.sock").display()))
            .arg(format!("--pid-file={}", dir.join("mariadb.pid").display()))
            .arg(format!("--log-error={}", dir.join("mariadb.log").display()))
            .arg(format!("--init-file={}", dir.join("init.sql").display()))
            .args(["--skip-name-resolve", "--skip-log-bin"])
            .args(["--max-connections=300", "--innodb-buffer-pool-size=64M"])
            .arg("--innodb-flush-log-at-trx-commit=2")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut server = OwnServer::spawn(Flavor::MariaDb, port, dir, command)?;
        let url = server.url();
        server.await_ready(&url).await?;
        let mut conn = sqlx::MySqlConnection::connect(&url).await?;
        let data: String = sqlx::query_scalar("SELECT @@datadir")
            .fetch_one(&mut conn)
            .await?;
        anyhow::ensure!(
            Path::new(data.trim_end_matches('/')) == server.dir.join("data"),
            "the MariaDB on port {port} serves {data}, not the data directory this benchmark made"
        );
        conn.close().await?;
        Ok(server)
    }

    fn spawn(
        flavor: Flavor,
        port: u16,
        dir: PathBuf,
        mut command: Command,
    ) -> anyhow::Result<OwnServer> {
        let child = command
            // A group of its own: the postmaster's backends join it, so that
            // they can be killed with it.
            .process_group(0)
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {}: {e}", flavor.name()))?;
        Ok(OwnServer {
            flavor,
            port,
            dir,
            child: Some(child),
        })
    }

    /// Waits up to 60 s for `url` to answer `SELECT 1`; fails early if the
    /// server exits.
    async fn await_ready(&mut self, url: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let answered = tokio::time::timeout(Duration::from_secs(2), async {
                let result: Result<(), sqlx::Error> = match self.flavor {
                    Flavor::Postgres => {
                        async {
                            let mut conn = sqlx::PgConnection::connect(url).await?;
                            sqlx::query("SELECT 1").execute(&mut conn).await?;
                            conn.close().await
                        }
                        .await
                    }
                    Flavor::MariaDb => {
                        async {
                            let mut conn = sqlx::MySqlConnection::connect(url).await?;
                            sqlx::query("SELECT 1").execute(&mut conn).await?;
                            conn.close().await
                        }
                        .await
                    }
                };
                result.is_ok()
            })
            .await;
            if answered == Ok(true) {
                return Ok(());
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                anyhow::bail!(
                    "{} on port {} exited ({status}; its log is in {})",
                    self.flavor.name(),
                    self.port,
                    self.dir.display()
                );
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{} on port {} did not answer within 60 s (its log is in {})",
                self.flavor.name(),
                self.port,
                self.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for OwnServer {
    /// A fast shutdown (SIGINT for PostgreSQL, SIGTERM for MariaDB), up to
    /// 20 s, then SIGKILL to the whole process group.
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let signal = match self.flavor {
                Flavor::Postgres => "-INT",
                Flavor::MariaDb => "-TERM",
            };
            let pid = child.id().to_string();
            let _ = Command::new("kill").args([signal, &pid]).status();
            let deadline = Instant::now() + Duration::from_secs(20);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{pid}")])
                .stderr(Stdio::null())
                .status();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `postgres` user's id (`-u`) or group (`-g`).
fn id(which: &str) -> anyhow::Result<u32> {
    let out = Command::new("id").args([which, "postgres"]).output()?;
    anyhow::ensure!(
        out.status.success(),
        "no `postgres` user: scripts/servers.sh up installs PostgreSQL"
    );
    Ok(String::from_utf8(out.stdout)?.trim().parse()?)
}

fn chown(path: &Path, uid: u32, gid: u32) -> anyhow::Result<()> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid))?;
    Ok(())
}

/// An empty directory `root/name`, readable by other users.
fn fresh_dir(root: &Path, name: &str) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = root.join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    for d in [root, dir.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(dir)
}

/// A log file in `dir`, appended to.
fn log(dir: &Path, name: &str) -> anyhow::Result<std::fs::File> {
    Ok(std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(name))?)
}

/// `port` if nothing holds it (a server left there would answer in place of
/// the benchmark's), else the first free of the next few of its parity
/// (47000–47999 lies in Linux's ephemeral range: a client's connection may
/// hold a port there for a while).
fn free_port(port: u16) -> anyhow::Result<u16> {
    let tried: Vec<u16> = (0..8).map(|i| port + 2 * i).collect();
    tried
        .iter()
        .copied()
        .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .ok_or_else(|| {
            anyhow::anyhow!("ports {tried:?} are all taken: is another benchmark running?")
        })
}
