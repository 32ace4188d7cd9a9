//! Pre-tokenizers of byte-level BPE models: the regex sets chosen by `tokenizer.ggml.pre`.
//!
//! A set is a list of regexes applied in sequence, as llama.cpp does: the first splits the text
//! into matches *and* the unmatched gaps between them (both become fragments); each following
//! regex splits every fragment of the previous step the same way, seeing only that fragment
//! (so `$` and look-ahead stop at the fragment's end). BPE then runs on each final fragment,
//! so no token ever crosses a fragment boundary.
//!
//! The patterns are the models' published split regexes written for Rust's regex syntax.
//! Where llama.cpp's engine gives a pattern a different meaning from its text, we follow
//! llama.cpp's behaviour (noted at the pattern).

use fancy_regex::{Regex, RegexBuilder};

/// Contractions, case-insensitive (`'s`, `'T`, `'Re`, ...), as in the Llama 3 / Qwen 2 sets.
macro_rules! contractions_ci {
    () => {
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    };
}

/// GPT-2's split: contractions, optional space + letters, optional space + digits,
/// optional space + other symbols, whitespace not followed by a non-space, other whitespace.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3: like GPT-2 but letters may take one leading non-letter/non-digit (not CR/LF),
/// numbers split in groups of at most three digits, punctuation runs keep trailing newlines,
/// and whitespace ending in a newline is one fragment.
const LLAMA3: &str = concat!(
    contractions_ci!(),
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// Qwen 2: Llama 3's split with single digits.
const QWEN2: &str = concat!(
    contractions_ci!(),
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// Qwen 3.5: Qwen 2's split with combining marks kept inside words.
const QWEN35: &str = concat!(
    contractions_ci!(),
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// CJK ideographs U+4E00..U+9FA5, U+0800..U+4E00 and Hangul U+AC00..U+D7FF, as in DeepSeek's
/// sets. llama.cpp matches this class after turning non-ASCII whitespace into U+000B, so the
/// whitespace inside U+0800..U+4E00 (U+1680, U+2000.., U+3000, ...) never matches: `&&\S`.
const DEEPSEEK_CJK: &str = r"[\x{4E00}-\x{9FA5}\x{0800}-\x{4E00}\x{AC00}-\x{D7FF}&&\S]+";

/// DeepSeek LLM's letter class: cased letters (Latin, Greek, Cyrillic, Armenian, Georgian,
/// Cherokee, Glagolitic, Coptic, full-width Latin, Deseret, Osage, Old Hungarian, Warang
/// Citi, Adlam and the cased letter-like symbols), an optional whitespace before them.
const DEEPSEEK_LLM_LETTERS: &str = concat!(
    r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}",
    r"\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}",
    r"\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}",
    r"\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}",
    r"\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}",
    r"\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}",
    r"\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}",
    r"\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}",
    r"\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}",
    r"\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}",
    r"\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}",
    r"\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}",
    r"\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}",
    r"\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}",
    r"\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}",
    r"\x{1E900}-\x{1E943}]+"
);

/// DeepSeek LLM's punctuation class: ASCII `!`..`/` and `:`..`~`, their full-width forms,
/// curly quotes U+2018..U+201F and U+3001..U+3002 (the published class starts at U+3000,
/// which llama.cpp treats as whitespace, so it never matches there).
const DEEPSEEK_LLM_PUNCT: &str =
    r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3001}-\x{3002}]+";

/// A known pre-tokenizer: its canonical name, the `tokenizer.ggml.pre` values that select it,
/// its regexes, and llama.cpp's defaults that depend on it.
pub(crate) struct PreSpec {
    pub name: &'static str,
    aliases: &'static [&'static str],
    patterns: &'static [&'static str],
    /// Default for `tokenizer.ggml.add_bos_token` when the key is absent.
    pub add_bos: bool,
    /// Whether a fragment that is itself a token skips BPE (Llama 3's `ignore_merges`).
    pub ignore_merges: bool,
}

