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

use rookery_proto::ToProvider;
use rookery_proto::stream;
use tokio::sync::mpsc;

use super::Outgoing;

/// The default bound on an outbox's own bytes.
pub const DEFAULT_MAX_OUTBOX_BYTES: usize = 1 << 30;

/// The coordinator's end.
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: mpsc::UnboundedSender<(Outgoing, usize)>,
    shared: Arc<Shared>,
}

/// The connection writer's end.
#[derive(Debug)]
pub struct OutboxReceiver {
    rx: mpsc::UnboundedReceiver<(Outgoing, usize)>,
    shared: Arc<Shared>,
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
        OutboxReceiver { rx, shared },
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
            ));
            return Err(overflow);
        }
        // A closed receiver: the connection ended, and its end is reported.
        let _ = self.tx.send((outgoing, bytes));
        Ok(())
    }
}

impl OutboxReceiver {
    /// The next frame to send; `Err` once the outbox overflowed (before
    /// anything still queued); `None` once every sender is gone.
    pub async fn recv(&mut self) -> Option<Result<Outgoing, Overflow>> {
        let (outgoing, bytes) = self.rx.recv().await?;
        self.shared.queued.fetch_sub(bytes, Ordering::AcqRel);
        if self.shared.overflowed.load(Ordering::Acquire) {
            return Some(Err(Overflow {
                max_bytes: self.shared.max_bytes,
            }));
        }
        Some(Ok(outgoing))
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

    #[tokio::test]
    async fn a_frame_to_a_closed_connection_is_no_error() {
        let (tx, rx) = outbox(10);
        drop(rx);
        assert_eq!(tx.send(payload(5)), Ok(()));
    }
}
