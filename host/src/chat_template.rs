//! Chat templates: turning `messages` into a prompt.
//!
//! A GGUF model may carry its Hugging Face chat template (`tokenizer.chat_template`, Jinja);
//! it is rendered with minijinja the way `transformers` does — `trim_blocks`,
//! `lstrip_blocks`, the variables `messages`, `add_generation_prompt`, `bos_token` and
//! `eos_token`, a `raise_exception(message)` function (its message becomes the client's 400
//! error), `strftime_now(format)`, and Python string methods (`.strip()`, `.startswith()`, …)
//! through minijinja-contrib's pycompat. A model without a template gets a plain fallback:
//! one `Role: content` line per message and a closing `Assistant:`.

use minijinja::{context, Environment, Error, ErrorKind, Value};
use serde::Serialize;

/// The name of the template in its environment.
const NAME: &str = "chat";

/// Stop string that ends the assistant's turn with the fallback format.
pub const FALLBACK_STOP: &str = "\nUser:";

/// One chat message, content already flattened to text.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// Why a conversation could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The template refused the conversation (`raise_exception`) or failed on it.
    #[error("{0}")]
    Render(String),
    #[error("the model's chat template does not compile: {0}")]
    Compile(String),
}

/// A model's chat template, or the fallback.
pub struct ChatTemplate {
    env: Option<Environment<'static>>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("fallback", &self.is_fallback())
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// The template of a model: its GGUF's `tokenizer.chat_template`, or the fallback when it
    /// has none or it does not compile (then the second value says why).
    pub fn of_model(
        file: &specula_gguf::GgufFile,
        tokenizer: &specula_tokenizer::Tokenizer,
    ) -> (Self, Option<String>) {
        let token = |id: Option<u32>| {
            id.and_then(|id| tokenizer.token_text(id))
                .unwrap_or_default()
                .to_string()
        };
        match file.get_str("tokenizer.chat_template").ok().flatten() {
            Some(source) => match Self::new(
                Some(source),
                &token(tokenizer.bos()),
                &token(tokenizer.eos()),
            ) {
                Ok(t) => (t, None),
                Err(e) => (Self::fallback(), Some(e.to_string())),
            },
            None => (Self::fallback(), None),
        }
    }

    /// Compiles `source` (`None` = the fallback format). `bos_token` and `eos_token` are the
    /// texts of the model's special tokens, as templates expect them.
    pub fn new(source: Option<&str>, bos_token: &str, eos_token: &str) -> Result<Self, ChatError> {
        let env = match source {
            Some(source) => {
                let mut env = Environment::new();
                env.set_trim_blocks(true);
                env.set_lstrip_blocks(true);
                env.set_unknown_method_callback(
                    minijinja_contrib::pycompat::unknown_method_callback,
                );
                env.add_function("raise_exception", raise_exception);
                env.add_function("strftime_now", strftime_now);
                env.add_template_owned(NAME, source.to_string())
                    .map_err(|e| ChatError::Compile(describe(&e)))?;
                Some(env)
            }
            None => None,
        };
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The plain `Role: content` format.
    pub fn fallback() -> Self {
        Self {
            env: None,
            bos_token: String::new(),
            eos_token: String::new(),
        }
    }

    /// Whether this is the plain fallback (the model has no usable template).
    pub fn is_fallback(&self) -> bool {
        self.env.is_none()
    }

    /// Stop strings the format needs so that generation ends with the assistant's turn.
    pub fn stops(&self) -> &'static [&'static str] {
        if self.is_fallback() {
            &[FALLBACK_STOP]
        } else {
            &[]
        }
    }

    /// Renders a conversation; with `add_generation_prompt`, ends where the assistant's reply
    /// begins.
    /// The prompt for the assistant's next turn after `messages`, and whether the tokenizer
    /// should still add BOS (`add_bos` asked for it; a template that writes BOS itself keeps
    /// it from being added twice).
    pub fn prompt(
        &self,
        messages: &[ChatMessage],
        tokenizer: &specula_tokenizer::Tokenizer,
        mut add_bos: bool,
    ) -> Result<(String, bool), ChatError> {
        let mut text = self.render(messages, true)?;
        let bos = tokenizer.bos().and_then(|b| tokenizer.token_text(b));
        if let Some(bos) = bos.filter(|b| !b.is_empty() && text.starts_with(*b)) {
            if add_bos && tokenizer.add_bos() {
                text.drain(..bos.len());
            } else {
                add_bos = false;
            }
        }
        Ok((text, add_bos))
    }

    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let Some(env) = &self.env else {
            return Ok(render_fallback(messages, add_generation_prompt));
        };
        let template = env
            .get_template(NAME)
            .map_err(|e| ChatError::Render(describe(&e)))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| ChatError::Render(describe(&e)))
    }
}

