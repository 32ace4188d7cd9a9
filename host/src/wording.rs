//! How serde's messages name the types they expected, in a user's words: a profile key or a
//! request field that wants a number says so, not `u32`.

/// `message` with Rust's type names (`expected u32`) as what a user would write.
pub fn plain_type_names(message: &str) -> String {
    static RUST_TYPE: std::sync::LazyLock<fancy_regex::Regex> = std::sync::LazyLock::new(|| {
        fancy_regex::Regex::new(r"\b(expected|as) (u8|u16|u32|u64|usize|i32|i64|isize|f32|f64)\b")
            .expect("valid pattern")
    });
    RUST_TYPE
        .replace_all(message, |caps: &fancy_regex::Captures<'_>| {
            let plain = match &caps[2] {
                "f32" | "f64" => "a number",
                unsigned if unsigned.starts_with('u') => "a whole number (0 or more)",
                _ => "a whole number",
            };
            format!("{} {plain}", &caps[1])
        })
        .into_owned()
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
