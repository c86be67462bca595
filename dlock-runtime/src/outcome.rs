//! How a `#[distributed_lock]` function reports that it could not run its body.
//!
//! The attribute decides by trait, not by reading the return type's tokens, so
//! aliases (`anyhow::Result<T>`, `std::io::Result<T>`, a crate's own `Result<T>`)
//! work like `Result<T, E>`.

use crate::error::LockError;

/// A return type that can carry a [`LockError`]: busy with `on_busy = "fail"`,
/// lost with `on_lost = "cancel"`, backend errors, not initialized.
///
/// Implemented for `Result<T, E>` with `E: From<LockError>` (the error is
/// returned), `Option<T>` (`None`, with a `warn` event) and `()` (with a `warn` event).
#[diagnostic::on_unimplemented(
    message = "`#[distributed_lock]` cannot report a lock failure through the return type `{Self}`",
    label = "this return type cannot carry a `dlock_runtime::LockError`",
    note = "use `Result<T, E>` where `E: From<dlock_runtime::LockError>` (`anyhow::Result<T>` and `std::io::Result<T>` work), `Option<T>`, or `()`"
)]
pub trait LockOutcome: Sized {
    /// The value returned instead of running (or finishing) the body.
    fn from_lock_error(error: LockError) -> Self;
}

impl<T, E: From<LockError>> LockOutcome for Result<T, E> {
    fn from_lock_error(error: LockError) -> Self {
        Err(E::from(error))
    }
}

impl<T> LockOutcome for Option<T> {
    fn from_lock_error(error: LockError) -> Self {
        tracing::warn!(error = %error, "dlock: the locked function did not run to completion");
        None
    }
}

impl LockOutcome for () {
    fn from_lock_error(error: LockError) -> Self {
        tracing::warn!(error = %error, "dlock: the locked function did not run to completion");
    }
}

/// A return type with a value meaning "skipped because the lock was busy",
/// required by `on_busy = "skip"`.
///
/// Implemented for `Result<(), E>` (`Ok(())`), `Result<Option<U>, E>` (`Ok(None)`),
/// `Option<T>` (`None`) and `()`.
#[diagnostic::on_unimplemented(
    message = "`on_busy = \"skip\"` needs a return type with a \"skipped\" value, not `{Self}`",
    label = "cannot express \"skipped\"",
    note = "use `Result<(), E>` (Ok(())), `Result<Option<T>, E>` (Ok(None)), `Option<T>` (None) or `()`, with `E: From<dlock_runtime::LockError>`; or use `on_busy = \"fail\"`"
)]
pub trait SkipOutcome: LockOutcome {
    /// The value returned when the body was skipped.
    fn skipped() -> Self;
}

/// The `T` of a `Result<T, E>` that can express "skipped".
#[diagnostic::on_unimplemented(
    message = "`on_busy = \"skip\"` needs `Ok(())` or `Ok(None)` to mean \"skipped\", but the success type is `{Self}`",
    label = "cannot express \"skipped\"",
    note = "return `Result<(), E>` or `Result<Option<T>, E>`, or use `on_busy = \"fail\"`"
)]
pub trait SkipValue {
    /// The success value meaning "skipped".
    fn skipped() -> Self;
}

impl SkipValue for () {
    fn skipped() -> Self {}
}

impl<U> SkipValue for Option<U> {
    fn skipped() -> Self {
        None
    }
}

impl<T: SkipValue, E: From<LockError>> SkipOutcome for Result<T, E> {
    fn skipped() -> Self {
        Ok(T::skipped())
    }
}

impl<T> SkipOutcome for Option<T> {
    fn skipped() -> Self {
        None
    }
}

impl SkipOutcome for () {
    fn skipped() -> Self {}
}
