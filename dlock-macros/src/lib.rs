//! The `#[distributed_lock]` attribute of **dlock**.
//!
//! Use it through the runtime crate, which re-exports it and provides everything the
//! generated code calls: depend on `dlock-runtime` and write
//! `use dlock_runtime::distributed_lock;`. This crate only parses and validates the
//! attribute at compile time and rewrites the function; it has no runtime code.
//!
//! # What it does
//!
//! `#[distributed_lock(key = "...")]` on an `async fn` makes "only one instance of
//! this function runs at a time for this key, across every process and machine" a
//! one-line annotation. Before the body runs the function acquires the lock named by
//! the key (formatted from the arguments) on the configured backend; while the body
//! runs a watchdog renews the lease; when the body ends — normal return, `?`, panic,
//! or the caller dropping the future — the lock is released.
//!
//! ```ignore
//! use dlock_runtime::distributed_lock;
//!
//! #[distributed_lock(key = "order:{order.id}", wait = "3s", lease = "10s")]
//! async fn pay(order: &Order) -> Result<Receipt, AppError> {
//!     // runs while holding the lock "order:42" (for order.id == 42)
//! }
//! ```
//!
//! It works on free functions, inherent and trait-impl methods (`self`, `&self`,
//! `&mut self`), generic functions (with `where` clauses), and functions with
//! `impl Trait` arguments and returns. The attributes, visibility and signature of the
//! function are kept exactly as written; only the body is replaced.
//!
//! # Arguments
//!
//! | argument | value | meaning | default |
//! |---|---|---|---|
//! | `key` (required) | string template | the lock's name; `{name}` or `{name.field.field}` interpolates a parameter with `Display` (`{self.id}` in methods, `{pair.0}` for tuple fields); `{{` and `}}` are literal braces | — |
//! | `keys` | list of string templates | instead of `key`: several keys in one hold, all or nothing, taken in one canonical order (sorted, de-duplicated) so that holds naming them in any order never deadlock; each template is checked like `key`; `key` with `keys`, an empty list or a literal duplicate is an error | — |
//! | `wait` | duration string | how long to wait for a busy lock before the busy policy applies; `"0s"` tries once | `"0s"` |
//! | `lease` | duration string, at least `"100ms"` | lease length; the watchdog renews it every `lease / 3` while the body runs | `"30s"` |
//! | `on_busy` | `"fail"` or `"skip"` | `"fail"`: return the busy error; `"skip"`: do not run the body, return the skip value | `"fail"` |
//! | `on_lost` | `"cancel"` or `"continue"` | `"cancel"`: when the lease is lost, stop the body at its next `.await` and return the lost error; `"continue"`: let it finish (logged) | `"cancel"` |
//! | `watchdog` | `true` or `false` | `false`: no renewal, `lease` is a hard cap on how long the lock is held | `true` |
//! | `fencing` | `true` or `false` | `false`: the hold has no fencing token (`fencing_token()` is `None`); on Redis (`redis://`, `redis+cluster://`) the grant is then a plain `SET NX PX`, without the token's script; elsewhere the backend does the same work and the token is dropped | `true` |
//! | `hold_at_least` | duration string | keep the lock at least this long after the body ends (as a lease that expires, never a sleep in the caller) | none |
//! | `max_hold` | duration string, at least the `lease`; not with `watchdog = false` | a ceiling on the whole hold, counted from the grant: then the renewals stop and the loss signal fires (reason `MaxHold`), so the body is cancelled under `on_lost = "cancel"`; the lease then runs out on the server (the attribute's release frees it at once when the body is cancelled). A nested hold keeps the outer hold's ceiling | none |
//! | `permits` | integer literal from 1 to 1024 | a semaphore: at most N holders of the key at once, each on its own slot `0..N` (`current().permit()`), with fencing tokens strictly increasing per (key, slot); `permits = 1` is the plain lock; not with `mode` | `1` |
//! | `mode` | `"read"` or `"write"` | `"read"`: a reader, sharing the key with other readers and never beside a writer; `"write"`: exclusive, exactly the plain lock (a plain lock is the write mode of its key); not with `permits` | `"write"` |
//! | `backend` | non-empty string | name of a registered backend | the default backend |
//! | `crate` | string holding a path | path of the runtime crate, for renamed dependencies | `"::dlock_runtime"` |
//!
//! Durations are humantime-style strings, parsed at compile time: one or more
//! `<integer><unit>` groups, optionally separated by spaces — `"250ms"`, `"3s"`,
//! `"1m 30s"`, `"1h30m"`. Units: `ns`, `us`/`µs`, `ms`, `s`/`sec`/`secs`/`second`/`seconds`,
//! `m`/`min`/`mins`/`minute`/`minutes`, `h`/`hr`/`hrs`/`hour`/`hours`, `d`/`day`/`days`.
//!
//! # Semaphores and read-write locks
//!
//! `permits = N` lets at most N holders of the key run at once, across every
//! process. Each holder takes a free slot `0..N`, which
//! `dlock_runtime::current()` tells the body (`permit()` is `Some(slot)`); the
//! fencing token increases strictly per (key, slot), so a store can fence each
//! slot on its own:
//!
//! ```ignore
//! // At most 3 replicas call the payment provider at once.
//! #[distributed_lock(key = "provider:{provider}", permits = 3, wait = "10s")]
//! async fn charge(provider: &str, amount: u64) -> Result<Receipt, AppError> {
//!     let slot = dlock_runtime::current().and_then(|lock| lock.permit()); // Some(0..3)
//!     // ...
//! }
//! ```
//!
//! Every holder of a key must ask for the same number of permits (a plain lock
//! counts as 1): while the key has holders, another number is
//! `LockError::Config` naming both; once every permit is free, any number is
//! accepted.
//!
//! `mode = "read"` shares the key with other readers; a writer — `mode =
//! "write"`, or a plain lock of the same key, which is the same thing —
//! excludes readers and writers alike. Writers are preferred: once a writer
//! waits, new readers wait behind it. Every grant, read or write, takes its
//! fencing token from the key's one sequence:
//!
//! ```ignore
//! #[distributed_lock(key = "doc:{id}", mode = "read")]
//! async fn render(id: DocId) -> Result<Html, AppError> { /* many at once */ }
//!
//! #[distributed_lock(key = "doc:{id}", mode = "write")]
//! async fn edit(id: DocId, change: Change) -> Result<(), AppError> { /* alone */ }
//! ```
//!
//! In one call chain, a read inside a write or read hold of the same key enters
//! at once; a write inside a read hold is `LockError::Config` at once (it could
//! only wait for itself). Both options work with `keys = [..]` too. A backend
//! that cannot keep a primitive's invariant refuses it with `LockError::Config`
//! saying why (Redlock: `permits` above 1 and `mode = "read"`; MySQL's session
//! mode: `mode = "read"`).
//!
//! # Return types
//!
//! What the function returns when it cannot run its body (the lock is busy, the lease
//! was lost with `on_lost = "cancel"`, the backend failed, or the runtime was not
//! initialised) depends on its return type:
//!
//! | return type | busy (`fail`), lost (`cancel`), backend error | `on_busy = "skip"` |
//! |---|---|---|
//! | `Result<T, E>` with `E: From<dlock_runtime::LockError>` | `Err(LockError::… .into())` | only for `T = ()` → `Ok(())` or `T = Option<U>` → `Ok(None)` |
//! | `Option<T>` | `None` (and a `warn` event) | `None` |
//! | `()` | returns `()` (and a `warn` event) | returns `()` |
//! | anything else | compile error saying which return types work | compile error |
//!
//! This is decided by traits of the runtime, not by reading the return type's
//! tokens, so aliases such as `anyhow::Result<T>`, `std::io::Result<T>` or a crate's
//! own `Result<T>` work. `impl Trait` in the return type is fine as long as the
//! concrete type fits, e.g. `-> Option<impl Display>`.
//!
//! Inside the body, `return` and `?` behave as in the original function: the body
//! becomes an `async move` block whose output is the declared return type.
//!
//! # Reentrancy: a call chain, not a task
//!
//! A function called from inside the body that locks the same key (same
//! registry and backend) enters at once instead of deadlocking against its
//! caller, and so do the functions it calls in turn. Sibling futures polled
//! inside the body — `tokio::join!(debit(), debit())`, `select!`,
//! `FuturesUnordered` — are not one call chain: they take turns, each within
//! its own `wait`, so their bodies never run at once. A nested call shares the
//! outer lease (its watchdog, fencing token and `hold_at_least`); its own
//! `lease`, `watchdog` and `hold_at_least` do not apply (a `debug` event says so
//! when they differ), nor does its `fencing`, and it reports `LockError::Lost`
//! if the shared lease was lost. A task spawned inside the body does not inherit the hold.
//!
//! # Compile-time errors
//!
//! An unknown or duplicate argument, a missing `key`, a bad duration, a `lease` below
//! 100 ms (zero included), an unknown policy, a malformed key template, a
//! `{placeholder}` that names no parameter, an empty `backend`, a `crate` string that
//! is not a path, a non-`async` or `const` function, and a return type the busy
//! policy cannot express are all compile errors pointing at the offending token, and so
//! are `permits` that is not an integer literal from 1 to 1024, a `mode` other than
//! `"read"` or `"write"`, and `permits` together with `mode`. All errors of one attribute are
//! reported together, and the function is still emitted unchanged next to them so
//! that the rest of the crate (and your IDE) keeps working.
//!
//! The minimum `lease` of 100 ms is `dlock_runtime::MIN_LEASE`: the watchdog renews
//! every `lease / 3`, and a shorter period would be shorter than its batch window. It
//! applies with `watchdog = false` too. (The programmatic builder reports a smaller
//! value as `LockError::Config` at run time.)
//!
//! # Equivalent code without the attribute
//!
//! The `pay` function above behaves like this hand-written version, using the
//! runtime's programmatic API:
//!
//! ```ignore
//! use std::time::Duration;
//!
//! async fn pay(order: &Order) -> Result<Receipt, AppError> {
//!     let key = format!("order:{}", order.id);
//!     let guard = dlock_runtime::lock(key)
//!         .wait(Duration::from_secs(3))
//!         .lease(Duration::from_secs(10))
//!         .acquire()
//!         .await?; // Err(LockError::Busy) after 3 s, converted into AppError
//!
//!     let result = async {
//!         // ... the original body ...
//!     }
//!     .await;
//!
//!     guard.release().await?;
//!     result
//! }
//! ```
//!
//! The attribute does more than this sketch: it also stops the body when the lease is
//! lost (`on_lost = "cancel"`, racing the body against `guard.lost()`, and then
//! returning at once while the release goes out in the background), releases the
//! lock from the guard's `Drop` on panic or cancellation, implements `on_busy =
//! "skip"` and `hold_at_least`, and maps errors to `Option` and `()` returns. It runs
//! the body in the lock's scope (so `dlock_runtime::current()` and reentrant calls
//! see the lock) and inside the acquisition's `dlock.lock` tracing span.
//!
//! The generated code calls only hidden items of the runtime
//! (`dlock_runtime::__private::…`), which are not a stable API:
//!
//! ```text
//! pub async fn pay(order: &Order) -> Result<Receipt, AppError> {
//!     const __DLOCK_SPEC: ::dlock_runtime::__private::Spec = ::dlock_runtime::__private::Spec {
//!         function: ::core::concat!(::core::module_path!(), "::", "pay"),
//!         wait: ::dlock_runtime::__private::Duration::new(3, 0),
//!         lease: ::dlock_runtime::__private::Duration::new(10, 0),
//!         on_busy: ::dlock_runtime::__private::BusyPolicy::Fail,
//!         on_lost: ::dlock_runtime::__private::LostPolicy::Cancel,
//!         watchdog: true,
//!         fencing: true,
//!         hold_at_least: ::core::option::Option::None,
//!         max_hold: ::core::option::Option::None,
//!         key_template: "order:{order.id}",
//!         backend: ::core::option::Option::None,
//!         mode: ::dlock_runtime::__private::HoldMode::Exclusive, // `permits` / `mode`
//!     };
//!     let __dlock_key: ::dlock_runtime::__private::String =
//!         ::dlock_runtime::__private::format!("order:{}", &order.id);
//!     ::dlock_runtime::__private::run_fail::<Result<Receipt, AppError>, _>(
//!         &__DLOCK_SPEC, __dlock_key, async move { /* the original body */ },
//!     ).await
//! }
//! ```
//!
//! # With `#[tracing::instrument]` (and other attributes that wrap the body)
//!
//! Attribute macros expand top-down: the upper attribute sees the function as
//! written, and the lower one sees the function the upper one produced. Both
//! `#[tracing::instrument]` and `#[distributed_lock]` keep the signature and wrap the
//! body, so the **lower** attribute's code ends up outermost:
//!
//! ```ignore
//! // The user's span wraps everything: the acquisition (and its `dlock.lock` span,
//! // a child of `pay`), the wait for a busy lock, the body and the release. With
//! // `err`/`ret`, the span also records lock errors such as `Busy`.
//! #[distributed_lock(key = "order:{order.id}", wait = "3s")]
//! #[tracing::instrument(skip(order))]
//! async fn pay(order: &Order) -> Result<Receipt, AppError> { /* ... */ }
//!
//! // The user's span is opened inside the locked body, as a child of `dlock.lock`;
//! // the acquisition happens outside it, and a busy lock never opens the span.
//! #[tracing::instrument(skip(order))]
//! #[distributed_lock(key = "order:{order.id}", wait = "3s")]
//! async fn pay(order: &Order) -> Result<Receipt, AppError> { /* ... */ }
//! ```
//!
//! In terms of the hand-written version above: with `#[tracing::instrument]` below
//! `#[distributed_lock]`, the whole of that function body is instrumented; above
//! it, only the inner `async { /* the original body */ }` is.
//!
//! # `Send`
//!
//! The generated future is `Send` whenever the function's own future would be, with
//! one addition: the return value must be `Send` too, because it is kept while the
//! lock is released before the function returns. Only the key (a `String`) is
//! computed before the first `.await`; the parameters move into the body unchanged,
//! so a `!Send` value that the body drops before its next `.await` is fine, as it is
//! without the attribute.
//!
//! # Limitations
//!
//! - The key is formatted with `Display` only (no format specs such as `{id:?}`).
//! - Under `#[async_trait]` the attribute sees the already-desugared, non-`async`
//!   method and rejects it; use native `async fn` in traits instead.

