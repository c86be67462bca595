//! The Redis Sentinel set-up of `scripts/servers.sh` (a primary, a replica,
//! three sentinels): its URL, who is primary, and whether it is healthy
//! again after a failover.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;

use crate::{server_url, servers_missing};

/// The name the sentinels monitor the primary under.
pub const NAME: &str = "dlock";
/// Where every server of the set-up listens.
pub const HOST: &str = "127.0.0.1";

/// A Sentinel URL over the given sentinel ports, with the same primary name.
pub fn url_over(ports: &[u16], options: &str) -> String {
    let hosts: Vec<String> = ports.iter().map(|p| format!("{HOST}:{p}")).collect();
    format!("redis+sentinel://{}/{NAME}{options}", hosts.join(","))
}

/// The Sentinel set-up's URL (`DLOCK_TEST_REDIS_SENTINEL_URL`).
pub fn url() -> String {
    server_url(
        "DLOCK_TEST_REDIS_SENTINEL_URL",
        "redis+sentinel://127.0.0.1:46411,127.0.0.1:46412,127.0.0.1:46413/dlock",
    )
}

/// The sentinels' ports, from the URL.
pub fn sentinel_ports() -> Vec<u16> {
    let url = url();
    let hosts = url
        .split_once("://")
        .and_then(|(_, rest)| rest.split('/').next())
        .expect("a sentinel URL");
    hosts
        .split(',')
        .map(|h| {
            h.rsplit_once(':')
                .expect("host:port")
                .1
                .parse()
                .expect("a port")
        })
        .collect()
}

/// A connection to the node or sentinel at `port` (within 2 s).
pub async fn connection(port: u16) -> redis::RedisResult<MultiplexedConnection> {
    let client = redis::Client::open(format!("redis://{HOST}:{port}/"))?;
    tokio::time::timeout(
        Duration::from_secs(2),
        client.get_multiplexed_async_connection(),
    )
    .await
    .unwrap_or_else(|_| {
        Err(redis::RedisError::from((
            redis::ErrorKind::Io,
            "no connection within 2 s",
        )))
    })
}

/// What one sentinel says about the primary: its port, if it answers.
pub async fn named_by(sentinel: u16) -> Option<u16> {
    let mut conn = connection(sentinel).await.ok()?;
    let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(NAME)
        .query_async(&mut conn)
        .await
        .ok()?;
    addr.map(|(_, port)| port)
}

/// The primary's port, as the first sentinel that answers names it.
pub async fn primary_port() -> u16 {
    for sentinel in sentinel_ports() {
        if let Some(port) = named_by(sentinel).await {
            return port;
        }
    }
    servers_missing(&url(), "no sentinel names the primary")
}

/// A flat `[name, value, …]` answer as a map.
pub fn fields(values: Vec<String>) -> HashMap<String, String> {
    values
        .chunks(2)
        .filter(|kv| kv.len() == 2)
        .map(|kv| (kv[0].clone(), kv[1].clone()))
        .collect()
}

/// Why the set-up is not healthy yet, or `None` if it is: every sentinel
/// names the same primary, sees the two other sentinels and one replica in
/// good standing; the primary says it is one; the replica's link is up.
pub async fn unhealthy() -> Option<String> {
    let mut primary = None;
    for sentinel in sentinel_ports() {
        let Ok(mut conn) = connection(sentinel).await else {
            return Some(format!("sentinel {sentinel} does not answer"));
        };
        let Some(named) = named_by(sentinel).await else {
            return Some(format!("sentinel {sentinel} names no primary"));
        };
        if *primary.get_or_insert(named) != named {
            return Some("the sentinels name different primaries".into());
        }
        let master: Vec<String> = redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(NAME)
            .query_async(&mut conn)
            .await
            .unwrap_or_default();
        let master = fields(master);
        if master.get("num-other-sentinels").map(String::as_str) != Some("2") {
            return Some(format!("sentinel {sentinel} does not see the two others"));
        }
        let replicas: Vec<Vec<String>> = redis::cmd("SENTINEL")
            .arg("REPLICAS")
            .arg(NAME)
            .query_async(&mut conn)
            .await
            .unwrap_or_default();
        let good = replicas
            .into_iter()
            .map(fields)
            .filter(|r| r.get("flags").map(String::as_str) == Some("slave"))
            .filter(|r| r.get("master-link-status").map(String::as_str) == Some("ok"))
            .count();
        if good != 1 {
            return Some(format!(
                "sentinel {sentinel} sees {good} replicas in good standing"
            ));
        }
    }
    let primary = primary?;
    let Ok(mut conn) = connection(primary).await else {
        return Some(format!("the primary {primary} does not answer"));
    };
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut conn)
        .await
        .unwrap_or_default();
    if !info.contains("role:master") || !info.contains("connected_slaves:1") {
        return Some(format!(
            "the primary {primary} has no linked replica: {info}"
        ));
    }
    None
}

/// Waits until the set-up is healthy (up to a minute and a half: a demoted
/// primary resyncs ≈16 s after a failover).
pub async fn wait_healthy() {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        match unhealthy().await {
            None => return,
            Some(why) if Instant::now() >= deadline => {
                panic!("the Sentinel set-up is not healthy after 90 s: {why}")
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}
