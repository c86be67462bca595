//! The error type of every dlock operation.

use std::fmt;
use std::time::Duration;

use crate::FencingToken;

/// Why a lock operation did not succeed.
///
/// Match with `{ .. }` patterns (`LockError::Busy { .. }`): the enum is
/// `#[non_exhaustive]` and variants may gain fields.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// Another holder kept the lock for the whole wait budget.
    #[error("lock `{key}` is busy (held elsewhere; waited {})", humantime::format_duration(*.waited))]
    Busy {
        /// The lock key, without the backend prefix.
        key: String,
        /// How long the caller waited before giving up.
        waited: Duration,
    },
    /// The lease ended before the holder released it (expired, deleted on the
    /// server, connection or session lost). Another process may hold it now.
    #[error("lease on lock `{key}` was lost before release")]
    Lost {
        /// The lock key, without the backend prefix.
        key: String,
    },
    /// A lock was requested before [`init`](crate::init) installed a registry.
    #[error(
        "dlock is not initialized: call dlock_runtime::init(...) at startup before taking locks"
    )]
    NotInitialized,
    /// The key cannot be stored by the backend without ambiguity.
    #[error("invalid lock key {key:?}: {reason}")]
    InvalidKey {
        /// The rejected key (escaped by `Debug` formatting when displayed).
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No backend of this name is registered.
    #[error("no lock backend named `{name}` is registered (known: {known})")]
    UnknownBackend {
        /// The requested name.
        name: String,
        /// The registered names, comma separated.
        known: String,
    },
    /// The backend failed (network, server, protocol). See [`LockError::is_retryable`].
    #[error("lock backend `{backend}` failed: {source}")]
    Backend {
        /// The backend's kind (`"sqlite"`, `"redis"`, …).
        backend: &'static str,
        /// What went wrong.
        #[source]
        source: BackendError,
    },
    /// The registry is shutting down ([`Registry::shutdown`](crate::Registry::shutdown)):
    /// no new locks are taken.
    #[error("dlock is shutting down: no new locks are taken")]
    ShutDown,
    /// A fenced write was refused: the resource has already seen a larger
    /// fencing token, so a newer holder of the lock exists and this one is
    /// stale (its lease ended while it ran). Roll the transaction back (or
    /// drop the write) and do not retry with the same token; see
    /// [`fence`](crate::fence).
    #[error("{}", fenced_message(resource, *token, *seen))]
    Fenced {
        /// The resource whose fence refused the write.
        resource: String,
        /// The token the write carried.
        token: FencingToken,
        /// The larger token the resource has seen, when the store tells it
        /// without another round trip.
        seen: Option<FencingToken>,
    },
    /// The registry or a backend was configured wrongly (bad URL, second `init`, …).
    #[error("dlock configuration error: {message}")]
    Config {
        /// A description that never contains secrets.
        message: String,
    },
}

impl LockError {
    /// Whether trying the same operation again later may succeed: a busy lock,
    /// or a backend failure that is transient (timeout, lost connection).
    pub fn is_retryable(&self) -> bool {
        match self {
            LockError::Busy { .. } => true,
            LockError::Backend { source, .. } => source.is_retryable(),
            _ => false,
        }
    }

    pub(crate) fn config(message: impl Into<String>) -> Self {
        LockError::Config {
            message: message.into(),
        }
    }

    pub(crate) fn invalid_key(key: &str, reason: impl Into<String>) -> Self {
        LockError::InvalidKey {
            key: key.to_owned(),
            reason: reason.into(),
        }
    }
}

impl From<LockError> for std::io::Error {
    fn from(err: LockError) -> Self {
        let kind = match &err {
            LockError::Busy { .. } => std::io::ErrorKind::WouldBlock,
            LockError::Lost { .. } => std::io::ErrorKind::ConnectionAborted,
            LockError::InvalidKey { .. } | LockError::Config { .. } => {
                std::io::ErrorKind::InvalidInput
            }
            LockError::UnknownBackend { .. } | LockError::NotInitialized => {
                std::io::ErrorKind::NotFound
            }
            LockError::ShutDown => std::io::ErrorKind::Interrupted,
            LockError::Backend { .. } => std::io::ErrorKind::Other,
            LockError::Fenced { .. } => std::io::ErrorKind::PermissionDenied,
        };
        std::io::Error::new(kind, err)
    }
}

