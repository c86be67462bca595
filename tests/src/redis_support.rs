//! Server-side access to Redis for the Redis backends' tests.

use futures_util::future::BoxFuture;
use redis::AsyncCommands;

use crate::Faults;

/// Admin access to the Redis servers under a backend. Connections are opened
/// per call, on the caller's runtime: every `#[tokio::test]` has its own, and a
/// connection kept from a finished test's runtime would be dead.
pub enum RedisFaults {
    /// Independent servers (a single instance, or Redlock's masters); the key is
    /// held if it is held on a majority of them.
    Nodes(Vec<String>),
    /// A Redis Cluster, by its seed nodes.
    Cluster(Vec<String>),
}

/// How the backend names a stored key on the server.
pub type KeyMapper = fn(&str) -> String;

/// The Redis backend's layout: `{K}`.
pub fn hash_tagged(stored: &str) -> String {
    format!("{{{stored}}}")
}

/// Redlock's layout: the stored key as is.
pub fn verbatim(stored: &str) -> String {
    stored.to_owned()
}

async fn node(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap_or_else(|e| crate::servers_missing(url, e))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| crate::servers_missing(url, e))
}

impl RedisFaults {
    /// Independent nodes (plain `redis://host:port` URLs); checks that they answer.
    pub async fn nodes(urls: &[String]) -> Self {
        for url in urls {
            node(url).await;
        }
        RedisFaults::Nodes(urls.to_vec())
    }

    /// A cluster through its seed nodes; checks that it answers.
    pub async fn cluster(urls: &[String]) -> Self {
        let faults = RedisFaults::Cluster(urls.to_vec());
        faults.cluster_connection().await;
        faults
    }

    async fn cluster_connection(&self) -> redis::cluster_async::ClusterConnection {
        let RedisFaults::Cluster(urls) = self else {
            unreachable!("not a cluster")
        };
        redis::cluster::ClusterClient::new(urls.clone())
            .unwrap_or_else(|e| crate::servers_missing(&urls.join(","), e))
            .get_async_connection()
            .await
            .unwrap_or_else(|e| crate::servers_missing(&urls.join(","), e))
    }

    /// A connection to the first node (for commands of a test's own).
    pub async fn first_node(&self) -> redis::aio::MultiplexedConnection {
        match self {
            RedisFaults::Nodes(urls) | RedisFaults::Cluster(urls) => node(&urls[0]).await,
        }
    }

    /// Deletes `key` everywhere (nodes that do not answer are skipped).
    pub async fn delete(&self, key: &str) {
        match self {
            RedisFaults::Nodes(urls) => {
                for url in urls {
                    if let Ok(client) = redis::Client::open(url.as_str())
                        && let Ok(mut c) = client.get_multiplexed_async_connection().await
                    {
                        let _: Result<i64, _> = c.del(key).await;
                    }
                }
            }
            RedisFaults::Cluster(_) => {
                let _: i64 = self.cluster_connection().await.del(key).await.expect("DEL");
            }
        }
    }

    /// Whether `key` exists with a TTL on a majority of the nodes.
    pub async fn exists(&self, key: &str) -> bool {
        match self {
            RedisFaults::Nodes(urls) => {
                let mut held = 0;
                for url in urls {
                    if let Ok(client) = redis::Client::open(url.as_str())
                        && let Ok(mut c) = client.get_multiplexed_async_connection().await
                        && matches!(c.pttl::<_, i64>(key).await, Ok(t) if t > 0)
                    {
                        held += 1;
                    }
                }
                held > urls.len() / 2
            }
            RedisFaults::Cluster(_) => {
                let ttl: i64 = self
                    .cluster_connection()
                    .await
                    .pttl(key)
                    .await
                    .expect("PTTL");
                ttl > 0
            }
        }
    }
}

