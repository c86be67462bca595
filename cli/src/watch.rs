//! `dlock watch`: the held keys redrawn in place every interval until
//! Ctrl-C, on the terminal's alternate screen (restored on the way out).
//! With `--json`, one JSON array a line instead, for other programs.

use std::io::Write as _;
use std::time::{Duration, SystemTime};

use crate::{Failure, Session, format};

/// Switches to the alternate screen and hides the cursor.
const ENTER: &str = "\x1b[?1049h\x1b[?25l";
/// Shows the cursor and leaves the alternate screen.
const LEAVE: &str = "\x1b[?25h\x1b[?1049l";
/// Cursor home, then clear the screen.
const CLEAR: &str = "\x1b[H\x1b[2J";

/// Restores the terminal however the loop ends (Ctrl-C, a write error, a
/// panic).
struct Screen;

impl Screen {
    fn enter() -> Screen {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(ENTER.as_bytes());
        let _ = out.flush();
        Screen
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(LEAVE.as_bytes());
        let _ = out.flush();
    }
}

/// Refreshes until Ctrl-C. A failed refresh is shown in the frame and
/// retried at the next tick; only Ctrl-C (or a closed output) ends it.
pub(crate) async fn run(
    session: &Session,
    prefix: &str,
    limit: usize,
    interval: Duration,
    json: bool,
) -> Result<(), Failure> {
    let interval = interval.max(Duration::from_millis(100));
    let screen = (!json).then(Screen::enter);
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let ctrl_c = quit_signal();
    tokio::pin!(ctrl_c);
    loop {
        tokio::select! {
            _ = &mut ctrl_c => break,
            _ = ticks.tick() => {}
        }
        let answer = tokio::select! {
            _ = &mut ctrl_c => break,
            answer = session.call("list", session.admin.list(prefix, limit)) => answer,
        };
        let text = if json {
            match answer {
                Ok(locks) => serde_json::to_string(&locks)
                    .map_err(|e| Failure::new(format!("writing JSON: {e}")))?,
                Err(Failure(message)) => serde_json::json!({ "error": message }).to_string(),
            }
        } else {
            frame(session, prefix, limit, interval, answer)
        };
        let mut out = std::io::stdout().lock();
        let written = if json {
            writeln!(out, "{text}")
        } else {
            write!(out, "{CLEAR}{text}")
        };
        if written.and_then(|()| out.flush()).is_err() {
            // The reader went away (a closed pipe): nothing left to show.
            break;
        }
    }
    drop(screen);
    Ok(())
}

/// Ctrl-C, or on Unix a termination (`kill`) or hang-up (the terminal
/// closed): each ends the watch with the terminal restored.
async fn quit_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut hup)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
        ) else {
            let _ = tokio::signal::ctrl_c().await;
            return;
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
            _ = hup.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// One screen: a title line, then the table, `no held keys`, or the error.
fn frame(
    session: &Session,
    prefix: &str,
    limit: usize,
    interval: Duration,
    answer: Result<Vec<dlock_runtime::LockInfo>, Failure>,
) -> String {
    let now = SystemTime::now();
    let mut text = format!(
        "dlock watch{}{prefix}  on {}  every {}\n{}  (Ctrl-C quits)\n\n",
        if prefix.is_empty() { "" } else { " " },
        session.shown_url,
        humantime::format_duration(interval),
        humantime::format_rfc3339_seconds(now),
    );
    match answer {
        Ok(locks) if locks.is_empty() => text.push_str("no held keys\n"),
        Ok(locks) => {
            text.push_str(&format::table(&locks, now));
            if locks.len() == limit {
                text.push_str(&format!("(first {limit} keys; see --limit)\n"));
            }
        }
        Err(Failure(message)) => text.push_str(&format!("error: {message}\n")),
    }
    text
}