/// The text of [`LockError::Fenced`].
fn fenced_message(resource: &str, token: FencingToken, seen: Option<FencingToken>) -> String {
    let seen = match seen {
        Some(seen) => format!("token {seen}"),
        None => "a larger token".to_owned(),
    };
    format!(
        "write to `{resource}` refused: fencing token {token} is stale, the resource has seen {seen} \
         (a newer holder of the lock wrote after this one's lease ended)"
    )
}

/// A failure inside a backend, with whether it is worth retrying.
pub struct BackendError {
    retryable: bool,
    config: bool,
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

impl BackendError {
    /// A transient failure (timeout, connection reset, server restarting).
    pub fn transient(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        BackendError {
            retryable: true,
            config: false,
            source: source.into(),
        }
    }

    /// A failure that will happen again (permission denied, bad schema, protocol error).
    pub fn permanent(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        BackendError {
            retryable: false,
            config: false,
            source: source.into(),
        }
    }

    /// A request the caller's configuration makes impossible (a semaphore
    /// asked with another number of permits than its holders use, a mode the
    /// key is not held in): the caller gets [`LockError::Config`] with
    /// `message`. Not retryable.
    pub fn config(message: impl Into<String>) -> Self {
        BackendError {
            retryable: false,
            config: true,
            source: message.into().into(),
        }
    }

    /// Whether this is a [`config`](Self::config) error.
    pub fn is_config(&self) -> bool {
        self.config
    }

    /// Whether the same call may succeed later.
    pub fn is_retryable(&self) -> bool {
        self.retryable
    }

    /// The client's own error (a `redis::RedisError`, an `sqlx::Error`, …) or
    /// the message the backend wrote.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.source
    }

    /// The client's own error, if it is an `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.source.downcast_ref::<E>()
    }

    /// Takes the client's own error out.
    pub fn into_inner(self) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self.source
    }

    /// Wraps it into [`LockError::Backend`].
    pub(crate) fn into_lock_error(self, backend: &'static str) -> LockError {
        if self.config {
            return LockError::config(self.source.to_string());
        }
        LockError::Backend {
            backend,
            source: self,
        }
    }
}

impl fmt::Debug for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendError")
            .field("retryable", &self.retryable)
            .field("config", &self.config)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

impl std::error::Error for BackendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.source()
    }
}

/// Removes the passwords from a URL-like string before it goes into an error
/// or a log: the user info's (`user:***@`), query parameters that carry one
/// (`?password=`, `?sslpassword=`), and those of URLs nested in the query
/// (`?listen_url=postgres%3A%2F%2Fu%3Apw%40…`).
pub(crate) fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        // No scheme (`user:secret@host/db`): what precedes an `@` may
        // still be credentials.
        return match url.rfind('@') {
            Some(at) => format!("***@{}", redact_query(&url[at + 1..])),
            None => redact_query(url),
        };
    };
    // The credentials end at the last `@` before any URL nested in the query
    // (`?listen_url=postgres://…`), even when an unencoded `/`, `?` or `#` in
    // the password would otherwise end the authority early.
    let nested = rest.find("://").unwrap_or(rest.len());
    let (authority, tail) = match rest[..nested].rfind('@') {
        Some(at) => match rest[at..].find(['/', '?', '#']) {
            Some(i) => rest.split_at(at + i),
            None => (rest, ""),
        },
        None => match rest.find(['/', '?', '#']) {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        },
    };
    let authority = match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            let user = userinfo.split(':').next().unwrap_or("");
            let host = &authority[at + 1..];
            if userinfo.contains(':') {
                format!("{user}:***@{host}")
            } else {
                format!("{user}@{host}")
            }
        }
        None => authority.to_owned(),
    };
    format!("{scheme}://{authority}{}", redact_query(tail))
}

