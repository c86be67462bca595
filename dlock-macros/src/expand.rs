//! Code generation: the user's attributes, visibility and signature verbatim, with a
//! body that acquires the lock around the original body.

use proc_macro2::{Group, Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned as _;
use syn::visit_mut::VisitMut;
use syn::{AttrStyle, Ident, ItemFn, LitStr, Member, ReturnType, Type};

use crate::parse::Args;
use crate::template::{Field, Piece};
use crate::validate::{self, BusyPolicy, LostPolicy, Mode, Model};

/// The whole attribute: parse, validate, generate. Never fails: errors become
/// `compile_error!`s emitted next to the original, unmodified item.
pub(crate) fn expand(attr: TokenStream, item: TokenStream) -> TokenStream {
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(_) => {
            let error = match syn::parse2::<syn::TraitItemFn>(item.clone()) {
                Ok(syn::TraitItemFn {
                    default: None,
                    semi_token: Some(semi),
                    ..
                }) => syn::Error::new(
                    semi.span,
                    "#[distributed_lock] needs a function body: put it on the method's \
                     implementation in an `impl` block, not on the trait's declaration",
                ),
                _ => syn::Error::new(
                    Span::call_site(),
                    "#[distributed_lock] can only be used on an `async fn` with a body \
                     (a free function, or a method in an `impl` block)",
                ),
            };
            return with_original(error, item);
        }
    };
    let args: Args = match syn::parse2(attr) {
        Ok(args) => args,
        Err(error) => return with_original(error, item),
    };
    match validate::validate(args, func) {
        Ok(model) => generate(&model),
        Err(error) => with_original(error, item),
    }
}

/// Every error as a `compile_error!`, followed by the item exactly as written, so
/// that the rest of the crate (and the IDE) still sees the function.
fn with_original(error: syn::Error, item: TokenStream) -> TokenStream {
    let errors = error.to_compile_error();
    quote! {
        #errors
        #item
    }
}

/// The runtime crate path: the user's `crate = "…"` (keeping the spans of its string
/// literal) or `::dlock_runtime` spanned at `span`.
fn krate(model: &Model, span: Span) -> TokenStream {
    match &model.krate {
        Some(path) => path.to_token_stream(),
        None => quote_spanned!(span=> ::dlock_runtime),
    }
}

/// Replaces every `impl Trait` in a type with `_`, so that the declared return type
/// can be written as a turbofish argument inside the body.
struct InferImplTrait;

impl VisitMut for InferImplTrait {
    fn visit_type_mut(&mut self, ty: &mut Type) {
        if let Type::ImplTrait(impl_trait) = ty {
            *ty = Type::Infer(syn::TypeInfer {
                underscore_token: syn::Token![_](impl_trait.impl_token.span),
            });
        } else {
            syn::visit_mut::visit_type_mut(self, ty);
        }
    }
}

