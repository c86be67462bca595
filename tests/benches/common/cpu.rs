//! Pinning with `taskset` and CPU time read from `/proc`: what the benchmarks
//! that start servers of their own use to pin the concurrency-1 section
//! (client and server on one CPU) and to measure CPU time per operation on
//! both sides.

use std::process::{Command, Stdio};

/// Whether `program` is a file in one of `PATH`'s directories.
pub(crate) fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// Whether `taskset` (util-linux) runs.
pub(crate) fn has_taskset() -> bool {
    Command::new("taskset")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `taskset` with `args`; fails unless it succeeds.
pub(crate) fn taskset(args: &[&str]) -> anyhow::Result<()> {
    let status = Command::new("taskset")
        .args(args)
        .stdout(Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "taskset {args:?} failed");
    Ok(())
}

/// `Cpus_allowed_list` of a process (`self` or a pid) or of `pid/task/tid`.
pub(crate) fn cpus_allowed(which: &str) -> anyhow::Result<String> {
    let status = std::fs::read_to_string(format!("/proc/{which}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|v| v.trim().to_owned())
        .ok_or_else(|| anyhow::anyhow!("no Cpus_allowed_list in /proc/{which}/status"))
}

/// The CPUs of every thread of a process: (tid, `Cpus_allowed_list`).
/// Threads that exit meanwhile are left out (all of them if the process did).
pub(crate) fn thread_cpus(pid: u32) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let tasks = match std::fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(tasks) => tasks,
        // The process exited.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e.into()),
    };
    for task in tasks {
        let tid = task?.file_name().to_string_lossy().into_owned();
        match cpus_allowed(&format!("{pid}/task/{tid}")) {
            Ok(cpus) => out.push((tid, cpus)),
            Err(e) if gone(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Whether an error says that the process or thread read is gone.
fn gone(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>().is_some_and(|e| {
        matches!(
            e.kind(),
            std::io::ErrorKind::NotFound | std::io::ErrorKind::InvalidInput
        ) || e.raw_os_error() == Some(3) // ESRCH
    })
}

/// A process and its children (one level: a PostgreSQL postmaster and its
/// backends and workers), from the parent pid field of `/proc/*/stat`.
pub(crate) fn process_tree(pid: u32) -> anyhow::Result<Vec<u32>> {
    let mut out = vec![pid];
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue; // exited meanwhile
        };
        // The fields after the command name (which may hold spaces): state, ppid, …
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    Ok(out)
}

/// Server processes pinned to one CPU, all their threads; their former
/// affinity is restored when dropped.
pub(crate) struct PinnedServer {
    /// (pid, its former `Cpus_allowed_list`).
    former: Vec<(String, String)>,
}

impl PinnedServer {
    /// Pins every thread of process `pid` to `cpu` and checks it.
    pub(crate) fn pin(pid: u32, cpu: &str) -> anyhow::Result<PinnedServer> {
        PinnedServer::pin_all(&[pid], cpu)
    }

    /// Pins every thread of each of `pids` to `cpu` and checks them. The
    /// processes they fork from now on inherit it.
    pub(crate) fn pin_all(pids: &[u32], cpu: &str) -> anyhow::Result<PinnedServer> {
        let mut pinned = PinnedServer { former: Vec::new() };
        for pid in pids {
            let pid_s = pid.to_string();
            match cpus_allowed(&pid_s) {
                Ok(former) => pinned.former.push((pid_s.clone(), former)),
                // A backend that exited since it was listed.
                Err(e) if gone(&e) => continue,
                Err(e) => return Err(e),
            }
            if let Err(e) = taskset(&["-a", "-p", "-c", cpu, &pid_s]) {
                if std::path::Path::new(&format!("/proc/{pid}")).exists() {
                    return Err(e);
                }
                continue; // it exited meanwhile
            }
            for (tid, cpus) in thread_cpus(*pid)? {
                anyhow::ensure!(
                    cpus == cpu,
                    "server process {pid} thread {tid} still on CPUs {cpus}"
                );
            }
        }
        Ok(pinned)
    }
}

impl Drop for PinnedServer {
    fn drop(&mut self) {
        for (pid, former) in &self.former {
            if std::path::Path::new(&format!("/proc/{pid}")).exists()
                && let Err(e) = taskset(&["-a", "-p", "-c", former, pid])
            {
                eprintln!("could not restore the CPU affinity of server process {pid}: {e}");
            }
        }
    }
}

/// This process's CPU time in ns (see [`schedstat`]).
pub(crate) fn client_cpu_ns() -> anyhow::Result<u64> {
    Ok(schedstat("self")?.0)
}

/// A process's (`self` or a pid) time on a CPU and time runnable but waiting
/// for one, in ns: the sums over its threads of the first two fields of
/// `/proc/PID/task/*/schedstat`. Our threads never exit meanwhile (the
/// runtimes keep theirs alive), nor do the server's; a thread that appears
/// counts from zero.
pub(crate) fn schedstat(pid: &str) -> anyhow::Result<(u64, u64)> {
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

/// [`schedstat`] summed over a process and its children ([`process_tree`]);
/// a process that exits meanwhile is left out.
pub(crate) fn tree_schedstat(pid: u32) -> anyhow::Result<(u64, u64)> {
    let (mut on_cpu, mut waiting) = (0u64, 0u64);
    for p in process_tree(pid)? {
        match schedstat(&p.to_string()) {
            Ok((run, wait)) => {
                on_cpu += run;
                waiting += wait;
            }
            Err(e) if gone(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok((on_cpu, waiting))
}

/// Clock ticks per second of `/proc/*/stat` (`getconf CLK_TCK`, normally 100).
pub(crate) fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
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
pub(crate) fn cpu_seconds() -> anyhow::Result<f64> {
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
