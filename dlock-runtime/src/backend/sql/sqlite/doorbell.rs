//! Doorbells: how a release on `sqlite://` reaches waiters in other processes
//! without a server.
//!
//! Next to the database file `locks.db` sits a directory `locks.db.dlock-bells/`
//! with at most 256 bell files, `00` … `ff`. A key's bell is
//! chosen by a hash of the stored key that every process and every version
//! computes alike (32-bit FNV-1a folded to 8 bits — not `DefaultHasher`, whose
//! output may change between Rust releases and is seeded per process).
//!
//! - **Ringing.** After a release has committed, the releasing process writes
//!   one byte into the key's bell file (open, write at offset 0, close: the
//!   file stays one byte long). A ring never fails a release: an error is
//!   logged at `debug` and ignored. A missing directory means no process has
//!   ever waited on this database, so there is nobody to ring for: the ring
//!   is skipped and no directory is created by a process that never waits.
//! - **Listening.** The first waiter of a backend creates the directory and one
//!   watcher (the `notify` crate: inotify on Linux, FSEvents on macOS, kqueue
//!   on the BSDs, `ReadDirectoryChangesW` on Windows) on it, non-recursively;
//!   it lives as long as the backend. A content change of bell `b` wakes the
//!   backend's waiters whose key falls in bucket `b` (a per-bucket
//!   `Notify`, registered only while someone waits: the map holds at most
//!   one entry per bucket with waiters). A queue overflow wakes every bucket.
//! - **Falling back.** If the watcher cannot be set up (no inotify, the watch
//!   limit reached, a read-only directory, a file where the directory should
//!   be), the backend says so once at `warn`, its waiters keep polling every
//!   `poll`, as they always do, and the next waiter a second later tries
//!   again: the poll stays as the fallback for a
//!   ring that never arrives (a release by an older dlock, a ring that failed,
//!   a filesystem that does not report other machines' writes, the directory
//!   removed — then the next attempt of any waiter sets up a new watcher).
//! - **Never blocking a release.** Bells are written by one thread of the
//!   process (`dlock-sqlite-bells`), not on an async worker: a hung
//!   filesystem stalls only the rings (at most one pending per bell), never
//!   the locks. A bell that is not a regular file is not rung.
//! - **One database, one set of bells.** The directory is named after the
//!   database file's canonical path, so a relative path or a symbolic link
//!   reaches the same bells.
//!
//! Every mistake here costs time, never safety: the lease table decides who
//! holds a key. A bell shared by two keys, a stale bell, or the releasing
//! process hearing its own ring (its waiters were already woken directly)
//! costs one extra attempt, an indexed read. The directory is bounded (256
//! files of one byte) however many keys are used.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use notify::event::{EventKind, ModifyKind};
use notify::{Event, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::Notify;

use crate::backend::WakeSource;

/// The bucket (and bell file) of a stored key: 32-bit FNV-1a of its bytes,
/// xor-folded to 8 bits. Part of the protocol between processes: stable
/// across processes, platforms and versions (a change would leave waiters of
/// older processes to their poll).
pub(super) fn bucket(key: &str) -> u8 {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in key.as_bytes() {
        hash ^= u32::from(*byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    let folded = hash ^ (hash >> 16);
    (folded ^ (folded >> 8)) as u8
}

/// The bell file's name of a bucket: two lowercase hex digits.
fn bell_name(bucket: u8) -> String {
    format!("{bucket:02x}")
}

/// The bucket a bell file's name stands for, if it is one.
fn parse_bell(path: &Path) -> Option<u8> {
    let name = path.file_name()?.to_str()?;
    if name.len() != 2 {
        return None;
    }
    u8::from_str_radix(name, 16).ok()
}

/// The doorbells of one database, for one backend (and its clones).
pub(super) struct Doorbells {
    dir: PathBuf,
    buckets: Arc<Buckets>,
    watch: Mutex<Watch>,
    /// The failure to watch was reported (once per backend).
    warned: AtomicBool,
}

enum Watch {
    /// No waiter has waited yet: no watcher, no thread.
    NotYet,
    /// Dropping the watcher ends the watch and its thread.
    Watching { _watcher: RecommendedWatcher },
    /// The watcher could not be set up: waiters poll. Tried again from
    /// `retry_at` (the obstacle may be brief: the inotify limit reached for a
    /// moment, a stray file where the directory goes).
    Unavailable { retry_at: Instant },
}

/// How long a backend whose watcher could not be set up polls before it
/// tries again.
const RETRY_WATCH_AFTER: Duration = Duration::from_secs(1);

/// Waiters per bucket, shared with the watcher's thread.
#[derive(Default)]
struct Buckets {
    map: Mutex<HashMap<u8, (Arc<Notify>, usize)>>,
    /// The watched directory went away: set up a new watcher when next asked.
    lost: AtomicBool,
}

impl Buckets {
    fn map(&self) -> MutexGuard<'_, HashMap<u8, (Arc<Notify>, usize)>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ring(&self, bucket: u8) {
        if let Some((notify, _)) = self.map().get(&bucket) {
            notify.notify_waiters();
        }
    }

    fn ring_all(&self) {
        for (notify, _) in self.map().values() {
            notify.notify_waiters();
        }
    }

    /// What the watcher's thread does with one event.
    fn heard(&self, dir: &Path, event: notify::Result<Event>) {
        let event = match event {
            Ok(event) => event,
            Err(err) => {
                // Something may have been missed: everyone looks again.
                tracing::debug!(error = %err, "dlock sqlite: doorbell watcher error");
                self.ring_all();
                return;
            }
        };
        if event.need_rescan() {
            // The kernel's queue overflowed: rings were dropped.
            self.ring_all();
            return;
        }
        match event.kind {
            // A ring is a write: inotify's IN_MODIFY, kqueue's NOTE_WRITE,
            // FSEvents' ItemModified, Windows' FILE_ACTION_MODIFIED. The open,
            // close and creation events around it are ignored, so one ring is
            // one wake-up.
            EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Any | ModifyKind::Other)
            | EventKind::Any => {
                for bucket in event.paths.iter().filter_map(|p| parse_bell(p)) {
                    self.ring(bucket);
                }
            }
            EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_))
                if event.paths.iter().any(|p| p == dir) =>
            {
                // The directory itself was removed or renamed: this watch
                // hears nothing more.
                self.lost.store(true, Ordering::Relaxed);
                self.ring_all();
            }
            _ => {}
        }
    }
}

