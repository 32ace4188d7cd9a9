//! Running one admitted request: wait for a slot, generate on it in `spawn_blocking`, and
//! send text and the outcome back over a channel.
//!
//! The request holds an `Arc` of the model revision it was admitted to, so a reload that
//! swaps in a new revision lets it finish on the old one. Generation stops within one decode
//! step once the request's cancel flag is set — the HTTP side sets it when the client goes
//! away, and so does a failed send here. A panic inside generation is caught: the request
//! gets a 500 and the slot gets a freshly opened pipeline (or is retired if that fails).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use crate::pipeline::Pipeline;
use crate::request::{Outcome, Request};
use crate::spec::generate;

use super::api::ApiError;
use super::metrics::Metrics;
use super::registry::Model;
use super::slots::{SlotError, Ticket};

/// What a running request reports.
#[derive(Debug)]
pub enum Event {
    /// Text that is certain (never a partial character or a possible stop-string prefix).
    Text(String),
    /// Generation ended; always the last event unless `Failed`.
    Done(Box<Outcome>),
    Failed(ApiError),
}

/// Starts `request` on `model` once `ticket` gets a slot; events arrive on the returned channel.
pub fn start(
    model: Arc<Model>,
    ticket: Ticket<Pipeline>,
    request: Request,
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
        let job_model = model.clone();
        let job_tx = tx.clone();
        let job_metrics = metrics.clone();
        let joined = tokio::task::spawn_blocking(move || {
            run_on_slot(&job_model, lease, &request, arrived, &job_metrics, &job_tx)
        })
        .await;
        if let Err(e) = joined {
            // `run_on_slot` catches panics; this is the runtime shutting down.
            let _ = tx.send(Event::Failed(ApiError::internal(format!(
                "generation did not finish: {e}"
            ))));
        }
    });
    rx
}

fn run_on_slot(
    model: &Model,
    mut lease: super::slots::Lease<Pipeline>,
    request: &Request,
    arrived: Instant,
    metrics: &Metrics,
    tx: &mpsc::UnboundedSender<Event>,
) {
    let mut first = true;
    let on_text = |piece: &str| {
        if first {
            first = false;
            metrics
                .first_token_seconds
                .with_label_values(&[&model.name])
                .observe(arrived.elapsed().as_secs_f64());
        }
        if tx.send(Event::Text(piece.to_string())).is_err() {
            request.cancel.cancel();
        }
    };
    let result = catch_unwind(AssertUnwindSafe(|| generate(&mut lease, request, on_text)));
    let event = match result {
        Ok(Ok(outcome)) => {
            metrics
                .request_seconds
                .with_label_values(&[&model.name])
                .observe(arrived.elapsed().as_secs_f64());
            metrics.record_outcome(
                &model.name,
                model.drafter.as_deref().unwrap_or("none"),
                &outcome,
            );
            Event::Done(Box::new(outcome))
        }
        Ok(Err(e)) => {
            tracing::error!(model = %model.name, "generation failed: {e:#}");
            Event::Failed(ApiError::internal(format!("generation failed: {e:#}")))
        }
        Err(panic) => {
            let message = panic_message(&*panic);
            tracing::error!(model = %model.name, "generation panicked: {message}");
            // The slot's backend may be in any state now: replace it, or retire the slot.
            match catch_unwind(AssertUnwindSafe(|| Pipeline::open(&model.profile))) {
                Ok(Ok(fresh)) => lease.replace(fresh),
                Ok(Err(e)) => {
                    tracing::error!(model = %model.name, "cannot reopen a slot after a panic; retiring it: {e:#}");
                    lease.discard();
                    return send_last(tx, internal_panic(&message));
                }
                Err(_) => {
                    tracing::error!(model = %model.name, "reopening a slot panicked; retiring it");
                    lease.discard();
                    return send_last(tx, internal_panic(&message));
                }
            }
            internal_panic(&message)
        }
    };
    // Free the slot before the client hears that the request is over.
    drop(lease);
    send_last(tx, event);
}

fn internal_panic(message: &str) -> Event {
    Event::Failed(ApiError::internal(format!(
        "internal error during generation: {message}"
    )))
}

fn send_last(tx: &mpsc::UnboundedSender<Event>, event: Event) {
    let _ = tx.send(event);
}

/// The text of a panic payload.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic".to_string()
    }
}
