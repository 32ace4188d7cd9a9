//! Scheduling: a fixed pool of slots per loaded profile, and a bounded queue in front of it.
//!
//! A slot is one sequence of the model's engine loop ([`crate::scheduler`]): the pool bounds
//! how many requests generate at once. A request first passes [`SlotPool::admit`], which refuses it
//! at once when the queue is full (the daemon answers 503), then waits for a slot in FIFO
//! order (tokio's semaphore is fair) and holds it, as a [`Lease`], until its generation
//! ends. Dropping a lease returns the slot.
//!
//! The pool is generic over what a slot holds so that its accounting can be tested without
//! models.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use prometheus::IntGauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Why a request got no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    #[error("the request queue is full ({queued} waiting for {slots} slots)")]
    QueueFull { queued: usize, slots: usize },
    #[error("no slot of this model is usable any more")]
    Closed,
}

/// Gauges the pool keeps current (shared by every revision of a model, so each pool adds
/// and subtracts rather than sets).
#[derive(Clone)]
pub struct PoolGauges {
    pub queued: IntGauge,
    pub active: IntGauge,
}

/// Slots holding `T`, a semaphore with one permit per slot, and the queue bound.
pub struct SlotPool<T> {
    idle: Mutex<Vec<T>>,
    permits: Arc<Semaphore>,
    slots: AtomicUsize,
    queue_limit: usize,
    waiting: AtomicUsize,
    active: AtomicUsize,
    gauges: PoolGauges,
}

impl<T> SlotPool<T> {
    /// A pool of `items.len()` slots; at most `queue_limit` requests may wait beyond them.
    pub fn new(items: Vec<T>, queue_limit: usize, gauges: PoolGauges) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(items.len())),
            slots: AtomicUsize::new(items.len()),
            idle: Mutex::new(items),
            queue_limit,
            waiting: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            gauges,
        })
    }

    pub fn slots(&self) -> usize {
        self.slots.load(Ordering::Relaxed)
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Requests holding a slot.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Admits a request, or refuses it when the queue is full. Never waits.
    pub fn admit(self: &Arc<Self>) -> Result<Ticket<T>, SlotError> {
        if self.permits.is_closed() {
            return Err(SlotError::Closed);
        }
        let limit = self.queue_limit + self.permits.available_permits();
        self.waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < limit).then_some(w + 1)
            })
            .map_err(|queued| SlotError::QueueFull {
                queued,
                slots: self.slots(),
            })?;
        self.gauges.queued.inc();
        Ok(Ticket {
            pool: Some(self.clone()),
        })
    }

    fn put_back(&self, item: T) {
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(item);
    }
}

/// An admitted request that has not got its slot yet; dropping it leaves the queue.
pub struct Ticket<T> {
    pool: Option<Arc<SlotPool<T>>>,
}

impl<T> Ticket<T> {
    /// Waits for a free slot. Dropping the future while it waits leaves the queue (the
    /// ticket, owned by the future, is dropped with it).
    pub async fn wait(mut self) -> Result<Lease<T>, SlotError> {
        let permits = self
            .pool
            .as_ref()
            .expect("a ticket is used once")
            .permits
            .clone();
        let permit = permits.acquire_owned().await;
        let pool = self.pool.take().expect("a ticket is used once");
        pool.waiting.fetch_sub(1, Ordering::AcqRel);
        pool.gauges.queued.dec();
        let permit = permit.map_err(|_| SlotError::Closed)?;
        let item = pool
            .idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .expect("one idle slot per free permit");
        pool.active.fetch_add(1, Ordering::AcqRel);
        pool.gauges.active.inc();
        Ok(Lease {
            pool,
            item: Some(item),
            permit: Some(permit),
        })
    }
}

impl<T> Drop for Ticket<T> {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.waiting.fetch_sub(1, Ordering::AcqRel);
            pool.gauges.queued.dec();
        }
    }
}

/// A slot held by one request; dropping it returns the slot to the pool.
pub struct Lease<T> {
    pool: Arc<SlotPool<T>>,
    item: Option<T>,
    permit: Option<OwnedSemaphorePermit>,
}

impl<T> Lease<T> {
    /// Puts `fresh` in the slot in place of its current content (after a panic left that
    /// in an unknown state).
    pub fn replace(&mut self, fresh: T) {
        self.item = Some(fresh);
    }

