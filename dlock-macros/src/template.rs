//! The key template: `"order:{order.id}"`.
//!
//! Literal text, `{{` and `}}` (literal braces), and placeholders `{name}` or
//! `{name.field.field}` whose first segment names a parameter of the function and
//! whose further segments are field names or tuple indices (`{pair.0}`). The
//! interpolated value is formatted with `Display`.

use syn::{FnArg, Pat, Signature};

/// One piece of a parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Piece {
    /// Literal text (braces already unescaped).
    Text(String),
    /// A `{…}` placeholder.
    Placeholder(Placeholder),
}

/// A `{root.field.field}` placeholder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placeholder {
    /// The placeholder as written, braces included (for error messages).
    pub(crate) raw: String,
    /// The parameter it names (`self` for the receiver; may be `r#name`).
    pub(crate) root: String,
    /// The field accesses after the root.
    pub(crate) fields: Vec<Field>,
}

/// One `.field` access in a placeholder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Field {
    /// `.name` (may be `r#name`).
    Named(String),
    /// `.0`
    Index(u32),
}

/// The accepted placeholder form, appended to placeholder errors.
const FORM: &str = "expected `{name}` or `{name.field}`, where `name` is a parameter";

/// Parses a key template. On failure returns every error found (each a complete
/// message quoting the offending placeholder or brace).
#[cfg(test)]
fn parse(template: &str) -> Result<Vec<Piece>, Vec<String>> {
    let (pieces, errors) = parse_lenient(template);
    if errors.is_empty() {
        Ok(pieces)
    } else {
        Err(errors)
    }
}

/// Parses a key template, returning the pieces that parsed and every error found
/// (each a complete message quoting the offending placeholder or brace). The
/// template is valid only if there are no errors; the pieces are still useful then
/// for checking the placeholders that did parse.
pub(crate) fn parse_lenient(template: &str) -> (Vec<Piece>, Vec<String>) {
    let mut pieces = Vec::new();
    let mut errors = Vec::new();
    let mut text = String::new();
    let mut chars = template.chars().peekable();

    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                text.push('{');
            }
            '{' => {
                let mut inner = String::new();
                let mut closed = false;
                for c in chars.by_ref() {
                    if c == '}' {
                        closed = true;
                        break;
                    }
                    inner.push(c);
                }
                if !closed {
                    errors.push(format!(
                        "unclosed `{{` in key: `{{{inner}` has no closing `}}` \
                         (write `{{{{` for a literal `{{`)"
                    ));
                    break;
                }
                match parse_placeholder(&inner) {
                    Ok(placeholder) => {
                        if !text.is_empty() {
                            pieces.push(Piece::Text(std::mem::take(&mut text)));
                        }
                        pieces.push(Piece::Placeholder(placeholder));
                    }
                    Err(e) => errors.push(e),
                }
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                text.push('}');
            }
            '}' => errors.push(
                "unmatched `}` in key: there is no `{` before it (write `}}` for a literal `}`)"
                    .to_owned(),
            ),
            c => text.push(c),
        }
    }
    if !text.is_empty() {
        pieces.push(Piece::Text(text));
    }
    (pieces, errors)
}

/// Parses the inside of `{…}`.
fn parse_placeholder(inner: &str) -> Result<Placeholder, String> {
    let raw = format!("{{{inner}}}");
    if inner.is_empty() {
        return Err(
            "empty placeholder `{}` in key: name a parameter, e.g. `{order_id}` or \
                    `{order.id}` (write `{{}}` for literal braces)"
                .to_owned(),
        );
    }
    if inner.contains('{') {
        return Err(format!(
            "invalid placeholder `{raw}` in key: `{{` inside a placeholder \
             (write `{{{{` for a literal `{{`)"
        ));
    }
    if inner.contains(':') {
        return Err(format!(
            "invalid placeholder `{raw}` in key: format specs are not supported, \
             values are formatted with `Display`; {FORM}"
        ));
    }
    if inner.chars().any(char::is_whitespace) {
        return Err(format!(
            "invalid placeholder `{raw}` in key: whitespace is not allowed; {FORM}"
        ));
    }

    let segments: Vec<&str> = inner.split('.').collect();
    if segments[0].is_empty() {
        return Err(format!(
            "invalid placeholder `{raw}` in key: missing parameter name before `.`; {FORM}"
        ));
    }
    if let Some(pos) = segments.iter().skip(1).position(|s| s.is_empty()) {
        let detail = if pos + 2 == segments.len() {
            "missing field name after the last `.`"
        } else {
            "empty field name between two `.`"
        };
        return Err(format!(
            "invalid placeholder `{raw}` in key: {detail}; {FORM}"
        ));
    }

    let root = segments[0];
    if root.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "invalid placeholder `{raw}` in key: placeholders name a parameter, \
             not a position; {FORM}"
        ));
    }
    if root != "self" && !is_ident(root) {
        return Err(format!(
            "invalid placeholder `{raw}` in key: `{root}` is not an identifier; {FORM}"
        ));
    }

    let mut fields = Vec::with_capacity(segments.len() - 1);
    for segment in &segments[1..] {
        if segment.bytes().all(|b| b.is_ascii_digit()) {
            match segment.parse::<u32>() {
                Ok(index) if segment.len() == 1 || !segment.starts_with('0') => {
                    fields.push(Field::Index(index));
                }
                _ => {
                    return Err(format!(
                        "invalid placeholder `{raw}` in key: `{segment}` is not a tuple index; \
                         {FORM}"
                    ));
                }
            }
        } else if is_ident(segment) {
            fields.push(Field::Named((*segment).to_owned()));
        } else {
            return Err(format!(
                "invalid placeholder `{raw}` in key: `{segment}` is not a field name or \
                 tuple index; {FORM}"
            ));
        }
    }

    Ok(Placeholder {
        raw,
        root: root.to_owned(),
        fields,
    })
}

