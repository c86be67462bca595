//! `dlock`: who holds which distributed lock, read from the server; a live
//! view of them; taking one back from its holder.
//!
//! Works on every backend dlock-runtime opens from a URL (`--url` or
//! `DLOCK_URL`). See `dlock --help` for the commands and exit codes.

#![forbid(unsafe_code)]

mod format;
mod watch;

use std::future::Future;
use std::io::{BufRead as _, IsTerminal as _, Write as _};
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use clap::{Args, Parser, Subcommand};
use dlock_runtime::admin::redact_url;
use dlock_runtime::{Admin, HolderInfo, Registry};

/// The exit codes, as `dlock --help` shows them.
const EXIT_CODES: &str = "\
Exit codes:
  0  success (also `show` of a free key, which prints `free` / JSON `null`)
  1  error: bad or unreachable URL, no lock table or SQLite file there (never
     created here: add `?create=true` to a SQL URL to let it), a server error or
     no answer within --timeout, or `revoke` not confirmed
  2  usage error (unknown command or option, missing --url)";

/// Who holds which distributed lock, and taking one back.
///
/// Reads what the server holds, whichever process took it. Keys are in the
/// application's key space: the registry prefix (`--prefix`, `dlock:` by
/// default, like dlock-runtime's) is added and removed here.
#[derive(Debug, Parser)]
#[command(name = "dlock", version, after_help = EXIT_CODES)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

