//! A provider connection's outbox: what the coordinator has handed the
//! connection's writer and the writer has not taken yet.
//!
//! The coordinator is one task serving every job, so it never waits for a
//! provider: sending is immediate. A provider that reads slower than its
//! job sends to it would make the queue, and the server, grow without end;
//! so the outbox counts the bytes it holds that nothing else holds (relayed
//! payload frames, the micro-batches of a `Forward`) and once they pass
//! its bound it refuses everything more, and its writer ends the
//! connection: the provider's stage is lost and reassigned, as for any
//! provider that leaves. Messages whose tensors the run keeps anyway
//! (`Assign` and `SetParams` share the checkpoint's buffers) cost nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use rookery_proto::ToProvider;
use rookery_proto::stream;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::Outgoing;

/// The default bound on an outbox's own bytes.
pub const DEFAULT_MAX_OUTBOX_BYTES: usize = 1 << 30;

/// The coordinator's end.
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: mpsc::UnboundedSender<(Outgoing, usize, Instant)>,
    shared: Arc<Shared>,
}

/// The connection writer's end.
#[derive(Debug)]
pub struct OutboxReceiver {
    rx: mpsc::UnboundedReceiver<(Outgoing, usize, Instant)>,
    shared: Arc<Shared>,
    /// Each frame is held until this long after it was queued (benchmarks
    /// of links between homes only; zero otherwise).
    delay: Duration,
    /// The frame taken from the queue and not yet handed out.
    held: Option<(Outgoing, Instant)>,
}

#[derive(Debug)]
struct Shared {
    queued: AtomicUsize,
    max_bytes: usize,
    overflowed: AtomicBool,
}

/// The outbox passed its bound: its provider reads too slowly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("more than {max_bytes} bytes waited to be sent to this provider; it reads too slowly")]
pub struct Overflow {
    pub max_bytes: usize,
}

/// An outbox that holds at most `max_bytes` of its own.
pub fn outbox(max_bytes: usize) -> (Outbox, OutboxReceiver) {
    let (tx, rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        queued: AtomicUsize::new(0),
        max_bytes,
        overflowed: AtomicBool::new(false),
    });
    (
        Outbox {
            tx,
            shared: shared.clone(),
        },
        OutboxReceiver {
            rx,
            shared,
            delay: Duration::ZERO,
            held: None,
        },
    )
}

/// What queuing `outgoing` adds to the memory the server holds.
fn own_bytes(outgoing: &Outgoing) -> usize {
    match outgoing {
        Outgoing::Payload(frame) => frame.len(),
        Outgoing::Message(message @ ToProvider::Forward(_)) => {
            stream::following(message).iter().sum()
        }
        Outgoing::Message(_) | Outgoing::Close { .. } => 0,
    }
}

impl Outbox {
    /// Queues `outgoing` unless the outbox has overflowed, or would now.
    /// A refused frame is dropped: the connection is ending.
    pub fn send(&self, outgoing: Outgoing) -> Result<(), Overflow> {
        let shared = &self.shared;
        let overflow = Overflow {
            max_bytes: shared.max_bytes,
        };
        if shared.overflowed.load(Ordering::Acquire) {
            return Err(overflow);
        }
        let bytes = own_bytes(&outgoing);
        let queued = shared.queued.fetch_add(bytes, Ordering::AcqRel) + bytes;
        if queued > shared.max_bytes {
            shared.queued.fetch_sub(bytes, Ordering::AcqRel);
            shared.overflowed.store(true, Ordering::Release);
            // Wakes a writer waiting for work, so it notices at once.
            let _ = self.tx.send((
                Outgoing::Close {
                    reason: String::new(),
                },
                0,
                Instant::now(),
            ));
            return Err(overflow);
        }
        // A closed receiver: the connection ended, and its end is reported.
        let _ = self.tx.send((outgoing, bytes, Instant::now()));
        Ok(())
    }
}

