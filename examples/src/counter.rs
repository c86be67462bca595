//! `quickstart`'s counter store: a counter in a file, standing in for a
//! database or service that checks fencing tokens, instrumented so that the
//! coordinator sees what happens.
//!
//! The store holds one [`Row`]: the counter's value and the fencing token of
//! the last accepted write. [`Counter::read`] and [`Counter::update`] are what
//! a real store offers; `quickstart` writes the fencing check itself, in the
//! closure it gives to `update`.
//!
//! The instrumentation, which a real store does not need:
//!
//! - `read` marks the caller as *inside* the read-modify-write, and `update`
//!   clears that mark. A caller that finds another's mark on entering has
//!   overlapped with it (or replaced a holder that died inside). The caller is
//!   identified by the worker number of its handle and the fencing token of the
//!   lock its task holds ([`dlock_runtime::current`]).
//! - `update` judges the write: accepted if the closure changed the row,
//!   refused otherwise. The store counts refused writes and remembers the last
//!   accepted writer.
//! - Each of these steps prints an [`Event`] line on stdout, which the
//!   coordinator reads ([`crate::harness`]).
//!
//! Each operation is atomic: it holds an OS file lock (`File::lock`) for the
//! few microseconds it reads and rewrites the file. That lock protects the
//! file's bytes, not the round: between `read` and `update` another worker
//! could run a whole round, and only the distributed lock prevents it. (The
//! calls block, briefly; a real store would have an async client.)

use std::collections::HashMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};

/// The stored row.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Row {
    /// The counter.
    pub value: u64,
    /// The fencing token of the last accepted write (0 before any).
    pub token: u64,
}

/// A handle on the counter store, used by one worker.
pub struct Counter {
    path: PathBuf,
    /// The worker using this handle, recorded in the "inside" mark.
    worker: u32,
    /// Whether this handle's last update was refused.
    refused: AtomicBool,
}

impl Counter {
    /// Creates the store's file, with a zero counter.
    pub fn create(path: &Path) -> io::Result<()> {
        std::fs::write(path, State::default().to_string())
    }

    /// A handle on the store at `path` for worker `worker`.
    pub fn open(path: PathBuf, worker: u32) -> Counter {
        Counter {
            path,
            worker,
            refused: AtomicBool::new(false),
        }
    }

    /// The counter's value (and the caller's "inside" mark set).
    pub fn read(&self) -> io::Result<u64> {
        let me = self.caller();
        let (value, found) = self.change(|state| (state.row.value, state.inside.replace(me)))?;
        Event::Holds(me).report();
        if let Some(other) = found {
            Event::FoundInside { me, other }.report();
        }
        Ok(value)
    }

    /// Reads, changes and rewrites the row in one atomic step, and returns
    /// what `change` returned. The write counts as accepted if `change`
    /// changed the row, as refused if it left it as it was.
    pub fn update<R>(&self, change: impl FnOnce(&mut Row) -> R) -> io::Result<R> {
        let me = self.caller();
        let (out, accepted, value) = self.change(|state| {
            let before = state.row;
            let out = change(&mut state.row);
            let accepted = state.row != before;
            if accepted {
                state.last_write = Some(me);
            } else {
                state.stale_refused += 1;
            }
            if state.inside == Some(me) {
                state.inside = None;
            }
            (out, accepted, state.row.value)
        })?;
        self.refused.store(!accepted, Ordering::Relaxed);
        match accepted {
            true => Event::Wrote { me, value },
            false => Event::Refused { me },
        }
        .report();
        Ok(out)
    }

    /// Whether this handle's last [`update`](Counter::update) was refused.
    pub fn last_write_refused(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    /// Everything the store records.
    pub fn state(&self) -> io::Result<State> {
        let mut file = File::open(&self.path)?;
        file.lock_shared()?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        text.parse()
    }

    /// The caller: this handle's worker, with the token of the lock it holds.
    fn caller(&self) -> Holder {
        let token = dlock_runtime::current()
            .and_then(|lock| lock.fencing_token())
            .map_or(0, u64::from);
        Holder {
            worker: self.worker,
            token,
        }
    }

    /// Reads, changes and rewrites the state under an exclusive file lock.
    fn change<R>(&self, change: impl FnOnce(&mut State) -> R) -> io::Result<R> {
        let mut file = OpenOptions::new().read(true).write(true).open(&self.path)?;
        file.lock()?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        let mut state: State = text.parse()?;
        let out = change(&mut state);
        file.rewind()?;
        file.set_len(0)?;
        file.write_all(state.to_string().as_bytes())?;
        Ok(out) // closing `file` releases the file lock
    }
}

/// A worker inside the read-modify-write, with the fencing token of its lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    /// The worker's number.
    pub worker: u32,
    /// The fencing token of the lock it held.
    pub token: u64,
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "worker {} token {}", self.worker, self.token)
    }
}

impl Holder {
    /// Parses the words of `worker 2 token 17`.
    fn from_words(words: &[&str]) -> Option<Holder> {
        match words {
            ["worker", worker, "token", token] => Some(Holder {
                worker: worker.parse().ok()?,
                token: token.parse().ok()?,
            }),
            _ => None,
        }
    }
}

