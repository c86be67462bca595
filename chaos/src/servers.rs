//! Servers the harness owns, so that the nemesis can kill and restart them:
//! Redis, with its data (append-only file, fsync on every write) or without
//! it, ZooKeeper (standalone, its snapshot and transaction log kept in its
//! directory: it always comes back with its data and its sessions), and
//! a member of a three-member etcd cluster (its data directory kept: a
//! killed member rejoins with its data), and
//! PostgreSQL and MariaDB (a fresh cluster or data directory per run, in a
//! directory of its own under the system's temporary directory; every commit
//! reaches the OS before it is acknowledged, so a SIGKILL of the server loses
//! nothing committed, and each comes back with its data after a crash
//! recovery).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use sqlx::Connection as _;
use tokio::process::{Child, Command};

/// Where Debian's PostgreSQL 15 programs are (`postgresql-15`).
const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// What runs on the port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavor {
    Redis,
    ZooKeeper,
    Postgres,
    MariaDb,
    Etcd,
}

/// One `redis-server`, one standalone ZooKeeper, one PostgreSQL or one
/// MariaDB, on a loopback port of ours.
pub(crate) struct Server {
    flavor: Flavor,
    port: u16,
    /// Configuration and logs.
    dir: PathBuf,
    /// PostgreSQL's and MariaDB's data (and PostgreSQL's socket), under the
    /// system's temporary directory: see [`Server::discard_data`].
    data: Option<PathBuf>,
    child: Option<Child>,
}

impl Server {
    /// Starts `redis-server` on `port`, keeping its files in `dir`.
    pub(crate) async fn redis(port: u16, dir: &Path) -> anyhow::Result<Self> {
        Self::start(Flavor::Redis, port, dir).await
    }

    /// Starts a standalone ZooKeeper on `port` (a JVM of 256 MB at most), keeping
    /// its configuration, data and log in `dir`
    /// ([`dlock_testkit::zookeeper_server`]). A tick of 500 ms lets sessions
    /// time out from 1 s. The transaction log is written before every answer but
    /// not fsynced (`forceSync=no`): the nemesis kills the process, not the
    /// machine, and the kernel keeps what was written.
    pub(crate) async fn zookeeper(port: u16, dir: &Path) -> anyhow::Result<Self> {
        dlock_testkit::zookeeper_server::configure(port, dir)?;
        Self::start(Flavor::ZooKeeper, port, dir).await
    }

    /// Starts member `index` of a three-member etcd cluster whose members'
    /// client ports are `clients` (peer port: client port + 3), keeping its
    /// data and log in `dir`. Writes are not fsynced (`--unsafe-no-fsync`):
    /// the nemesis kills processes, not the machine. Ready once its client
    /// port accepts connections (requests wait there for a quorum).
    pub(crate) async fn etcd(index: usize, clients: [u16; 3], dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let peer = |i: usize| clients[i] + 3;
        let cluster: Vec<String> = (0..3)
            .map(|i| format!("m{i}=http://127.0.0.1:{}", peer(i)))
            .collect();
        let (client, me) = (clients[index], peer(index));
        let args = [
            "--name".to_owned(),
            format!("m{index}"),
            "--data-dir".to_owned(),
            dir.join("data").display().to_string(),
            "--listen-client-urls".to_owned(),
            format!("http://127.0.0.1:{client}"),
            "--advertise-client-urls".to_owned(),
            format!("http://127.0.0.1:{client}"),
            "--listen-peer-urls".to_owned(),
            format!("http://127.0.0.1:{me}"),
            "--initial-advertise-peer-urls".to_owned(),
            format!("http://127.0.0.1:{me}"),
            "--initial-cluster".to_owned(),
            cluster.join(","),
            "--initial-cluster-token".to_owned(),
            format!("dlock-chaos-{}", clients[0]),
            "--initial-cluster-state".to_owned(),
            "new".to_owned(),
            "--unsafe-no-fsync".to_owned(),
        ];
        std::fs::write(dir.join("etcd.args"), args.join("\n"))?;
        Self::start(Flavor::Etcd, client, dir).await
    }

