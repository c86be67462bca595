//! A worker process: loops over the annotated functions below until its standard
//! input closes, printing one [`WorkerEvent`] per step on standard output.
//!
//! Even-numbered workers use `on_lost = "cancel"` (the body stops when the lease
//! is lost: the lost-signal path); odd-numbered ones use `on_lost = "continue"`,
//! so a holder that was paused past its lease really sends its stale write and the
//! store's fencing has to refuse it.

use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dlock_runtime::{LockError, Registry, distributed_lock};
use rand::{Rng as _, SeedableRng as _, rngs::StdRng};
use tokio::io::AsyncBufReadExt as _;
use tokio::sync::Mutex;

use crate::clock::now_ns;
use crate::history::{Step, WorkerEvent};
use crate::store::{ReadReply, StoreClient};

/// The lease of both annotated functions (their `lease = "1s"`); the nemesis
/// scales its pauses by it.
pub(crate) const LEASE: Duration = Duration::from_secs(1);

/// What a worker is started with.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct WorkerArgs {
    /// Worker slot.
    #[arg(long)]
    pub(crate) id: usize,
    /// Incarnation of the slot (restarts count up).
    #[arg(long, default_value_t = 0)]
    pub(crate) inc: u32,
    /// Lock backend URL.
    #[arg(long)]
    pub(crate) url: String,
    /// Loopback port of the fenced store.
    #[arg(long)]
    pub(crate) store_port: u16,
    /// Run id, part of every lock key.
    #[arg(long)]
    pub(crate) run: String,
    /// How many keys the workers share.
    #[arg(long, default_value_t = 3)]
    pub(crate) keys: usize,
    /// Longest time spent inside the lock between read and write.
    #[arg(long, default_value_t = 20)]
    pub(crate) hold_max_ms: u64,
    /// Seed of this worker's choices.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
}

/// Whether worker `id` runs with `on_lost = "cancel"` (even ids) or `"continue"`.
pub(crate) fn cancels_on_loss(id: usize) -> bool {
    id.is_multiple_of(2)
}

/// Why a step did not finish.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("store: {0}")]
    Store(anyhow::Error),
}

struct Worker {
    args: WorkerArgs,
    /// `None` after a call was cut short (its reply would be read by the next one).
    store: Mutex<Option<StoreClient>>,
    hold: Mutex<StdRng>,
    /// Set by a `long` line on stdin: the next stay inside lasts [`LONG_HOLD`].
    long_next: Arc<AtomicBool>,
}

/// A stay inside the lock the nemesis asks for, to strike while the body runs.
pub(crate) const LONG_HOLD: Duration = Duration::from_millis(2500);

impl Worker {
    fn emit(&self, key: &str, ev: Step) {
        let event = WorkerEvent {
            t: now_ns(),
            w: self.args.id,
            inc: self.args.inc,
            key: key.to_owned(),
            ev,
        };
        let mut line = serde_json::to_vec(&event).expect("events serialize");
        line.push(b'\n');
        // One write per line: a reader never sees half of one unless we are killed.
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(&line).and_then(|()| out.flush());
    }