/// Keeps a waiter's bucket registered; dropped with its wake-up source.
struct Registration {
    buckets: Arc<Buckets>,
    bucket: u8,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut map = self.buckets.map();
        if let Some(entry) = map.get_mut(&self.bucket) {
            entry.1 -= 1;
            if entry.1 == 0 {
                map.remove(&self.bucket);
            }
        }
    }
}

impl Doorbells {
    /// The doorbells of the database at `db`: `<db>.dlock-bells/`. Touches
    /// nothing until a waiter waits or a release rings.
    pub(super) fn new(db: &Path) -> Self {
        // The database file itself, however it was named (a relative path, a
        // symbolic link): every process then rings and watches the same
        // bells, and the watcher's event paths (absolute) compare equal to
        // `dir`. The file exists by now (the pool has connected). A hard link
        // to the database would still get bells of its own: its waiters poll.
        let db = std::fs::canonicalize(db)
            .or_else(|_| std::path::absolute(db))
            .unwrap_or_else(|_| db.to_owned());
        let mut dir = OsString::from(db.as_os_str());
        dir.push(".dlock-bells");
        Doorbells {
            dir: PathBuf::from(dir),
            buckets: Arc::default(),
            watch: Mutex::new(Watch::NotYet),
            warned: AtomicBool::new(false),
        }
    }

    /// Rings `key`'s bell: tells waiters in other processes that it was
    /// released. Called after the release committed; never fails, never
    /// blocks: the file is written by the process's ringer thread.
    pub(super) fn ring(&self, key: &str) {
        ringer::ring(self.dir.join(bell_name(bucket(key))));
    }

    /// Writes one bell (on the ringer thread). Anything but a regular file
    /// (a FIFO would block the open) is left alone.
    fn ring_path(path: &Path) {
        if std::fs::symlink_metadata(path).is_ok_and(|m| !m.is_file()) {
            tracing::debug!(bell = %path.display(), "dlock sqlite: a doorbell is not a regular file; not rung");
            return;
        }
        let rung = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .and_then(|mut file| file.write_all(&[1]));
        match rung {
            Ok(()) => {}
            // No directory: no process ever waited on this database.
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => {
                tracing::debug!(
                    bell = %path.display(),
                    error = %err,
                    "dlock sqlite: ringing a doorbell failed; waiters elsewhere will poll"
                );
            }
        }
    }

    /// A wake-up source for a waiter of `key`, rung by other processes'
    /// releases; `None` if this backend cannot hear them (waiters poll).
    /// Sets up the watcher on the first call.
    pub(super) fn source(&self, key: &str) -> Option<WakeSource> {
        if !self.listen() {
            return None;
        }
        let bucket = bucket(key);
        let notify = {
            let mut map = self.buckets.map();
            let entry = map
                .entry(bucket)
                .or_insert_with(|| (Arc::new(Notify::new()), 0));
            entry.1 += 1;
            entry.0.clone()
        };
        Some(WakeSource::notify(notify).keep_alive(Registration {
            buckets: self.buckets.clone(),
            bucket,
        }))
    }

