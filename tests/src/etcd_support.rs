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
}
