//! The benchmark's own Redis server, pinning with `taskset`, and the CPU and
//! command counters read from the server and from `/proc`.

use super::*;

pub(super) fn has_taskset() -> bool {
    std::process::Command::new("taskset")
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub(super) fn taskset(args: &[&str]) -> anyhow::Result<()> {
    let status = std::process::Command::new("taskset")
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "taskset {args:?} failed");
    Ok(())
}

/// `Cpus_allowed_list` of a process (`self` or a pid) or of `pid/task/tid`.
pub(super) fn cpus_allowed(which: &str) -> anyhow::Result<String> {
    let status = std::fs::read_to_string(format!("/proc/{which}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|v| v.trim().to_owned())
        .ok_or_else(|| anyhow::anyhow!("no Cpus_allowed_list in /proc/{which}/status"))
}

/// The server's threads pinned to one CPU; their former affinity is restored
/// when dropped.
pub(super) struct PinnedServer {
    pub(super) pid: String,
    pub(super) former: String,
}

impl PinnedServer {
    pub(super) fn pin(pid: u32, cpu: &str) -> anyhow::Result<PinnedServer> {
        let pid = pid.to_string();
        let pinned = PinnedServer {
            former: cpus_allowed(&pid)?,
            pid,
        };
        taskset(&["-a", "-p", "-c", cpu, &pinned.pid])?;
        for task in std::fs::read_dir(format!("/proc/{}/task", pinned.pid))? {
            let tid = task?.file_name().to_string_lossy().into_owned();
            let cpus = cpus_allowed(&format!("{}/task/{tid}", pinned.pid))?;
            anyhow::ensure!(cpus == cpu, "server thread {tid} still on CPUs {cpus}");
        }
        Ok(pinned)
    }
}

impl Drop for PinnedServer {
    fn drop(&mut self) {
        if let Err(e) = taskset(&["-a", "-p", "-c", &self.former, &self.pid]) {
            eprintln!("could not restore the server's CPU affinity: {e}");
        }
    }
}

pub(super) fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// Starts the benchmark's own server and checks that what answers is it.
pub(super) async fn own_server() -> anyhow::Result<OwnRedis> {
    anyhow::ensure!(
        on_path("redis-server"),
        "redis-server is not on PATH: scripts/servers.sh up installs it"
    );
    // A server left on the port would answer in place of ours.
    std::net::TcpListener::bind(("127.0.0.1", BENCH_PORT)).map_err(|e| {
        anyhow::anyhow!("port {BENCH_PORT} is taken ({e}): is another benchmark running?")
    })?;
    let server = OwnRedis::start(BENCH_PORT, &[]).await;
    let mut admin = server.admin().await;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut admin)
        .await?;
    let answering = info_field(&info, "process_id");
    anyhow::ensure!(
        answering.is_some() && answering == server.pid().map(f64::from),
        "the server on port {BENCH_PORT} is not the one this benchmark started"
    );
    let keys: u64 = redis::cmd("DBSIZE").query_async(&mut admin).await?;
    anyhow::ensure!(keys == 0, "the benchmark's new server holds {keys} keys");
    Ok(server)
}

/// `INFO commandstats`: command → (calls, usec).
pub(super) async fn commandstats(
    conn: &mut MultiplexedConnection,
) -> anyhow::Result<BTreeMap<String, (u64, u64)>> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let mut out = BTreeMap::new();
    for line in info.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let field = |key: &str| {
            rest.split(',')
                .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
                .and_then(|v| v.parse::<u64>().ok())
        };
        let (Some(calls), Some(usec)) = (field("calls"), field("usec")) else {
            anyhow::bail!("unexpected INFO commandstats line {line:?}");
        };
        out.insert(name.to_owned(), (calls, usec));
    }
    Ok(out)
}

/// The server's counts of `EVALSHA` (renewals; nothing else runs scripts
/// meanwhile) and `SCRIPT LOAD` (one per renewal pipeline).
pub(super) async fn script_calls(conn: &mut MultiplexedConnection) -> anyhow::Result<(u64, u64)> {
    let stats = commandstats(conn).await?;
    let calls = |name: &str| stats.get(name).map_or(0, |(calls, _)| *calls);
    Ok((calls("evalsha"), calls("script|load")))
}

/// A numeric field of an `INFO` answer.
pub(super) fn info_field(info: &str, name: &str) -> Option<f64> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
}

/// The server's user + system CPU time (`INFO cpu`), in seconds.
pub(super) async fn server_cpu_seconds(conn: &mut MultiplexedConnection) -> anyhow::Result<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    match (
        info_field(&info, "used_cpu_sys"),
        info_field(&info, "used_cpu_user"),
    ) {
        (Some(sys), Some(user)) => Ok(sys + user),
        _ => anyhow::bail!("no used_cpu_sys/used_cpu_user in INFO cpu"),
    }
}

/// This process's CPU time in ns (see [`schedstat`]).
pub(super) fn client_cpu_ns() -> anyhow::Result<u64> {
    Ok(schedstat("self")?.0)
}

/// A process's (`self` or a pid) time on a CPU and time runnable but waiting
/// for one, in ns: the sums over its threads of the first two fields of
/// `/proc/PID/task/*/schedstat`. Our threads never exit meanwhile (the
/// runtimes keep theirs alive), nor do the server's; a thread that appears
/// counts from zero.
pub(super) fn schedstat(pid: &str) -> anyhow::Result<(u64, u64)> {
    let (mut on_cpu, mut waiting) = (0u64, 0u64);
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let path = task?.path().join("schedstat");
        match std::fs::read_to_string(&path) {
            Ok(stat) => {
                let mut fields = stat.split_whitespace().map(str::parse::<u64>);
                match (fields.next(), fields.next()) {
                    (Some(Ok(run)), Some(Ok(wait))) => {
                        on_cpu += run;
                        waiting += wait;
                    }
                    _ => anyhow::bail!("unexpected {}: {stat:?}", path.display()),
                }
            }
            // A thread that exited between the listing and the read.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok((on_cpu, waiting))
}

/// Clock ticks per second of `/proc/*/stat` (`getconf CLK_TCK`, normally 100).
pub(super) fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// This process's user + system CPU time from `/proc/self/stat`, in seconds
/// (tick resolution: the cross-check of [`client_cpu_ns`]).
pub(super) fn cpu_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| anyhow::anyhow!("unexpected /proc/self/stat"))?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the file, 12 and 13 here.
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    Ok(ticks as f64 / clock_ticks())
}
