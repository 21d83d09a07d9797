//! Two things a provider connection keeps track of: the measurement of its
//! link (bandwidth, by timed probes after `Welcome`) and the tensor bytes it
//! announced and still owes in payload frames.

use std::collections::VecDeque;

use rookery_proto::stream::{Lane, Payload, Streamed, check_payload};
use rookery_proto::{ToProvider, ToServer, WireDType};

/// Measures a provider's link once, right after `Welcome`: an empty probe
/// times the round trip, then [`LinkProbe::BYTES`] of probes times the
/// round trip plus the transfer; the difference gives the bandwidth the
/// planner weighs boundary tensors with. Up to [`LinkProbe::ROUNDS`] such
/// pairs are timed, while they fit in [`LinkProbe::BUDGET`], and the
/// quickest of each kind counts: a provider connects while it (and its
/// neighbours) are still starting, and other work can only make a probe
/// slower. (Differences of single rounds are no good: one slow empty probe
/// makes the link look boundless.)
///
/// The full probe goes out as [`LinkProbe::CHUNKS`] probes of one seq,
/// each padded with the same shared [`LinkProbe::CHUNK`] of zeros, and is
/// timed to the last of their acknowledgements (every provider answers
/// each probe as it reads it). One 1 MiB frame would cost every connection
/// a megabyte for good: the WebSocket's write buffer keeps the capacity
/// of the largest frame it sent, and an idle browser is mostly that.
#[derive(Debug, Default)]
pub(super) struct LinkProbe {
    began: Option<tokio::time::Instant>,
    awaiting: Option<AwaitedProbe>,
    quickest_empty: Option<std::time::Duration>,
    quickest_full: Option<std::time::Duration>,
}

#[derive(Debug)]
struct AwaitedProbe {
    /// Even: an empty probe; odd: the full one of the same round.
    seq: u32,
    sent: tokio::time::Instant,
    /// Acknowledgements still to come for `seq`.
    acks_left: usize,
}

pub(super) enum ProbeNext {
    Send(Vec<ToProvider>),
    Measured(f64),
    /// More acknowledgements of the full probe are due.
    Awaiting,
    Ignore,
}

/// The padding of every full probe's frames, shared by all connections.
static ZEROS: [u8; LinkProbe::CHUNK] = [0; LinkProbe::CHUNK];

impl LinkProbe {
    /// Large enough to time a fast link, small enough for a slow one (8 s
    /// at 1 Mbit/s).
    pub(super) const BYTES: usize = 1 << 20;
    /// The padding of one frame of the full probe.
    pub(super) const CHUNK: usize = 16 << 10;
    pub(super) const CHUNKS: usize = Self::BYTES / Self::CHUNK;
    /// What a measurement is clamped to, in Mbit/s: timer resolution makes
    /// loopback look unboundedly fast.
    pub(super) const RANGE: (f64, f64) = (1.0, 100_000.0);
    pub(super) const ROUNDS: u32 = 3;
    /// No round starts after probing has taken this long (a slow link is
    /// timed once).
    pub(super) const BUDGET: std::time::Duration = std::time::Duration::from_millis(500);

    pub(super) fn start(&mut self) -> Vec<ToProvider> {
        let now = tokio::time::Instant::now();
        self.began = Some(now);
        self.send(0, now)
    }

    fn send(&mut self, seq: u32, now: tokio::time::Instant) -> Vec<ToProvider> {
        let (frames, padding) = if seq.is_multiple_of(2) {
            (1, rookery_proto::Bytes::new())
        } else {
            (Self::CHUNKS, rookery_proto::Bytes::from_static(&ZEROS))
        };
        self.awaiting = Some(AwaitedProbe {
            seq,
            sent: now,
            acks_left: frames,
        });
        vec![
            ToProvider::Probe {
                seq,
                padding: padding.clone(),
            };
            frames
        ]
    }