/// [`Faults`] over [`RedisFaults`], with the backend's key layout.
pub struct RedisKeyFaults {
    /// The admin connections.
    pub redis: RedisFaults,
    /// Stored key → Redis key.
    pub layout: KeyMapper,
}

impl Faults for RedisKeyFaults {
    fn revoke<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move { self.redis.delete(&(self.layout)(stored_key)).await })
    }

    fn is_held<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(async move { self.redis.exists(&(self.layout)(stored_key)).await })
    }
}

/// `scripts/servers.sh`, which starts and stops the test servers.
fn servers_script() -> std::path::PathBuf {
    std::path::PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/servers.sh"
    ))
}

fn servers_sh(args: &[&str]) {
    let status = std::process::Command::new(servers_script())
        .args(args)
        .status()
        .expect("run scripts/servers.sh");
    assert!(status.success(), "scripts/servers.sh {args:?} failed");
}

/// Kills the Redis instance on `port` with SIGKILL (no shutdown, no save).
pub fn sigkill_redis(port: u16) {
    let state = std::env::var_os("DLOCK_SERVERS_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/servers"))
        });
    let pid = std::fs::read_to_string(state.join(format!("redis/{port}/redis.pid")))
        .expect("the server's pid file");
    let status = std::process::Command::new("kill")
        .args(["-9", pid.trim()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -9 redis:{port}");
}

/// Stops the Redis instance on `port` (SIGTERM; the test servers keep no data).
pub fn stop_redis(port: u16) {
    servers_sh(&["stop-redis", &port.to_string()]);
}

/// Starts the Redis instance on `port` again (a no-op if it runs) and waits
/// until it answers.
pub fn start_redis(port: u16) {
    servers_sh(&["start-redis", &port.to_string()]);
}

/// Starts the Redis instances on `ports` again when dropped, so that a failed
/// assertion does not leave the servers down for the next tests.
pub struct RestartRedisOnDrop(pub Vec<u16>);

impl Drop for RestartRedisOnDrop {
    fn drop(&mut self) {
        for port in &self.0 {
            servers_sh(&["start-redis", &port.to_string()]);
        }
    }
}

/// A `redis-server` of a test's own on a loopback port (29400–29420 by
/// convention), without persistence: killed, it comes back empty. Killed when
/// dropped. For tests that restart, promote or stop a server, which the
/// shared servers of `scripts/servers.sh` must not suffer.
pub struct OwnRedis {
    port: u16,
    dir: std::path::PathBuf,
    extra: Vec<String>,
    child: Option<std::process::Child>,
}

impl OwnRedis {
    /// Starts `redis-server` on `port` with `extra` arguments (e.g.
    /// `["--replicaof", "127.0.0.1", "29402"]`) and waits until it answers.
    pub async fn start(port: u16, extra: &[&str]) -> OwnRedis {
        let dir =
            std::env::temp_dir().join(format!("dlock-test-redis-{port}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a directory for the test's redis-server");
        let mut server = OwnRedis {
            port,
            dir,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            child: None,
        };
        server.spawn().await;
        server
    }

    /// `redis://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    async fn spawn(&mut self) {
        let mut extra = vec!["--save", "", "--appendonly", "no"];
        extra.extend(self.extra.iter().map(String::as_str));
        let child = dlock_testkit::redis_server::command(self.port, &self.dir, &extra)
            .spawn()
            .unwrap_or_else(|e| crate::servers_missing(&self.url(), e));
        self.child = Some(child);
        assert!(
            dlock_testkit::redis_server::wait_until_it_answers(
                self.port,
                std::time::Duration::from_secs(10)
            )
            .await,
            "redis-server on port {} did not answer within 10 s (see {}/redis.log)",
            self.port,
            self.dir.display()
        );
    }

    /// SIGKILL: no shutdown, no save (it keeps no data anyway).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port, empty, and waits until it answers.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }

    /// A plain connection to it.
    pub async fn admin(&self) -> redis::aio::MultiplexedConnection {
        node(&self.url()).await
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
