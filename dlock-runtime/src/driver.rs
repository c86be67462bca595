//! dlock's own I/O runtime.
//!
//! Connections of some clients (sqlx pools) belong to the runtime that opened
//! them and break when it shuts down. Tests create one runtime per
//! `#[tokio::test]`, and applications may call locks from several runtimes, so
//! the registry's watchdog, the releases handed over by `Drop`, and the calls of
//! backends that ask for it run on this small runtime, which lives as long as
//! the process.

use std::cell::Cell;
use std::future::Future;
use std::sync::OnceLock;

use tokio::runtime::{Builder, Handle, Runtime};

fn runtime() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("dlock-io")
            .on_thread_start(|| ON_IO_RUNTIME.set(true))
            .enable_all()
            .build()
            .expect("dlock: cannot start its I/O runtime (out of threads?)")
    })
}

thread_local! {
    static ON_IO_RUNTIME: Cell<bool> = const { Cell::new(false) };
}

/// Whether the current thread is one of the I/O runtime's.
pub(crate) fn on_io_runtime() -> bool {
    ON_IO_RUNTIME.get()
}

/// The handle of the I/O runtime.
pub(crate) fn handle() -> &'static Handle {
    runtime().handle()
}

/// Runs `future` on the I/O runtime and waits for its output from any runtime.
/// The work goes on if the caller stops waiting.
pub(crate) async fn run<F>(future: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    match handle().spawn(future).await {
        Ok(output) => output,
        Err(err) => match err.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            // Tasks of this runtime are never aborted and the runtime is never
            // shut down, so a join error is always a panic.
            Err(err) => unreachable!("dlock I/O task ended without output: {err}"),
        },
    }
}
