//! Chat templates: a model's own Jinja template (`tokenizer.chat_template` in GGUF metadata or
//! `tokenizer_config.json`) rendered with minijinja, with the globals HF templates expect
//! (`bos_token`, `eos_token`, `add_generation_prompt`, `raise_exception`) and a few Python string
//! methods (`strip`, `startswith`, ...) that templates commonly call.

use minijinja::value::{Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};

use crate::{ChatMessage, TextError};

/// The special-token strings a template sees as globals (transformers passes the tokenizer's
/// `special_tokens_map`): `bos_token` and `eos_token` always (empty when the model has none, so a
/// template that prints them still renders), `unk_token` / `pad_token` only when the model has them,
/// so `{% if pad_token is defined %}` works as in Python.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: String,
    pub eos: String,
    pub unk: Option<String>,
    pub pad: Option<String>,
}

/// A compiled chat template plus the special-token strings it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    tokens: SpecialTokens,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("tokens", &self.tokens)
            .finish()
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source` with only `bos_token` / `eos_token` defined.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TextError> {
        Self::with_tokens(
            source,
            SpecialTokens {
                bos: bos_token.to_owned(),
                eos: eos_token.to_owned(),
                ..SpecialTokens::default()
            },
        )
    }

    /// Compiles `source`; a syntax error is reported here rather than per request.
    pub fn with_tokens(source: &str, tokens: SpecialTokens) -> Result<Self, TextError> {
        let mut env = Environment::new();
        // HF renders with trim_blocks + lstrip_blocks (transformers' `_compile_jinja_template`).
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TextError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.set_unknown_method_callback(python_methods);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|e| TextError::Template(e.to_string()))?;
        Ok(Self { env, tokens })
    }

    /// Renders `messages` to the prompt text.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| TextError::Template(e.to_string()))?;
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| {
                minijinja::context! { role => &*m.role, content => &*m.content }
            })
            .collect();
        let t = &self.tokens;
        // `Value::UNDEFINED` for an absent token keeps `is defined` tests meaningful.
        let optional = |s: &Option<String>| s.as_deref().map_or(Value::UNDEFINED, Value::from);
        let ctx = minijinja::context! {
            messages => msgs,
            add_generation_prompt => add_generation_prompt,
            bos_token => t.bos.as_str(),
            eos_token => t.eos.as_str(),
            unk_token => optional(&t.unk),
            pad_token => optional(&t.pad),
        };
        tmpl.render(ctx)
            .map_err(|e| TextError::Template(e.to_string()))
    }
}

/// The Python `str`/`dict` methods HF chat templates use most.
fn python_methods(
    state: &mut minijinja::State<'_, '_>,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    let arg_str = |i: usize| args.get(i).and_then(|v| v.as_str()).map(str::to_owned);
    match (value.kind(), method) {
        (ValueKind::String, _) => {
            let s = value.as_str().unwrap_or_default();
            match method {
                "strip" => Ok(Value::from(match arg_str(0) {
                    Some(c) => s.trim_matches(|ch| c.contains(ch)),
                    None => s.trim(),
                })),
                "lstrip" => Ok(Value::from(match arg_str(0) {
                    Some(c) => s.trim_start_matches(|ch| c.contains(ch)),
                    None => s.trim_start(),
                })),
                "rstrip" => Ok(Value::from(match arg_str(0) {
                    Some(c) => s.trim_end_matches(|ch| c.contains(ch)),
                    None => s.trim_end(),
                })),
                "startswith" => Ok(Value::from(arg_str(0).is_some_and(|p| s.starts_with(&p)))),
                "endswith" => Ok(Value::from(arg_str(0).is_some_and(|p| s.ends_with(&p)))),
                "upper" => Ok(Value::from(s.to_uppercase())),
                "lower" => Ok(Value::from(s.to_lowercase())),
                "replace" => match (arg_str(0), arg_str(1)) {
                    (Some(a), Some(b)) => Ok(Value::from(s.replace(&a, &b))),
                    _ => Err(Error::from(ErrorKind::MissingArgument)),
                },
                "split" => Ok(Value::from(match arg_str(0) {
                    Some(sep) => s.split(sep.as_str()).map(Value::from).collect::<Vec<_>>(),
                    None => s.split_whitespace().map(Value::from).collect::<Vec<_>>(),
                })),
                _ => Err(Error::from(ErrorKind::UnknownMethod)),
            }
        }
        (ValueKind::Map, "items") => state.apply_filter("items", std::slice::from_ref(value)),
        (ValueKind::Map, "get") => {
            let key = args.first().cloned().unwrap_or_default();
            match value.get_item(&key) {
                Ok(v) if !v.is_undefined() => Ok(v),
                _ => Ok(args.get(1).cloned().unwrap_or_default()),
            }
        }
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg<'a>(role: &'a str, content: &'a str) -> ChatMessage<'a> {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_smollm2_template() {
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").expect("compiles");
        let out = t.render(&[msg("user", "Hi")], true).expect("renders");
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_gen = t
            .render(&[msg("system", "S"), msg("user", "Hi")], false)
            .expect("renders");
        assert_eq!(
            no_gen,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ bos_token }}{{ messages[0]['content'].strip() }}";
        let t = ChatTemplate::new(src, "<s>", "</s>").expect("compiles");
        let err = t
            .render(&[msg("assistant", "x")], false)
            .expect_err("must fail");
        assert!(err.to_string().contains("first must be user"), "{err}");
        assert_eq!(
            t.render(&[msg("user", "  hi ")], false).expect("renders"),
            "<s>hi"
        );
    }

    #[test]
    fn syntax_errors_are_reported_at_construction() {
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }
}