impl OutboxReceiver {
    /// The next frame to send; `Err` once the outbox overflowed (before
    /// anything still queued); `None` once every sender is gone.
    /// Cancel-safe, as `select!` needs: a frame taken from the queue but
    /// still held for its delay stays held for the next call.
    pub async fn recv(&mut self) -> Option<Result<Outgoing, Overflow>> {
        if self.held.is_none() {
            let (outgoing, bytes, queued_at) = self.rx.recv().await?;
            self.shared.queued.fetch_sub(bytes, Ordering::AcqRel);
            if self.shared.overflowed.load(Ordering::Acquire) {
                return Some(Err(Overflow {
                    max_bytes: self.shared.max_bytes,
                }));
            }
            self.held = Some((outgoing, queued_at));
        }
        if let Some((_, queued_at)) = &self.held
            && !self.delay.is_zero()
        {
            // From when it was queued, not from now: frames queued together
            // leave together, and the link's latency never becomes a
            // throughput limit.
            tokio::time::sleep_until(*queued_at + self.delay).await;
        }
        self.held.take().map(|(outgoing, _)| Ok(outgoing))
    }

    /// Holds every frame until `delay` after it was queued: one hop of a
    /// link with that latency, for benchmarks (`rookery train
    /// --relay-delay-ms`, feature `bench-latency`).
    pub fn delayed(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_proto::Bytes;

    fn payload(bytes: usize) -> Outgoing {
        Outgoing::Payload(Bytes::from(vec![0u8; bytes]))
    }

    #[tokio::test]
    async fn an_outbox_holds_its_bound_and_then_refuses_everything() {
        let (tx, mut rx) = outbox(1000);
        tx.send(payload(600)).unwrap();
        // Messages whose tensors the run holds anyway cost nothing.
        tx.send(Outgoing::Message(ToProvider::Heartbeat { seq: 1 }))
            .unwrap();
        // Taken by the writer, a frame no longer counts.
        assert!(matches!(rx.recv().await, Some(Ok(Outgoing::Payload(_)))));
        tx.send(payload(900)).unwrap();
        assert_eq!(tx.send(payload(101)), Err(Overflow { max_bytes: 1000 }));
        // Once over, even small frames are refused, and the writer hears
        // of it before anything still queued.
        assert!(tx.send(payload(1)).is_err());
        assert!(matches!(
            rx.recv().await,
            Some(Err(Overflow { max_bytes: 1000 }))
        ));
    }

    /// A benchmark's link latency: each frame leaves `delay` after it was
    /// queued, so frames queued together leave together (latency, not a
    /// throughput limit), in order, and a frame queued later waits its own.
    #[tokio::test(start_paused = true)]
    async fn a_delayed_outbox_holds_each_frame_its_delay_from_when_it_was_queued() {
        let delay = Duration::from_millis(100);
        let (tx, rx) = outbox(1 << 20);
        let mut rx = rx.delayed(delay);
        let start = Instant::now();
        for bytes in [1, 2, 3] {
            tx.send(payload(bytes)).unwrap();
        }
        for bytes in [1, 2, 3] {
            let Some(Ok(Outgoing::Payload(frame))) = rx.recv().await else {
                panic!("a payload")
            };
            assert_eq!(frame.len(), bytes);
            assert_eq!(start.elapsed(), delay, "frame {bytes}");
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        tx.send(payload(4)).unwrap();
        assert!(rx.recv().await.is_some());
        assert_eq!(start.elapsed(), delay + Duration::from_millis(30) + delay);
        // A recv cut short while it holds a frame (the writer's select!
        // took another branch) loses nothing: the next one hands it out.
        tx.send(payload(5)).unwrap();
        let cut = tokio::time::timeout(Duration::from_millis(10), rx.recv()).await;
        assert!(cut.is_err(), "held for its delay");
        let next = tokio::time::timeout(Duration::from_secs(1), rx.recv()).await;
        let Ok(Some(Ok(Outgoing::Payload(frame)))) = next else {
            panic!("the held frame was lost: {next:?}")
        };
        assert_eq!(frame.len(), 5);
        // Undelayed, nothing waits.
        let (tx, mut rx) = outbox(1 << 20);
        let start = Instant::now();
        tx.send(payload(1)).unwrap();
        assert!(rx.recv().await.is_some());
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    #[tokio::test]
    async fn a_frame_to_a_closed_connection_is_no_error() {
        let (tx, rx) = outbox(10);
        drop(rx);
        assert_eq!(tx.send(payload(5)), Ok(()));
    }
}
