//! Parsing the attribute's arguments: `name = value` pairs separated by commas.
//!
//! The parser is lenient: each comma-separated argument is parsed on its own, and a
//! bad one (unknown name, duplicate, missing or mistyped value) is recorded as an
//! error while parsing carries on, so that every problem of an attribute is reported
//! in one compilation. Values keep their spans for later errors.

use proc_macro2::{Span, TokenStream, TokenTree};
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream, Parser};
use syn::{Ident, Lit, LitBool, LitInt, LitStr, Token};

mod kw {
    syn::custom_keyword!(key);
    syn::custom_keyword!(keys);
    syn::custom_keyword!(wait);
    syn::custom_keyword!(lease);
    syn::custom_keyword!(on_busy);
    syn::custom_keyword!(on_lost);
    syn::custom_keyword!(watchdog);
    syn::custom_keyword!(fencing);
    syn::custom_keyword!(hold_at_least);
    syn::custom_keyword!(max_hold);
    syn::custom_keyword!(permits);
    syn::custom_keyword!(mode);
    syn::custom_keyword!(backend);
}

/// Every argument name, in the order the docs list them.
pub(crate) const ALLOWED: &str = "key, keys, wait, lease, on_busy, on_lost, watchdog, fencing, hold_at_least, max_hold, permits, mode, backend, crate";

/// The parsed (not yet validated) arguments.
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) key: Option<LitStr>,
    /// `keys = [..]`: the templates and the span of the list.
    pub(crate) keys: Option<(Vec<LitStr>, Span)>,
    pub(crate) wait: Option<LitStr>,
    pub(crate) lease: Option<LitStr>,
    pub(crate) on_busy: Option<LitStr>,
    pub(crate) on_lost: Option<LitStr>,
    pub(crate) watchdog: Option<LitBool>,
    pub(crate) fencing: Option<LitBool>,
    pub(crate) hold_at_least: Option<LitStr>,
    pub(crate) max_hold: Option<LitStr>,
    /// `permits = N`: the integer literal as written (checked by `validate`).
    pub(crate) permits: Option<LitInt>,
    /// `mode = "read" | "write"` (checked by `validate`).
    pub(crate) mode: Option<LitStr>,
    pub(crate) backend: Option<LitStr>,
    pub(crate) krate: Option<LitStr>,
    /// Whether a `key` argument was written, even one with a bad value (so that a
    /// bad key is not also reported as a missing one).
    pub(crate) key_written: bool,
    /// The same for `keys`.
    pub(crate) keys_written: bool,
    /// Which of `permits` and `mode` was written first, whatever its value:
    /// the other one is then an error at its own argument.
    hold_written: Option<Name>,
    /// Every parse error, combined; `None` if there were none.
    pub(crate) errors: Option<syn::Error>,
}

/// Which argument a `name = value` pair sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Name {
    Key,
    Keys,
    Wait,
    Lease,
    OnBusy,
    OnLost,
    Watchdog,
    Fencing,
    HoldAtLeast,
    MaxHold,
    Permits,
    Mode,
    Backend,
    Crate,
}

impl Name {
    fn as_str(self) -> &'static str {
        match self {
            Name::Key => "key",
            Name::Keys => "keys",
            Name::Wait => "wait",
            Name::Lease => "lease",
            Name::OnBusy => "on_busy",
            Name::OnLost => "on_lost",
            Name::Watchdog => "watchdog",
            Name::Fencing => "fencing",
            Name::HoldAtLeast => "hold_at_least",
            Name::MaxHold => "max_hold",
            Name::Permits => "permits",
            Name::Mode => "mode",
            Name::Backend => "backend",
            Name::Crate => "crate",
        }
    }

    /// An example of a well-formed argument, for error messages.
    fn example(self) -> &'static str {
        match self {
            Name::Key => "key = \"order:{order.id}\"",
            Name::Keys => "keys = [\"acct:{from.id}\", \"acct:{to.id}\"]",
            Name::Wait => "wait = \"3s\"",
            Name::Lease => "lease = \"30s\"",
            Name::OnBusy => "on_busy = \"fail\"",
            Name::OnLost => "on_lost = \"cancel\"",
            Name::Watchdog => "watchdog = true",
            Name::Fencing => "fencing = false",
            Name::HoldAtLeast => "hold_at_least = \"1s\"",
            Name::MaxHold => "max_hold = \"5m\"",
            Name::Permits => "permits = 3",
            Name::Mode => "mode = \"read\"",
            Name::Backend => "backend = \"redis\"",
            Name::Crate => "crate = \"::dlock_runtime\"",
        }
    }

    /// The expected kind of value, for error messages.
    fn expects(self) -> &'static str {
        match self {
            Name::Key => "a string literal template",
            Name::Keys => "a list of string literal templates",
            Name::Wait | Name::Lease | Name::HoldAtLeast | Name::MaxHold => "a duration string",
            Name::OnBusy => "a string, \"fail\" or \"skip\"",
            Name::OnLost => "a string, \"cancel\" or \"continue\"",
            Name::Watchdog | Name::Fencing => "a bool literal",
            Name::Permits => "an integer literal from 1 to 1024",
            Name::Mode => "a string, \"read\" or \"write\"",
            Name::Backend => "a string naming a registered backend",
            Name::Crate => "a string holding a path",
        }
    }
}