const SPECS: &[PreSpec] = &[
    PreSpec {
        name: "default",
        aliases: &["default"],
        patterns: &[r"[\p{P}$+<=>^~|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
        add_bos: false,
        ignore_merges: false,
    },
    PreSpec {
        name: "gpt-2",
        aliases: &[
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "jina-v2-es",
            "jina-v2-de",
            "gigachat",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
            "trillion",
            "mellum",
            "a.x-4.0",
        ],
        patterns: &[GPT2],
        add_bos: false,
        ignore_merges: false,
    },
    PreSpec {
        name: "llama-bpe",
        aliases: &[
            "llama-bpe",
            "llama3",
            "llama-v3",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
        ],
        patterns: &[LLAMA3],
        add_bos: true,
        ignore_merges: true,
    },
    PreSpec {
        name: "dbrx",
        aliases: &["dbrx", "smaug-bpe"],
        patterns: &[LLAMA3],
        add_bos: false,
        ignore_merges: false,
    },
    PreSpec {
        name: "qwen2",
        aliases: &[
            "qwen2",
            "deepseek-r1-qwen",
            "megrez",
            "stablelm2",
            "hunyuan",
            "kormo",
            "f2llmv2",
            "solar-open",
        ],
        patterns: &[QWEN2],
        add_bos: false,
        ignore_merges: false,
    },
    PreSpec {
        name: "qwen35",
        aliases: &["qwen35"],
        patterns: &[QWEN35],
        add_bos: false,
        ignore_merges: false,
    },
    PreSpec {
        name: "deepseek-llm",
        aliases: &["deepseek-llm"],
        patterns: &[
            r"[\r\n]",
            DEEPSEEK_LLM_LETTERS,
            DEEPSEEK_LLM_PUNCT,
            r"\s+$",
            DEEPSEEK_CJK,
            r"\p{N}+",
        ],
        add_bos: false,
        ignore_merges: false,
    },
    PreSpec {
        name: "deepseek-coder",
        aliases: &["deepseek-coder"],
        patterns: &[
            r"[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            DEEPSEEK_CJK,
            r"\p{N}",
        ],
        add_bos: false,
        ignore_merges: false,
    },
    PreSpec {
        name: "deepseek-v3",
        aliases: &["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"],
        patterns: &[
            r"\p{N}{1,3}",
            r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
            concat!(
                r"[!-/:-@\[-`{-~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+",
                r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            ),
        ],
        add_bos: false,
        ignore_merges: false,
    },
    PreSpec {
        name: "falcon",
        aliases: &["falcon"],
        patterns: &[r"[\p{P}$+<=>^~|`]+", GPT2, r"[0-9][0-9][0-9]"],
        add_bos: false,
        ignore_merges: false,
    },
    PreSpec {
        name: "starcoder",
        aliases: &[
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        patterns: &[r"\p{N}", GPT2],
        add_bos: false,
        ignore_merges: false,
    },
];

/// The spec selected by a `tokenizer.ggml.pre` value.
pub(crate) fn spec(pre: &str) -> Option<&'static PreSpec> {
    SPECS.iter().find(|s| s.aliases.contains(&pre))
}

/// Every accepted `tokenizer.ggml.pre` value, for error messages.
pub(crate) fn known_names() -> String {
    SPECS
        .iter()
        .flat_map(|s| s.aliases.iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}

/// fancy-regex's default (one million) is reached by a single match over a million-character
/// whitespace run (`\s+(?!\S)` keeps one backtrack point per character). These patterns have
/// no nested repetition, so backtracking stays linear in the fragment; the limit only guards
/// against a runaway and, if ever hit, leaves the rest of the fragment unsplit.
const BACKTRACK_LIMIT: usize = 1 << 30;

/// A compiled regex set.
pub(crate) struct PreTokenizer {
    pub spec: &'static PreSpec,
    regexes: Vec<Regex>,
}

impl PreTokenizer {
    pub fn new(spec: &'static PreSpec) -> Result<Self, String> {
        let regexes = spec
            .patterns
            .iter()
            .map(|p| {
                RegexBuilder::new(p)
                    .backtrack_limit(BACKTRACK_LIMIT)
                    .build()
                    .map_err(|e| format!("pre-tokenizer '{}': {e}", spec.name))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { spec, regexes })
    }

    /// Splits `text` into fragments (in order, covering all of it, none empty).
    pub fn split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut fragments = vec![text];
        let mut next = Vec::new();
        for re in &self.regexes {
            next.clear();
            for &fragment in &fragments {
                split_one(re, fragment, &mut next);
            }
            std::mem::swap(&mut fragments, &mut next);
        }
        fragments.retain(|f| !f.is_empty());
        fragments
    }
}

/// Splits one fragment into the matches of `re` and the gaps between them.
fn split_one<'t>(re: &Regex, fragment: &'t str, out: &mut Vec<&'t str>) {
    let mut last = 0;
    for m in re.find_iter(fragment) {
        match m {
            Ok(m) => {
                if m.start() == m.end() {
                    continue;
                }
                if m.start() > last {
                    out.push(&fragment[last..m.start()]);
                }
                out.push(m.as_str());
                last = m.end();
            }
            Err(e) => {
                // Only a backtracking limit can fail here; keep the rest whole.
                tracing::debug!("pre-tokenizer regex gave up on a fragment: {e}");
                break;
            }
        }
    }
    if last < fragment.len() {
        out.push(&fragment[last..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_set_compiles() {
        for spec in SPECS {
            PreTokenizer::new(spec).unwrap();
        }
    }

    fn split(name: &str, text: &str) -> Vec<String> {
        let pre = PreTokenizer::new(spec(name).unwrap()).unwrap();
        pre.split(text).into_iter().map(String::from).collect()
    }

    #[test]
    fn gpt2_splits() {
        assert_eq!(split("gpt-2", "Hello world"), ["Hello", " world"]);
        assert_eq!(split("gpt-2", "  \n\n  x"), ["  \n\n ", " x"]);
        assert_eq!(
            split("gpt-2", "I'm 1234 ok!?"),
            ["I", "'m", " 1234", " ok", "!?"]
        );
        assert_eq!(split("gpt-2", "a  "), ["a", "  "]);
    }

    #[test]
    fn llama3_splits() {
        assert_eq!(split("llama-bpe", "1234567"), ["123", "456", "7"]);
        assert_eq!(split("llama-bpe", "I'M here"), ["I", "'M", " here"]);
        assert_eq!(split("llama-bpe", "  \n\n  x"), ["  \n\n", " ", " x"]);
        assert_eq!(split("llama-bpe", "(hi);\n"), ["(hi", ");\n"]);
        assert_eq!(split("qwen2", "x=123"), ["x", "=", "1", "2", "3"]);
    }

    /// Qwen 3.5 keeps combining marks inside words (decomposed accents, Indic vowel signs and
    /// viramas); Qwen 2's split leaves each mark to the punctuation rule.
    #[test]
    fn qwen35_keeps_combining_marks_inside_words() {
        let text = "cafe\u{301} na\u{308}ive \u{928}\u{92e}\u{938}\u{94d}\u{924}\u{947}";
        assert_eq!(
            split("qwen35", text),
            [
                "cafe\u{301}",
                " na\u{308}ive",
                " \u{928}\u{92e}\u{938}\u{94d}\u{924}\u{947}"
            ]
        );
        assert_eq!(
            split("qwen2", "cafe\u{301} na\u{308}ive"),
            ["cafe", "\u{301}", " na", "\u{308}ive"]
        );
        // A mark after a non-letter is not pulled into a word.
        assert_eq!(split("qwen35", "1\u{301}x"), ["1", "\u{301}x"]);
    }

    #[test]
    fn sequenced_sets() {
        assert_eq!(split("starcoder", "abc 123"), ["abc", " ", "1", "2", "3"]);
        assert_eq!(
            split("falcon", "a, b!! 1234567"),
            ["a", ",", " b", "!!", " ", "123", "456", "7"]
        );
        assert_eq!(
            split("deepseek-coder", "a = b\r\n12"),
            ["a", " =", " b", "\r", "\n", "1", "2"]
        );
        assert_eq!(
            split("deepseek-llm", "Hi, 你好 12  "),
            ["Hi", ",", " ", "你好", " ", "12", "  "]
        );
    }
}