/// `secs, nanos` for `Duration::new`, spanned at the argument's value.
fn duration(k: &TokenStream, d: validate::Spanned<std::time::Duration>) -> TokenStream {
    let secs = proc_macro2::Literal::u64_unsuffixed(d.value.as_secs());
    let nanos = proc_macro2::Literal::u32_unsuffixed(d.value.subsec_nanos());
    quote_spanned!(d.span=> #k::__private::Duration::new(#secs, #nanos))
}

fn generate(model: &Model) -> TokenStream {
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
    } = &model.func;
    let body_span = block.brace_token.span.join();
    let k = krate(model, Span::call_site());

    // Inner attributes (`#![allow(..)]`) stay at the top of the function body.
    let outer_attrs = attrs.iter().filter(|a| matches!(a.style, AttrStyle::Outer));
    let inner_attrs = attrs
        .iter()
        .filter(|a| matches!(a.style, AttrStyle::Inner(_)));

    // The spec constant.
    let function = LitStr::new(&sig.ident.unraw().to_string(), sig.ident.span());
    let wait = duration(&k, model.wait);
    let lease = duration(&k, model.lease);
    let on_busy = match model.on_busy.value {
        BusyPolicy::Fail => quote_spanned!(model.on_busy.span=> #k::__private::BusyPolicy::Fail),
        BusyPolicy::Skip => quote_spanned!(model.on_busy.span=> #k::__private::BusyPolicy::Skip),
    };
    let on_lost = match model.on_lost.value {
        LostPolicy::Cancel => {
            quote_spanned!(model.on_lost.span=> #k::__private::LostPolicy::Cancel)
        }
        LostPolicy::Continue => {
            quote_spanned!(model.on_lost.span=> #k::__private::LostPolicy::Continue)
        }
    };
    let watchdog = syn::LitBool::new(model.watchdog.value, model.watchdog.span);
    let fencing = syn::LitBool::new(model.fencing.value, model.fencing.span);
    let hold_at_least = match model.hold_at_least {
        Some(d) => {
            let d = duration(&k, d);
            quote_spanned!(d.span()=> ::core::option::Option::Some(#d))
        }
        None => quote!(::core::option::Option::None),
    };
    let max_hold = match model.max_hold {
        Some(d) => {
            let d = duration(&k, d);
            quote_spanned!(d.span()=> ::core::option::Option::Some(#d))
        }
        None => quote!(::core::option::Option::None),
    };
    let mode_span = model.mode.span;
    let mode = match model.mode.value {
        Mode::Exclusive => quote_spanned!(mode_span=> #k::__private::HoldMode::Exclusive),
        Mode::Shared => quote_spanned!(mode_span=> #k::__private::HoldMode::Shared),
        Mode::Permit(permits) => {
            let mut permits = proc_macro2::Literal::u32_unsuffixed(permits);
            permits.set_span(mode_span);
            quote_spanned!(mode_span=> #k::__private::HoldMode::Permit { permits: #permits })
        }
    };
    // The key label of the metrics: the templates as written (bounded).
    let key_template = LitStr::new(
        &model
            .keys
            .iter()
            .map(|t| t.lit.value())
            .collect::<Vec<_>>()
            .join(","),
        Span::call_site(),
    );
    let backend = match &model.backend {
        Some(name) => quote_spanned!(name.span()=> ::core::option::Option::Some(#name)),
        None => quote!(::core::option::Option::None),
    };

    // Each key: `format!("order:{}", &order.id)`, identifiers spanned at the
    // key literal so that they resolve to the function's parameters.
    // The `format!` path resolves at the call site even for a `crate = "…"` path
    // (keeping its location): with the user's spans, clippy would take the macro
    // call for user code and flag `format!("literal")` of constant keys
    // (`useless_format`).
    let format_k = respan_call_site(krate(model, Span::call_site()));
    let formats = model.keys.iter().map(|template| {
        let key_span = template.lit.span();
        let mut format = String::new();
        let mut key_args = Vec::new();
        for piece in &template.pieces {
            match piece {
                Piece::Text(text) => {
                    format.push_str(&text.replace('{', "{{").replace('}', "}}"));
                }
                Piece::Placeholder(p) => {
                    format.push_str("{}");
                    let root = ident(&p.root, key_span);
                    let fields = p.fields.iter().map(|field| match field {
                        Field::Named(name) => Member::Named(ident(name, key_span)),
                        Field::Index(index) => Member::Unnamed(syn::Index {
                            index: *index,
                            span: key_span,
                        }),
                    });
                    key_args.push(quote_spanned!(key_span=> &#root #(.#fields)*));
                }
            }
        }
        let format = LitStr::new(&format, key_span);
        quote!(#format_k::__private::format!(#format #(, #key_args)*))
    });
    let formats: Vec<TokenStream> = formats.collect();

    // Hygienic names: invisible to the user's body.
    let spec = Ident::new("__DLOCK_SPEC", Span::mixed_site());
    let key = Ident::new("__dlock_key", Span::mixed_site());
    let user_block = syn::Block {
        brace_token: block.brace_token,
        stmts: block.stmts.clone(),
    };

    // The call: `run_fail::<RET, _>(…).await`. The runtime's
    // `#[diagnostic::on_unimplemented]` errors must point at the user's return type.
    // rustc reports an unmet bound of `run_fail` at the turbofish argument, at the
    // call, and again at the `await` keyword (a single token). It shows identical
    // reports once, so every one of these is given the same one-token span: the
    // return type's anchor (`Result` in `io::Result<T>`). Otherwise a multi-token
    // type would get the same error twice, at the whole type and at one token.
    let (ret_ty, anchor) = match &sig.output {
        ReturnType::Type(_, ty) => {
            let anchor = anchor_span(ty);
            let mut ty = (**ty).clone();
            InferImplTrait.visit_type_mut(&mut ty);
            (respan(ty.to_token_stream(), anchor), anchor)
        }
        ReturnType::Default => {
            let span = sig.ident.span();
            (quote_spanned!(span=> ()), span)
        }
    };
    let run = match (model.on_busy.value, model.several) {
        (BusyPolicy::Fail, false) => Ident::new("run_fail", anchor),
        (BusyPolicy::Skip, false) => Ident::new("run_skip", anchor),
        (BusyPolicy::Fail, true) => Ident::new("run_fail_all", anchor),
        (BusyPolicy::Skip, true) => Ident::new("run_skip_all", anchor),
    };
    // A `crate = "…"` path is moved to the anchor too (otherwise the call would span
    // from the attribute to the return type); a path that does not resolve is then
    // reported at the return type as well as at the `crate` string.
    let call_k = respan(krate(model, anchor), anchor);
    // For a unit return (none, or `-> ()`) the call is a statement: as a tail
    // expression it would trip `clippy::semicolon_if_nothing_returned` in user crates.
    let semi = match &sig.output {
        ReturnType::Default => Some(quote_spanned!(anchor=> ;)),
        ReturnType::Type(_, ty) => match &**ty {
            Type::Tuple(tuple) if tuple.elems.is_empty() => Some(quote_spanned!(anchor=> ;)),
            _ => None,
        },
    };
    let call = quote_spanned! {anchor=>
        #call_k::__private::#run::<#ret_ty, _>(&#spec, #key, async move #user_block).await #semi
    };

    let key_binding = if model.several {
        quote! {
            let #key: #k::__private::Vec<#k::__private::String> =
                #k::__private::Vec::from([#(#formats),*]);
        }
    } else {
        quote!(let #key: #k::__private::String = #(#formats)*;)
    };

    quote_spanned! {body_span=>
        #(#outer_attrs)*
        #vis #sig {
            #(#inner_attrs)*
            const #spec: #k::__private::Spec = #k::__private::Spec {
                function: ::core::concat!(::core::module_path!(), "::", #function),
                wait: #wait,
                lease: #lease,
                on_busy: #on_busy,
                on_lost: #on_lost,
                watchdog: #watchdog,
                fencing: #fencing,
                hold_at_least: #hold_at_least,
                max_hold: #max_hold,
                key_template: #key_template,
                backend: #backend,
                mode: #mode,
            };
            #key_binding
            #call
        }
    }
}

/// The token of a return type that its errors point at: the last path segment's
/// name for a path (`Result` in `std::io::Result<T>`), else the first token.
fn anchor_span(ty: &Type) -> Span {
    match ty {
        Type::Path(path) => path
            .path
            .segments
            .last()
            .map_or_else(|| ty.span(), |segment| segment.ident.span()),
        Type::Paren(paren) => anchor_span(&paren.elem),
        Type::Group(group) => anchor_span(&group.elem),
        _ => ty.span(),
    }
}

/// `tokens` shown at `span`'s location. Only the location changes: each token keeps
/// its own name resolution (hygiene), so `$crate` and macro-generated names in the
/// user's return type still resolve.
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|token| match token {
            TokenTree::Group(group) => {
                let mut new = Group::new(group.delimiter(), respan(group.stream(), span));
                new.set_span(group.span().located_at(span));
                TokenTree::Group(new)
            }
            mut token => {
                token.set_span(token.span().located_at(span));
                token
            }
        })
        .collect()
}

/// `tokens` resolved as if written by the macro at its call site, each keeping its
/// location (for a path the user wrote in a string literal, the resolution is the
/// call site's anyway).
fn respan_call_site(tokens: TokenStream) -> TokenStream {
    tokens
        .into_iter()
        .map(|token| match token {
            TokenTree::Group(group) => {
                let mut new = Group::new(group.delimiter(), respan_call_site(group.stream()));
                new.set_span(Span::call_site().located_at(group.span()));
                TokenTree::Group(new)
            }
            mut token => {
                token.set_span(Span::call_site().located_at(token.span()));
                token
            }
        })
        .collect()
}

/// An identifier from a template name (`self`, `name` or raw `r#name`).
fn ident(name: &str, span: Span) -> Ident {
    match name.strip_prefix("r#") {
        Some(raw) => Ident::new_raw(raw, span),
        None => Ident::new(name, span),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand_str(attr: &str, item: &str) -> String {
        let attr: TokenStream = attr.parse().expect("attribute tokens");
        let item: TokenStream = item.parse().expect("item tokens");
        expand(attr, item).to_string()
    }

    #[test]
    fn replaces_only_the_body() {
        let out = expand_str(
            r#"key = "order:{order.id}", wait = "3s", lease = "1m 30s""#,
            "#[inline] pub async fn pay<T: Clone>(order: &Order) -> io::Result<impl Display> where T: Send { body() }",
        );
        let func: ItemFn = syn::parse_str(&out).expect("the output is one function");
        let original: ItemFn = syn::parse_str(
            "#[inline] pub async fn pay<T: Clone>(order: &Order) -> io::Result<impl Display> where T: Send {}",
        )
        .expect("a function");
        assert_eq!(func.attrs, original.attrs);
        assert_eq!(func.vis, original.vis);
        assert_eq!(func.sig, original.sig);

        let compact: String = out.split_whitespace().collect();
        for expected in [
            "const__DLOCK_SPEC:::dlock_runtime::__private::Spec=",
            "function:::core::concat!(::core::module_path!(),\"::\",\"pay\")",
            "wait:::dlock_runtime::__private::Duration::new(3,0)",
            "lease:::dlock_runtime::__private::Duration::new(90,0)",
            "on_busy:::dlock_runtime::__private::BusyPolicy::Fail",
            "on_lost:::dlock_runtime::__private::LostPolicy::Cancel",
            "watchdog:true",
            "fencing:true",
            "hold_at_least:::core::option::Option::None",
            "max_hold:::core::option::Option::None",
            "key_template:\"order:{order.id}\"",
            "backend:::core::option::Option::None",
            "mode:::dlock_runtime::__private::HoldMode::Exclusive",
            "let__dlock_key:::dlock_runtime::__private::String=::dlock_runtime::__private::format!(\"order:{}\",&order.id);",
            "::dlock_runtime::__private::run_fail::<io::Result<_>,_>(&__DLOCK_SPEC,__dlock_key,asyncmove{body()}).await",
        ] {
            assert!(compact.contains(expected), "missing {expected} in\n{out}");
        }
    }

    #[test]
    fn options_and_skip() {
        let out = expand_str(
            r#"key = "{{x}}:{self.0}:{p.a.1}", on_busy = "skip", on_lost = "continue",
               watchdog = false, fencing = false, hold_at_least = "1500ms", backend = "zk",
               crate = "my::rt""#,
            "async fn m(&self, p: P) { }",
        );
        let compact: String = out.split_whitespace().collect();
        for expected in [
            "my::rt::__private::run_skip::<(),_>(",
            "asyncmove{}).await;",
            "on_busy:my::rt::__private::BusyPolicy::Skip",
            "on_lost:my::rt::__private::LostPolicy::Continue",
            "watchdog:false",
            "fencing:false",
            "hold_at_least:::core::option::Option::Some(my::rt::__private::Duration::new(1,500000000))",
            "backend:::core::option::Option::Some(\"zk\")",
            "format!(\"{{x}}:{}:{}\",&self.0,&p.a.1)",
        ] {
            assert!(compact.contains(expected), "missing {expected} in\n{out}");
        }
    }

    #[test]
    fn several_keys_build_one_list() {
        let out = expand_str(
            r#"keys = ["acct:{from.id}", "acct:{to.id}"], on_busy = "skip""#,
            "async fn transfer(from: &Acct, to: &Acct) -> Option<u8> { None }",
        );
        let compact: String = out.split_whitespace().collect();
        for expected in [
            "let__dlock_key:::dlock_runtime::__private::Vec<::dlock_runtime::__private::String>=\
             ::dlock_runtime::__private::Vec::from([\
             ::dlock_runtime::__private::format!(\"acct:{}\",&from.id),\
             ::dlock_runtime::__private::format!(\"acct:{}\",&to.id)]);",
            "::dlock_runtime::__private::run_skip_all::<Option<u8>,_>(&__DLOCK_SPEC,__dlock_key,",
        ] {
            assert!(compact.contains(expected), "missing {expected} in\n{out}");
        }
    }

    #[test]
    fn inner_attributes_stay_at_the_top() {
        let out = expand_str(
            r#"key = "k""#,
            "async fn f() { #![allow(unused)] let x = 1; }",
        );
        let compact: String = out.split_whitespace().collect();
        assert!(
            compact.contains("{#![allow(unused)]const__DLOCK_SPEC"),
            "{out}"
        );
        assert!(compact.contains("asyncmove{letx=1;}"), "{out}");
    }

    #[test]
    fn errors_keep_the_original_function() {
        let item = "pub async fn f(a: u8) -> Option<u8> { Some(a) }";
        let out = expand_str(r#"key = "{b}", wait = "x""#, item);
        assert_eq!(out.matches("compile_error").count(), 2, "{out}");
        let original: TokenStream = item.parse().expect("item tokens");
        assert!(out.ends_with(&original.to_string()), "{out}");
    }

    #[test]
    fn not_a_function() {
        let out = expand_str(r#"key = "k""#, "struct S;");
        assert!(
            out.contains("can only be used on an `async fn` with a body"),
            "{out}"
        );
        assert!(out.ends_with("struct S ;"), "{out}");
        let out = expand_str(r#"key = "k""#, "async fn f(&self);");
        assert!(out.contains("needs a function body"), "{out}");
    }

    #[test]
    fn impl_trait_becomes_infer() {
        let mut ty: Type = syn::parse_quote!(Result<Vec<impl Display>, impl Error + Send>);
        InferImplTrait.visit_type_mut(&mut ty);
        assert_eq!(ty.to_token_stream().to_string(), "Result < Vec < _ > , _ >");
    }

    #[test]
    fn max_hold_and_the_template_of_several_keys() {
        let out = expand_str(
            r#"keys = ["a:{x}", "b:{y}"], lease = "10s", max_hold = "1m""#,
            "async fn f(x: u8, y: u8) { }",
        );
        let compact: String = out.split_whitespace().collect();
        for expected in [
            "max_hold:::core::option::Option::Some(::dlock_runtime::__private::Duration::new(60,0))",
            "key_template:\"a:{x},b:{y}\"",
        ] {
            assert!(compact.contains(expected), "missing {expected} in\n{out}");
        }
    }

    #[test]
    fn permits_become_a_permit_mode() {
        let out = expand_str(r#"key = "pay", permits = 3"#, "async fn f() {}");
        let compact: String = out.split_whitespace().collect();
        assert!(
            compact.contains("mode:::dlock_runtime::__private::HoldMode::Permit{permits:3}"),
            "{out}"
        );
        // A suffix is the user's; the field is a `u32` whatever they wrote.
        let out = expand_str(r#"key = "pay", permits = 1024u16"#, "async fn f() {}");
        let compact: String = out.split_whitespace().collect();
        assert!(compact.contains("HoldMode::Permit{permits:1024}"), "{out}");
    }

    #[test]
    fn one_permit_is_the_plain_lock() {
        let out = expand_str(r#"key = "k", permits = 1"#, "async fn f() {}");
        let compact: String = out.split_whitespace().collect();
        assert!(
            compact.contains("mode:::dlock_runtime::__private::HoldMode::Exclusive"),
            "{out}"
        );
        assert!(!compact.contains("Permit"), "{out}");
    }

    #[test]
    fn read_and_write_modes() {
        let out = expand_str(
            r#"key = "doc:{id}", mode = "read", crate = "my::rt""#,
            "async fn f(id: u8) {}",
        );
        let compact: String = out.split_whitespace().collect();
        assert!(
            compact.contains("mode:my::rt::__private::HoldMode::Shared"),
            "{out}"
        );
        let out = expand_str(r#"key = "doc", mode = "write""#, "async fn f() {}");
        let compact: String = out.split_whitespace().collect();
        assert!(
            compact.contains("mode:::dlock_runtime::__private::HoldMode::Exclusive"),
            "{out}"
        );
    }

    #[test]
    fn modes_with_several_keys() {
        let out = expand_str(
            r#"keys = ["a:{x}", "b:{x}"], permits = 2"#,
            "async fn f(x: u8) {}",
        );
        let compact: String = out.split_whitespace().collect();
        assert!(compact.contains("HoldMode::Permit{permits:2}"), "{out}");
        assert!(compact.contains("run_fail_all::<(),_>"), "{out}");
        let out = expand_str(
            r#"mode = "read", keys = ["a:{x}", "b:{x}"]"#,
            "async fn f(x: u8) {}",
        );
        let compact: String = out.split_whitespace().collect();
        assert!(compact.contains("HoldMode::Shared"), "{out}");
        assert!(compact.contains("run_fail_all::<(),_>"), "{out}");
    }

    #[test]
    fn a_bad_mode_keeps_the_original_function() {
        let item = "async fn f() {}";
        let out = expand_str(r#"key = "k", permits = 0, mode = "read""#, item);
        assert_eq!(out.matches("compile_error").count(), 2, "{out}");
        assert!(!out.contains("HoldMode"), "{out}");
        let original: TokenStream = item.parse().expect("item tokens");
        assert!(out.ends_with(&original.to_string()), "{out}");
    }
}
