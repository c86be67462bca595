//! etcd for the etcd backend's tests: the test cluster's URL, a plain
//! client, and server-side access (the suite's [`Faults`]).

use etcd_client::{Client, DeleteOptions, GetOptions};
use futures_util::future::BoxFuture;

use crate::Faults;

/// The test cluster's URL (`scripts/servers.sh`).
pub fn url() -> String {
    crate::server_url(
        "DLOCK_TEST_ETCD_URL",
        "etcd://127.0.0.1:42379,127.0.0.1:42389,127.0.0.1:42399/dlock-test",
    )
}

/// `host:port` of every member of an `etcd://` URL.
pub fn endpoints(url: &str) -> Vec<String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    rest[..end].split(',').map(str::to_owned).collect()
}

/// A plain client of the cluster of `url`, on the caller's runtime (open
/// one per test).
pub async fn admin(url: &str) -> Client {
    Client::connect(endpoints(url), None)
        .await
        .unwrap_or_else(|e| crate::servers_missing(url, e))
}

/// The keys under `prefix`, in create order, with their create revisions.
pub async fn entries(client: &Client, prefix: &str) -> Vec<(String, i64)> {
    let mut client = client.clone();
    let options = GetOptions::new().with_prefix().with_sort(
        etcd_client::SortTarget::Create,
        etcd_client::SortOrder::Ascend,
    );
    client
        .get(prefix, Some(options))
        .await
        .unwrap_or_else(|e| panic!("listing {prefix}: {e}"))
        .kvs()
        .iter()
        .map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.create_revision(),
            )
        })
        .collect()
}

/// The suite's server-side controls on the etcd backend: a key is held
/// while its queue has an entry; revoking deletes its entries (what an
/// operator deleting the holder's key does).
pub struct EtcdFaults {
    /// The backend under test (for where it keeps a key).
    pub backend: dlock_runtime::EtcdBackend,
    /// Its URL.
    pub url: String,
}

impl Faults for EtcdFaults {
    fn revoke<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let mut client = admin(&self.url).await;
            let prefix = self.backend.queue_prefix(stored_key);
            client
                .delete(prefix.as_str(), Some(DeleteOptions::new().with_prefix()))
                .await
                .unwrap_or_else(|e| panic!("revoking {prefix}: {e}"));
        })
    }

    fn is_held<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let client = admin(&self.url).await;
            !entries(&client, &self.backend.queue_prefix(stored_key))
                .await
                .is_empty()
        })
    }

    fn leftover<'a>(&'a self, stored_prefix: &'a str) -> BoxFuture<'a, Option<usize>> {
        Box::pin(async move {
            let client = admin(&self.url).await;
            let mut left = 0;
            for under in kept_under(&self.backend, stored_prefix) {
                left += entries(&client, &under).await.len();
            }
            Some(left)
        })
    }
}

/// Where the backend keeps anything of stored keys starting with
/// `stored_prefix`: their queues, their slot claims, their revocation marks.
pub fn kept_under(backend: &dlock_runtime::EtcdBackend, stored_prefix: &str) -> [String; 3] {
    let escaped = stored_prefix.replace('%', "%25").replace('/', "%2F");
    let queue = backend.queue_prefix(stored_prefix);
    let root = &queue[..queue.len() - escaped.len() - 1];
    [
        format!("{root}{escaped}"),
        format!("{root}%slots/{escaped}"),
        format!("{root}%revoked/{escaped}"),
    ]
}

/// `scripts/servers.sh`, which starts and stops the test cluster's members.
fn servers_sh(args: &[&str]) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/servers.sh");
    let status = std::process::Command::new(script)
        .args(args)
        .status()
        .expect("run scripts/servers.sh");
    assert!(status.success(), "scripts/servers.sh {args:?} failed");
}

/// Kills member `index` (0 to 2) of the test cluster with SIGKILL.
pub fn kill_member(index: usize) {
    servers_sh(&["stop-etcd", &index.to_string(), "kill"]);
}

/// Starts member `index` again (a no-op if it runs) and waits until it answers.
pub fn start_member(index: usize) {
    servers_sh(&["start-etcd", &index.to_string()]);
}

/// Starts every member again when dropped, so that a failed assertion does
/// not leave the cluster short of a member for the next tests.
pub struct RestartMembersOnDrop;

impl Drop for RestartMembersOnDrop {
    fn drop(&mut self) {
        for index in 0..3 {
            start_member(index);
        }
    }
}

/// The index (in the URL's order) of the member that leads now, asking each
/// member until one answers.
pub async fn leader(url: &str) -> usize {
    let members = endpoints(url);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        for (index, member) in members.iter().enumerate() {
            let Ok(mut client) = Client::connect([member.as_str()], None).await else {
                continue;
            };
            let Ok(Ok(status)) =
                tokio::time::timeout(std::time::Duration::from_secs(1), client.status()).await
            else {
                continue;
            };
            if status.leader() != 0
                && status.header().map(|h| h.member_id()) == Some(status.leader())
            {
                return index;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no etcd member leads: is the test cluster up?"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A backend on the cluster `url` names (a missing cluster fails the test).
pub async fn backend(url: &str) -> dlock_runtime::EtcdBackend {
    dlock_runtime::EtcdBackend::connect(url)
        .await
        .unwrap_or_else(|e| crate::servers_missing(url, e))
}

/// A registry whose default backend is `backend`.
pub fn registry(backend: &dlock_runtime::EtcdBackend) -> dlock_runtime::Registry {
    dlock_runtime::Registry::builder()
        .default_backend(backend.clone())
        .build()
}

/// The test cluster's URL with its members replaced by `members`.
pub fn url_to(members: &[String], query: &str) -> String {
    let base = url();
    let hosts = endpoints(&base).join(",");
    format!("{}{query}", base.replacen(&hosts, &members.join(","), 1))
}