    pub(super) fn acknowledged(&mut self, seq: u32) -> ProbeNext {
        let now = tokio::time::Instant::now();
        let Some(awaited) = self.awaiting.as_mut().filter(|a| a.seq == seq) else {
            return ProbeNext::Ignore;
        };
        awaited.acks_left -= 1;
        if awaited.acks_left > 0 {
            return ProbeNext::Awaiting;
        }
        let took = now - awaited.sent;
        self.awaiting = None;
        let quickest = if seq.is_multiple_of(2) {
            &mut self.quickest_empty
        } else {
            &mut self.quickest_full
        };
        *quickest = Some(quickest.map_or(took, |q| q.min(took)));
        if seq.is_multiple_of(2) {
            return ProbeNext::Send(self.send(seq + 1, now));
        }
        let rounds = seq / 2 + 1;
        let within_budget = self.began.is_some_and(|b| now - b < Self::BUDGET);
        if rounds < Self::ROUNDS && within_budget {
            return ProbeNext::Send(self.send(seq + 1, now));
        }
        let (Some(empty), Some(full)) = (self.quickest_empty, self.quickest_full) else {
            return ProbeNext::Ignore;
        };
        let transfer = full.saturating_sub(empty).as_secs_f64();
        let mbps = (Self::BYTES * 8) as f64 / transfer.max(1e-9) / 1e6;
        ProbeNext::Measured(mbps.clamp(Self::RANGE.0, Self::RANGE.1))
    }
}

/// The tensor bytes a provider announced on the relayed lanes and has not
/// sent yet, tensor by tensor in order. Each payload frame is checked here,
/// in the provider's own task, before it is relayed: it must belong to the
/// lane and fit the tensor it continues, and hold whole, finite elements of
/// the tensor's type ([`check_payload`]).
#[derive(Debug, Default)]
pub(super) struct Owed(VecDeque<OwedTensor>);

#[derive(Debug)]
struct OwedTensor {
    lane: Lane,
    name: String,
    dtype: WireDType,
    done: usize,
    left: usize,
}

impl Owed {
    /// Bound on announced-but-unsent tensors: a provider owes at most a few.
    pub(super) const MAX_PENDING: usize = 1024;

    pub(super) fn announce(&mut self, message: &ToServer) -> Result<(), String> {
        let Some(lane) = message.lane().filter(|lane| lane.is_relayed()) else {
            return Ok(());
        };
        for tensor in message
            .streamed_tensors()
            .into_iter()
            .filter(|t| t.follows())
        {
            if self.0.len() >= Self::MAX_PENDING {
                return Err("too many announced tensors outstanding".into());
            }
            self.0.push_back(OwedTensor {
                lane,
                name: tensor.name.clone(),
                dtype: tensor.dtype,
                done: 0,
                left: tensor.expected_len().unwrap_or(0),
            });
        }
        Ok(())
    }

    pub(super) fn take(&mut self, payload: &Payload) -> Result<(), String> {
        let Some(owed) = self.0.front_mut() else {
            return Err("a payload frame that no message announced".into());
        };
        if payload.lane != owed.lane {
            return Err(format!(
                "a {:?} payload while {:?} bytes are owed",
                payload.lane, owed.lane
            ));
        }
        let data = payload.data();
        check_payload(&owed.name, owed.dtype, owed.done, owed.left, data)
            .map_err(|e| e.to_string())?;
        owed.done += data.len();
        owed.left -= data.len();
        if owed.left == 0 {
            self.0.pop_front();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paddings(messages: &[ToProvider]) -> Vec<(usize, *const u8)> {
        messages
            .iter()
            .map(|m| match m {
                ToProvider::Probe { padding, .. } => (padding.len(), padding.as_ptr()),
                other => panic!("expected a probe, got {other:?}"),
            })
            .collect()
    }

    #[tokio::test]
    async fn a_full_probe_is_small_frames_padded_from_one_buffer_every_connection_shares() {
        let full = |probe: &mut LinkProbe| {
            probe.start();
            match probe.acknowledged(0) {
                ProbeNext::Send(next) => paddings(&next),
                _ => panic!("the empty probe's answer must send the full one"),
            }
        };
        let (first, second) = (
            full(&mut LinkProbe::default()),
            full(&mut LinkProbe::default()),
        );
        assert_eq!(first.len(), LinkProbe::CHUNKS);
        assert_eq!(first.iter().map(|p| p.0).sum::<usize>(), LinkProbe::BYTES);
        assert!(first.iter().all(|p| p.0 <= 64 << 10), "{:?}", first[0]);
        assert!(first.iter().chain(&second).all(|p| p.1 == first[0].1));
    }

    #[tokio::test]
    async fn a_full_probe_is_timed_to_its_last_answer() {
        let mut probe = LinkProbe::default();
        probe.start();
        assert!(matches!(probe.acknowledged(0), ProbeNext::Send(_)));
        for _ in 1..LinkProbe::CHUNKS {
            assert!(matches!(probe.acknowledged(1), ProbeNext::Awaiting));
        }
        assert!(matches!(probe.acknowledged(1), ProbeNext::Send(_)));
        assert!(matches!(probe.acknowledged(1), ProbeNext::Ignore));
    }
}
