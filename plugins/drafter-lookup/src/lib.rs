//! Specula drafter plugin `lookup`: prompt-lookup drafting.
//!
//! The drafts are the tokens that followed the longest earlier occurrence (from `n_max` down
//! to `n_min` tokens) of the context's suffix: first in the prompt and generated text (the
//! most recent occurrence wins), then in the optional static corpus. When nothing matches it
//! proposes nothing, so the step costs the target nothing extra.
//!
//! Where the host verifies trees, the continuations of several earlier occurrences are offered
//! at once, merged where they agree: the best match's continuation first (two thirds of the
//! nodes at most), then the others' until the nodes run out — so where the text went on in
//! different ways before, each way is verified in the same pass.
//!
//! Options (`[drafter.options]`): `n_min` (default 2), `n_max` (default 5).

use abi_stable::std_types::RSlice;
use specula_plugin_api::{
    Draft, DraftRequest, Drafter, DrafterModels, DrafterParams, PanicFence, PluginError,
    PluginResult, TREE_ROOT,
};

pub use specula_drafting::ngram::{Match, NgramIndex};

/// The prompt-lookup drafter.
#[derive(Debug)]
pub struct LookupDrafter {
    /// Set by the first panic of a call: every later call is refused.
    fence: PanicFence,
    n_min: usize,
    n_max: usize,
    context: NgramIndex,
    corpus: NgramIndex,
}

impl LookupDrafter {
    /// Checks `params`' options: `n_min` and `n_max`, with 1 <= n_min <= n_max.
    pub fn check(params: &DrafterParams) -> Result<(), PluginError> {
        Self::lengths(params).map(|_| ())
    }

    fn lengths(params: &DrafterParams) -> Result<(usize, usize), PluginError> {
        params.check_options(&["n_min", "n_max"])?;
        let n_min: usize = params.parse_option("n_min", 2)?;
        let n_max: usize = params.parse_option("n_max", 5)?;
        if n_min == 0 || n_min > n_max {
            return Err(PluginError::invalid_input(format!(
                "drafter.options: need 1 <= n_min <= n_max, got n_min = {n_min}, n_max = {n_max}"
            )));
        }
        Ok((n_min, n_max))
    }

    pub fn new(params: &DrafterParams) -> Result<Self, PluginError> {
        let (n_min, n_max) = Self::lengths(params)?;
        let mut corpus = NgramIndex::new(n_min);
        corpus.extend(&params.corpus);
        Ok(Self {
            fence: PanicFence::default(),
            n_min,
            n_max,
            context: NgramIndex::new(n_min),
            corpus,
        })
    }

    /// Proposes a tree of up to `max` tokens continuing `context` into `out` (tokens and
    /// parents): the continuations of every match (the context's before the corpus's at equal
    /// lengths), longest match first, merged into a trie.
    pub fn draft_tree(&mut self, context: &[u32], max: usize, out: &mut Draft) {
        out.clear();
        self.context.sync(context);
        let n_max = self.n_max.min(context.len());
        let own = self
            .context
            .matches(context, self.n_min, n_max, context.len())
            .into_iter()
            .map(|m| (m, self.context.tokens()));
        let corpus = self
            .corpus
            .matches(context, self.n_min, n_max, usize::MAX)
            .into_iter()
            .map(|m| (m, self.corpus.tokens()));
        let mut all: Vec<(Match, &[u32])> = own.chain(corpus).collect();
        all.sort_by_key(|(m, _)| std::cmp::Reverse(m.len));
        let first_share = match all.len() {
            1 => max,
            _ => (max * 2).div_ceil(3).max(1),
        };
        for (i, (m, tokens)) in all.iter().enumerate() {
            let mut at = TREE_ROOT;
            let mut added = 0;
            for &token in &tokens[m.start..] {
                if out.tokens.len() >= max || (i == 0 && added >= first_share) {
                    break;
                }
                let child =
                    (0..out.tokens.len()).find(|&j| out.parents[j] == at && out.tokens[j] == token);
                at = match child {
                    Some(j) => j as u32,
                    None => {
                        out.tokens.push(token);
                        out.parents.push(at);
                        added += 1;
                        out.tokens.len() as u32 - 1
                    }
                };
            }
            if out.tokens.len() >= max {
                break;
            }
        }
    }

    /// Proposes up to `max` tokens continuing `context`.
    pub fn draft(&mut self, context: &[u32], max: usize) -> Vec<u32> {
        self.context.sync(context);
        let n_max = self.n_max.min(context.len());
        // The context's own suffix ends at `context.len()`; continuations must start before.
        let own = self
            .context
            .longest_match(context, self.n_min, n_max, context.len())
            .map(|m| (m, self.context.tokens()));
        let from_corpus = || {
            self.corpus
                .longest_match(context, self.n_min, n_max, usize::MAX)
                .map(|m| (m, self.corpus.tokens()))
        };
        let best = match (own, from_corpus()) {
            (Some(a), Some(b)) if b.0.len > a.0.len => Some(b),
            (Some(a), _) => Some(a),
            (None, b) => b,
        };
        match best {
            Some((m, tokens)) => {
                let end = (m.start + max).min(tokens.len());
                tokens[m.start..end].to_vec()
            }
            None => Vec::new(),
        }
    }
}

