//! The shape of a model to write.

use specula_gguf::GgmlType;

use crate::mix::TypeMix;

use crate::GenError;

/// An architecture the writer produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    /// llama with q/k/v biases and NeoX RoPE (Qwen2 / Qwen2.5).
    Qwen2,
    Qwen3,
    Qwen35,
    Qwen3Next,
}

impl Arch {
    /// `general.architecture`.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen35 => "qwen35",
            Arch::Qwen3Next => "qwen3next",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [
            Arch::Llama,
            Arch::Qwen2,
            Arch::Qwen3,
            Arch::Qwen35,
            Arch::Qwen3Next,
        ]
        .into_iter()
        .find(|a| a.gguf_name() == name)
    }

    pub fn is_hybrid(self) -> bool {
        matches!(self, Arch::Qwen35 | Arch::Qwen3Next)
    }

    /// Whether attention has per-head q/k RMSNorm weights (qwen3 and the hybrids).
    pub fn has_qk_norm(self) -> bool {
        !matches!(self, Arch::Llama | Arch::Qwen2)
    }
}

/// The Gated DeltaNet part of a hybrid model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HybridSpec {
    /// Head size of the recurrent state (`ssm.state_size`).
    pub state_size: u32,
    /// Key heads (`ssm.group_count`).
    pub k_heads: u32,
    /// Value heads (`ssm.time_step_rank`).
    pub v_heads: u32,
    pub conv_kernel: u32,
    /// Layer `i` is full attention iff `(i + 1) % interval == 0`.
    pub full_attention_interval: u32,
}

/// The MoE FFN of `qwen3next`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeSpec {
    pub experts: u32,
    pub experts_used: u32,
    pub expert_ffn: u32,
    pub shared_ffn: u32,
}

/// The shape and storage of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub arch: Arch,
    pub name: String,
    pub hidden: u32,
    /// Trunk layers (an MTP block comes on top).
    pub layers: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub ffn: u32,
    pub context: u32,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// Rotated dimensions per head (`None`: all of them).
    pub rope_dims: Option<u32>,
    /// qwen35's multi-section RoPE (`rope.dimension_sections`).
    pub rope_sections: Option<[i32; 4]>,
    /// Storage type of the matrices (vectors are always F32; matrices whose rows are not
    /// whole blocks of the type fall back to F32).
    pub weight_type: GgmlType,
    /// Which matrices take another type than `weight_type` (llama.cpp's `_M` mixes).
    pub mix: TypeMix,
    /// Share `token_embd` as the output projection (no `output.weight`).
    pub tied_output: bool,
    /// Vocabulary size for a synthetic vocabulary (`None`: the caller's).
    pub vocab: Option<u32>,
    pub hybrid: Option<HybridSpec>,
    pub moe: Option<MoeSpec>,
    /// Append one MTP / NextN block.
    pub mtp: bool,
}

impl ModelSpec {
    /// A dense model with the usual defaults (llama RoPE base, F32, untied, no extras).
    #[allow(clippy::too_many_arguments)]
    pub fn dense(
        arch: Arch,
        name: &str,
        hidden: u32,
        layers: u32,
        heads: u32,
        kv_heads: u32,
        head_dim: u32,
        ffn: u32,
    ) -> Self {
        Self {
            arch,
            name: name.to_string(),
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            ffn,
            context: 4096,
            rope_base: 10000.0,
            rms_eps: 1e-5,
            rope_dims: None,
            rope_sections: None,
            weight_type: GgmlType::F32,
            mix: TypeMix::Uniform,
            tied_output: false,
            vocab: None,
            hybrid: None,
            moe: None,
            mtp: false,
        }
    }

    /// Whether trunk layer `layer` is full attention (always, for dense models).
    pub fn is_attention_layer(&self, layer: u32) -> bool {
        match self.hybrid {
            Some(h) => (layer + 1).is_multiple_of(h.full_attention_interval.max(1)),
            None => true,
        }
    }

    /// Checks the shape is one the architecture can have.
    pub fn validate(&self) -> Result<(), GenError> {
        let bad = |m: String| Err(GenError::Shape(m));
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "heads ({}) must be a positive multiple of kv heads ({})",
                self.heads, self.kv_heads
            ));
        }
        if matches!(self.arch, Arch::Llama | Arch::Qwen2)
            && self.head_dim * self.heads != self.hidden
        {
            return bad(format!(
                "{} needs head_dim × heads = hidden ({} × {} ≠ {})",
                self.arch.gguf_name(),
                self.head_dim,
                self.heads,
                self.hidden
            ));
        }
        let rope = self.rope_dims.unwrap_or(self.head_dim);
        if !rope.is_multiple_of(2) || rope > self.head_dim {
            return bad(format!(
                "rotated dimensions ({rope}) must be even and at most head_dim ({})",
                self.head_dim
            ));
        }
        if self.arch.is_hybrid() != self.hybrid.is_some() {
            return bad(format!(
                "{} {} a [hybrid] shape",
                self.arch.gguf_name(),
                if self.arch.is_hybrid() {
                    "needs"
                } else {
                    "takes no"
                }
            ));
        }
        if (self.arch == Arch::Qwen3Next) != self.moe.is_some() {
            return bad("a MoE shape goes with qwen3next, and only with it".into());
        }
        if self.arch == Arch::Qwen35 && self.rope_sections.is_none() {
            return bad("qwen35 needs rope sections".into());
        }
        if self.mtp && !self.arch.is_hybrid() {
            return bad("MTP blocks are written for qwen35 / qwen3next".into());
        }
        if let Some(h) = self.hybrid {
            if h.k_heads == 0
                || !h.v_heads.is_multiple_of(h.k_heads)
                || h.conv_kernel < 2
                || h.full_attention_interval == 0
            {
                return bad(format!("bad hybrid shape {h:?}"));
            }
        }
        if let Some(m) = self.moe {
            if m.experts_used == 0 || m.experts_used > m.experts {
                return bad(format!("bad MoE shape {m:?}"));
            }
        }
        if specula_kernels::WeightType::from_ggml(self.weight_type).is_none() {
            return bad(format!(
                "cannot write {} weights (writable: {})",
                self.weight_type,
                specula_kernels::WeightType::list()
            ));
        }
        if self.mix == TypeMix::Q4KM && self.weight_type != GgmlType::Q4K {
            return bad(format!(
                "the q4_K_M mix goes over Q4_K weights, not {}",
                self.weight_type
            ));
        }
        Ok(())
    }
}