    /// Starts a PostgreSQL 15 on `port` (Debian's binaries in [`PG_BIN`]),
    /// with a cluster made for this run by `initdb --auth=trust` and the role
    /// and database `dlock` (password `dlock`). PostgreSQL refuses to run as
    /// root: it runs as the `postgres` user, its data directory and socket
    /// directory in a directory of its own under the system's temporary
    /// directory, owned by that user; its log goes to `dir/postgres.log`.
    /// `fsync=off` and `full_page_writes=off` for speed, but
    /// `synchronous_commit=on`: a commit is written to the OS before it is
    /// acknowledged, so a SIGKILL of the server loses nothing committed.
    pub(crate) async fn postgres(port: u16, dir: &Path) -> anyhow::Result<Self> {
        for program in ["initdb", "postgres"] {
            let path = Path::new(PG_BIN).join(program);
            if !path.exists() {
                bail!(
                    "PostgreSQL 15 is not installed ({} is missing): install the test servers with scripts/servers.sh up",
                    path.display()
                );
            }
        }
        let user = nix::unistd::User::from_name("postgres")?
            .context("no `postgres` user (install the test servers: scripts/servers.sh up)")?;
        std::fs::create_dir_all(dir)?;
        let root = temp_root("postgres", port)?;
        for sub in ["", "sock"] {
            let path = root.join(sub);
            std::fs::create_dir_all(&path)?;
            nix::unistd::chown(&path, Some(user.uid), Some(user.gid))?;
        }
        let log = std::fs::File::create(dir.join("initdb.log"))?;
        let status = Command::new(Path::new(PG_BIN).join("initdb"))
            .arg("-D")
            .arg(root.join("data"))
            .args(["--auth=trust", "--username=postgres", "--encoding=UTF8"])
            .args(["--locale=C", "--no-sync"])
            .uid(user.uid.as_raw())
            .gid(user.gid.as_raw())
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .status()
            .await
            .context("cannot run initdb")?;
        if !status.success() {
            bail!("initdb failed ({status}; see {}/initdb.log)", dir.display());
        }
        let mut server = Self {
            flavor: Flavor::Postgres,
            port,
            dir: dir.to_owned(),
            data: Some(root),
            child: None,
        };
        server.spawn().await?;
        let admin = format!("postgres://postgres@127.0.0.1:{port}/postgres");
        let mut conn = sqlx::PgConnection::connect(&admin).await?;
        for sql in [
            "CREATE ROLE dlock LOGIN PASSWORD 'dlock'",
            "CREATE DATABASE dlock OWNER dlock",
        ] {
            sqlx::raw_sql(sql).execute(&mut conn).await?;
        }
        conn.close().await?;
        Ok(server)
    }

