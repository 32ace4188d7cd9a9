//! Running a forward pass on a rayon pool whose threads stay awake between its parallel
//! regions.
//!
//! A forward pass is a few hundred short fork-joins (every projection, attention, the GDN
//! heads), separated by bits of serial work (norms, RoPE, activation quantisation). Between
//! them rayon parks its idle workers, and waking a parked thread costs a futex call and, in a
//! virtual machine, an inter-processor interrupt to a halted vCPU: tens of microseconds per
//! region, which a k-token verify pays as often as a single-token step. [`install_busy`] keeps
//! the pool's other threads polling for work for the length of one pass (as llama.cpp's
//! threads poll between graph nodes), so a region starts on every thread at once.

use rayon::{ThreadPool, Yield};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a polling thread goes on finding no work before it returns to rayon's idling. It
/// bridges the serial stretches between a pass's parallel regions (microseconds), and it is
/// what keeps a polling thread from waiting forever when rayon started its polling job inside
/// another job (a thread waiting on a join runs other jobs meanwhile): the pass it waits for
/// may be waiting on that very job.
const IDLE_POLL: Duration = Duration::from_micros(200);

/// Runs `work` on `pool` (as [`ThreadPool::install`]) while every other thread of the pool
/// polls for the parallel work `work` spawns instead of parking between regions; they go back
/// to rayon's normal idling when `work` returns, or after finding no work for `IDLE_POLL`.
pub fn install_busy<R: Send>(pool: &ThreadPool, work: impl FnOnce() -> R + Send) -> R {
    if pool.current_num_threads() <= 1 {
        return pool.install(work);
    }
    pool.install(|| {
        let owner = rayon::current_thread_index();
        let done = AtomicBool::new(false);
        rayon::scope(|scope| {
            scope.spawn_broadcast(|_, context| {
                // The thread running `work` must not spin here: `done` waits on it.
                if Some(context.index()) == owner {
                    return;
                }
                let mut idle_since = Instant::now();
                while !done.load(Ordering::Acquire) {
                    if rayon::yield_now() == Some(Yield::Executed) {
                        idle_since = Instant::now();
                    } else if idle_since.elapsed() > IDLE_POLL {
                        return;
                    } else {
                        std::hint::spin_loop();
                    }
                }
            });
            // Set however `work` ends, a panic included, so the scope can finish.
            let _release = ReleaseOnDrop(&done);
            work()
        })
    })
}

/// Sets its flag when dropped.
struct ReleaseOnDrop<'a>(&'a AtomicBool);

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn runs_the_work_with_every_thread_and_returns() {
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for _ in 0..20 {
                let sum: u64 = install_busy(&pool, || {
                    (0..10_000u64).into_par_iter().map(|i| i * i).sum::<u64>()
                        + (0..100u64).into_par_iter().sum::<u64>()
                });
                assert_eq!(sum, 333_283_335_000 + 4950);
            }
            // A panic in the work reaches the caller and leaves the pool usable.
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                install_busy(&pool, || -> u32 { panic!("boom") })
            }));
            assert!(caught.is_err());
            assert_eq!(install_busy(&pool, || 7), 7);
        }
    }

    /// A pass that waits on a job its polling thread is inside: the other thread stole job X,
    /// and while X waits on a half that the pass's thread runs, that thread started its polling
    /// job for the pass — which, polling until the pass ended, never returned into X (a
    /// deadlock seen in CI). Polling stops after `IDLE_POLL` without work instead.
    #[test]
    fn a_pass_waiting_on_a_job_its_poller_is_inside_finishes() {
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .unwrap();
            let (x_started, d_started, x_done) = (
                AtomicBool::new(false),
                AtomicBool::new(false),
                AtomicBool::new(false),
            );
            pool.install(|| {
                rayon::join(
                    || {
                        while !x_started.load(Ordering::Acquire) {
                            std::hint::spin_loop();
                        }
                        install_busy(&pool, || {
                            // Steal X's second half, then wait for X to end.
                            while !d_started.load(Ordering::Acquire) {
                                rayon::yield_now();
                            }
                            while !x_done.load(Ordering::Acquire) {
                                rayon::yield_now();
                            }
                        })
                    },
                    || {
                        // X, on the other thread.
                        x_started.store(true, Ordering::Release);
                        rayon::join(
                            || {
                                while !d_started.load(Ordering::Acquire) {
                                    std::hint::spin_loop();
                                }
                            },
                            || {
                                d_started.store(true, Ordering::Release);
                                std::thread::sleep(Duration::from_millis(20));
                            },
                        );
                        x_done.store(true, Ordering::Release);
                    },
                )
            });
            sender.send(()).unwrap();
        });
        receiver
            .recv_timeout(Duration::from_secs(20))
            .expect("the pass deadlocked");
    }
}
