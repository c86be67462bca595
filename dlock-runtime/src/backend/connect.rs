//! Opening the backend a URL names: the one place that knows every backend.

use std::sync::Arc;

use super::LockBackend;
use crate::error::{LockError, redact_url};

/// The URL schemes dlock knows, for error messages.
const SCHEMES: &str = "memory://, sqlite://path, redis://, rediss://, redis+cluster://, \
     rediss+cluster://, redis+sentinel://, rediss+sentinel://, redlock://, redlocks://, zk://, postgres://, postgresql://, mysql://, \
     mariadb://, etcd://";

/// Opens the backend a URL names.
///
/// `memory://`, `sqlite://path` (feature `sqlite`), `redis://`, `rediss://`,
/// `redis+cluster://`, `redis+sentinel://` and `redlock://` (feature `redis`), `zk://` (feature
/// `zookeeper`), `etcd://` (feature `etcd`), `postgres://` (feature `postgres`) and `mysql://` (feature
/// `mysql`) are available in this release.
pub async fn connect(url: &str) -> Result<Arc<dyn LockBackend>, LockError> {
    // Only a `scheme://` prefix names a backend: in `user:secret@host` the
    // text before the first `:` is a user name, never echoed as a scheme.
    let scheme = url
        .split_once("://")
        .map(|(scheme, _)| scheme.to_ascii_lowercase())
        .filter(|scheme| {
            !scheme.is_empty()
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        })
        .ok_or_else(|| {
            LockError::config(format!(
                "`{}` is not a lock URL; expected one of {SCHEMES}",
                redact_url(url)
            ))
        })?;
    match scheme.as_str() {
        "memory" => Ok(Arc::new(super::memory::MemoryBackend::new())),
        #[cfg(feature = "sqlite")]
        "sqlite" => Ok(Arc::new(super::sql::SqliteBackend::connect(url).await?)),
        #[cfg(not(feature = "sqlite"))]
        "sqlite" => Err(LockError::config(
            "the `sqlite` backend is disabled: enable the `sqlite` feature of dlock-runtime",
        )),
        #[cfg(feature = "redis")]
        "redis" | "rediss" | "redis+cluster" | "rediss+cluster" | "redis+sentinel"
        | "rediss+sentinel" => Ok(Arc::new(super::redis::RedisBackend::connect(url).await?)),
        #[cfg(feature = "redis")]
        "redlock" | "redlocks" => Ok(Arc::new(
            super::redis::redlock::RedlockBackend::connect(url).await?,
        )),
        #[cfg(not(feature = "redis"))]
        "redis" | "rediss" | "redis+cluster" | "rediss+cluster" | "redis+sentinel"
        | "rediss+sentinel" | "redlock" | "redlocks" => Err(LockError::config(format!(
            "the `{scheme}` backend is disabled: enable the `redis` feature of dlock-runtime"
        ))),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Ok(Arc::new(super::sql::PostgresBackend::connect(url).await?)),
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => Ok(Arc::new(super::sql::MysqlBackend::connect(url).await?)),
        #[cfg(not(feature = "postgres"))]
        "postgres" | "postgresql" => Err(LockError::config(format!(
            "the `{scheme}` backend is disabled: enable the `postgres` feature of dlock-runtime"
        ))),
        #[cfg(not(feature = "mysql"))]
        "mysql" | "mariadb" => Err(LockError::config(format!(
            "the `{scheme}` backend is disabled: enable the `mysql` feature of dlock-runtime"
        ))),
        #[cfg(feature = "zookeeper")]
        "zk" => Ok(Arc::new(
            super::zookeeper::ZooKeeperBackend::connect(url).await?,
        )),
        #[cfg(not(feature = "zookeeper"))]
        "zk" => Err(LockError::config(
            "the `zk` backend is disabled: enable the `zookeeper` feature of dlock-runtime",
        )),
        #[cfg(feature = "etcd")]
        "etcd" => Ok(Arc::new(super::etcd::EtcdBackend::connect(url).await?)),
        #[cfg(not(feature = "etcd"))]
        "etcd" => Err(LockError::config(
            "the `etcd` backend is disabled: enable the `etcd` feature of dlock-runtime",
        )),
        _ => Err(LockError::config(format!(
            "unknown lock URL scheme `{scheme}` in `{}`; expected one of {SCHEMES}",
            redact_url(url)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn urls_without_a_scheme_are_refused_without_their_credentials() {
        for url in [
            "user:s3cret@db.example:5432/locks",
            "s3cret@db.example",
            "db.example:5432?password=s3cret",
            "",
        ] {
            let err = connect(url).await.expect_err(url).to_string();
            assert!(err.contains("is not a lock URL"), "{url}: {err}");
            assert!(!err.contains("s3cret"), "{url}: the secret is shown: {err}");
            assert!(
                !err.contains("user"),
                "{url}: the user name is shown: {err}"
            );
        }
    }

    #[tokio::test]
    async fn unknown_schemes_are_named_and_the_known_ones_listed() {
        let err = connect("etcdx://u:s3cret@h:1/p")
            .await
            .expect_err("unknown");
        let err = err.to_string();
        assert!(err.contains("unknown lock URL scheme `etcdx`"), "{err}");
        assert!(!err.contains("s3cret"), "{err}");
        for scheme in ["rediss+cluster://", "redlocks://", "postgresql://"] {
            assert!(err.contains(scheme), "{scheme} missing from: {err}");
        }
    }
}