    /// Whether a watcher is listening, setting one up if none was tried yet
    /// (or the last one lost its directory). Returns once the watch is in
    /// place, so a ring after this call is heard.
    fn listen(&self) -> bool {
        let mut watch = self.watch.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*watch, Watch::Watching { .. })
            && self.buckets.lost.swap(false, Ordering::Relaxed)
        {
            tracing::debug!(dir = %self.dir.display(), "dlock sqlite: doorbells removed; watching anew");
            *watch = Watch::NotYet;
        }
        if matches!(*watch, Watch::Unavailable { retry_at } if Instant::now() >= retry_at) {
            *watch = Watch::NotYet;
        }
        if matches!(*watch, Watch::NotYet) {
            *watch = match self.watch() {
                Ok(watcher) => Watch::Watching { _watcher: watcher },
                Err(err) => {
                    if !self.warned.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            dir = %self.dir.display(),
                            error = %err,
                            "dlock sqlite: cannot watch the doorbells; waiters in this process \
                             hear other processes' releases by polling (tried again every {:?})",
                            RETRY_WATCH_AFTER
                        );
                    }
                    Watch::Unavailable {
                        retry_at: Instant::now() + RETRY_WATCH_AFTER,
                    }
                }
            };
        }
        matches!(*watch, Watch::Watching { .. })
    }

    /// Sets up a new watcher if the last one lost its directory: called by
    /// every busy attempt, so waiters already waiting move to the new
    /// directory (the removal woke them all).
    pub(super) fn relisten_if_lost(&self) {
        if self.buckets.lost.load(Ordering::Relaxed) {
            let _ = self.listen();
        }
    }

    fn watch(&self) -> Result<RecommendedWatcher, String> {
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("cannot create it: {e}"))?;
        let buckets = self.buckets.clone();
        let dir = self.dir.clone();
        let mut watcher = notify::recommended_watcher(move |event| buckets.heard(&dir, event))
            .map_err(|e| e.to_string())?;
        watcher
            .watch(&self.dir, RecursiveMode::NonRecursive)
            .map_err(|e| e.to_string())?;
        Ok(watcher)
    }

    /// Whether a watcher listens for other processes' rings.
    pub(super) fn watching(&self) -> bool {
        matches!(
            *self.watch.lock().unwrap_or_else(|p| p.into_inner()),
            Watch::Watching { .. }
        )
    }

    /// Buckets with waiters right now.
    pub(super) fn waited_buckets(&self) -> usize {
        self.buckets.map().len()
    }
}

/// The process's ringer: one thread that writes the bells, so a release
/// never does blocking file I/O on an async worker (a hung filesystem would
/// stall every lock of the process). Rings wait in a set, so a ringer stuck
/// on one file holds at most one pending ring per bell.
mod ringer {
    use std::collections::BTreeSet;
    use std::path::PathBuf;
    use std::sync::{Condvar, LazyLock, Mutex};

    struct Pending {
        bells: Mutex<BTreeSet<PathBuf>>,
        rung: Condvar,
    }

    static PENDING: LazyLock<&'static Pending> = LazyLock::new(|| {
        let pending: &'static Pending = Box::leak(Box::new(Pending {
            bells: Mutex::new(BTreeSet::new()),
            rung: Condvar::new(),
        }));
        let started = std::thread::Builder::new()
            .name("dlock-sqlite-bells".into())
            .spawn(move || {
                loop {
                    let next = {
                        let mut bells = pending.bells.lock().unwrap_or_else(|p| p.into_inner());
                        loop {
                            if let Some(bell) = bells.pop_first() {
                                break bell;
                            }
                            bells = pending.rung.wait(bells).unwrap_or_else(|p| p.into_inner());
                        }
                    };
                    super::Doorbells::ring_path(&next);
                }
            });
        if let Err(err) = started {
            tracing::warn!(error = %err, "dlock sqlite: no doorbell thread; waiters elsewhere will poll");
        }
        pending
    });

    pub(super) fn ring(bell: PathBuf) {
        let pending = *PENDING;
        pending
            .bells
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(bell);
        pending.rung.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_hash_is_fixed() {
        // FNV-1a 32 of "" is 0x811c9dc5, of "a" 0xe40c292c, of
        // "dlock:order:1" 0x18de2df3; the xor of their four bytes by hand.
        assert_eq!(bucket(""), 0xc5);
        assert_eq!(bucket("a"), 0xed);
        assert_eq!(bucket("dlock:order:1"), 0x18);
        assert_eq!(parse_bell(Path::new("/x/y.db.dlock-bells/0a")), Some(10));
        assert_eq!(parse_bell(Path::new("/x/y.db.dlock-bells/zz")), None);
        assert_eq!(bell_name(10), "0a");
    }

    #[test]
    fn keys_spread_over_the_buckets() {
        let used: std::collections::HashSet<u8> = (0..2000)
            .map(|i| bucket(&format!("dlock:order:{i}")))
            .collect();
        assert!(used.len() > 240, "{}", used.len());
    }
}