/// A well-formed value.
enum Value {
    Str(LitStr),
    /// `keys`: the templates and the span of the list.
    Strs(Vec<LitStr>, Span),
    Bool(LitBool),
    Int(LitInt),
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args::default();
        while !input.is_empty() {
            // One argument: every token tree up to the next top-level comma.
            let mut chunk = TokenStream::new();
            while !input.is_empty() && !input.peek(Token![,]) {
                chunk.extend([input.parse::<TokenTree>()?]);
            }
            let comma: Option<Token![,]> = input.parse()?;
            if chunk.is_empty() {
                if let Some(comma) = comma {
                    args.error(syn::Error::new(
                        comma.span,
                        format!("expected an argument before `,`, one of: {ALLOWED}"),
                    ));
                }
                continue;
            }
            let first = match chunk.clone().into_iter().next() {
                Some(TokenTree::Ident(name)) => name.to_string(),
                _ => String::new(),
            };
            match first.as_str() {
                "key" => args.key_written = true,
                "keys" => args.keys_written = true,
                "permits" | "mode" => {
                    let name = if first == "permits" {
                        Name::Permits
                    } else {
                        Name::Mode
                    };
                    match args.hold_written {
                        Some(earlier) if earlier != name => {
                            args.error(permits_with_mode(&chunk, name));
                            continue;
                        }
                        _ => args.hold_written = Some(name),
                    }
                }
                _ => {}
            }
            match (|input: ParseStream<'_>| parse_arg(input)).parse2(chunk.clone()) {
                Ok((name, name_span, value)) => args.set(name, name_span, &chunk, value),
                Err(e) => args.error(e),
            }
        }
        Ok(args)
    }
}

impl Args {
    fn error(&mut self, error: syn::Error) {
        match &mut self.errors {
            Some(errors) => errors.combine(error),
            None => self.errors = Some(error),
        }
    }

    /// Stores a well-formed argument; `arg` is all of its tokens (`name = value`).
    fn set(&mut self, name: Name, name_span: Span, arg: &TokenStream, value: Value) {
        let duplicate = match (name, value) {
            (Name::Watchdog, Value::Bool(b)) => replace(&mut self.watchdog, b),
            (Name::Fencing, Value::Bool(b)) => replace(&mut self.fencing, b),
            (Name::Key, Value::Str(s)) => replace(&mut self.key, s),
            (Name::Keys, Value::Strs(list, span)) => replace(&mut self.keys, (list, span)),
            (Name::Wait, Value::Str(s)) => replace(&mut self.wait, s),
            (Name::Lease, Value::Str(s)) => replace(&mut self.lease, s),
            (Name::OnBusy, Value::Str(s)) => replace(&mut self.on_busy, s),
            (Name::OnLost, Value::Str(s)) => replace(&mut self.on_lost, s),
            (Name::HoldAtLeast, Value::Str(s)) => replace(&mut self.hold_at_least, s),
            (Name::MaxHold, Value::Str(s)) => replace(&mut self.max_hold, s),
            (Name::Permits, Value::Int(n)) => replace(&mut self.permits, n),
            (Name::Mode, Value::Str(s)) => replace(&mut self.mode, s),
            (Name::Backend, Value::Str(s)) => replace(&mut self.backend, s),
            (Name::Crate, Value::Str(s)) => replace(&mut self.krate, s),
            // `parse_value` only returns a bool for `watchdog` and `fencing`, a
            // list for `keys`, an integer for `permits` and a string otherwise.
            _ => false,
        };
        if duplicate {
            let message = format!(
                "duplicate argument `{}`: each argument may be given once",
                name.as_str()
            );
            // A second `permits` or `mode` is shown whole, value included: it
            // says another kind of lock than the first.
            self.error(match name {
                Name::Permits | Name::Mode => syn::Error::new_spanned(arg, message),
                _ => syn::Error::new(name_span, message),
            });
        }
    }
}