mod duration;
mod expand;
mod parse;
mod template;
mod validate;

use proc_macro::TokenStream;

/// Runs an `async fn` under a distributed lock.
///
/// ```ignore
/// use dlock_runtime::distributed_lock;
///
/// #[distributed_lock(key = "order:{order.id}", wait = "3s", lease = "10s")]
/// async fn pay(order: &Order) -> Result<Receipt, AppError> {
///     // ...
/// }
///
/// #[distributed_lock(key = "report:nightly", on_busy = "skip", hold_at_least = "5m")]
/// async fn nightly_report() {
///     // runs on at most one machine; the others skip it
/// }
///
/// #[distributed_lock(key = "provider:{provider}", permits = 3, wait = "10s")]
/// async fn charge(provider: &str) -> Result<Receipt, AppError> {
///     // at most 3 of these run at once; `current().permit()` is the slot
/// }
///
/// #[distributed_lock(key = "doc:{id}", mode = "read")]
/// async fn render(id: u64) -> Result<Html, AppError> {
///     // with other readers, never beside a writer (`mode = "write"` or a plain lock)
/// }
/// ```
///
/// Arguments: `key` (required template) or `keys`, `wait`, `lease`, `on_busy`
/// (`"fail"` | `"skip"`), `on_lost` (`"cancel"` | `"continue"`), `watchdog`,
/// `fencing`, `hold_at_least`, `max_hold`, `permits` (1 to 1024), `mode`
/// (`"read"` | `"write"`), `backend` and `crate`. See the [crate
/// documentation](crate) for what each does, the supported return types, and the
/// code this expands to.
#[proc_macro_attribute]
pub fn distributed_lock(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::expand(attr.into(), item.into()).into()
}