/// The options every command takes, before or after its name.
#[derive(Debug, Args)]
struct Global {
    /// The lock backend's URL (`redis://host`, `postgres://user:pass@host/db`,
    /// `sqlite://path`, `zk://…`, `etcd://…`, …)
    #[arg(long, env = "DLOCK_URL", hide_env_values = true, global = true)]
    url: Option<String>,
    /// Print one JSON document instead of a table
    #[arg(long, global = true)]
    json: bool,
    /// The registry's key prefix, as the applications' `RegistryBuilder::key_prefix`
    #[arg(
        long = "prefix",
        value_name = "REGISTRY_PREFIX",
        default_value = dlock_runtime::DEFAULT_PREFIX,
        global = true
    )]
    registry_prefix: String,
    /// How long to wait for the server, to connect and for each request
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration, global = true)]
    timeout: Duration,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the held keys (all, or those starting with PREFIX), in key order
    List {
        /// Only keys starting with this
        #[arg(default_value = "")]
        prefix: String,
        /// At most this many keys
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Show who holds KEY (`free` and exit code 0 when nobody does)
    Show {
        /// The key, as the application names it
        key: String,
    },
    /// Take KEY from its holders: their next renewal fails and their `lost()` fires
    ///
    /// Shows the holders and asks on standard input; revokes only on `y` or
    /// `yes` (a script may pipe `yes`), unless --yes.
    Revoke {
        /// The key, as the application names it
        key: String,
        /// Do not ask
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// A live table of the held keys (all, or those starting with PREFIX); Ctrl-C quits
    Watch {
        /// Only keys starting with this
        #[arg(default_value = "")]
        prefix: String,
        /// At most this many keys
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Time between refreshes
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        interval: Duration,
    },
}

/// A failure the command reports: its message, already free of secrets.
#[derive(Debug)]
struct Failure(String);

impl Failure {
    fn new(message: impl Into<String>) -> Self {
        Failure(message.into())
    }
}

/// The connection the commands share: the admin view and what is needed to
/// describe the server in messages.
struct Session {
    admin: Admin,
    /// The URL with its secrets redacted.
    shown_url: String,
    timeout: Duration,
    /// The URL's secrets, scrubbed from every error a backend reports.
    secrets: Arc<Vec<String>>,
}

impl Session {
    /// Runs one request within the timeout, its error scrubbed.
    async fn call<T>(
        &self,
        what: &str,
        request: impl Future<Output = Result<T, dlock_runtime::LockError>>,
    ) -> Result<T, Failure> {
        bounded(self.timeout, &self.shown_url, &self.secrets, what, request).await
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dlock: error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let outcome = runtime.block_on(run(cli));
    // Backends keep background tasks (connection managers, watchers): leave
    // them without waiting.
    runtime.shutdown_background();
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(message)) => {
            eprintln!("dlock: error: {message}");
            ExitCode::from(1)
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let Some(url) = cli.global.url.clone() else {
        // The same wording and exit code as clap's own usage errors.
        use clap::CommandFactory as _;
        Cli::command()
            .error(
                clap::error::ErrorKind::MissingRequiredArgument,
                "no lock URL: pass --url URL or set DLOCK_URL",
            )
            .exit();
    };
    let session = open(&url, &cli.global).await?;
    let json = cli.global.json;
    match cli.command {
        Command::List { prefix, limit } => {
            let locks = session
                .call("list", session.admin.list(&prefix, limit))
                .await?;
            if json {
                print_json(&locks)?;
            } else if locks.is_empty() {
                println!("no held keys{}", under(&prefix));
            } else {
                print!("{}", format::table(&locks, SystemTime::now()));
                if locks.len() == limit {
                    eprintln!("(the first {limit} keys; see --limit)");
                }
            }
        }
        Command::Show { key } => {
            let info = session.call("show", session.admin.inspect(&key)).await?;
            match (&info, json) {
                (_, true) => print_json(&info)?,
                (Some(info), false) => print!("{}", format::detail(info, SystemTime::now())),
                (None, false) => println!("{key}: free"),
            }
        }
        Command::Revoke { key, yes } => revoke(&session, &key, yes, json).await?,
        Command::Watch {
            prefix,
            limit,
            interval,
        } => watch::run(&session, &prefix, limit, interval, json).await?,
    }
    Ok(())
}

/// Connects within the timeout, to lock tables that must already be there
/// (see [`without_creating`]).
async fn open(url: &str, global: &Global) -> Result<Session, Failure> {
    let shown_url = redact_url(url);
    let secrets = Arc::new(secrets_of(url));
    let opened = without_creating(url)
        .map_err(|e| Failure::new(format!("connect on {shown_url}: {}", scrub(&e, &secrets))))?;
    let backend = bounded(
        global.timeout,
        &shown_url,
        &secrets,
        "connect",
        dlock_runtime::connect(&opened),
    )
    .await?;
    let registry = Registry::builder()
        .default_backend(backend)
        .key_prefix(global.registry_prefix.clone())
        .build();
    let admin = registry
        .admin(None)
        .map_err(|e| Failure::new(scrub(&e.to_string(), &secrets)))?;
    Ok(Session {
        admin,
        shown_url,
        timeout: global.timeout,
        secrets,
    })
}

/// The URL the commands open: one that reads the lock tables the
/// applications made, never makes them. A misspelt `?table=` or SQLite path
/// would otherwise be created empty and every key shown free. PostgreSQL
/// and MySQL URLs get `create=false` unless they say `create` themselves
/// (`?create=true` lets the command add what an older table lacks); a
/// SQLite file must exist.
fn without_creating(url: &str) -> Result<String, String> {
    let Some((scheme, rest)) = url.split_once(':') else {
        return Ok(url.to_owned());
    };
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    match scheme.to_ascii_lowercase().as_str() {
        "postgres" | "postgresql" | "mysql" | "mariadb" => {
            if query
                .split('&')
                .any(|option| option.split('=').next() == Some("create"))
            {
                Ok(url.to_owned())
            } else if url.contains('?') {
                Ok(format!("{url}&create=false"))
            } else {
                Ok(format!("{url}?create=false"))
            }
        }
        "sqlite" => {
            let file = path.strip_prefix("//").unwrap_or(path);
            if file.is_empty() || Path::new(file).is_file() {
                Ok(url.to_owned())
            } else {
                Err(format!(
                    "no SQLite lock database at `{file}` (the applications that lock make it; \
                     is the path right?)"
                ))
            }
        }
        _ => Ok(url.to_owned()),
    }
}

/// `request` within `timeout`; its error, or the timeout, as a message
/// naming the (redacted) server.
async fn bounded<T>(
    timeout: Duration,
    shown_url: &str,
    secrets: &[String],
    what: &str,
    request: impl Future<Output = Result<T, dlock_runtime::LockError>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(timeout, request).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => {
            let message = scrub(&e.to_string(), secrets);
            Err(Failure::new(if message.contains(shown_url) {
                format!("{what}: {message}")
            } else {
                format!("{what} on {shown_url}: {message}")
            }))
        }
        Err(_) => Err(Failure::new(format!(
            "{what} on {shown_url}: no answer within {} (is the server up? see --timeout)",
            humantime::format_duration(timeout)
        ))),
    }
}

/// ` under `PREFIX`` for a non-empty prefix.
fn under(prefix: &str) -> String {
    if prefix.is_empty() {
        String::new()
    } else {
        format!(" under `{prefix}`")
    }
}

/// Asks, unless `yes`, then revokes and says from whom.
async fn revoke(session: &Session, key: &str, yes: bool, json: bool) -> Result<(), Failure> {
    // The holders the question named, to say so if the key changed hands
    // before the answer came.
    let mut asked_about = None;
    if !yes {
        let Some(info) = session.call("show", session.admin.inspect(key)).await? else {
            if json {
                print_json(&Vec::<HolderInfo>::new())?;
            } else {
                println!("{key}: free, nothing to revoke");
            }
            return Ok(());
        };
        let mut prompt = format!("{key} is held by:\n");
        for h in info.holders() {
            prompt.push_str(&format!(
                "  {} token {} held for {}\n",
                format::holder(h),
                format::token(h),
                format::held_for(h, SystemTime::now())
            ));
        }
        prompt.push_str("Revoke it? Its holders lose it at their next renewal. [y/N] ");
        let answer = ask(&prompt).await?;
        if !matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes") {
            return Err(Failure::new(format!("{key}: not revoked")));
        }
        asked_about = Some(info);
    }
    let revoked = session.call("revoke", session.admin.revoke(key)).await?;
    if let Some(info) = asked_about
        && revoked.iter().any(|h| {
            !info
                .holders()
                .iter()
                .any(|a| (a.token(), a.pid(), a.host()) == (h.token(), h.pid(), h.host()))
        })
    {
        eprintln!(
            "dlock: warning: {key} changed hands after the question; revoked its holders then"
        );
    }
    if json {
        print_json(&revoked)?;
    } else if revoked.is_empty() {
        println!("{key}: free, nothing to revoke");
    } else {
        for h in &revoked {
            println!(
                "revoked {key} from {}, token {}",
                format::holder(h),
                format::token(h)
            );
        }
    }
    Ok(())
}