/// Whether `s` is exactly one Rust identifier (non-keyword, or a raw `r#name`).
fn is_ident(s: &str) -> bool {
    !s.is_empty()
        && !s.chars().any(char::is_whitespace)
        && syn::parse_str::<syn::Ident>(s).is_ok_and(|ident| ident == s)
}

/// Every name a placeholder may start with: `self` for a receiver, and every
/// identifier bound by the patterns of the typed arguments, in order.
pub(crate) fn param_names(sig: &Signature) -> Vec<String> {
    let mut names = Vec::new();
    for input in &sig.inputs {
        match input {
            FnArg::Receiver(_) => names.push("self".to_owned()),
            FnArg::Typed(typed) => bound_names(&typed.pat, &mut names),
        }
    }
    names
}

/// Collects the identifiers a pattern binds.
fn bound_names(pat: &Pat, names: &mut Vec<String>) {
    match pat {
        Pat::Ident(p) => {
            names.push(p.ident.to_string());
            if let Some((_, sub)) = &p.subpat {
                bound_names(sub, names);
            }
        }
        Pat::Tuple(p) => p.elems.iter().for_each(|p| bound_names(p, names)),
        Pat::TupleStruct(p) => p.elems.iter().for_each(|p| bound_names(p, names)),
        Pat::Struct(p) => p.fields.iter().for_each(|f| bound_names(&f.pat, names)),
        Pat::Slice(p) => p.elems.iter().for_each(|p| bound_names(p, names)),
        Pat::Reference(p) => bound_names(&p.pat, names),
        Pat::Type(p) => bound_names(&p.pat, names),
        Pat::Paren(p) => bound_names(&p.pat, names),
        // Every alternative binds the same names.
        Pat::Or(p) => {
            if let Some(first) = p.cases.first() {
                bound_names(first, names);
            }
        }
        // Wildcards, literals, ranges, rest patterns, paths and macros bind nothing
        // we can see.
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Piece {
        Piece::Text(s.to_owned())
    }

    fn ph(raw: &str, root: &str, fields: Vec<Field>) -> Piece {
        Piece::Placeholder(Placeholder {
            raw: raw.to_owned(),
            root: root.to_owned(),
            fields,
        })
    }

    fn named(s: &str) -> Field {
        Field::Named(s.to_owned())
    }

    fn errs(template: &str) -> Vec<String> {
        match parse(template) {
            Ok(p) => panic!("{template:?} should not parse, got {p:?}"),
            Err(e) => e,
        }
    }

    fn one_err(template: &str) -> String {
        let mut e = errs(template);
        assert_eq!(e.len(), 1, "{template:?}: {e:?}");
        e.remove(0)
    }

    #[test]
    fn literal_only() {
        assert_eq!(parse("jobs:nightly").unwrap(), vec![text("jobs:nightly")]);
        assert_eq!(parse("").unwrap(), vec![]);
    }

    #[test]
    fn escaped_braces() {
        assert_eq!(parse("{{literal}}").unwrap(), vec![text("{literal}")]);
        assert_eq!(parse("a{{}}b").unwrap(), vec![text("a{}b")]);
        assert_eq!(
            parse("{{{id}}}").unwrap(),
            vec![text("{"), ph("{id}", "id", vec![]), text("}")]
        );
    }

    #[test]
    fn placeholders() {
        assert_eq!(
            parse("order:{order.id}").unwrap(),
            vec![text("order:"), ph("{order.id}", "order", vec![named("id")])]
        );
        assert_eq!(
            parse("{a}{b}").unwrap(),
            vec![ph("{a}", "a", vec![]), ph("{b}", "b", vec![])]
        );
        assert_eq!(
            parse("x:{self.inner.name}:y").unwrap(),
            vec![
                text("x:"),
                ph(
                    "{self.inner.name}",
                    "self",
                    vec![named("inner"), named("name")]
                ),
                text(":y"),
            ]
        );
        assert_eq!(
            parse("{pair.0}-{pair.1.x}").unwrap(),
            vec![
                ph("{pair.0}", "pair", vec![Field::Index(0)]),
                text("-"),
                ph("{pair.1.x}", "pair", vec![Field::Index(1), named("x")]),
            ]
        );
        assert_eq!(
            parse("{r#type}").unwrap(),
            vec![ph("{r#type}", "r#type", vec![])]
        );
        assert_eq!(
            parse("{_id}:{ünïcode}").unwrap(),
            vec![
                ph("{_id}", "_id", vec![]),
                text(":"),
                ph("{ünïcode}", "ünïcode", vec![])
            ]
        );
    }

    #[test]
    fn bad_placeholders() {
        assert!(one_err("{}").starts_with("empty placeholder `{}`"));
        assert!(one_err("a{x.}").contains("`{x.}` in key: missing field name after the last `.`"));
        assert!(one_err("{.x}").contains("`{.x}` in key: missing parameter name before `.`"));
        assert!(one_err("{x..y}").contains("`{x..y}` in key: empty field name between two `.`"));
        assert!(one_err("{x y}").contains("`{x y}` in key: whitespace"));
        assert!(one_err("{ x }").contains("`{ x }` in key: whitespace"));
        assert!(one_err("{1x}").contains("`1x` is not an identifier"));
        assert!(one_err("{x-y}").contains("`x-y` is not an identifier"));
        assert!(one_err("{type}").contains("`type` is not an identifier"));
        assert!(one_err("{0}").contains("not a position"));
        assert!(one_err("{x.01}").contains("`01` is not a tuple index"));
        assert!(one_err("{x.a-b}").contains("`a-b` is not a field name"));
        assert!(one_err("{x:?}").contains("format specs are not supported"));
    }

    #[test]
    fn bad_braces() {
        assert_eq!(
            one_err("order:{id"),
            "unclosed `{` in key: `{id` has no closing `}` (write `{{` for a literal `{`)"
        );
        assert!(one_err("order:{").contains("`{` has no closing `}`"));
        assert_eq!(
            one_err("order}"),
            "unmatched `}` in key: there is no `{` before it (write `}}` for a literal `}`)"
        );
        assert!(one_err("{a{b}").contains("`{` inside a placeholder"));
    }

    #[test]
    fn collects_every_error() {
        let e = errs("{}:{x.}:}:{ok}:{");
        assert_eq!(e.len(), 4, "{e:?}");
        assert!(e[0].contains("empty placeholder"));
        assert!(e[1].contains("{x.}"));
        assert!(e[2].contains("unmatched `}`"));
        assert!(e[3].contains("unclosed `{`"));
    }

    #[test]
    fn lenient_parse_keeps_the_good_placeholders() {
        let (pieces, errors) = parse_lenient("a:{x}:{}:{y.z}:{");
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert_eq!(
            pieces,
            vec![
                text("a:"),
                ph("{x}", "x", vec![]),
                text("::"),
                ph("{y.z}", "y", vec![named("z")]),
                text(":"),
            ]
        );
    }

    #[test]
    fn parameter_names() {
        let sig: Signature = syn::parse_quote! {
            fn f(
                &self,
                order: &Order,
                (a, b): (u8, u8),
                Point { x, y: why, .. }: Point,
                Wrapper(inner): Wrapper,
                &r: &u8,
                mut m: u8,
                whole @ Some(part): Option<u8>,
                _: u8,
                [first, ..]: [u8; 3],
                r#type: u8,
            )
        };
        assert_eq!(
            param_names(&sig),
            [
                "self", "order", "a", "b", "x", "why", "inner", "r", "m", "whole", "part", "first",
                "r#type"
            ]
        );
        let sig: Signature = syn::parse_quote!(fn consume(self, x: impl Display));
        assert_eq!(param_names(&sig), ["self", "x"]);
        let sig: Signature = syn::parse_quote!(fn none());
        assert!(param_names(&sig).is_empty());
    }

    /// Random templates built from the characters the parser cares about: it never
    /// panics, every error is a message, and brace-free text is one literal piece.
    #[test]
    fn fuzzed_templates_never_panic() {
        use rand::{Rng as _, SeedableRng as _};
        const PIECES: &[&str] = &[
            "{", "}", "{{", "}}", ".", "a", "b_1", "0", " ", ":", "é", "日", "*", "/", "\\", "\n",
            "r#",
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x7e41);
        for _ in 0..20_000 {
            let n = rng.random_range(0..12);
            let template: String = (0..n)
                .map(|_| PIECES[rng.random_range(0..PIECES.len())])
                .collect();
            let (pieces, errors) = parse_lenient(&template);
            assert!(errors.iter().all(|e| !e.is_empty()), "{template:?}");
            if !template.contains(['{', '}']) {
                assert!(errors.is_empty(), "{template:?}: {errors:?}");
                let expected = if template.is_empty() {
                    vec![]
                } else {
                    vec![text(&template)]
                };
                assert_eq!(pieces, expected, "{template:?}");
            }
        }
    }
}
