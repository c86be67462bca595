//! Turns the parsed [`Args`] and the annotated function into a validated [`Model`],
//! collecting every error (not just the first) into one [`syn::Error`].

use std::time::Duration;

use proc_macro2::Span;
use syn::{ItemFn, LitStr, Path};

use crate::duration;
use crate::parse::Args;
use crate::template::{self, Piece};

/// The shortest `lease` accepted (zero included in what is rejected).
///
/// This mirrors `dlock_runtime::MIN_LEASE` (the proc-macro crate cannot depend on the
/// runtime, so the value is repeated here and in the message): the watchdog renews
/// every `lease / 3`, and a shorter lease would make that period shorter than the
/// watchdog's batch window, so renewals could not keep up. A literal below it is a
/// compile error here, as a smaller builder value is a `Config` error at run time.
const MIN_LEASE: Duration = Duration::from_millis(100);

/// The most `permits` accepted: `dlock_runtime::MAX_PERMITS`, repeated here for
/// the same reason as [`MIN_LEASE`].
const MAX_PERMITS: u64 = 1024;

/// Everything the expansion needs, all checked.
pub(crate) struct Model {
    /// The user's function, unchanged.
    pub(crate) func: ItemFn,
    /// The runtime crate path (`crate = "…"`), or `None` for `::dlock_runtime`.
    pub(crate) krate: Option<Path>,
    /// The key templates (one for `key`, one or more for `keys`): each literal
    /// (for spans) and its parsed pieces.
    pub(crate) keys: Vec<KeyTemplate>,
    /// Whether the keys came as `keys = [..]` (one hold of several keys).
    pub(crate) several: bool,
    pub(crate) wait: Spanned<Duration>,
    pub(crate) lease: Spanned<Duration>,
    pub(crate) on_busy: Spanned<BusyPolicy>,
    pub(crate) on_lost: Spanned<LostPolicy>,
    pub(crate) watchdog: Spanned<bool>,
    pub(crate) fencing: Spanned<bool>,
    pub(crate) hold_at_least: Option<Spanned<Duration>>,
    pub(crate) max_hold: Option<Spanned<Duration>>,
    /// `permits` / `mode`: what each hold takes of its key.
    pub(crate) mode: Spanned<Mode>,
    pub(crate) backend: Option<LitStr>,
}

/// One key template: its literal (for spans) and its parsed pieces.
pub(crate) struct KeyTemplate {
    pub(crate) lit: LitStr,
    pub(crate) pieces: Vec<Piece>,
}

/// A value and the span of the token it came from (the call site for defaults).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Spanned<T> {
    pub(crate) value: T,
    pub(crate) span: Span,
}

impl<T> Spanned<T> {
    fn new(value: T, span: Span) -> Self {
        Spanned { value, span }
    }
}

/// `on_busy`
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BusyPolicy {
    Fail,
    Skip,
}

/// `on_lost`
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LostPolicy {
    Cancel,
    Continue,
}

/// `permits` / `mode`: the runtime's `HoldMode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// The plain lock: no `permits` or `mode`, `permits = 1`, `mode = "write"`.
    Exclusive,
    /// `mode = "read"`.
    Shared,
    /// `permits = N` with 2 ≤ N ≤ 1024.
    Permit(u32),
}

/// Accumulates errors with [`syn::Error::combine`].
#[derive(Default)]
struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(errors) => errors.combine(error),
            None => self.0 = Some(error),
        }
    }

    fn at(&mut self, span: Span, message: impl std::fmt::Display) {
        self.push(syn::Error::new(span, message));
    }
}

