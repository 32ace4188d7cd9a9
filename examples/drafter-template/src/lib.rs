//! `template`: a Specula drafter plugin in one file, written against `specula-plugin-api`
//! alone — a starting point for your own.
//!
//! It drafts from bigram statistics of the current sequence: after token `a`, it proposes the
//! token that has most often followed `a` so far (earliest on ties), and chains that guess up
//! to `max_tokens` drafts. Text that repeats itself — code, lists, stories that reuse phrases
//! — gets accepted drafts; anything else costs a cheap lookup. It has no draft distribution,
//! so at temperature > 0 the host treats each draft as one-hot, which keeps sampling exact.
//!
//! What every drafter must do (docs/PLUGINS.md has the whole contract):
//! - never panic across the boundary (the export macro runs every entry point in `guard`);
//! - after a panic, refuse further calls (`PanicFence`);
//! - reject unknown options with an error naming them (`check_options`);
//! - draft only from the context the host passes: drafts are checked by the target, so a
//!   bad draft costs time, never correctness.

use std::collections::HashMap;

use specula_plugin_api::abi_stable::std_types::RSlice;
use specula_plugin_api::{
    Draft, DraftRequest, Drafter, DrafterModels, DrafterParams, PanicFence, PluginError,
    PluginResult,
};

/// The plugin's name in messages (profiles select it by its file name).
const NAME: &str = "template";

/// The bigram drafter.
#[derive(Debug, Default)]
pub struct BigramDrafter {
    fence: PanicFence,
    /// Fewest times a bigram must have been seen before it is proposed.
    min_count: u32,
    /// `follows[a][b]`: how often `b` followed `a`; `first[a][b]`, where `b` first followed `a`.
    follows: HashMap<u32, HashMap<u32, (u32, usize)>>,
    /// How much of the context is counted.
    counted: usize,
    context: Vec<u32>,
}

impl BigramDrafter {
    /// Checks the options: `min_count` (a positive integer, default 1).
    pub fn check(params: &DrafterParams) -> Result<(), PluginError> {
        params.check_options(&["min_count"])?;
        Self::min_count(params).map(|_| ())
    }

    fn min_count(params: &DrafterParams) -> Result<u32, PluginError> {
        let n: u32 = params.parse_option("min_count", 1)?;
        if n == 0 {
            return Err(PluginError::invalid_input(
                "drafter.options.min_count: must be at least 1",
            ));
        }
        Ok(n)
    }

    pub fn new(params: &DrafterParams) -> Result<Self, PluginError> {
        Self::check(params)?;
        Ok(Self {
            min_count: Self::min_count(params)?,
            ..Self::default()
        })
    }

    /// Brings the counts in line with `context`; a context that is not an extension of the
    /// counted one starts the counts over.
    fn sync(&mut self, context: &[u32]) {
        if !context.starts_with(&self.context[..self.counted.min(self.context.len())]) {
            self.follows.clear();
            self.counted = 0;
        }
        self.context.clear();
        self.context.extend_from_slice(context);
        for i in self.counted.max(1)..context.len() {
            let entry = self
                .follows
                .entry(context[i - 1])
                .or_default()
                .entry(context[i])
                .or_insert((0, i));
            entry.0 += 1;
        }
        self.counted = context.len();
    }

    /// The most frequent successor of `token` seen at least `min_count` times.
    fn successor(&self, token: u32) -> Option<u32> {
        self.follows
            .get(&token)?
            .iter()
            .filter(|(_, &(count, _))| count >= self.min_count)
            .max_by(|a, b| a.1 .0.cmp(&b.1 .0).then(b.1 .1.cmp(&a.1 .1)))
            .map(|(&next, _)| next)
    }

    fn draft(&mut self, context: &[u32], max_tokens: usize, out: &mut Draft) {
        self.sync(context);
        let Some(&last) = context.last() else {
            return;
        };
        let mut token = last;
        while out.tokens.len() < max_tokens {
            match self.successor(token) {
                Some(next) => {
                    out.tokens.push(next);
                    token = next;
                }
                None => break,
            }
        }
    }
}

impl Drafter for BigramDrafter {
    fn begin(
        &mut self,
        prompt: RSlice<'_, u32>,
        _reused: u32,
        _models: DrafterModels<'_>,
    ) -> PluginResult<()> {
        self.fence.clone().guard(NAME, || {
            self.follows.clear();
            self.counted = 0;
            self.sync(&prompt);
            Ok(())
        })
    }

    fn propose(
        &mut self,
        request: DraftRequest<'_>,
        _models: DrafterModels<'_>,
        out: &mut Draft,
    ) -> PluginResult<()> {
        self.fence.clone().guard(NAME, || {
            out.clear();
            self.draft(&request.context, request.max_tokens as usize, out);
            Ok(())
        })
    }

    fn accept(
        &mut self,
        _accepted: RSlice<'_, u32>,
        _models: DrafterModels<'_>,
    ) -> PluginResult<()> {
        // Accepted tokens arrive with the next context; nothing to do here.
        self.fence.clone().guard(NAME, || Ok(()))
    }
}

specula_plugin_api::export_drafter! {
    name: NAME,
    description: "template: drafts the most frequent successor of each token seen so far",
    create: BigramDrafter::new,
    check: BigramDrafter::check,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_the_most_frequent_successors() {
        let mut d = BigramDrafter {
            min_count: 1,
            ..Default::default()
        };
        let mut out = Draft::default();
        // 1 2 3 1 2 4 1 2 3 1: after 1 comes 2; after 2, 3 (twice) beats 4; after 3, 1.
        d.draft(&[1, 2, 3, 1, 2, 4, 1, 2, 3, 1], 5, &mut out);
        assert_eq!(out.tokens.as_slice(), [2, 3, 1, 2, 3]);
        out.clear();
        // A context that is not an extension starts over: nothing follows 9 yet.
        d.draft(&[9], 3, &mut out);
        assert!(out.tokens.is_empty());
    }
}
