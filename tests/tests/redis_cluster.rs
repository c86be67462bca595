//! The conformance suite, unchanged, on a three-master Redis Cluster.
#![cfg(feature = "redis")]

use std::sync::Arc;

use dlock_runtime::{RedisBackend, Registry};
use dlock_tests::redis_support::{RedisFaults, RedisKeyFaults, hash_tagged};
use dlock_tests::{Harness, server_url, servers_missing};
use tokio::sync::OnceCell;

async fn harness() -> &'static Harness {
    static HARNESS: OnceCell<Harness> = OnceCell::const_new();
    HARNESS
        .get_or_init(|| async {
            let url = server_url(
                "DLOCK_TEST_REDIS_CLUSTER_URL",
                "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
            );
            let backend = RedisBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e));
            dlock_runtime::init(Registry::builder().default_backend(backend).build())
                .expect("first init");
            let seeds: Vec<String> = url
                .trim_start_matches("redis+cluster://")
                .split(',')
                .map(|h| format!("redis://{h}"))
                .collect();
            Harness {
                faults: Arc::new(RedisKeyFaults {
                    redis: RedisFaults::cluster(&seeds).await,
                    layout: hash_tagged,
                }),
                fences: true,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);