/// The error for the second of `permits` and `mode` (`second` names it),
/// spanned at that whole argument.
fn permits_with_mode(arg: &TokenStream, second: Name) -> syn::Error {
    let first = if second == Name::Permits {
        "mode"
    } else {
        "permits"
    };
    syn::Error::new_spanned(
        arg,
        format!(
            "`{}` cannot be used with `{first}`: a semaphore (`permits = N`) has no read or \
             write mode; keep `permits = N` for at most N holders at once, or \
             `mode = \"read\"` / `mode = \"write\"` for a read-write lock",
            second.as_str()
        ),
    )
}

/// Stores `value` in `slot` unless it is already set; returns whether it was.
fn replace<T>(slot: &mut Option<T>, value: T) -> bool {
    if slot.is_some() {
        true
    } else {
        *slot = Some(value);
        false
    }
}

/// Parses one `name = value` argument (the input holds exactly its tokens).
fn parse_arg(input: ParseStream<'_>) -> syn::Result<(Name, Span, Value)> {
    let (name, name_span) = parse_name(input)?;

    if input.is_empty() {
        return Err(syn::Error::new(
            name_span,
            format!(
                "argument `{}` needs a value, e.g. `{}`",
                name.as_str(),
                name.example()
            ),
        ));
    }
    let eq: Token![=] = input.parse().map_err(|_| {
        syn::Error::new(
            input.span(),
            format!(
                "expected `=` after `{}`, e.g. `{}`",
                name.as_str(),
                name.example()
            ),
        )
    })?;
    if input.is_empty() {
        return Err(syn::Error::new(
            eq.span,
            format!(
                "missing value after `{} =`, e.g. `{}`",
                name.as_str(),
                name.example()
            ),
        ));
    }

    let rest: TokenStream = input.parse()?;
    let value = parse_value(name, rest)?;
    Ok((name, name_span, value))
}

/// Parses an argument name: one of the keywords, or an error naming the unknown one.
fn parse_name(input: ParseStream<'_>) -> syn::Result<(Name, Span)> {
    macro_rules! keywords {
        ($($kw:path => $name:expr),* $(,)?) => {
            $(
                if input.peek($kw) {
                    let kw: $kw = input.parse()?;
                    return Ok(($name, kw.span));
                }
            )*
        };
    }
    keywords! {
        kw::keys => Name::Keys,
        kw::key => Name::Key,
        kw::wait => Name::Wait,
        kw::lease => Name::Lease,
        kw::on_busy => Name::OnBusy,
        kw::on_lost => Name::OnLost,
        kw::watchdog => Name::Watchdog,
        kw::fencing => Name::Fencing,
        kw::hold_at_least => Name::HoldAtLeast,
        kw::max_hold => Name::MaxHold,
        kw::permits => Name::Permits,
        kw::mode => Name::Mode,
        kw::backend => Name::Backend,
    }
    if input.peek(Token![crate]) {
        let kw: Token![crate] = input.parse()?;
        return Ok((Name::Crate, kw.span));
    }
    if input.peek(Ident::peek_any) {
        let ident = Ident::parse_any(input)?;
        let unknown = ident.unraw().to_string();
        let hint = suggestion(&unknown)
            .map(|s| format!("; did you mean `{s}`?"))
            .unwrap_or_default();
        return Err(syn::Error::new(
            ident.span(),
            format!("unknown argument `{unknown}`{hint} (allowed: {ALLOWED})"),
        ));
    }
    Err(syn::Error::new(
        input.span(),
        format!("expected an argument name, one of: {ALLOWED}"),
    ))
}

