//! The options of a SQL URL: the query string's pairs, percent-decoded,
//! taken one by one by the backend, and the rest handed on to the driver.

use std::time::Duration;

use crate::error::LockError;

/// The option pairs of a URL's query string, percent-decoded, for the
/// backend to take its own options from.
// `pub` for the server databases' `Dialect` interface.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unreachable_pub)
)]
pub struct UrlOptions {
    scheme: &'static str,
    pairs: Vec<(String, String)>,
}

impl UrlOptions {
    /// Splits `query` (what follows `?`, without it) into pairs.
    pub(crate) fn parse(scheme: &'static str, query: &str) -> Result<Self, LockError> {
        let mut pairs = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            pairs.push((percent_decode(name)?, percent_decode(value)?));
        }
        Ok(UrlOptions { scheme, pairs })
    }

    /// Takes option `name` out (the last one given wins), if present.
    pub(crate) fn take(&mut self, name: &str) -> Option<String> {
        let mut found = None;
        self.pairs.retain(|(n, v)| {
            if n == name {
                found = Some(v.clone());
                false
            } else {
                true
            }
        });
        found
    }

    /// Takes a duration option (`250ms`, `1m 30s`); zero is refused unless `zero_ok`.
    pub(crate) fn duration(
        &mut self,
        name: &str,
        default: Duration,
        zero_ok: bool,
    ) -> Result<Duration, LockError> {
        let Some(value) = self.take(name) else {
            return Ok(default);
        };
        let parsed = humantime::parse_duration(&value).map_err(|e| {
            LockError::config(format!(
                "bad `{name}={value}` in a {} URL: {e}",
                self.scheme
            ))
        })?;
        if parsed.is_zero() && !zero_ok {
            return Err(LockError::config(format!(
                "`{name}` in a {} URL must be more than zero",
                self.scheme
            )));
        }
        Ok(parsed)
    }

    /// Takes a boolean option (`true`/`false`, `on`/`off`, `1`/`0`, `yes`/`no`).
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn flag(&mut self, name: &str, default: bool) -> Result<bool, LockError> {
        let Some(value) = self.take(name) else {
            return Ok(default);
        };
        match value.to_ascii_lowercase().as_str() {
            "true" | "on" | "1" | "yes" => Ok(true),
            "false" | "off" | "0" | "no" => Ok(false),
            _ => Err(LockError::config(format!(
                "bad `{name}={value}` in a {} URL: expected true or false",
                self.scheme
            ))),
        }
    }

    /// Takes `mode=lease|session`.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn mode(&mut self) -> Result<Mode, LockError> {
        match self.take("mode").as_deref() {
            None | Some("lease") => Ok(Mode::Lease),
            Some("session") => Ok(Mode::Session),
            Some(other) => Err(LockError::config(format!(
                "bad `mode={other}` in a {} URL: expected `lease` (the default) or `session`",
                self.scheme
            ))),
        }
    }

    /// Takes `table=` (default `dlock_leases`), checked to be a plain identifier.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn table(&mut self) -> Result<String, LockError> {
        let table = self
            .take("table")
            .unwrap_or_else(|| "dlock_leases".to_owned());
        check_table_name(&table).map_err(|why| {
            LockError::config(format!(
                "bad `table={table}` in a {} URL: {why}",
                self.scheme
            ))
        })?;
        Ok(table)
    }

    /// Refuses options nobody took (for URLs with no driver to hand them
    /// to); `known` lists the options there are.
    #[cfg(feature = "sqlite")]
    pub(crate) fn refuse_rest(&self, known: &str) -> Result<(), LockError> {
        match self.pairs.first() {
            None => Ok(()),
            Some((name, _)) => Err(LockError::config(format!(
                "unknown option `{name}` in a {} URL; known: {known}",
                self.scheme
            ))),
        }
    }

    /// The pairs nobody took, to hand on to the driver (`sslmode=require`, …),
    /// as a query string (percent-encoded again), empty if none.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn rest(&self) -> String {
        self.pairs
            .iter()
            .map(|(n, v)| format!("{}={}", percent_encode(n), percent_encode(v)))
            .collect::<Vec<_>>()
            .join("&")
    }

    /// The URL for the driver: `scheme` (`postgres://`) and `base`, with
    /// the options nobody took.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn driver_url(&self, scheme: &str, base: &str) -> String {
        let rest = self.rest();
        if rest.is_empty() {
            format!("{scheme}{base}")
        } else {
            format!("{scheme}{base}?{rest}")
        }
    }
}