impl Drafter for LookupDrafter {
    fn begin(
        &mut self,
        prompt: RSlice<'_, u32>,
        _reused: u32,
        _models: DrafterModels<'_>,
    ) -> PluginResult<()> {
        self.fence.clone().guard("lookup", || {
            self.context.clear();
            self.context.extend(&prompt);
            Ok(())
        })
    }

    fn propose(
        &mut self,
        request: DraftRequest<'_>,
        _models: DrafterModels<'_>,
        out: &mut Draft,
    ) -> PluginResult<()> {
        self.fence.clone().guard("lookup", || {
            out.clear();
            if request.tree {
                self.draft_tree(&request.context, request.max_tokens as usize, out);
                return Ok(());
            }
            let tokens = self.draft(&request.context, request.max_tokens as usize);
            out.tokens.extend(tokens);
            Ok(())
        })
    }

    fn accept(
        &mut self,
        _accepted: RSlice<'_, u32>,
        _models: DrafterModels<'_>,
    ) -> PluginResult<()> {
        // Accepted tokens arrive with the next context.
        self.fence.clone().guard("lookup", || Ok(()))
    }
}

specula_plugin_api::export_drafter! {
    name: "lookup",
    description: "prompt-lookup (n-gram) drafting, optionally from a static corpus",
    create: LookupDrafter::new,
    check: LookupDrafter::check,
}

#[cfg(test)]
mod tests {
    use super::*;
    use abi_stable::std_types::{ROption, RString, RVec, Tuple2};

    fn params(corpus: &[u32], options: &[(&str, &str)]) -> DrafterParams {
        DrafterParams {
            target: specula_plugin_api::ModelInfo {
                architecture: "llama".into(),
                name: "t".into(),
                vocab_size: 100,
                context_size: 100,
                train_context_length: 100,
                hidden_size: 8,
                n_layers: 1,
                bos_token: ROption::RSome(1),
                eos_token: ROption::RSome(2),
                has_mtp_head: false,
                n_params: 0,
                weight_bytes: 0,
            },
            draft_model: ROption::RNone,
            options: options
                .iter()
                .map(|(k, v)| Tuple2(RString::from(*k), RString::from(*v)))
                .collect::<RVec<_>>(),
            corpus: corpus.to_vec().into(),
        }
    }

    #[test]
    fn drafts_the_continuation_of_an_earlier_occurrence() {
        let mut d = LookupDrafter::new(&params(&[], &[])).unwrap();
        let context = [10, 11, 12, 13, 14, 50, 10, 11, 12];
        assert_eq!(d.draft(&context, 3), vec![13, 14, 50]);
        assert_eq!(d.draft(&context, 10), vec![13, 14, 50, 10, 11, 12]);
    }

    #[test]
    fn a_tree_offers_every_earlier_continuation_merged_where_they_agree() {
        let mut d = LookupDrafter::new(&params(&[], &[])).unwrap();
        // [7, 8] went on as 1 2 3 9, then as 1 2 4 9.
        let context = [7, 8, 1, 2, 3, 9, 7, 8, 1, 2, 4, 9, 6, 8, 5, 7, 8];
        let mut out = Draft::default();
        d.draft_tree(&context, 6, &mut out);
        // The most recent continuation (two thirds of the nodes), then the earlier one,
        // sharing its first two tokens and branching where it differs.
        assert_eq!(out.tokens.to_vec(), vec![1, 2, 4, 9, 3, 9]);
        assert_eq!(out.parents.to_vec(), vec![TREE_ROOT, 0, 1, 2, 1, 4]);
        // A chain when one match only.
        let mut out = Draft::default();
        d.draft_tree(&[10, 11, 12, 13, 10, 11], 3, &mut out);
        assert_eq!(out.tokens.to_vec(), vec![12, 13, 10]);
        assert_eq!(out.parents.to_vec(), vec![TREE_ROOT, 0, 1]);
    }

    #[test]
    fn proposes_nothing_without_a_match() {
        let mut d = LookupDrafter::new(&params(&[], &[])).unwrap();
        assert!(d.draft(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(d.draft(&[], 4).is_empty());
    }

    #[test]
    fn falls_back_to_the_corpus() {
        let mut d = LookupDrafter::new(&params(&[7, 8, 9, 20, 21], &[])).unwrap();
        assert_eq!(d.draft(&[1, 7, 8, 9], 2), vec![20, 21]);
    }

    #[test]
    fn follows_a_growing_context_and_restarts_on_a_new_one() {
        let mut d = LookupDrafter::new(&params(&[], &[])).unwrap();
        let mut context = vec![3, 4, 5, 6, 3, 4];
        assert_eq!(d.draft(&context, 2), vec![5, 6]);
        context.extend([5, 6, 3]);
        assert_eq!(d.draft(&context, 1), vec![4]);
        assert!(d.draft(&[9, 9, 8], 2).is_empty());
    }

    #[test]
    fn bad_options_are_named() {
        let err = LookupDrafter::new(&params(&[], &[("n_mni", "2")])).unwrap_err();
        assert!(err.message.contains("drafter.options.n_mni"), "{err}");
        let err = LookupDrafter::new(&params(&[], &[("n_min", "x")])).unwrap_err();
        assert!(err.message.contains("n_min"), "{err}");
        let err = LookupDrafter::new(&params(&[], &[("n_min", "4"), ("n_max", "2")])).unwrap_err();
        assert!(err.message.contains("n_min"), "{err}");
    }
}