    /// Starts a MariaDB (`mariadbd`) on `port`, with a data directory made for
    /// this run by `mariadb-install-db` under the system's temporary
    /// directory, and the user `dlock` (password `dlock`, all rights on the
    /// database `dlock`; root has only unix-socket authentication); its
    /// configuration and log go to `dir`. `innodb_flush_log_at_trx_commit=2`:
    /// a commit is written to the OS before it is acknowledged (not fsynced),
    /// so a SIGKILL of the server loses nothing committed. The performance
    /// schema records metadata locks, so that the `GET_LOCK` locks still held
    /// can be counted (`performance_schema.metadata_locks`).
    pub(crate) async fn mariadb(port: u16, dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let root = temp_root("mariadb", port)?;
        let log = std::fs::File::create(dir.join("install-db.log"))?;
        let status = Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", root.join("data").display()))
            .args([
                "--user=root",
                "--auth-root-authentication-method=socket",
                "--skip-test-db",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .status()
            .await
            .context(
                "cannot run mariadb-install-db (install the test servers: scripts/servers.sh up)",
            )?;
        if !status.success() {
            bail!(
                "mariadb-install-db failed ({status}; see {}/install-db.log)",
                dir.display()
            );
        }
        std::fs::write(
            dir.join("init.sql"),
            "CREATE DATABASE IF NOT EXISTS dlock;\n\
             CREATE USER IF NOT EXISTS 'dlock'@'%' IDENTIFIED BY 'dlock';\n\
             GRANT ALL PRIVILEGES ON dlock.* TO 'dlock'@'%';\n\
             GRANT PROCESS ON *.* TO 'dlock'@'%';\n\
             GRANT SELECT ON performance_schema.* TO 'dlock'@'%';\n",
        )?;
        let mut server = Self {
            flavor: Flavor::MariaDb,
            port,
            dir: dir.to_owned(),
            data: Some(root),
            child: None,
        };
        server.spawn().await?;
        Ok(server)
    }

    async fn start(flavor: Flavor, port: u16, dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut server = Self {
            flavor,
            port,
            dir: dir.to_owned(),
            data: None,
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
        // every kill a no-op. (Our own killed server's processes may take a
        // moment to be gone.)
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match std::net::TcpListener::bind(("127.0.0.1", self.port)) {
                Ok(_) => break,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => bail!(
                    "port {} is taken ({e}); pass another --port-base",
                    self.port
                ),
            }
        }
        match self.flavor {
            Flavor::Redis => self.spawn_redis().await,
            Flavor::ZooKeeper => self.spawn_zookeeper().await,
            Flavor::Postgres => self.spawn_postgres().await,
            Flavor::MariaDb => self.spawn_mariadb().await,
            Flavor::Etcd => self.spawn_etcd().await,
        }
    }

    /// The postmaster, in a process group of its own (its backends join it:
    /// [`Server::kill`] kills them all at once).
    async fn spawn_postgres(&mut self) -> anyhow::Result<()> {
        let root = self
            .data
            .clone()
            .context("PostgreSQL without a data directory")?;
        let user = nix::unistd::User::from_name("postgres")?.context("no `postgres` user")?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("postgres.log"))?;
        let settings = [
            "listen_addresses=127.0.0.1".to_owned(),
            format!("port={}", self.port),
            format!("unix_socket_directories={}", root.join("sock").display()),
            "fsync=off".to_owned(),
            "full_page_writes=off".to_owned(),
            "synchronous_commit=on".to_owned(),
            "max_connections=300".to_owned(),
            "shared_buffers=32MB".to_owned(),
        ];
        let mut command = Command::new(Path::new(PG_BIN).join("postgres"));
        command.arg("-D").arg(root.join("data"));
        for setting in &settings {
            command.args(["-c", setting]);
        }
        let child = command
            .uid(user.uid.as_raw())
            .gid(user.gid.as_raw())
            .current_dir("/")
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("cannot run postgres (install the test servers: scripts/servers.sh up)")?;
        self.child = Some(child);
        let url = format!("postgres://postgres@127.0.0.1:{}/postgres", self.port);
        self.await_ready("PostgreSQL", "postgres.log", || {
            let url = url.clone();
            async move {
                let answered: Result<(), sqlx::Error> = async {
                    let mut conn = sqlx::PgConnection::connect(&url).await?;
                    sqlx::query("SELECT 1").execute(&mut conn).await?;
                    conn.close().await
                }
                .await;
                answered.is_ok()
            }
        })
        .await
    }

    /// `mariadbd`, running as root (it is told so) in a process group of its
    /// own.
    async fn spawn_mariadb(&mut self) -> anyhow::Result<()> {
        let root = self
            .data
            .clone()
            .context("MariaDB without a data directory")?;
        let dir = &self.dir;
        let child = Command::new("mariadbd")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", root.join("data").display()))
            .arg("--user=root")
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", root.join("mariadb.sock").display()))
            .arg(format!("--pid-file={}", root.join("mariadb.pid").display()))
            .arg(format!("--log-error={}", dir.join("mariadb.log").display()))
            .arg(format!("--init-file={}", dir.join("init.sql").display()))
            .args([
                "--skip-name-resolve",
                "--skip-log-bin",
                "--max-connections=300",
            ])
            .args([
                "--innodb-buffer-pool-size=64M",
                "--innodb-log-file-size=32M",
                "--innodb-flush-log-at-trx-commit=2",
            ])
            .args([
                "--performance-schema=ON",
                "--performance-schema-instrument=wait/lock/metadata/sql/mdl=ON",
            ])
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("cannot run mariadbd (install the test servers: scripts/servers.sh up)")?;
        self.child = Some(child);
        let url = format!("mysql://dlock:dlock@127.0.0.1:{}/dlock", self.port);
        self.await_ready("MariaDB", "mariadb.log", || {
            let url = url.clone();
            async move {
                let answered: Result<(), sqlx::Error> = async {
                    let mut conn = sqlx::MySqlConnection::connect(&url).await?;
                    sqlx::query("SELECT 1").execute(&mut conn).await?;
                    conn.close().await
                }
                .await;
                answered.is_ok()
            }
        })
        .await
    }

    /// Waits up to 60 s (a JVM start or a crash recovery included) for
    /// `probe` to answer true, failing early if the server exits.
    async fn await_ready<F, Fut>(&mut self, what: &str, log: &str, probe: F) -> anyhow::Result<()>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(true) = tokio::time::timeout(Duration::from_secs(1), probe()).await {
                return Ok(());
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "{what} on port {} exited ({status}; see {}/{log})",
                    self.port,
                    self.dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!(
            "{what} on port {} did not answer within 60 s (see {}/{log})",
            self.port,
            self.dir.display()
        )
    }

    async fn spawn_etcd(&mut self) -> anyhow::Result<()> {
        let args = std::fs::read_to_string(self.dir.join("etcd.args"))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))?;
        let child = Command::new("etcd")
            .args(args.lines())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("cannot run etcd (install the test servers: scripts/servers.sh up)")?;
        self.child = Some(child);
        let port = self.port;
        self.await_ready("etcd", "etcd.log", || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await
    }

