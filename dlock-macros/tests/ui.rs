//! Compile-time behaviour of `#[distributed_lock]` (trybuild UI tests).
//!
//! `ui/fail/*.rs` must not compile, and the error (message and span) must match the
//! checked-in `.stderr` file; regenerate with
//! `TRYBUILD=overwrite cargo test -p dlock-macros --test ui` and review the diff.
//! `ui/pass/*.rs` must compile and run: each calls its locked functions before
//! `dlock_runtime::init` and checks the `NotInitialized` mapping of its return type.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("ui/fail/*.rs");
    t.pass("ui/pass/*.rs");
}