/// Validates the arguments against the function. Every problem found is reported.
pub(crate) fn validate(args: Args, func: ItemFn) -> syn::Result<Model> {
    let mut errors = Errors::default();
    if let Some(parse_errors) = args.errors {
        errors.push(parse_errors);
    }
    let sig = &func.sig;

    // key, keys
    let mut keys = Vec::new();
    let mut check_template = |errors: &mut Errors, name: &str, lit: &LitStr| {
        let text = lit.value();
        if text.is_empty() {
            let example = if name == "key" {
                "key = \"order:{order.id}\""
            } else {
                "keys = [\"acct:{from.id}\", \"acct:{to.id}\"]"
            };
            errors.at(
                lit.span(),
                format!("`{name}` must not be empty, e.g. {example}"),
            );
        }
        let (pieces, messages) = template::parse_lenient(&text);
        for message in messages {
            errors.at(lit.span(), message);
        }
        let params = template::param_names(sig);
        for piece in &pieces {
            if let Piece::Placeholder(p) = piece
                && !params.contains(&p.root)
            {
                errors.at(lit.span(), unknown_param(&p.raw, &p.root, sig, &params));
            }
        }
        keys.push(KeyTemplate {
            lit: lit.clone(),
            pieces,
        });
    };
    match (&args.key, &args.keys) {
        (Some(_), Some((_, span))) => errors.at(
            *span,
            "`key` and `keys` cannot be used together: name one key with `key = \"..\"`, \
             or every key of the hold with `keys = [..]`",
        ),
        (None, None) if args.key_written || args.keys_written => {}
        (None, None) => errors.at(
            Span::call_site(),
            "missing required argument `key`, e.g. \
             #[distributed_lock(key = \"order:{order.id}\")]",
        ),
        (Some(key), None) => check_template(&mut errors, "key", key),
        (None, Some((list, span))) => {
            if list.is_empty() {
                errors.at(
                    *span,
                    "`keys` must not be empty: name every key of the hold, \
                     e.g. keys = [\"acct:{from.id}\", \"acct:{to.id}\"]",
                );
            }
            for (i, lit) in list.iter().enumerate() {
                if list[..i]
                    .iter()
                    .any(|earlier| earlier.value() == lit.value())
                {
                    errors.at(
                        lit.span(),
                        format!(
                            "duplicate key `{}` in `keys`: each key of a hold is named once",
                            lit.value()
                        ),
                    );
                }
                check_template(&mut errors, "keys", lit);
            }
        }
    }
    let several = args.keys.is_some();

    // Durations.
    let mut duration = |lit: Option<&LitStr>, default: Duration| match lit {
        None => Some(Spanned::new(default, Span::call_site())),
        Some(lit) => match duration::parse(&lit.value()) {
            Ok(d) => Some(Spanned::new(d, lit.span())),
            Err(message) => {
                errors.at(lit.span(), message);
                None
            }
        },
    };
    let wait = duration(args.wait.as_ref(), Duration::ZERO);
    let lease = duration(args.lease.as_ref(), Duration::from_secs(30));
    let hold_at_least = args
        .hold_at_least
        .as_ref()
        .map(|lit| duration(Some(lit), Duration::ZERO));
    let max_hold = args
        .max_hold
        .as_ref()
        .map(|lit| duration(Some(lit), Duration::ZERO));
    if let Some(lease) = &lease
        && lease.value < MIN_LEASE
    {
        errors.at(
            lease.span,
            "`lease` must be at least 100ms (dlock_runtime::MIN_LEASE): \
             the watchdog renews every lease/3, e.g. lease = \"30s\"",
        );
    }

    // Policies.
    let on_busy = match &args.on_busy {
        None => Some(Spanned::new(BusyPolicy::Fail, Span::call_site())),
        Some(lit) => match lit.value().as_str() {
            "fail" => Some(Spanned::new(BusyPolicy::Fail, lit.span())),
            "skip" => Some(Spanned::new(BusyPolicy::Skip, lit.span())),
            other => {
                errors.at(
                    lit.span(),
                    format!("unknown `on_busy` policy `{other}`: expected \"fail\" or \"skip\""),
                );
                None
            }
        },
    };
    let on_lost = match &args.on_lost {
        None => Some(Spanned::new(LostPolicy::Cancel, Span::call_site())),
        Some(lit) => match lit.value().as_str() {
            "cancel" => Some(Spanned::new(LostPolicy::Cancel, lit.span())),
            "continue" => Some(Spanned::new(LostPolicy::Continue, lit.span())),
            other => {
                errors.at(
                    lit.span(),
                    format!(
                        "unknown `on_lost` policy `{other}`: expected \"cancel\" or \"continue\""
                    ),
                );
                None
            }
        },
    };
    let watchdog = args.watchdog.as_ref().map_or_else(
        || Spanned::new(true, Span::call_site()),
        |b| Spanned::new(b.value, b.span),
    );
    let fencing = args.fencing.as_ref().map_or_else(
        || Spanned::new(true, Span::call_site()),
        |b| Spanned::new(b.value, b.span),
    );

    // max_hold: a ceiling on a hold the watchdog keeps renewing.
    if let Some(Some(ceiling)) = &max_hold {
        if !watchdog.value {
            errors.at(
                ceiling.span,
                "`max_hold` needs the watchdog: with `watchdog = false` the lease is already \
                 the cap on the hold; remove `max_hold`, or remove `watchdog = false`",
            );
        } else if ceiling.value.is_zero() {
            errors.at(
                ceiling.span,
                "`max_hold` must be greater than zero, e.g. max_hold = \"5m\"",
            );
        } else if let Some(lease) = &lease
            && ceiling.value < lease.value
        {
            errors.at(
                ceiling.span,
                format!(
                    "`max_hold` (\"{}\") must be at least the lease ({}): a shorter cap \
                     needs no renewal; use `lease` with `watchdog = false` instead",
                    args.max_hold
                        .as_ref()
                        .map(LitStr::value)
                        .unwrap_or_default(),
                    args.lease
                        .as_ref()
                        .map_or("\"30s\", the default".to_owned(), |l| format!(
                            "\"{}\"",
                            l.value()
                        )),
                ),
            );
        }
    }

    // permits, mode (`parse` already refused the two together).
    let mode = match (&args.permits, &args.mode) {
        (Some(lit), _) => match lit.base10_digits().parse::<u64>() {
            Ok(0) => {
                errors.at(
                    lit.span(),
                    "`permits` must be at least 1: with 0 permits the body could never run; \
                     write permits = 1 (or leave `permits` out) for a plain lock, \
                     or e.g. permits = 3 for at most 3 holders at once",
                );
                None
            }
            Ok(1) => Some(Spanned::new(Mode::Exclusive, lit.span())),
            Ok(n) if n <= MAX_PERMITS => Some(Spanned::new(
                Mode::Permit(u32::try_from(n).unwrap_or(u32::MAX)),
                lit.span(),
            )),
            // More than 1024, or more than even a `u64` holds.
            _ => {
                errors.at(
                    lit.span(),
                    format!(
                        "`permits` must be at most 1024 (dlock_runtime::MAX_PERMITS), not {}: \
                         every holder of a semaphore has its own slot on the server; \
                         e.g. permits = 3",
                        lit.base10_digits()
                    ),
                );
                None
            }
        },
        (None, Some(lit)) => match lit.value().as_str() {
            "read" => Some(Spanned::new(Mode::Shared, lit.span())),
            "write" => Some(Spanned::new(Mode::Exclusive, lit.span())),
            other => {
                errors.at(
                    lit.span(),
                    format!(
                        "unknown `mode` `{other}`: expected \"read\" (shared with other \
                         readers) or \"write\" (exclusive, the plain lock)"
                    ),
                );
                None
            }
        },
        (None, None) => Some(Spanned::new(Mode::Exclusive, Span::call_site())),
    };

    // backend
    if let Some(backend) = &args.backend
        && backend.value().is_empty()
    {
        errors.at(
            backend.span(),
            "`backend` must not be empty: name a registered backend, e.g. backend = \"redis\", \
             or leave `backend` out to use the default backend",
        );
    }

    // crate
    let krate = args
        .krate
        .as_ref()
        .and_then(|lit| match lit.parse::<Path>() {
            Ok(path) => Some(path),
            Err(_) => {
                errors.at(
                    lit.span(),
                    format!(
                        "invalid `crate` path `{}`: expected a path to the runtime crate, \
                     e.g. crate = \"::dlock_runtime\"",
                        lit.value()
                    ),
                );
                None
            }
        });

    // The function itself.
    if let Some(constness) = &sig.constness {
        errors.at(
            constness.span,
            "#[distributed_lock] cannot be used on a `const fn`: it needs an `async fn`",
        );
    } else if sig.asyncness.is_none() {
        errors.at(
            sig.fn_token.span,
            "#[distributed_lock] can only be used on an `async fn`: \
             acquiring the lock awaits the backend (write `async fn`)",
        );
    }

    if let Some(errors) = errors.0 {
        return Err(errors);
    }
    match (
        keys.is_empty(),
        wait,
        lease,
        on_busy,
        on_lost,
        hold_at_least,
        max_hold,
        mode,
    ) {
        (
            false,
            Some(wait),
            Some(lease),
            Some(on_busy),
            Some(on_lost),
            hold_at_least,
            max_hold,
            Some(mode),
        ) => Ok(Model {
            func,
            krate,
            keys,
            several,
            wait,
            lease,
            on_busy,
            on_lost,
            watchdog,
            fencing,
            hold_at_least: hold_at_least.flatten(),
            max_hold: max_hold.flatten(),
            mode,
            backend: args.backend,
        }),
        // Every `None` above pushed an error, so this is unreachable in practice.
        _ => Err(syn::Error::new(
            Span::call_site(),
            "invalid #[distributed_lock] attribute",
        )),
    }
}

