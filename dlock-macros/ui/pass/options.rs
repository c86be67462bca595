// `crate`, `backend`, `hold_at_least`, `max_hold`, `watchdog`, `fencing` and `on_lost` arguments.
use dlock_runtime::{LockError, distributed_lock};

mod renamed {
    pub use dlock_runtime as dl;
}

#[derive(Debug)]
pub struct AppError(LockError);

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError(e)
    }
}

#[distributed_lock(key = "a", crate = "::dlock_runtime")]
pub async fn explicit_crate() -> Result<(), AppError> {
    Ok(())
}

#[distributed_lock(key = "b", crate = "crate::renamed::dl")]
pub async fn renamed_crate() -> Result<(), AppError> {
    Ok(())
}

#[distributed_lock(key = "c", backend = "other")]
pub async fn other_backend() -> Result<(), AppError> {
    Ok(())
}

#[rustfmt::skip] // keeps the trailing comma, which the attribute accepts
#[distributed_lock(
    key = "d",
    wait = "1m 30s",
    lease = "1h30m",
    hold_at_least = "250ms",
    watchdog = false,
    fencing = false,
    on_lost = "continue",
    on_busy = "fail",
)]
pub async fn everything() -> Result<(), AppError> {
    Ok(())
}

#[distributed_lock(key = "e", on_lost = "cancel", watchdog = true, fencing = true, lease = "1d")]
pub async fn defaults_spelled_out() -> Result<(), AppError> {
    Ok(())
}

#[distributed_lock(key = "f:{n}", lease = "10s", max_hold = "10s")]
pub async fn capped(n: u8) -> Result<(), AppError> {
    let _ = n;
    Ok(())
}

#[tokio::main]
async fn main() {
    for r in [
        explicit_crate().await,
        renamed_crate().await,
        other_backend().await,
        everything().await,
        defaults_spelled_out().await,
        capped(1).await,
    ] {
        assert!(
            matches!(r, Err(AppError(LockError::NotInitialized))),
            "{r:?}"
        );
    }
}