    /// The body both annotated functions run: fenced read, a short stay, fenced write.
    async fn read_modify_write(&self, key: &str) -> Result<(), StepError> {
        let held = dlock_runtime::current().expect("called inside the lock");
        let token = held.fencing_token().map(u64::from);
        self.emit(key, Step::Acquired { token });

        let mut slot = self.store.lock().await;
        let mut store = match slot.take() {
            Some(store) => store,
            None => StoreClient::connect(self.args.store_port)
                .await
                .map_err(StepError::Store)?,
        };
        let w = self.args.id;
        let (value, version) = match store.read(w, key, token).await.map_err(StepError::Store)? {
            ReadReply::Ok { value, version } => (value, version),
            ReadReply::Stale => {
                *slot = Some(store);
                self.emit(key, Step::Fenced);
                return Ok(());
            }
        };
        let hold = if self.long_next.swap(false, Ordering::SeqCst) {
            LONG_HOLD
        } else {
            Duration::from_millis(
                self.hold
                    .lock()
                    .await
                    .random_range(0..=self.args.hold_max_ms),
            )
        };
        self.emit(
            key,
            Step::Read {
                value,
                version,
                hold_ms: hold.as_millis() as u64,
            },
        );
        let mut noticed = false;
        let stay = tokio::time::sleep(hold);
        tokio::pin!(stay);
        if !cancels_on_loss(self.args.id) {
            // `on_lost = "continue"`: record the signal when it comes, stay anyway.
            tokio::select! {
                () = &mut stay => {}
                () = held.lost() => {
                    self.emit(key, Step::Lost { cancelled: false });
                    noticed = true;
                    stay.await;
                }
            }
        } else {
            stay.await;
        }
        let accepted = store
            .write(w, key, token, version, value + 1)
            .await
            .map_err(StepError::Store)?;
        *slot = Some(store);
        self.emit(key, Step::Wrote { accepted });
        if !accepted {
            self.emit(key, Step::Fenced);
        }
        if held.is_lost() && !noticed {
            // Only reached with `on_lost = "continue"`.
            self.emit(key, Step::Lost { cancelled: false });
        }
        self.emit(key, Step::Leaving);
        Ok(())
    }
}

#[distributed_lock(
    key = "chaos:{run}:{key}",
    wait = "2s",
    lease = "1s",
    on_lost = "cancel"
)]
async fn step_cancel(run: &str, key: &str, worker: &Worker) -> Result<(), StepError> {
    worker.read_modify_write(key).await
}

#[distributed_lock(
    key = "chaos:{run}:{key}",
    wait = "2s",
    lease = "1s",
    on_lost = "continue"
)]
async fn step_continue(run: &str, key: &str, worker: &Worker) -> Result<(), StepError> {
    worker.read_modify_write(key).await
}

/// Runs a worker until standard input closes.
pub(crate) async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    // A restarted worker may come up while the server is down: keep trying.
    let registry = loop {
        match Registry::from_url(&args.url).await {
            Ok(registry) => break registry,
            Err(e) => {
                eprintln!("worker {}: connect: {e}", args.id);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    dlock_runtime::init(registry)?;

    let long_next = Arc::new(AtomicBool::new(false));
    let stop = read_stdin(long_next.clone());
    let mut rng = StdRng::seed_from_u64(args.seed ^ ((args.id as u64) << 32) ^ u64::from(args.inc));
    let worker = Worker {
        store: Mutex::new(None),
        hold: Mutex::new(StdRng::seed_from_u64(rng.random())),
        long_next,
        args,
    };
    let keys: Vec<String> = (0..worker.args.keys).map(|k| format!("k{k}")).collect();
    let cancel_on_lost = cancels_on_loss(worker.args.id);
    while !*stop.borrow() {
        let key = &keys[rng.random_range(0..keys.len())];
        worker.emit(key, Step::Attempt);
        let result = if cancel_on_lost {
            step_cancel(&worker.args.run, key, &worker).await
        } else {
            step_continue(&worker.args.run, key, &worker).await
        };
        match result {
            Ok(()) => worker.emit(key, Step::Released),
            Err(StepError::Lock(LockError::Busy { .. })) => worker.emit(key, Step::Busy),
            // A store call cut short by the cancellation took its connection with it
            // (the slot stays empty), so no reply is ever read by the wrong call.
            Err(StepError::Lock(LockError::Lost { .. })) => {
                worker.emit(key, Step::Lost { cancelled: true })
            }
            Err(e) => {
                worker.emit(
                    key,
                    Step::Error {
                        message: e.to_string(),
                    },
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    Ok(())
}

/// Reads the orchestrator's lines: `long` asks for a long stay next time; the end
/// of input means stop (the returned flag becomes `true`).
fn read_stdin(long_next: Arc<AtomicBool>) -> tokio::sync::watch::Receiver<bool> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if line.trim() == "long" {
                long_next.store(true, Ordering::SeqCst);
            }
        }
        let _ = tx.send(true);
    });
    rx
}