/// The message for a placeholder whose root names no parameter.
fn unknown_param(raw: &str, root: &str, sig: &syn::Signature, params: &[String]) -> String {
    let function = &sig.ident;
    let listed = if params.is_empty() {
        format!("`{function}` has no parameters")
    } else {
        let names: Vec<String> = params.iter().map(|p| format!("`{p}`")).collect();
        format!("the parameters of `{function}` are {}", names.join(", "))
    };
    let hint = if root == "self" {
        " (`self` is only available in methods that take `self`, `&self` or `&mut self`)"
    } else {
        ""
    };
    format!("placeholder `{raw}` names no parameter: {listed}{hint}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(attr: &str, func: &str) -> syn::Result<Model> {
        let args: Args = syn::parse_str(attr).expect("Args parsing never fails outright");
        validate(args, syn::parse_str(func).expect("a function"))
    }

    fn messages(attr: &str, func: &str) -> Vec<String> {
        match check(attr, func) {
            Ok(_) => panic!("{attr} on {func} should be rejected"),
            Err(e) => e.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn defaults() {
        let model = check(r#"key = "k""#, "async fn f() {}").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(model.wait.value, Duration::ZERO);
        assert_eq!(model.lease.value, Duration::from_secs(30));
        assert_eq!(model.on_busy.value, BusyPolicy::Fail);
        assert_eq!(model.on_lost.value, LostPolicy::Cancel);
        assert!(model.watchdog.value);
        assert!(model.fencing.value);
        assert!(model.hold_at_least.is_none());
        assert!(model.backend.is_none());
        assert!(model.krate.is_none());
    }

    #[test]
    fn every_argument() {
        let model = check(
            r#"key = "o:{o.id}", wait = "1m 30s", lease = "10s", on_busy = "skip",
               on_lost = "continue", watchdog = false, fencing = false,
               hold_at_least = "250ms", backend = "zk", crate = "::renamed""#,
            "async fn f(o: &Order) -> Option<()> { None }",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(model.wait.value, Duration::from_secs(90));
        assert_eq!(model.lease.value, Duration::from_secs(10));
        assert_eq!(model.on_busy.value, BusyPolicy::Skip);
        assert_eq!(model.on_lost.value, LostPolicy::Continue);
        assert!(!model.watchdog.value);
        assert!(!model.fencing.value);
        assert_eq!(
            model.hold_at_least.map(|d| d.value),
            Some(Duration::from_millis(250))
        );
        assert_eq!(model.backend.map(|b| b.value()).as_deref(), Some("zk"));
        assert!(model.krate.is_some());
    }

    #[test]
    fn function_shape() {
        assert_eq!(
            messages(r#"key = "k""#, "fn f() {}"),
            [
                "#[distributed_lock] can only be used on an `async fn`: acquiring the lock \
              awaits the backend (write `async fn`)"
            ]
        );
        assert_eq!(
            messages(r#"key = "k""#, "const fn f() {}"),
            ["#[distributed_lock] cannot be used on a `const fn`: it needs an `async fn`"]
        );
    }

    #[test]
    fn placeholders_must_name_parameters() {
        assert_eq!(
            messages(r#"key = "{x}""#, "async fn pay(&self, order: u8) {}"),
            ["placeholder `{x}` names no parameter: the parameters of `pay` are `self`, `order`"]
        );
        assert_eq!(
            messages(r#"key = "{x}""#, "async fn pay() {}"),
            ["placeholder `{x}` names no parameter: `pay` has no parameters"]
        );
        assert!(
            check(
                r#"key = "{self.id}:{a}""#,
                "async fn m(&self, (a, _b): (u8, u8)) {}"
            )
            .is_ok()
        );
    }

    #[test]
    fn lease_has_a_minimum() {
        let too_short = [
            "`lease` must be at least 100ms (dlock_runtime::MIN_LEASE): the watchdog renews \
             every lease/3, e.g. lease = \"30s\"",
        ];
        for lease in ["0s", "0ms", "50ms", "99ms", "99999us", "99999999ns"] {
            assert_eq!(
                messages(
                    &format!(r#"key = "k", lease = "{lease}""#),
                    "async fn f() {}"
                ),
                too_short,
                "{lease}"
            );
        }
        for lease in ["100ms", "100000us", "1s"] {
            let model = check(
                &format!(r#"key = "k", lease = "{lease}""#),
                "async fn f() {}",
            )
            .unwrap_or_else(|e| panic!("{lease}: {e}"));
            assert!(model.lease.value >= MIN_LEASE);
        }
        // Also without the watchdog, where `lease` is a hard cap.
        assert_eq!(
            messages(
                r#"key = "k", lease = "10ms", watchdog = false"#,
                "async fn f() {}"
            )
            .len(),
            1
        );
    }

    #[test]
    fn collects_every_error() {
        let errors = messages(
            r#"key = "{nope}:{", wait = "soon", lease = "0s", on_busy = "maybe",
               on_lost = "ignore", backend = "", crate = "not a path", bogus = 1"#,
            "fn f() {}",
        );
        assert_eq!(errors.len(), 10, "{errors:#?}");
        assert!(errors[0].starts_with("unknown argument `bogus`"));
        assert!(errors[1].starts_with("unclosed `{`"));
        assert!(errors[2].starts_with("placeholder `{nope}` names no parameter"));
        assert!(errors[3].starts_with("invalid duration `soon`"));
        assert!(errors[4].starts_with("`lease` must be at least 100ms"));
        assert!(errors[5].starts_with("unknown `on_busy` policy `maybe`"));
        assert!(errors[6].starts_with("unknown `on_lost` policy `ignore`"));
        assert!(errors[7].starts_with("`backend` must not be empty"));
        assert!(errors[8].starts_with("invalid `crate` path `not a path`"));
        assert!(errors[9].contains("can only be used on an `async fn`"));
    }

    #[test]
    fn several_keys() {
        let model = check(
            r#"keys = ["acct:{from}", "acct:{to}"]"#,
            "async fn transfer(from: u32, to: u32) {}",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(model.several);
        assert_eq!(model.keys.len(), 2);
        assert_eq!(model.keys[1].lit.value(), "acct:{to}");
        assert!(!check(r#"key = "k""#, "async fn f() {}").unwrap().several);
    }

    #[test]
    fn key_and_keys_together() {
        assert_eq!(
            messages(r#"key = "a", keys = ["b", "c"]"#, "async fn f() {}"),
            [
                "`key` and `keys` cannot be used together: name one key with `key = \"..\"`, \
                 or every key of the hold with `keys = [..]`"
            ]
        );
    }

    #[test]
    fn empty_keys() {
        assert_eq!(
            messages("keys = []", "async fn f() {}"),
            ["`keys` must not be empty: name every key of the hold, \
                 e.g. keys = [\"acct:{from.id}\", \"acct:{to.id}\"]"]
        );
    }

    #[test]
    fn duplicate_literal_in_keys() {
        assert_eq!(
            messages(r#"keys = ["a:{x}", "b", "a:{x}"]"#, "async fn f(x: u8) {}"),
            ["duplicate key `a:{x}` in `keys`: each key of a hold is named once"]
        );
    }

    #[test]
    fn each_of_keys_is_checked_like_key() {
        let e = messages(
            r#"keys = ["a:{x}", "", "b:{nope}"]"#,
            "async fn f(x: u8) {}",
        );
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e[0].starts_with("`keys` must not be empty"), "{e:?}");
        assert!(
            e[1].starts_with("placeholder `{nope}` names no parameter"),
            "{e:?}"
        );
        let e = messages(r#"keys = ["a", 1]"#, "async fn f() {}");
        assert!(
            e[0].starts_with("each key of `keys` must be a string literal"),
            "{e:?}"
        );
        // A `keys` with a bad value is not also reported as a missing key.
        assert_eq!(e.len(), 1, "{e:?}");
    }

    #[test]
    fn missing_key() {
        assert_eq!(
            messages("", "async fn f() {}"),
            [
                "missing required argument `key`, e.g. #[distributed_lock(key = \"order:{order.id}\")]"
            ]
        );
        // A key with a bad value is reported once, not also as missing.
        assert_eq!(messages("key = 42", "async fn f() {}").len(), 1);
        assert_eq!(
            messages(r#"key = """#, "async fn f() {}"),
            ["`key` must not be empty, e.g. key = \"order:{order.id}\""]
        );
    }

    #[test]
    fn max_hold_is_a_ceiling_above_the_lease_under_the_watchdog() {
        let model = check(
            r#"key = "k", lease = "10s", max_hold = "1m""#,
            "async fn f() {}",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            model.max_hold.map(|d| d.value),
            Some(Duration::from_secs(60))
        );
        assert_eq!(
            messages(
                r#"key = "k", watchdog = false, max_hold = "1m""#,
                "async fn f() {}"
            ),
            [
                "`max_hold` needs the watchdog: with `watchdog = false` the lease is already \
                 the cap on the hold; remove `max_hold`, or remove `watchdog = false`"
            ]
        );
        assert_eq!(
            messages(r#"key = "k", max_hold = "0s""#, "async fn f() {}"),
            ["`max_hold` must be greater than zero, e.g. max_hold = \"5m\""]
        );
        assert_eq!(
            messages(r#"key = "k", max_hold = "10s""#, "async fn f() {}"),
            [
                "`max_hold` (\"10s\") must be at least the lease (\"30s\", the default): a \
                 shorter cap needs no renewal; use `lease` with `watchdog = false` instead"
            ]
        );
        assert!(messages(r#"key = "k", max_hold = "soon""#, "async fn f() {}")[0].contains("soon"));
    }

    #[test]
    fn permits_from_one_to_the_maximum() {
        let mode = |attr: &str| {
            check(attr, "async fn f() {}")
                .unwrap_or_else(|e| panic!("{attr}: {e}"))
                .mode
                .value
        };
        assert_eq!(mode(r#"key = "k""#), Mode::Exclusive);
        assert_eq!(mode(r#"key = "k", permits = 1"#), Mode::Exclusive);
        assert_eq!(mode(r#"key = "k", permits = 2"#), Mode::Permit(2));
        assert_eq!(mode(r#"key = "k", permits = 0x10"#), Mode::Permit(16));
        assert_eq!(mode(r#"key = "k", permits = 1_024"#), Mode::Permit(1024));
        assert_eq!(mode(r#"keys = ["a", "b"], permits = 5"#), Mode::Permit(5));
    }

    #[test]
    fn permits_out_of_range() {
        assert_eq!(
            messages(r#"key = "k", permits = 0"#, "async fn f() {}"),
            [
                "`permits` must be at least 1: with 0 permits the body could never run; write \
                 permits = 1 (or leave `permits` out) for a plain lock, or e.g. permits = 3 for \
                 at most 3 holders at once"
            ]
        );
        assert_eq!(
            messages(r#"key = "k", permits = 1025"#, "async fn f() {}"),
            [
                "`permits` must be at most 1024 (dlock_runtime::MAX_PERMITS), not 1025: every \
                 holder of a semaphore has its own slot on the server; e.g. permits = 3"
            ]
        );
        for huge in [
            "4294967296",
            "99999999999999999999999",
            "0xFFFF_FFFF_FFFF_FFFF_FF",
        ] {
            let e = messages(
                &format!(r#"key = "k", permits = {huge}"#),
                "async fn f() {}",
            );
            assert_eq!(e.len(), 1, "{e:?}");
            assert!(e[0].starts_with("`permits` must be at most 1024"), "{e:?}");
        }
    }

    #[test]
    fn read_and_write_modes() {
        for (value, expected) in [("read", Mode::Shared), ("write", Mode::Exclusive)] {
            let model = check(
                &format!(r#"key = "k", mode = "{value}""#),
                "async fn f() {}",
            )
            .unwrap_or_else(|e| panic!("{value}: {e}"));
            assert_eq!(model.mode.value, expected);
        }
        for value in ["Read", "shared", "exclusive", ""] {
            assert_eq!(
                messages(
                    &format!(r#"key = "k", mode = "{value}""#),
                    "async fn f() {}"
                ),
                [format!(
                    "unknown `mode` `{value}`: expected \"read\" (shared with other readers) \
                     or \"write\" (exclusive, the plain lock)"
                )]
            );
        }
    }

    #[test]
    fn mode_errors_come_with_the_others() {
        let e = messages(
            r#"key = "{nope}", permits = 0, mode = "read", wait = "soon""#,
            "async fn f() {}",
        );
        assert_eq!(e.len(), 4, "{e:#?}");
        assert!(
            e[0].starts_with("`mode` cannot be used with `permits`"),
            "{e:#?}"
        );
        assert!(e[1].starts_with("placeholder `{nope}`"), "{e:#?}");
        assert!(e[2].starts_with("invalid duration `soon`"), "{e:#?}");
        assert!(e[3].starts_with("`permits` must be at least 1"), "{e:#?}");
    }
}
