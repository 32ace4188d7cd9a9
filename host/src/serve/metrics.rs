//! Prometheus metrics of the daemon, per model (the profile name): requests, tokens, latency
//! histograms, queue depth and busy slots, reloads, and the speculative counters — drafted,
//! accepted and acceptance by draft position — labelled with the drafter too, so that a
//! reload that changes the drafter shows both side by side.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::request::{Outcome, StopReason};
use crate::scheduler::EngineEvent;
use crate::spec::SpecStats;

/// Label value for requests that named no known model (keeps label cardinality bounded).
pub const NO_MODEL: &str = "-";

/// Every metric the daemon exports, registered in its own registry.
pub struct Metrics {
    registry: Registry,
    /// Requests answered, by model, endpoint and HTTP status.
    pub requests: IntCounterVec,
    pub prompt_tokens: IntCounterVec,
    pub generated_tokens: IntCounterVec,
    /// Generations stopped because the client went away.
    pub cancelled: IntCounterVec,
    /// Time from arrival to the last token.
    pub request_seconds: HistogramVec,
    /// Time from arrival to the first generated text.
    pub first_token_seconds: HistogramVec,
    /// Time spent waiting for a free slot.
    pub queue_seconds: HistogramVec,
    /// Requests waiting for a slot.
    pub queue_depth: IntGaugeVec,
    /// Requests generating on a slot.
    pub active: IntGaugeVec,
    /// Slots of the serving revision.
    pub slots: IntGaugeVec,
    /// 1 while the model has a ready revision serving.
    pub ready: IntGaugeVec,
    /// Profile loads, by result (`ok` / `failed`).
    pub loads: IntCounterVec,
    /// Open HTTP connections.
    pub http_connections: IntGauge,
    /// Connections answered 503 because too many were open.
    pub http_refused: IntCounter,
    /// Connections closed over a time limit, by phase (`header`, `keep_alive`).
    pub http_timeouts: IntCounterVec,
    /// Rows of each engine pass (certain tokens, drafts, prompt chunks of every sequence).
    pub pass_rows: HistogramVec,
    /// Sequences sharing each engine pass.
    pub pass_sequences: HistogramVec,
    /// Requests whose prompt started with blocks of the prefix cache.
    pub prefix_cache_hits: IntCounterVec,
    /// Prompt tokens taken from the prefix cache instead of evaluated.
    pub prefix_cache_tokens: IntCounterVec,
    /// The target's KV pool in blocks, by state (`used`, `cached`, `free`).
    pub kv_blocks: IntGaugeVec,
    /// Positions per KV block.
    pub kv_block_tokens: IntGaugeVec,
    spec_steps: IntCounterVec,
    spec_target_passes: IntCounterVec,
    spec_drafted: IntCounterVec,
    spec_accepted: IntCounterVec,
    spec_drafted_by_position: IntCounterVec,
    spec_accepted_by_position: IntCounterVec,
    spec_acceptance_by_position: GaugeVec,
    /// Cumulative statistics per (model, drafter), for the acceptance ratios.
    cumulative: Mutex<HashMap<(String, String), SpecStats>>,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let histogram = |name: &str, help: &str, labels: &[&str]| {
            let h = HistogramVec::new(
                HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()),
                labels,
            )
            .expect("valid metric");
            registry
                .register(Box::new(h.clone()))
                .expect("unique metric");
            h
        };
        let counts = |name: &str, help: &str, buckets: &[f64]| {
            let h = HistogramVec::new(
                HistogramOpts::new(name, help).buckets(buckets.to_vec()),
                &["model"],
            )
            .expect("valid metric");
            registry
                .register(Box::new(h.clone()))
                .expect("unique metric");
            h
        };
        let spec = ["model", "drafter"];
        let by_position = ["model", "drafter", "position"];
        let acceptance = GaugeVec::new(
            Opts::new(
                "specula_spec_acceptance_by_position",
                "Cumulative fraction of drafts accepted at each draft position (0 = first)",
            ),
            &by_position,
        )
        .expect("valid metric");
        registry
            .register(Box::new(acceptance.clone()))
            .expect("unique metric");
        let http_connections = IntGauge::new("specula_http_connections", "Open HTTP connections")
            .expect("valid metric");
        registry
            .register(Box::new(http_connections.clone()))
            .expect("unique metric");
        let http_refused = IntCounter::new(
            "specula_http_refused_connections_total",
            "Connections answered 503 at once: --max-connections were open, or the daemon was shutting down",
        )
        .expect("valid metric");
        registry
            .register(Box::new(http_refused.clone()))
            .expect("unique metric");
        Self {
            http_connections,
            http_refused,
            http_timeouts: counter(
                "specula_http_timed_out_connections_total",
                "Connections closed for exceeding a time limit, by phase (header, body, keep_alive)",
                &["phase"],
            ),
            requests: counter(
                "specula_requests_total",
                "Requests answered, by model, endpoint and HTTP status",
                &["model", "endpoint", "status"],
            ),
            prompt_tokens: counter(
                "specula_prompt_tokens_total",
                "Prompt tokens evaluated",
                &["model"],
            ),
            generated_tokens: counter(
                "specula_generated_tokens_total",
                "Tokens generated",
                &["model"],
            ),
            cancelled: counter(
                "specula_cancelled_requests_total",
                "Generations stopped because the client disconnected",
                &["model"],
            ),
            request_seconds: histogram(
                "specula_request_duration_seconds",
                "Time from a request's arrival to its last token",
                &["model"],
            ),
            first_token_seconds: histogram(
                "specula_time_to_first_token_seconds",
                "Time from a request's arrival to its first generated text",
                &["model"],
            ),
            queue_seconds: histogram(
                "specula_queue_wait_seconds",
                "Time a request waited for a free slot",
                &["model"],
            ),
            queue_depth: gauge(
                "specula_queue_depth",
                "Requests waiting for a free slot",
                &["model"],
            ),
            active: gauge(
                "specula_active_requests",
                "Requests generating on a slot",
                &["model"],
            ),
            slots: gauge(
                "specula_slots",
                "Parallel slots of the serving revision",
                &["model"],
            ),
            ready: gauge(
                "specula_model_ready",
                "1 while a loaded revision of the model is serving",
                &["model"],
            ),
            loads: counter(
                "specula_profile_loads_total",
                "Profile loads (startup and reloads), by result",
                &["model", "result"],
            ),
            pass_rows: counts(
                "specula_pass_rows",
                "Rows per engine pass: every running sequence's certain token and drafts, and prompt chunks",
                &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0],
            ),
            pass_sequences: counts(
                "specula_pass_sequences",
                "Sequences sharing an engine pass",
                &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0],
            ),
            prefix_cache_hits: counter(
                "specula_prefix_cache_hits_total",
                "Requests whose prompt started with blocks the prefix cache held",
                &["model"],
            ),
            prefix_cache_tokens: counter(
                "specula_prefix_cache_tokens_total",
                "Prompt tokens taken from the prefix cache instead of evaluated",
                &["model"],
            ),
            kv_blocks: gauge(
                "specula_kv_blocks",
                "Blocks of the target's KV pool: used by running requests, cached (prefix cache only, reclaimable), free",
                &["model", "state"],
            ),
            kv_block_tokens: gauge(
                "specula_kv_block_tokens",
                "Positions per block of the target's KV pool",
                &["model"],
            ),
            spec_steps: counter(
                "specula_spec_steps_total",
                "Decode steps (each emits one certain token)",
                &spec,
            ),
            spec_target_passes: counter(
                "specula_spec_target_passes_total",
                "Target forward passes (prefill and verify)",
                &spec,
            ),
            spec_drafted: counter(
                "specula_spec_drafted_tokens_total",
                "Draft tokens proposed and verified",
                &spec,
            ),
            spec_accepted: counter(
                "specula_spec_accepted_tokens_total",
                "Draft tokens the target accepted",
                &spec,
            ),
            spec_drafted_by_position: counter(
                "specula_spec_drafted_by_position_total",
                "Drafts verified at each draft position (0 = first)",
                &by_position,
            ),
            spec_accepted_by_position: counter(
                "specula_spec_accepted_by_position_total",
                "Drafts accepted at each draft position (0 = first)",
                &by_position,
            ),
            spec_acceptance_by_position: acceptance,
            cumulative: Mutex::new(HashMap::new()),
            registry,
        }
    }

    /// Records a finished generation of `model` with `drafter` (`none` for plain decoding).
    pub fn record_outcome(&self, model: &str, drafter: &str, outcome: &Outcome) {
        self.prompt_tokens
            .with_label_values(&[model])
            .inc_by(outcome.prompt_tokens.len() as u64);
        self.generated_tokens
            .with_label_values(&[model])
            .inc_by(outcome.tokens.len() as u64);
        if outcome.stop_reason == StopReason::Cancelled {
            self.cancelled.with_label_values(&[model]).inc();
        }
        let s = &outcome.speculative;
        let labels = [model, drafter];
        self.spec_steps.with_label_values(&labels).inc_by(s.steps);
        self.spec_target_passes
            .with_label_values(&labels)
            .inc_by(s.target_passes);
        self.spec_drafted
            .with_label_values(&labels)
            .inc_by(s.drafted);
        // Accepted by the target, whether or not a stop condition then cut them.
        self.spec_accepted
            .with_label_values(&labels)
            .inc_by(s.accepted + s.clamped);
        for (i, (&d, &a)) in s
            .drafted_by_position
            .iter()
            .zip(&s.accepted_by_position)
            .enumerate()
        {
            let position = i.to_string();
            let labels = [model, drafter, position.as_str()];
            self.spec_drafted_by_position
                .with_label_values(&labels)
                .inc_by(d);
            self.spec_accepted_by_position
                .with_label_values(&labels)
                .inc_by(a);
        }
        let mut cumulative = self.cumulative.lock().unwrap_or_else(|e| e.into_inner());
        let total = cumulative
            .entry((model.to_string(), drafter.to_string()))
            .or_default();
        total.merge(s);
        for (i, rate) in total.acceptance_by_position().into_iter().enumerate() {
            let position = i.to_string();
            self.spec_acceptance_by_position
                .with_label_values(&[model, drafter, position.as_str()])
                .set(rate);
        }
    }

    /// What `model`'s engine loop reports, recorded under its name.
    pub fn engine_observer(&self, model: &str) -> Arc<dyn Fn(EngineEvent) + Send + Sync> {
        let rows = self.pass_rows.with_label_values(&[model]);
        let sequences = self.pass_sequences.with_label_values(&[model]);
        let hits = self.prefix_cache_hits.with_label_values(&[model]);
        let saved = self.prefix_cache_tokens.with_label_values(&[model]);
        let [used, cached, free] = ["used", "cached", "free"]
            .map(|state| self.kv_blocks.with_label_values(&[model, state]));
        let block_tokens = self.kv_block_tokens.with_label_values(&[model]);
        Arc::new(move |event| match event {
            EngineEvent::Pass {
                sequences: n,
                rows: r,
                ..
            } => {
                rows.observe(r as f64);
                sequences.observe(n as f64);
            }
            EngineEvent::Admitted { reused, .. } => {
                if reused > 0 {
                    hits.inc();
                    saved.inc_by(reused as u64);
                }
            }
            EngineEvent::DraftPass { .. } => {}
            EngineEvent::Kv(kv) => {
                let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
                used.set(gauge(kv.blocks_used));
                cached.set(gauge(kv.blocks_cached));
                free.set(gauge(kv.blocks_free()));
                block_tokens.set(i64::from(kv.block_tokens));
            }
        })
    }

    /// Counts an answered request.
    pub fn record_request(&self, model: &str, endpoint: &str, status: u16) {
        self.requests
            .with_label_values(&[model, endpoint, &status.to_string()])
            .inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let encoder = TextEncoder::new();
        if let Err(e) = encoder.encode(&self.registry.gather(), &mut out) {
            tracing::error!("cannot encode metrics: {e}");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::Timings;

    fn outcome(drafted: usize, accepted: usize) -> Outcome {
        let mut speculative = SpecStats::default();
        speculative.record_verdicts(drafted, drafted, accepted);
        speculative.accepted = accepted as u64;
        Outcome {
            prompt_tokens: vec![1, 2, 3],
            tokens: vec![4, 5],
            text: "ab".into(),
            stop_reason: StopReason::MaxTokens,
            timings: Timings::default(),
            speculative,
        }
    }

    #[test]
    fn outcomes_add_up_per_model_and_drafter() {
        let m = Metrics::new();
        m.record_outcome("stories", "lookup", &outcome(2, 1));
        m.record_outcome("stories", "lookup", &outcome(2, 2));
        m.record_outcome("stories", "model", &outcome(1, 0));
        m.record_request("stories", "completions", 200);
        let text = m.render();
        for line in [
            "specula_prompt_tokens_total{model=\"stories\"} 9",
            "specula_spec_drafted_tokens_total{drafter=\"lookup\",model=\"stories\"} 4",
            "specula_spec_accepted_tokens_total{drafter=\"lookup\",model=\"stories\"} 3",
            "specula_spec_drafted_tokens_total{drafter=\"model\",model=\"stories\"} 1",
            "specula_spec_acceptance_by_position{drafter=\"lookup\",model=\"stories\",position=\"0\"} 1",
            "specula_spec_acceptance_by_position{drafter=\"lookup\",model=\"stories\",position=\"1\"} 0.5",
            "specula_requests_total{endpoint=\"completions\",model=\"stories\",status=\"200\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