/// Writes `prompt` to standard error and reads one line from standard input
/// (a terminal or a pipe); the empty string at its end.
async fn ask(prompt: &str) -> Result<String, Failure> {
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(prompt.as_bytes());
    let _ = err.flush();
    drop(err);
    let interactive = std::io::stdin().is_terminal();
    let line = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).map(|_| line)
    })
    .await
    .map_err(|e| Failure::new(format!("reading the answer: {e}")))?
    .map_err(|e| Failure::new(format!("reading the answer: {e}")))?;
    if !interactive {
        // Keep the transcript readable when the answer came from a pipe.
        eprintln!("{}", line.trim_end());
    }
    Ok(line)
}

/// One JSON document on standard output.
fn print_json<T: serde::Serialize + ?Sized>(value: &T) -> Result<(), Failure> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Failure::new(format!("writing JSON: {e}")))?;
    println!("{text}");
    Ok(())
}

/// The secrets a URL carries: the user info's password and the values of
/// query parameters whose name says password, raw and percent-decoded.
///
/// A secret equal to a part the redacted URL shows anyway (the user name, a
/// host, a path segment: `postgres://dlock:dlock@db/dlock`) is not one:
/// scrubbing it would hide nothing and turn every message's words that
/// happen to match (`dlock`'s own name among them) into `***`.
fn secrets_of(url: &str) -> Vec<String> {
    let mut found = Vec::new();
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let mut shown: Vec<&str> = Vec::new();
    let hosts = match authority.rfind('@') {
        Some(at) => {
            let user_info = &authority[..at];
            match user_info.split_once(':') {
                Some((user, password)) => {
                    found.push(password.to_owned());
                    shown.push(user);
                }
                None => shown.push(user_info),
            }
            &authority[at + 1..]
        }
        None => authority,
    };
    shown.extend(
        hosts
            .split(',')
            .map(|h| h.rsplit_once(':').map_or(h, |(host, _)| host)),
    );
    let path = rest[authority_end..]
        .split(['?', '#'])
        .next()
        .unwrap_or_default();
    shown.extend(path.split('/'));
    if let Some((_, query)) = url.split_once('?') {
        for pair in query.split(['&', '#']) {
            if let Some((name, value)) = pair.split_once('=')
                && (name.to_ascii_lowercase().contains("pass")
                    || name.to_ascii_lowercase().contains("secret")
                    || name.to_ascii_lowercase().contains("token"))
            {
                found.push(value.to_owned());
            }
        }
    }
    let decoded: Vec<String> = found.iter().map(|s| percent_decode(s)).collect();
    found.extend(decoded);
    found.retain(|s| s.len() >= 3 && !shown.iter().any(|part| percent_decode(part) == *s));
    found.sort_by_key(|s| std::cmp::Reverse(s.len()));
    found.dedup();
    found
}