/// The path, query and fragment of a URL with the query's secrets redacted.
fn redact_query(tail: &str) -> String {
    let Some((path, query)) = tail.split_once('?') else {
        return tail.to_owned();
    };
    let (query, fragment) = match query.split_once('#') {
        Some((q, f)) => (q, Some(f)),
        None => (query, None),
    };
    let params: Vec<String> = query
        .split('&')
        .map(|param| {
            let Some((name, value)) = param.split_once('=') else {
                return param.to_owned();
            };
            let lower = name.to_ascii_lowercase();
            if lower.contains("password") || lower == "pass" || lower == "passwd" {
                return format!("{name}=***");
            }
            let decoded = percent_encoding::percent_decode_str(value).decode_utf8_lossy();
            if decoded.contains("://") {
                let redacted = redact_url(&decoded);
                if redacted != decoded {
                    return format!("{name}={redacted}");
                }
            }
            param.to_owned()
        })
        .collect();
    let mut out = format!("{path}?{}", params.join("&"));
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("postgres://dlock:s3cret@127.0.0.1:5432/db?x=1"),
            "postgres://dlock:***@127.0.0.1:5432/db?x=1"
        );
        assert_eq!(redact_url("redis://:pw@h/"), "redis://:***@h/");
        assert_eq!(redact_url("sqlite://a/b.db"), "sqlite://a/b.db");
        assert_eq!(redact_url("memory://"), "memory://");
        assert_eq!(
            redact_url("postgres://u@h/db?password=s3cret&timeout=1s"),
            "postgres://u@h/db?password=***&timeout=1s"
        );
        assert_eq!(
            redact_url("postgres://h/db?sslpassword=s3cret#x"),
            "postgres://h/db?sslpassword=***#x"
        );
        let nested = redact_url(
            "postgres://h/db?listen_url=postgres%3A%2F%2Fu%3As3cret%40d%3A6432%2Fdb&x=1",
        );
        assert!(!nested.contains("s3cret"), "{nested}");
        assert!(nested.contains("u:***@d:6432/db"), "{nested}");
        assert_eq!(
            redact_url("postgres://h/db?listen_url=postgres%3A%2F%2Fd%2Fdb"),
            "postgres://h/db?listen_url=postgres%3A%2F%2Fd%2Fdb"
        );
        // Unencoded reserved characters in a password never show.
        for url in [
            "postgres://admin:se/cretpw@127.0.0.1:1/locks",
            "redis://:se#cretpw@127.0.0.1:1/",
            "mysql://u:se?cretpw@h/db",
            "redis://u:se@cretpw@h:1/",
        ] {
            let shown = redact_url(url);
            assert!(
                !shown.contains("cretpw") && !shown.contains("se/") && !shown.contains("se#"),
                "{shown}"
            );
        }
        assert_eq!(
            redact_url("postgres://u:p@h/db?listen_url=postgres://v:q@d/db"),
            "postgres://u:***@h/db?listen_url=postgres://v:***@d/db"
        );
    }

    #[test]
    fn retryable() {
        assert!(
            LockError::Busy {
                key: "k".into(),
                waited: Duration::ZERO
            }
            .is_retryable()
        );
        assert!(
            BackendError::transient("x")
                .into_lock_error("t")
                .is_retryable()
        );
        assert!(
            !BackendError::permanent("x")
                .into_lock_error("t")
                .is_retryable()
        );
        assert!(!LockError::NotInitialized.is_retryable());
        assert!(
            !LockError::Fenced {
                resource: "r".into(),
                token: FencingToken::new(1),
                seen: None
            }
            .is_retryable()
        );
    }

    #[test]
    fn fenced_says_which_write_was_refused_and_why() {
        let err = LockError::Fenced {
            resource: "account:7".into(),
            token: FencingToken::new(5),
            seen: Some(FencingToken::new(9)),
        };
        assert_eq!(
            err.to_string(),
            "write to `account:7` refused: fencing token 5 is stale, the resource has seen \
             token 9 (a newer holder of the lock wrote after this one's lease ended)"
        );
        let unknown = LockError::Fenced {
            resource: "r".into(),
            token: FencingToken::new(5),
            seen: None,
        };
        assert!(
            unknown.to_string().contains("seen a larger token"),
            "{unknown}"
        );
        let io = std::io::Error::from(unknown);
        assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied);
    }

    #[test]
    fn the_clients_error_is_reachable() {
        let io = std::io::Error::new(std::io::ErrorKind::TimedOut, "slow");
        let err = BackendError::transient(io);
        assert_eq!(
            err.downcast_ref::<std::io::Error>()
                .map(std::io::Error::kind),
            Some(std::io::ErrorKind::TimedOut)
        );
        assert_eq!(err.get_ref().to_string(), "slow");
        assert!(err.into_inner().downcast::<std::io::Error>().is_ok());
    }
}