/// How a SQL backend holds its locks.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A row per key in a lease table (the default).
    Lease,
    /// A server-side lock on a dedicated connection per held lock.
    Session,
}

/// Table names go into statements as written: letters, digits and `_`, not
/// starting with a digit, optionally after a schema (`locks.dlock_leases`).
/// Short enough that `<table>_fence` fits PostgreSQL's 63-byte identifiers.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn check_table_name(name: &str) -> Result<(), &'static str> {
    let mut parts = name.split('.');
    let (Some(first), second, None) = (parts.next(), parts.next(), parts.next()) else {
        return Err("at most one `.` (schema.table)");
    };
    for part in [Some(first), second].into_iter().flatten() {
        let mut chars = part.chars();
        let Some(head) = chars.next() else {
            return Err("an empty name");
        };
        if !(head.is_ascii_alphabetic() || head == '_')
            || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err("only ASCII letters, digits and `_`, not starting with a digit");
        }
        if part.len() > 50 {
            return Err("at most 50 characters");
        }
    }
    Ok(())
}

fn percent_decode(s: &str) -> Result<String, LockError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| LockError::config("bad percent-escape in a URL option"))?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| LockError::config("a URL option is not UTF-8"))
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/' | b':') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(all(test, any(feature = "postgres", feature = "mysql")))]
mod tests {
    use super::*;

    #[test]
    fn options_are_taken_and_the_rest_handed_on() {
        let mut o = UrlOptions::parse(
            "postgres://",
            "mode=session&table=locks.my_leases&sslmode=require&listen_url=postgres%3A%2F%2Fh%2Fdb%3Fa%3D1&poll=250ms&create=false",
        )
        .unwrap();
        assert_eq!(o.mode().unwrap(), Mode::Session);
        assert_eq!(o.table().unwrap(), "locks.my_leases");
        assert_eq!(o.take("listen_url").unwrap(), "postgres://h/db?a=1");
        assert_eq!(
            o.duration("poll", Duration::from_secs(1), false).unwrap(),
            Duration::from_millis(250)
        );
        assert!(!o.flag("create", true).unwrap());
        assert_eq!(o.rest(), "sslmode=require");
        let mut o = UrlOptions::parse("mysql://", "").unwrap();
        assert_eq!(o.mode().unwrap(), Mode::Lease);
        assert_eq!(o.table().unwrap(), "dlock_leases");
        assert!(o.flag("create", true).unwrap());
    }

    #[test]
    fn bad_options_are_config_errors() {
        for query in [
            "mode=sessions",
            "table=a;drop",
            "table=1abc",
            "table=a.b.c",
            "poll=0s",
            "poll=soon",
            "create=maybe",
            "x=%zz",
        ] {
            let mut o = match UrlOptions::parse("postgres://", query) {
                Ok(o) => o,
                Err(LockError::Config { .. }) => continue,
                Err(e) => panic!("{query}: {e}"),
            };
            let result = o
                .mode()
                .and_then(|_| o.table())
                .and_then(|_| o.duration("poll", Duration::from_secs(1), false))
                .and_then(|_| o.flag("create", true));
            assert!(
                matches!(result, Err(LockError::Config { .. })),
                "{query}: {:?}",
                result.err()
            );
        }
    }

    #[test]
    fn table_names() {
        assert!(check_table_name("dlock_leases").is_ok());
        assert!(check_table_name("_x1.y_2").is_ok());
        assert!(check_table_name("").is_err());
        assert!(check_table_name("a b").is_err());
        assert!(check_table_name("a\"b").is_err());
        assert!(check_table_name(&"x".repeat(51)).is_err());
    }
}
