//! The benchmark's own Redis server and the CPU and command counters read
//! from it (pinning and `/proc` counters: `common::cpu`).

use super::*;

pub(super) use crate::common::cpu::{
    PinnedServer, client_cpu_ns, cpu_seconds, cpus_allowed, on_path, schedstat,
};

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