    /// Drops the slot's content and retires the slot: the pool shrinks by one, and once no
    /// slot is left, waiting and future requests fail with [`SlotError::Closed`].
    pub fn discard(mut self) {
        self.item = None;
        if let Some(permit) = self.permit.take() {
            permit.forget();
        }
        if self.pool.slots.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.pool.permits.close();
        }
    }
}

impl<T> std::ops::Deref for Lease<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.item.as_ref().expect("a lease holds its slot")
    }
}

impl<T> std::ops::DerefMut for Lease<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.item.as_mut().expect("a lease holds its slot")
    }
}

impl<T> Drop for Lease<T> {
    fn drop(&mut self) {
        if let Some(item) = self.item.take() {
            self.pool.put_back(item);
        }
        self.pool.active.fetch_sub(1, Ordering::AcqRel);
        self.pool.gauges.active.dec();
        // The permit (if not forgotten) is released after the slot is back.
        drop(self.permit.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn gauges() -> PoolGauges {
        PoolGauges {
            queued: IntGauge::new("q", "q").unwrap(),
            active: IntGauge::new("a", "a").unwrap(),
        }
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn the_queue_is_bounded_and_slots_are_exclusive() {
        block_on(async {
            let g = gauges();
            let pool = SlotPool::new(vec![1, 2], 1, g.clone());
            let a = pool.admit().unwrap().wait().await.unwrap();
            let b = pool.admit().unwrap().wait().await.unwrap();
            assert_ne!(*a, *b);
            assert_eq!((pool.active(), g.active.get()), (2, 2));
            // One may wait; the next is refused.
            let waiting = pool.admit().unwrap();
            assert_eq!(g.queued.get(), 1);
            assert_eq!(
                pool.admit().err(),
                Some(SlotError::QueueFull {
                    queued: 1,
                    slots: 2
                })
            );
            let first = *a;
            drop(a);
            let c = tokio::time::timeout(Duration::from_secs(1), waiting.wait())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(*c, first);
            assert_eq!((pool.queued(), g.queued.get()), (0, 0));
            drop((b, c));
            assert_eq!((pool.active(), g.active.get()), (0, 0));
        });
    }

    #[test]
    fn a_dropped_ticket_leaves_the_queue() {
        block_on(async {
            let pool = SlotPool::new(vec![()], 0, gauges());
            let held = pool.admit().unwrap().wait().await.unwrap();
            assert!(pool.admit().is_err());
            drop(held);
            let ticket = pool.admit().unwrap();
            drop(ticket);
            assert_eq!(pool.queued(), 0);
            assert!(pool.admit().is_ok());
        });
    }

    /// A request whose client leaves while it waits drops its `wait` future mid-wait: that
    /// must leave the queue as dropping the ticket does.
    #[test]
    fn a_wait_abandoned_midway_leaves_the_queue() {
        block_on(async {
            let g = gauges();
            let pool = SlotPool::new(vec![()], 1, g.clone());
            let held = pool.admit().unwrap().wait().await.unwrap();
            let waiting = pool.admit().unwrap().wait();
            let gave_up = tokio::time::timeout(Duration::from_millis(20), waiting).await;
            assert!(gave_up.is_err(), "the slot is held");
            assert_eq!((pool.queued(), g.queued.get()), (0, 0));
            drop(held);
            let next = pool.admit().unwrap().wait().await.unwrap();
            assert_eq!((pool.active(), pool.queued()), (1, 0));
            drop(next);
        });
    }

    #[test]
    fn discarding_the_last_slot_closes_the_pool() {
        block_on(async {
            let pool = SlotPool::new(vec![7], 4, gauges());
            let lease = pool.admit().unwrap().wait().await.unwrap();
            let waiter = pool.admit().unwrap();
            lease.discard();
            assert_eq!(waiter.wait().await.err(), Some(SlotError::Closed));
            assert_eq!(pool.admit().err(), Some(SlotError::Closed));
            assert_eq!(pool.slots(), 0);
        });
    }

    #[test]
    fn a_replaced_slot_returns_its_new_content() {
        block_on(async {
            let pool = SlotPool::new(vec![1], 0, gauges());
            let mut lease = pool.admit().unwrap().wait().await.unwrap();
            lease.replace(5);
            drop(lease);
            let lease = pool.admit().unwrap().wait().await.unwrap();
            assert_eq!(*lease, 5);
        });
    }
}