    async fn spawn_zookeeper(&mut self) -> anyhow::Result<()> {
        let child = Command::from(dlock_testkit::zookeeper_server::command(
            &self.dir,
            256,
            &[],
        )?)
        .kill_on_drop(true)
        .spawn()
        .context("cannot run java (install the test servers: scripts/servers.sh up)")?;
        self.child = Some(child);
        // A JVM, then the data and the sessions to load.
        let port = self.port;
        self.await_ready("ZooKeeper", "zookeeper.log", || {
            dlock_testkit::zookeeper_server::serving(port)
        })
        .await
    }

    async fn spawn_redis(&mut self) -> anyhow::Result<()> {
        let persistence = [
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
        ];
        let child = Command::from(dlock_testkit::redis_server::command(
            self.port,
            &self.dir,
            &persistence,
        ))
        .kill_on_drop(true)
        .spawn()
        .context("cannot run redis-server (install the test servers: scripts/servers.sh up)")?;
        self.child = Some(child);
        if dlock_testkit::redis_server::wait_until_it_answers(self.port, Duration::from_secs(10))
            .await
        {
            return Ok(());
        }
        bail!(
            "redis-server on port {} did not answer within 10 s (see {}/redis.log)",
            self.port,
            self.dir.display()
        )
    }

    /// SIGKILL: no shutdown, no last save. PostgreSQL and MariaDB: the whole
    /// process group (the postmaster and its backends at once: backends left
    /// behind would keep the shared memory a restart needs).
    pub(crate) async fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            if matches!(self.flavor, Flavor::Postgres | Flavor::MariaDb)
                && let Some(pid) = child.id().and_then(|id| i32::try_from(id).ok())
            {
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            child.kill().await?;
        }
        Ok(())
    }

    /// Removes PostgreSQL's or MariaDB's data directory (after the last
    /// [`Server::kill`]: the logs stay in the run's directory).
    pub(crate) fn discard_data(&mut self) -> anyhow::Result<()> {
        if let Some(root) = self.data.take() {
            std::fs::remove_dir_all(&root)
                .with_context(|| format!("removing {}", root.display()))?;
        }
        Ok(())
    }

    /// Starts it again, from its append-only file (`keep_data`) or empty. ZooKeeper,
    /// etcd, PostgreSQL and MariaDB always keep their data (after a crash recovery).
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

/// A run that ends early (an error) leaves no PostgreSQL backend or MariaDB
/// running, and no data directory behind.
impl Drop for Server {
    fn drop(&mut self) {
        if let Some(root) = self.data.take() {
            if let Some(pid) = self
                .child
                .as_ref()
                .and_then(|c| c.id())
                .and_then(|id| i32::try_from(id).ok())
            {
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let _ = std::fs::remove_dir_all(root);
        }
    }
}

/// A fresh, empty directory for `flavor`'s data under the system's temporary
/// directory, readable by other users (PostgreSQL's server runs as `postgres`).
fn temp_root(flavor: &str, port: u16) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let root = std::env::temp_dir().join(format!(
        "dlock-chaos-{flavor}-{port}-{}",
        std::process::id()
    ));
    if root.exists() {
        std::fs::remove_dir_all(&root)?;
    }
    std::fs::create_dir_all(&root)?;
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755))?;
    Ok(root)
}
