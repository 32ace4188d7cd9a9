//! How serde's messages name the types they expected, in a user's words: a profile key or a
//! request field that wants a number says so, not `u32`.

/// `message` with Rust's type names (`expected u32`) as what a user would write.
pub fn plain_type_names(message: &str) -> String {
    const NAMES: [(&str, &str); 10] = [
        ("u8", "a whole number (0 or more)"),
        ("u16", "a whole number (0 or more)"),
        ("u32", "a whole number (0 or more)"),
        ("u64", "a whole number (0 or more)"),
        ("usize", "a whole number (0 or more)"),
        ("i32", "a whole number"),
        ("i64", "a whole number"),
        ("isize", "a whole number"),
        ("f32", "a number"),
        ("f64", "a number"),
    ];
    let mut text = message.to_string();
    for (rust, plain) in NAMES {
        for lead in ["expected ", "as "] {
            let from = format!("{lead}{rust}");
            // Only whole words: `expected u32`, not `expected u32x` (there is none, but a
            // message quoting a user's text could hold anything after it).
            let mut out = String::with_capacity(text.len());
            let mut rest = text.as_str();
            while let Some(at) = rest.find(&from) {
                let end = at + from.len();
                let whole = rest[end..]
                    .chars()
                    .next()
                    .is_none_or(|c| !c.is_alphanumeric() && c != '_');
                out.push_str(&rest[..at]);
                if whole {
                    out.push_str(lead);
                    out.push_str(plain);
                } else {
                    out.push_str(&from);
                }
                rest = &rest[end..];
            }
            out.push_str(rest);
            text = out;
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_type_names_become_words() {
        assert_eq!(
            plain_type_names("invalid type: string \"abc\", expected u32"),
            "invalid type: string \"abc\", expected a whole number (0 or more)"
        );
        assert_eq!(
            plain_type_names("invalid type: string \"x\", expected f32; expected i64"),
            "invalid type: string \"x\", expected a number; expected a whole number"
        );
        assert_eq!(
            plain_type_names("cannot parse \"abc\" as usize"),
            "cannot parse \"abc\" as a whole number (0 or more)"
        );
        assert_eq!(plain_type_names("expected u32x"), "expected u32x");
        assert_eq!(plain_type_names("nothing to change"), "nothing to change");
    }
}