/// The allowed argument closest to `unknown`, if one is close enough to be a typo.
fn suggestion(unknown: &str) -> Option<&'static str> {
    ALLOWED
        .split(", ")
        .map(|name| (edit_distance(unknown, name), name))
        .filter(|&(distance, name)| distance <= 2 && distance < name.len())
        .min_by_key(|&(distance, _)| distance)
        .map(|(_, name)| name)
}

/// Levenshtein distance (the names are short ASCII words).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitution = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

/// Checks that `tokens` (everything after `=`) is one literal of the right kind.
fn parse_value(name: Name, tokens: TokenStream) -> syn::Result<Value> {
    let wrong = |detail: String| {
        syn::Error::new_spanned(
            &tokens,
            format!(
                "`{}` expects {}{detail}, e.g. `{}`",
                name.as_str(),
                name.expects(),
                name.example()
            ),
        )
    };
    if name == Name::Keys {
        let Ok(list) = syn::parse2::<syn::ExprArray>(tokens.clone()) else {
            return Err(wrong(String::new()));
        };
        let span = list.bracket_token.span.join();
        let mut templates = Vec::with_capacity(list.elems.len());
        for elem in &list.elems {
            match elem {
                syn::Expr::Lit(syn::ExprLit {
                    lit: Lit::Str(s), ..
                }) => templates.push(s.clone()),
                other => {
                    return Err(syn::Error::new_spanned(
                        other,
                        format!(
                            "each key of `keys` must be a string literal template, e.g. `{}`",
                            name.example()
                        ),
                    ));
                }
            }
        }
        return Ok(Value::Strs(templates, span));
    }
    let Ok(lit) = syn::parse2::<Lit>(tokens.clone()) else {
        return Err(match (name, syn::parse2::<syn::Path>(tokens.clone())) {
            (Name::Permits, Ok(_)) => wrong(
                " written out (the attribute checks it at compile time, so it cannot read a \
                 constant)"
                    .to_owned(),
            ),
            (Name::Mode, Ok(path)) if path.is_ident("read") || path.is_ident("write") => {
                wrong(" in quotes".to_owned())
            }
            _ => wrong(String::new()),
        });
    };
    match (name, lit) {
        (Name::Watchdog | Name::Fencing, Lit::Bool(b)) => Ok(Value::Bool(b)),
        (Name::Watchdog | Name::Fencing, Lit::Str(s))
            if matches!(s.value().as_str(), "true" | "false") =>
        {
            Err(wrong(" without quotes".to_owned()))
        }
        (Name::Watchdog | Name::Fencing, _) => Err(wrong(String::new())),
        // `Lit` also parses a negative number as one literal.
        (Name::Permits, Lit::Int(n)) if !n.base10_digits().starts_with('-') => Ok(Value::Int(n)),
        (Name::Permits, Lit::Str(s)) if s.value().trim().parse::<u64>().is_ok() => {
            Err(wrong(" without quotes".to_owned()))
        }
        (Name::Permits, _) => Err(wrong(String::new())),
        (_, Lit::Str(s)) => Ok(Value::Str(s)),
        (Name::Wait | Name::Lease | Name::HoldAtLeast, Lit::Int(_) | Lit::Float(_)) => {
            Err(wrong(" with a unit".to_owned()))
        }
        (_, _) => Err(wrong(String::new())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Args {
        syn::parse_str::<Args>(s).expect("Args parsing never fails outright")
    }

    fn errors(s: &str) -> Vec<String> {
        parse(s)
            .errors
            .map(|e| e.into_iter().map(|e| e.to_string()).collect())
            .unwrap_or_default()
    }

    #[test]
    fn all_arguments() {
        let args = parse(
            r#"key = "order:{order.id}", wait = "3s", lease = "10s", on_busy = "skip",
               on_lost = "continue", watchdog = false, fencing = false, hold_at_least = "1s",
               backend = "zk", crate = "::my_dlock","#,
        );
        assert!(args.errors.is_none());
        assert_eq!(args.key.unwrap().value(), "order:{order.id}");
        assert_eq!(args.wait.unwrap().value(), "3s");
        assert_eq!(args.lease.unwrap().value(), "10s");
        assert_eq!(args.on_busy.unwrap().value(), "skip");
        assert_eq!(args.on_lost.unwrap().value(), "continue");
        assert!(!args.watchdog.unwrap().value);
        assert!(!args.fencing.unwrap().value);
        assert_eq!(args.hold_at_least.unwrap().value(), "1s");
        assert_eq!(args.backend.unwrap().value(), "zk");
        assert_eq!(args.krate.unwrap().value(), "::my_dlock");
    }

    #[test]
    fn empty() {
        let args = parse("");
        assert!(args.errors.is_none());
        assert!(args.key.is_none());
    }

    #[test]
    fn unknown_argument() {
        assert_eq!(
            errors(r#"key = "k", timeout = "3s""#),
            [
                "unknown argument `timeout` (allowed: key, keys, wait, lease, on_busy, on_lost, \
              watchdog, fencing, hold_at_least, max_hold, permits, mode, backend, crate)"
            ]
        );
        assert!(errors(r#"key = "k", leese = "3s""#)[0].contains("did you mean `lease`?"));
        assert!(errors(r#"key = "k", onbusy = "skip""#)[0].contains("did you mean `on_busy`?"));
        assert!(errors(r#"self = "k""#)[0].contains("unknown argument `self`"));
        assert!(errors(r#""k""#)[0].starts_with("expected an argument name"));
    }

    #[test]
    fn duplicate_argument() {
        let args = parse(r#"key = "a", wait = "1s", wait = "2s""#);
        assert_eq!(args.wait.unwrap().value(), "1s");
        assert_eq!(
            args.errors.unwrap().to_string(),
            "duplicate argument `wait`: each argument may be given once"
        );
    }

    #[test]
    fn missing_values() {
        assert_eq!(
            errors("key"),
            ["argument `key` needs a value, e.g. `key = \"order:{order.id}\"`"]
        );
        assert_eq!(
            errors("wait ="),
            ["missing value after `wait =`, e.g. `wait = \"3s\"`"]
        );
        assert_eq!(
            errors(r#"wait "3s""#),
            ["expected `=` after `wait`, e.g. `wait = \"3s\"`"]
        );
        assert!(errors(r#"key = "a",, wait = "1s""#)[0].starts_with("expected an argument"));
    }

    #[test]
    fn wrong_value_kinds() {
        assert_eq!(
            errors("key = order.id"),
            ["`key` expects a string literal template, e.g. `key = \"order:{order.id}\"`"]
        );
        assert_eq!(
            errors("wait = 3"),
            ["`wait` expects a duration string with a unit, e.g. `wait = \"3s\"`"]
        );
        assert_eq!(
            errors(r#"watchdog = "true""#),
            ["`watchdog` expects a bool literal without quotes, e.g. `watchdog = true`"]
        );
        assert_eq!(
            errors("watchdog = 1"),
            ["`watchdog` expects a bool literal, e.g. `watchdog = true`"]
        );
        assert_eq!(
            errors(r#"fencing = "false""#),
            ["`fencing` expects a bool literal without quotes, e.g. `fencing = false`"]
        );
        assert_eq!(
            errors("fencing = off"),
            ["`fencing` expects a bool literal, e.g. `fencing = false`"]
        );
        assert_eq!(
            errors(r#"key = "a", fencing = false, fencing = true"#),
            ["duplicate argument `fencing`: each argument may be given once"]
        );
        assert_eq!(
            errors("crate = ::dlock_runtime"),
            ["`crate` expects a string holding a path, e.g. `crate = \"::dlock_runtime\"`"]
        );
        assert!(errors(r#"key = "a" "b""#)[0].starts_with("`key` expects"));
    }

    #[test]
    fn permits_and_mode() {
        let args = parse(r#"key = "k", permits = 3"#);
        assert!(args.errors.is_none());
        assert_eq!(args.permits.unwrap().base10_digits(), "3");
        let args = parse(r#"key = "k", mode = "read""#);
        assert!(args.errors.is_none());
        assert_eq!(args.mode.unwrap().value(), "read");
        assert!(errors("permits = 3").is_empty());
        assert!(errors(r#"key = "k", permit = 3"#)[0].contains("did you mean `permits`?"));
        assert!(errors(r#"key = "k", mod = "read""#)[0].contains("did you mean `mode`?"));
    }

    #[test]
    fn permits_must_be_an_integer_literal() {
        let integer = "`permits` expects an integer literal from 1 to 1024, e.g. `permits = 3`";
        for value in [
            "2.5", "-1", "-0", "- 3", "-2.5", "true", "'3'", "3 4", "[3]",
        ] {
            assert_eq!(errors(&format!("permits = {value}")), [integer], "{value}");
        }
        assert_eq!(
            errors(r#"permits = "3""#),
            [
                "`permits` expects an integer literal from 1 to 1024 without quotes, \
                 e.g. `permits = 3`"
            ]
        );
        assert_eq!(errors(r#"permits = "three""#), [integer]);
        for value in ["N", "limits::PAYMENTS"] {
            assert_eq!(
                errors(&format!("permits = {value}")),
                [
                    "`permits` expects an integer literal from 1 to 1024 written out (the \
                     attribute checks it at compile time, so it cannot read a constant), \
                     e.g. `permits = 3`"
                ],
                "{value}"
            );
        }
        // A bad value is a value error only, not also a missing or duplicate one.
        assert!(parse("permits = 2.5").permits.is_none());
    }

    #[test]
    fn mode_must_be_a_string() {
        let string = "`mode` expects a string, \"read\" or \"write\", e.g. `mode = \"read\"`";
        for value in ["1", "true", "shared", "HoldMode::Shared"] {
            assert_eq!(errors(&format!("mode = {value}")), [string], "{value}");
        }
        for value in ["read", "write"] {
            assert_eq!(
                errors(&format!("mode = {value}")),
                ["`mode` expects a string, \"read\" or \"write\" in quotes, \
                     e.g. `mode = \"read\"`"],
                "{value}"
            );
        }
    }

    #[test]
    fn duplicate_permits_and_mode() {
        let args = parse(r#"key = "k", permits = 3, permits = 4"#);
        assert_eq!(args.permits.unwrap().base10_digits(), "3");
        assert_eq!(
            args.errors.unwrap().to_string(),
            "duplicate argument `permits`: each argument may be given once"
        );
        assert_eq!(
            errors(r#"mode = "read", key = "k", mode = "write""#),
            ["duplicate argument `mode`: each argument may be given once"]
        );
    }

    #[test]
    fn permits_with_mode_is_an_error_on_the_second() {
        let args = parse(r#"key = "k", permits = 3, mode = "read""#);
        assert_eq!(args.permits.unwrap().base10_digits(), "3");
        assert!(args.mode.is_none());
        assert_eq!(
            args.errors.unwrap().to_string(),
            "`mode` cannot be used with `permits`: a semaphore (`permits = N`) has no read or \
             write mode; keep `permits = N` for at most N holders at once, or \
             `mode = \"read\"` / `mode = \"write\"` for a read-write lock"
        );
        let args = parse(r#"mode = "write", key = "k", permits = 2"#);
        assert_eq!(args.mode.unwrap().value(), "write");
        assert!(args.permits.is_none());
        assert!(
            args.errors
                .unwrap()
                .to_string()
                .starts_with("`permits` cannot be used with `mode`")
        );
        // Whatever the first one's value: it was written.
        let e = errors(r#"key = "k", permits = "x", mode = "read""#);
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e[0].starts_with("`permits` expects"), "{e:?}");
        assert!(
            e[1].starts_with("`mode` cannot be used with `permits`"),
            "{e:?}"
        );
        // Each further one is reported too.
        let e = errors(r#"key = "k", mode = "read", permits = 2, permits = 3"#);
        assert_eq!(e.len(), 2, "{e:?}");
    }

    #[test]
    fn bad_key_counts_as_written() {
        let args = parse("key = 1");
        assert!(args.key.is_none());
        assert!(args.key_written);
        assert!(!parse(r#"wait = "1s""#).key_written);
    }

    #[test]
    fn collects_every_error() {
        let e = errors(r#"key = 1, nope = 2, wait = "1s", wait = "2s", lease"#);
        assert_eq!(e.len(), 4, "{e:?}");
        assert!(e[0].starts_with("`key` expects"));
        assert!(e[1].starts_with("unknown argument `nope`"));
        assert!(e[2].starts_with("duplicate argument `wait`"));
        assert!(e[3].starts_with("argument `lease` needs a value"));
    }

    #[test]
    fn distance() {
        assert_eq!(edit_distance("lease", "lease"), 0);
        assert_eq!(edit_distance("leese", "lease"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(suggestion("xyz"), None);
    }
}