/// `%XX` escapes decoded (invalid ones kept as they are).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = s.get(i + 1..i + 3)
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `message` with every secret replaced by `***`: a second guard behind the
/// backends' own redaction, since a driver's error may quote what it was given.
fn scrub(message: &str, secrets: &[String]) -> String {
    secrets
        .iter()
        .fold(message.to_owned(), |m, s| m.replace(s.as_str(), "***"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_found_in_the_user_info_and_the_query() {
        let found = secrets_of(
            "postgres://dlock:p%40ss@db:5432/locks?sslpassword=k3y&listen_url=x&mode=session",
        );
        assert!(found.contains(&"p%40ss".to_owned()), "{found:?}");
        assert!(found.contains(&"p@ss".to_owned()), "{found:?}");
        assert!(found.contains(&"k3y".to_owned()), "{found:?}");
        assert!(!found.iter().any(|s| s == "session"), "{found:?}");
        assert_eq!(
            scrub("auth failed for dlock:p@ss (k3y)", &found),
            "auth failed for dlock:*** (***)"
        );
    }

    #[test]
    fn a_password_the_url_shows_elsewhere_is_no_secret() {
        assert!(secrets_of("mysql://dlock:dlock@127.0.0.1:43306/dlock").is_empty());
        assert!(secrets_of("postgres://app:db1@db1:5432/locks").is_empty());
        assert_eq!(
            secrets_of("postgres://dlock:s3cret@127.0.0.1:45432/dlock"),
            vec!["s3cret".to_owned()]
        );
        let found = secrets_of("mysql://dlock:dlock@127.0.0.1:43306/dlock");
        assert_eq!(
            scrub("dlock configuration error: no table `dlock_x`", &found),
            "dlock configuration error: no table `dlock_x`"
        );
    }

    #[test]
    fn urls_without_a_password_have_no_secrets() {
        assert!(secrets_of("redis://127.0.0.1:6379/").is_empty());
        assert!(secrets_of("sqlite:///var/lib/app/locks.db").is_empty());
    }

    #[test]
    fn the_global_options_are_taken_before_and_after_the_command() {
        for args in [
            &["dlock", "--json", "--url", "memory://", "list"][..],
            &["dlock", "list", "--json", "--url", "memory://"][..],
        ] {
            let cli = Cli::try_parse_from(args).expect("parses");
            assert!(cli.global.json, "{args:?}");
            assert_eq!(cli.global.url.as_deref(), Some("memory://"), "{args:?}");
        }
    }

    #[test]
    fn sql_urls_are_opened_without_creating_tables() {
        let url = |u: &str| without_creating(u).unwrap();
        assert_eq!(url("mysql://h/db"), "mysql://h/db?create=false");
        assert_eq!(
            url("postgres://h/db?table=t"),
            "postgres://h/db?table=t&create=false"
        );
        assert_eq!(
            url("MariaDB://h/db?create=true"),
            "MariaDB://h/db?create=true"
        );
        assert_eq!(
            url("postgresql://h/db?create=false"),
            "postgresql://h/db?create=false"
        );
        assert_eq!(url("redis://h/?table=x"), "redis://h/?table=x");
        let missing = without_creating("sqlite:///nonexistent-dir/locks.db?poll=5ms").unwrap_err();
        assert!(missing.contains("`/nonexistent-dir/locks.db`"), "{missing}");
        assert!(without_creating("sqlite://nonexistent.db").is_err());
        let existing = std::env::current_exe().unwrap();
        let existing = format!("sqlite://{}", existing.display());
        assert_eq!(url(&existing), existing);
    }

    #[test]
    fn the_cli_definition_is_consistent() {
        use clap::CommandFactory as _;
        Cli::command().debug_assert();
    }
}
