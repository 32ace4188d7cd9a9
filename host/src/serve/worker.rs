//! Running one admitted request: wait for a slot, hand the request to the model's engine
//! loop, and send text and the outcome back over a channel.
//!
//! The request holds an `Arc` of the model revision it was admitted to until it ends, so a
//! reload that swaps in a new revision lets it finish on the old one (whose engine loop
//! drains its sequences, then stops). Generation stops within one decode step once the
//! request's cancel flag is set — the HTTP side sets it when the client goes away, and so
//! does a failed send here. A panic in the request's generation fails it with a 500 and
//! leaves the other requests running ([`crate::scheduler`]).

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use crate::request::{Outcome, Request};
use crate::scheduler::{Job, JobError};

use super::api::ApiError;
use super::metrics::Metrics;
use super::registry::Model;
use super::slots::{SlotError, Ticket};

pub use crate::scheduler::panic_message;

/// What a running request reports.
#[derive(Debug)]
pub enum Event {
    /// Text that is certain (never a partial character or a possible stop-string prefix).
    Text(String),
    /// Generation ended; always the last event unless `Failed`.
    Done(Box<Outcome>),
    Failed(ApiError),
}

/// Starts `request` (its prompt tokenized as `prompt` by the model's tokenizer) on `model`
/// once `ticket` gets a slot; events arrive on the returned channel.
pub fn start(
    model: Arc<Model>,
    ticket: Ticket<()>,
    request: Request,
    prompt: Vec<u32>,
    arrived: Instant,
    metrics: Arc<Metrics>,
) -> mpsc::UnboundedReceiver<Event> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        // A client that leaves while queued (its response dropped, so `rx` with it) leaves
        // the queue at once instead of waiting for a slot it will not use.
        let waited = tokio::select! {
            waited = ticket.wait() => waited,
            _ = tx.closed() => {
                metrics.cancelled.with_label_values(&[&model.name]).inc();
                tracing::debug!(model = %model.name, "the client left while queued");
                return;
            }
        };
        let lease = match waited {
            Ok(lease) => lease,
            Err(e @ SlotError::Closed) => {
                let _ = tx.send(Event::Failed(ApiError::unavailable(
                    format!("model `{}`: {e}", model.name),
                    "model_unavailable",
                )));
                return;
            }
            Err(e) => {
                let _ = tx.send(Event::Failed(ApiError::unavailable(
                    e.to_string(),
                    "queue_full",
                )));
                return;
            }
        };
        metrics
            .queue_seconds
            .with_label_values(&[&model.name])
            .observe(arrived.elapsed().as_secs_f64());
        if request.cancel.is_cancelled() || tx.is_closed() {
            metrics.cancelled.with_label_values(&[&model.name]).inc();
            return; // the client left as the slot came free; dropping the lease returns it
        }

        let mut first = true;
        let text_tx = tx.clone();
        let cancel = request.cancel.clone();
        let text_metrics = metrics.clone();
        let name = model.name.clone();
        let on_text = Box::new(move |piece: &str| {
            if first {
                first = false;
                text_metrics
                    .first_token_seconds
                    .with_label_values(&[&name])
                    .observe(arrived.elapsed().as_secs_f64());
            }
            if text_tx.send(Event::Text(piece.to_string())).is_err() {
                cancel.cancel();
            }
        });
        let done_model = model.clone();
        let done_tx = tx.clone();
        let on_done = Box::new(move |result: Result<Outcome, JobError>| {
            // Free the slot before the client hears that the request is over.
            drop(lease);
            let event = match result {
                Ok(outcome) => {
                    metrics
                        .request_seconds
                        .with_label_values(&[&done_model.name])
                        .observe(arrived.elapsed().as_secs_f64());
                    metrics.record_outcome(
                        &done_model.name,
                        done_model.drafter.as_deref().unwrap_or("none"),
                        &outcome,
                    );
                    Event::Done(Box::new(outcome))
                }
                Err(e @ (JobError::Unavailable(_) | JobError::Stopped)) => {
                    Event::Failed(ApiError::unavailable(
                        format!("model `{}`: {e}; reload it", done_model.name),
                        "model_unavailable",
                    ))
                }
                Err(e @ JobError::Capacity(_)) => {
                    tracing::warn!(model = %done_model.name, "{e}");
                    Event::Failed(ApiError::unavailable(e.to_string(), "kv_cache_full"))
                }
                Err(e) => {
                    tracing::error!(model = %done_model.name, "{e}");
                    Event::Failed(ApiError::internal(e.to_string()))
                }
            };
            let _ = done_tx.send(event);
            // The revision stays alive (for this request) until here.
            drop(done_model);
        });
        let job = Job {
            request,
            prompt: Some(prompt),
            on_text,
            on_done,
        };
        if let Err(job) = model.engine.submit(job) {
            (job.on_done)(Err(JobError::Stopped));
        }
    });
    rx
}