fn render_fallback(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    let mut out = String::new();
    for m in messages {
        let mut role = m.role.trim().to_string();
        if let Some(first) = role.get(..1) {
            role = first.to_uppercase() + &role[1..];
        }
        out.push_str(&role);
        out.push_str(": ");
        out.push_str(m.content.trim());
        out.push('\n');
    }
    if add_generation_prompt {
        out.push_str("Assistant:");
    }
    out
}

/// `raise_exception(message)`: templates call it to refuse a conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// An error's message without minijinja's template-location decoration, but with the
/// detail of a failed operation.
fn describe(e: &Error) -> String {
    match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(detail)) => detail.to_string(),
        _ => {
            let mut text = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(s) = source {
                text.push_str(": ");
                text.push_str(&s.to_string());
                source = s.source();
            }
            text
        }
    }
}

/// `strftime_now(format)`: the current UTC date and time (templates put today's date in the
/// system prompt). Supports `%d %m %y %Y %b %B %H %M %S %j %%`.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(format.as_str(), secs)
}

fn strftime(format: &str, unix_secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = (unix_secs / 86_400) as i64;
    let secs = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('Y') => out.push_str(&year.to_string()),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(role, content)| ChatMessage {
                role: role.to_string(),
                content: content.to_string(),
            })
            .collect()
    }

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// Llama 2's template (abridged): BOS per turn, alternation enforced with raise_exception.
    const LLAMA2: &str = "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}";

    #[test]
    fn chatml_renders_with_the_generation_prompt() {
        let t = ChatTemplate::new(Some(CHATML), "<s>", "</s>").unwrap();
        let text = t
            .render(&msgs(&[("system", "Be brief."), ("user", "Hi")]), true)
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(t.stops().is_empty());
    }

    #[test]
    fn llama2_uses_bos_eos_and_python_methods() {
        let t = ChatTemplate::new(Some(LLAMA2), "<s>", "</s>").unwrap();
        let text = t
            .render(
                &msgs(&[
                    ("system", "S"),
                    ("user", " Hi "),
                    ("assistant", "Hello"),
                    ("user", "  Bye "),
                ]),
                true,
            )
            .unwrap();
        assert_eq!(
            text,
            "<s>[INST] <<SYS>>\nS\n<</SYS>>\n\n Hi [/INST] Hello </s><s>[INST] Bye [/INST]"
        );
    }

    #[test]
    fn raise_exception_becomes_the_error_message() {
        let t = ChatTemplate::new(Some(LLAMA2), "<s>", "</s>").unwrap();
        let err = t
            .render(&msgs(&[("user", "a"), ("user", "b")]), true)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "Conversation roles must alternate user/assistant/user/assistant/..."
        );
    }

    #[test]
    fn a_broken_template_is_a_compile_error() {
        let err = ChatTemplate::new(Some("{% for x in %}"), "", "").unwrap_err();
        assert!(matches!(err, ChatError::Compile(_)), "{err}");
    }

    #[test]
    fn fallback_is_role_lines_and_an_assistant_prompt() {
        let t = ChatTemplate::fallback();
        let text = t
            .render(
                &msgs(&[("system", "Tell stories."), ("user", "Once upon a time")]),
                true,
            )
            .unwrap();
        assert_eq!(
            text,
            "System: Tell stories.\nUser: Once upon a time\nAssistant:"
        );
        assert_eq!(t.stops(), &[FALLBACK_STOP]);
    }

    #[test]
    fn strftime_formats_dates() {
        // 2024-02-29 13:05:09 UTC
        let t = 1_709_211_909;
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %B %j %%", t),
            "2024-02-29 13:05:09 February 060 %"
        );
        assert_eq!(strftime("%d/%m/%y", 0), "01/01/70");
    }
}