/// The store's content, kept as `name value` lines in its file.
#[derive(Debug, Default)]
pub struct State {
    /// The row: the counter and the token of the last accepted write.
    pub row: Row,
    /// How many writes were refused.
    pub stale_refused: u64,
    /// Who is inside the read-modify-write now (the overlap detector).
    pub inside: Option<Holder>,
    /// Who made the last accepted write.
    pub last_write: Option<Holder>,
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let holder = |h: Option<Holder>| h.map_or_else(|| "none".to_owned(), |h| h.to_string());
        writeln!(f, "value {}", self.row.value)?;
        writeln!(f, "token {}", self.row.token)?;
        writeln!(f, "stale_refused {}", self.stale_refused)?;
        writeln!(f, "inside {}", holder(self.inside))?;
        writeln!(f, "last_write {}", holder(self.last_write))
    }
}

impl FromStr for State {
    type Err = io::Error;

    fn from_str(text: &str) -> io::Result<State> {
        let fields: HashMap<&str, &str> = text.lines().filter_map(|l| l.split_once(' ')).collect();
        let bad = |name: &str| io::Error::new(io::ErrorKind::InvalidData, format!("bad `{name}`"));
        let number = |name: &str| {
            fields
                .get(name)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| bad(name))
        };
        let holder = |name: &str| match fields.get(name) {
            Some(&"none") => Ok(None),
            Some(v) => Holder::from_words(&v.split(' ').collect::<Vec<_>>())
                .map(Some)
                .ok_or_else(|| bad(name)),
            None => Err(bad(name)),
        };
        Ok(State {
            row: Row {
                value: number("value")?,
                token: number("token")?,
            },
            stale_refused: number("stale_refused")?,
            inside: holder("inside")?,
            last_write: holder("last_write")?,
        })
    }
}

/// What the store tells the coordinator: one line on stdout per event.
#[derive(Debug, Clone, Copy)]
pub enum Event {
    /// `worker 2 token 17 holds the lock`: it read the counter.
    Holds(Holder),
    /// `worker 2 token 17 found worker 3 token 16 inside`
    FoundInside {
        /// The worker that entered.
        me: Holder,
        /// The worker whose mark it found.
        other: Holder,
    },
    /// `worker 2 token 17 wrote 18`
    Wrote {
        /// The writer.
        me: Holder,
        /// The value it wrote.
        value: u64,
    },
    /// `worker 2 token 17 was refused`
    Refused {
        /// The writer.
        me: Holder,
    },
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Holds(me) => write!(f, "{me} holds the lock"),
            Event::FoundInside { me, other } => write!(f, "{me} found {other} inside"),
            Event::Wrote { me, value } => write!(f, "{me} wrote {value}"),
            Event::Refused { me } => write!(f, "{me} was refused"),
        }
    }
}

impl Event {
    /// Parses a line the store printed (an event's `Display`).
    pub fn parse(line: &str) -> Option<Event> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let (me, rest) = words.split_at_checked(4)?;
        let me = Holder::from_words(me)?;
        Some(match rest {
            ["holds", "the", "lock"] => Event::Holds(me),
            ["found", other @ .., "inside"] => Event::FoundInside {
                me,
                other: Holder::from_words(other)?,
            },
            ["wrote", value] => Event::Wrote {
                me,
                value: value.parse().ok()?,
            },
            ["was", "refused"] => Event::Refused { me },
            _ => return None,
        })
    }

    /// Prints the event for the coordinator (stdout is flushed at each newline).
    fn report(self) {
        println!("{self}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(worker: u32, token: u64) -> Holder {
        Holder { worker, token }
    }

    #[test]
    fn events_read_back_as_printed() {
        let events = [
            Event::Holds(holder(2, 17)),
            Event::FoundInside {
                me: holder(2, 17),
                other: holder(3, 16),
            },
            Event::Wrote {
                me: holder(2, 17),
                value: 18,
            },
            Event::Refused { me: holder(2, 17) },
        ];
        for event in events {
            let line = event.to_string();
            let parsed = Event::parse(&line).expect("a printed event parses");
            assert_eq!(parsed.to_string(), line);
        }
        assert!(Event::parse("worker 2 token 17 did something else").is_none());
        assert!(Event::parse("a log line").is_none());
    }

    #[test]
    fn the_state_reads_back_as_written() {
        let state = State {
            row: Row {
                value: 41,
                token: 9,
            },
            stale_refused: 2,
            inside: Some(holder(1, 9)),
            last_write: None,
        };
        let read: State = state.to_string().parse().expect("a written state parses");
        assert_eq!(read.row, state.row);
        assert_eq!(read.stale_refused, 2);
        assert_eq!(read.inside, Some(holder(1, 9)));
        assert_eq!(read.last_write, None);
    }

    #[test]
    fn an_update_that_leaves_the_row_is_counted_as_refused() {
        let dir = std::env::temp_dir().join(format!("dlock-counter-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("counter.txt");
        Counter::create(&path).unwrap();
        let counter = Counter::open(path, 1);

        assert_eq!(counter.read().unwrap(), 0);
        assert_eq!(counter.state().unwrap().inside, Some(holder(1, 0)));
        counter
            .update(|row| *row = Row { value: 1, token: 5 })
            .unwrap();
        assert!(!counter.last_write_refused());
        let state = counter.state().unwrap();
        assert_eq!(state.row, Row { value: 1, token: 5 });
        assert_eq!(state.inside, None, "the update clears the caller's mark");
        assert_eq!(state.last_write, Some(holder(1, 0)));

        counter.update(|_| ()).unwrap();
        assert!(counter.last_write_refused());
        let state = counter.state().unwrap();
        assert_eq!(state.row, Row { value: 1, token: 5 });
        assert_eq!(state.stale_refused, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
