//! The NextN / MTP head (`blk.{n_trunk}`): from the trunk's final-norm hidden state `h` of
//! position `p` and the token at `p + 1`, the logits for position `p + 2`.
//!
//! `x = eh_proj · [enorm(embed(token)) | hnorm(h)]`, then one gated full-attention decoder
//! block with the trunk's FFN kind (`x += attn(attn_norm(x)); x += ffn(post_attention_norm(x))`)
//! over the head's own KV cache, then `shared_head_norm` (else `output_norm`) gives the head's
//! hidden state — which feeds the next chained step — and `shared_head_head` (else `output`)
//! the logits. The embedding is `nextn.embed_tokens`, else `token_embd`.
//!
//! Cache entry `p` holds the keys and values of the step for position `p`; its RoPE position
//! is `p + 1`, the position of the token it embeds (as llama.cpp feeds the MTP head the
//! target's tokens at their own positions): the decoder block's mixer keeps its cache in
//! [`KvSlot::MTP`].

use specula_gguf::GgufFile;
use specula_plugin_api::PluginError;

use super::hybrid::{HybridConfig, HybridLayer, Mixer};
use crate::blocks::attention::GatedAttentionWeights;
use crate::blocks::ffn::FfnBlock;
use crate::graph::{Act, KvSlot, LayerOps, Rows};
use crate::model::weights::{load_optional_vector, load_vector, MatrixRef, Vector};
use crate::model::LoadError;

/// The weights of the MTP block.
#[derive(Debug, Clone)]
pub struct MtpWeights {
    /// The block's index (`blk.{layer}`).
    pub layer: usize,
    /// `nextn.eh_proj {2·n_embd, n_embd}`.
    pub eh_proj: MatrixRef,
    pub enorm: Vector,
    pub hnorm: Vector,
    /// The decoder block: gated full attention over the head's own cache, then the trunk's
    /// FFN kind.
    pub block: HybridLayer,
    /// `nextn.shared_head_norm`, else the trunk's `output_norm`.
    pub head_norm: Vector,
    /// `nextn.embed_tokens`, else `token_embd`.
    pub embed: MatrixRef,
    /// `nextn.shared_head_head`, else the trunk's `output`.
    pub head: MatrixRef,
}

impl MtpWeights {
    /// Every matrix the head multiplies, mutably (to interleave them): not `embed`, which is
    /// looked up by rows.
    pub fn matrices_mut(&mut self) -> Vec<&mut MatrixRef> {
        let mut out = vec![&mut self.eh_proj, &mut self.head];
        out.extend(self.block.matrices_mut());
        out
    }

    /// Loads block `layer` as an MTP head; the optional NextN tensors fall back to the trunk's
    /// `token_embd`, `output` and `output_norm`.
    pub fn load(
        file: &GgufFile,
        layer: usize,
        config: &HybridConfig,
        token_embd: &MatrixRef,
        output: &MatrixRef,
        output_norm: &Vector,
    ) -> Result<Self, LoadError> {
        let e = config.n_embd;
        let name = |t: &str| format!("blk.{layer}.{t}.weight");
        let optional_matrix = |t: &str| -> Result<Option<MatrixRef>, LoadError> {
            match file.tensor_info(&name(t)) {
                None => Ok(None),
                Some(_) => MatrixRef::load(file, &name(t), config.n_vocab, e).map(Some),
            }
        };
        Ok(Self {
            layer,
            eh_proj: MatrixRef::load(file, &name("nextn.eh_proj"), e, 2 * e)?,
            enorm: load_vector(file, &name("nextn.enorm"), e)?,
            hnorm: load_vector(file, &name("nextn.hnorm"), e)?,
            block: HybridLayer {
                attn_norm: load_vector(file, &name("attn_norm"), e)?,
                post_attention_norm: load_vector(file, &name("post_attention_norm"), e)?,
                mixer: Mixer::Attention {
                    kv: KvSlot::MTP,
                    weights: GatedAttentionWeights::load(file, layer, &config.attention, e)?,
                },
                ffn: FfnBlock::load(file, layer, &config.ffn)?,
            },
            head_norm: load_optional_vector(file, &name("nextn.shared_head_norm"), e)?
                .unwrap_or_else(|| output_norm.clone()),
            embed: optional_matrix("nextn.embed_tokens")?.unwrap_or_else(|| token_embd.clone()),
            head: optional_matrix("nextn.shared_head_head")?.unwrap_or_else(|| output.clone()),
        })
    }
}

/// The MTP head over `rows` whose inputs `[embedding | trunk hidden]` are in [`Act::MtpIn`]:
/// the input projection, the architecture's `decoder` layer run on the head's block, and the
/// shared head — its final-norm hidden states into [`Act::Hidden`], the logits of the rows
/// that get them into the pass's logits.
pub fn forward<O: LayerOps>(
    ops: &mut O,
    w: &MtpWeights,
    rows: &Rows,
    decoder: impl FnOnce(&mut O, &HybridLayer, &Rows) -> Result<(), PluginError>,
) -> Result<(), PluginError> {
    let e = w.enorm.len();
    let (embedding, hidden) = (Act::MtpIn.cols(0), Act::MtpIn.cols(e));
    ops.rms_norm(embedding, &w.enorm, embedding, rows)?;
    ops.rms_norm(hidden, &w.hnorm, hidden, rows)?;
    ops.matmul(&w.eh_proj, Act::MtpIn, Act::X, rows)?;
    decoder(ops, &w.block, rows)?;
    super::output_head(ops, &w.head_norm, &w.head, rows)
}
