//! Which storage type each matrix gets: the model's one weight type, or a mix as llama.cpp's
//! quantizer writes its `_M` file types.

use specula_gguf::GgmlType;

/// How the matrices of a model are typed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TypeMix {
    /// Every matrix in the model's weight type.
    #[default]
    Uniform,
    /// llama.cpp's `Q4_K_M` (the model's weight type is Q4_K): Q6_K for the output projection
    /// (the token embedding when it is tied), and for the `attn_v`-like matrices (`attn_v`, the
    /// Gated DeltaNet's fused `attn_qkv`) and the `ffn_down` matrices of about half the blocks
    /// — the first and last eighth and every third one between ([`more_bits`]); Q4_K
    /// elsewhere; the MoE router (`ffn_gate_inp`) stays F32.
    Q4KM,
}

impl TypeMix {
    /// The name `gen-model --type` takes for this mix over `base`.
    pub fn name(self, base: GgmlType) -> String {
        match self {
            TypeMix::Uniform => base.to_string(),
            TypeMix::Q4KM => "q4_K_M".to_string(),
        }
    }

    /// The mix and base type called `name` (`q4_K_M`), if `name` is a mix.
    pub fn from_name(name: &str) -> Option<(TypeMix, GgmlType)> {
        name.eq_ignore_ascii_case("q4_K_M")
            .then_some((TypeMix::Q4KM, GgmlType::Q4K))
    }

    /// The type of matrix `name` (a GGUF tensor name) in a model of `blocks` blocks (the MTP
    /// block included) whose matrices are `base` unless the mix says otherwise; `tied`: the
    /// token embedding is also the output projection.
    pub fn type_of(self, name: &str, base: GgmlType, blocks: u32, tied: bool) -> GgmlType {
        match self {
            TypeMix::Uniform => base,
            TypeMix::Q4KM => {
                let block = || {
                    name.strip_prefix("blk.")
                        .and_then(|rest| rest.split('.').next())
                        .and_then(|n| n.parse::<u32>().ok())
                };
                if name == "output.weight" || (tied && name == "token_embd.weight") {
                    GgmlType::Q6K
                } else if name.contains("ffn_gate_inp") {
                    GgmlType::F32
                } else if name.contains("attn_v.weight")
                    || name.contains("attn_qkv.weight")
                    || name.contains("ffn_down")
                {
                    // llama.cpp counts attn_v and the fused attn_qkv together (its attn_v-like
                    // branch comes first in its chain of rules, so its separate Q5_K rule for
                    // attn_qkv never applies); every block here has exactly one of them, so a
                    // matrix's index among them is its block's.
                    match block() {
                        Some(b) if more_bits(b, blocks) => GgmlType::Q6K,
                        _ => base,
                    }
                } else {
                    base
                }
            }
        }
    }
}

/// llama.cpp's choice of the blocks whose sensitive matrices get more bits: the first and last
/// eighth, and every third block between.
pub fn more_bits(block: u32, blocks: u32) -> bool {
    let (b, n) = (block as i64, blocks as i64);
    b < n / 8 || b >= 7 * n / 8 || (b - n / 8) % 3 == 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_m_gives_half_the_sensitive_matrices_six_bits() {
        // 28 blocks (qwen3-0.6b): blocks 0-2, 24-27 and 5, 8, ..., 23 between.
        let chosen: Vec<u32> = (0..28).filter(|&b| more_bits(b, 28)).collect();
        assert_eq!(chosen, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]);
        let m = TypeMix::Q4KM;
        let q4 = GgmlType::Q4K;
        assert_eq!(
            m.type_of("blk.5.attn_v.weight", q4, 28, true),
            GgmlType::Q6K
        );
        assert_eq!(m.type_of("blk.6.attn_v.weight", q4, 28, true), q4);
        assert_eq!(
            m.type_of("blk.27.ffn_down.weight", q4, 28, true),
            GgmlType::Q6K
        );
        assert_eq!(
            m.type_of("blk.0.attn_qkv.weight", q4, 28, true),
            GgmlType::Q6K
        );
        assert_eq!(m.type_of("blk.3.ffn_down_exps.weight", q4, 28, true), q4);
        assert_eq!(
            m.type_of("blk.3.ffn_gate_inp.weight", q4, 28, true),
            GgmlType::F32
        );
        assert_eq!(m.type_of("blk.1.attn_q.weight", q4, 28, true), q4);
        assert_eq!(m.type_of("token_embd.weight", q4, 28, true), GgmlType::Q6K);
        assert_eq!(m.type_of("token_embd.weight", q4, 28, false), q4);
        assert_eq!(m.type_of("output.weight", q4, 28, false), GgmlType::Q6K);
        assert_eq!(TypeMix::from_name("Q4_K_M"), Some((TypeMix::Q4KM, q4)));
        assert_eq!(TypeMix::from_name("q4_K"), None);
        assert_eq!(TypeMix::Uniform.type_of("output.weight", q4, 28, false), q4);
    }
}
