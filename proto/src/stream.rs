//! Streamed tensors: how activations and gradients cross the server without
//! being stored and forwarded whole.
//!
//! A provider sends a large boundary tensor as its message (an
//! [`Activations`] or [`Gradients`] frame) whose tensor has no bytes, followed
//! by payload frames holding those bytes in order, each at most
//! [`CHUNK_BYTES`]. A payload frame is [`PAYLOAD_TAG`], the [`Lane`] byte, then
//! raw tensor bytes; its first byte can never start a protocol message, whose
//! first byte is a small enum tag. The server checks each payload frame as it
//! arrives and passes the very same frame on to the next stage, which
//! assembles the message ([`Assembler`]). The relay thus overlaps its two
//! hops and never copies a tensor out of a frame.
//!
//! The rule for which tensors follow: a tensor of a streamed message follows
//! exactly when it has no bytes while its shape needs some. Everything else,
//! the server's own frames included, travels inline as before.

use bytes::{Bytes, BytesMut};
use serde::de::DeserializeOwned;

use crate::{
    Activations, Backward, DecodeError, EncodeError, Forward, Gradients, ToProvider, ToServer,
    WireTensor, decode_frame, encode,
};

/// First byte of a payload frame.
pub const PAYLOAD_TAG: u8 = 0xFF;
/// Largest run of tensor bytes in one payload frame. Small enough that the
/// server's two hops overlap, large enough that per-frame costs stay small:
/// `bench relay`'s median ratio over 7 runs here was 0.54 with 256 KiB, 0.71
/// with 512 KiB and 0.63 with 1 MiB.
pub const CHUNK_BYTES: usize = 512 * 1024;
/// Tensors smaller than this travel inline: streaming them saves nothing.
pub const STREAM_MIN_BYTES: usize = 64 * 1024;

/// Which way a payload flows through a cluster. A stage receives its
/// inputs' activations on one lane and its outputs' gradients on the other,
/// from different neighbours, so a payload names its lane to find its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Activations, Root to Leaf.
    Forward = 0,
    /// Gradients, Leaf to Root.
    Backward = 1,
}

impl Lane {
    fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            0 => Some(Lane::Forward),
            1 => Some(Lane::Backward),
            _ => None,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A frame as read off a socket.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming<T> {
    Message(T),
    Payload(Payload),
}

/// One payload frame, kept whole so that it can be passed on unchanged.
#[derive(Debug, Clone, PartialEq)]
pub struct Payload {
    pub lane: Lane,
    frame: Bytes,
}

impl Payload {
    /// The tensor bytes it carries.
    pub fn data(&self) -> &[u8] {
        &self.frame[2..]
    }

    /// The frame as received, to send on as it is.
    pub fn frame(&self) -> Bytes {
        self.frame.clone()
    }
}

/// Reads one frame: a payload, or a message decoded by [`decode_frame`].
pub fn read_frame<T: DeserializeOwned>(
    frame: &Bytes,
    limit: usize,
) -> Result<Incoming<T>, DecodeError> {
    match frame.first() {
        Some(&PAYLOAD_TAG) => {
            if frame.len() > limit {
                return Err(DecodeError::TooLarge {
                    len: frame.len(),
                    limit,
                });
            }
            let lane = frame
                .get(1)
                .copied()
                .and_then(Lane::from_byte)
                .ok_or_else(|| DecodeError::Malformed("payload frame without a lane".into()))?;
            Ok(Incoming::Payload(Payload {
                lane,
                frame: frame.clone(),
            }))
        }
        _ => decode_frame(frame, limit).map(Incoming::Message),
    }
}

/// The messages whose tensors may follow them, and on which lane.
pub trait Streamed {
    fn lane(&self) -> Option<Lane>;
    fn streamed_tensors(&self) -> &[WireTensor];
    fn streamed_tensors_mut(&mut self) -> &mut [WireTensor];
}

macro_rules! streamed {
    ($message:ident { $($variant:ident($body:ident) => $field:ident, $lane:ident;)* }) => {
        impl Streamed for $message {
            fn lane(&self) -> Option<Lane> {
                match self {
                    $($message::$variant(_) => Some(Lane::$lane),)*
                    _ => None,
                }
            }

            fn streamed_tensors(&self) -> &[WireTensor] {
                match self {
                    $($message::$variant($body { $field, .. }) => $field,)*
                    _ => &[],
                }
            }

            fn streamed_tensors_mut(&mut self) -> &mut [WireTensor] {
                match self {
                    $($message::$variant($body { $field, .. }) => $field,)*
                    _ => &mut [],
                }
            }
        }
    };
}

streamed!(ToServer {
    Activations(Activations) => outputs, Forward;
    Gradients(Gradients) => grads, Backward;
});
streamed!(ToProvider {
    Forward(Forward) => inputs, Forward;
    Backward(Backward) => grads, Backward;
});

impl WireTensor {
    /// Whether its bytes follow its message in payload frames.
    pub fn follows(&self) -> bool {
        self.data.is_empty() && self.expected_len().is_some_and(|n| n > 0)
    }

    /// Bytes it puts on the wire, inline or following.
    pub fn wire_len(&self) -> usize {
        if self.follows() {
            self.expected_len().unwrap_or(0)
        } else {
            self.data.len()
        }
    }
}

/// The byte counts, in order, of a message's tensors that follow it.
pub fn following<T: Streamed>(message: &T) -> Vec<usize> {
    message
        .streamed_tensors()
        .iter()
        .filter(|t| t.follows())
        .filter_map(WireTensor::expected_len)
        .collect()
}

/// Encodes a message as its frames: the message, then, for a streamed
/// message's tensors of [`STREAM_MIN_BYTES`] or more, their payload frames.
pub fn encode_streamed<T: Streamed + serde::Serialize + Clone>(
    message: &T,
) -> Result<Vec<Bytes>, EncodeError> {
    let Some(lane) = message.lane() else {
        return Ok(vec![encode(message)?.into()]);
    };
    let streams = |t: &WireTensor| t.data.len() >= STREAM_MIN_BYTES;
    if !message.streamed_tensors().iter().any(streams) {
        return Ok(vec![encode(message)?.into()]);
    }
    let mut header = message.clone();
    let mut payloads = Vec::new();
    for tensor in header.streamed_tensors_mut() {
        if streams(tensor) {
            payloads.push(std::mem::take(&mut tensor.data));
        }
    }
    let mut frames = vec![Bytes::from(encode(&header)?)];
    for data in &payloads {
        for chunk in data.chunks(CHUNK_BYTES) {
            let mut frame = Vec::with_capacity(2 + chunk.len());
            frame.extend_from_slice(&[PAYLOAD_TAG, lane as u8]);
            frame.extend_from_slice(chunk);
            frames.push(frame.into());
        }
    }
    Ok(frames)
}

/// Why frames cannot be assembled into messages.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    #[error("a payload frame on the {0:?} lane with no message waiting for it")]
    Unexpected(Lane),
    #[error("a payload of {got} bytes where {left} were left of tensor `{name}`")]
    Overrun {
        name: String,
        got: usize,
        left: usize,
    },
    #[error("a streamed message on the {0:?} lane before the previous one was complete")]
    Interleaved(Lane),
}

/// Puts streamed messages back together on the receiving side; a payload
/// that is a whole tensor is used as it is, without a copy.
#[derive(Debug)]
pub struct Assembler<T> {
    lanes: [Option<Waiting<T>>; 2],
}

#[derive(Debug)]
struct Waiting<T> {
    message: T,
    /// Index into the streamed tensors of the one being filled.
    tensor: usize,
    filled: BytesMut,
}

impl<T> Default for Assembler<T> {
    fn default() -> Self {
        Self {
            lanes: [None, None],
        }
    }
}

impl<T: Streamed> Assembler<T> {
    /// Takes one frame; returns a message once it is complete.
    pub fn push(&mut self, incoming: Incoming<T>) -> Result<Option<T>, StreamError> {
        match incoming {
            Incoming::Message(message) => {
                let Some(lane) = message.lane() else {
                    return Ok(Some(message));
                };
                let Some(first) = message.streamed_tensors().iter().position(|t| t.follows())
                else {
                    return Ok(Some(message));
                };
                let slot = &mut self.lanes[lane.index()];
                if slot.is_some() {
                    return Err(StreamError::Interleaved(lane));
                }
                *slot = Some(Waiting {
                    message,
                    tensor: first,
                    filled: BytesMut::new(),
                });
                Ok(None)
            }
            Incoming::Payload(payload) => {
                let slot = &mut self.lanes[payload.lane.index()];
                let waiting = slot.as_mut().ok_or(StreamError::Unexpected(payload.lane))?;
                if waiting.fill(&payload)? {
                    Ok(slot.take().map(|w| w.message))
                } else {
                    Ok(None)
                }
            }
        }
    }
}

impl<T: Streamed> Waiting<T> {
    /// Adds a payload to the tensor being filled; true once every tensor is.
    fn fill(&mut self, payload: &Payload) -> Result<bool, StreamError> {
        let tensors = self.message.streamed_tensors_mut();
        let tensor = &mut tensors[self.tensor];
        let want = tensor.expected_len().unwrap_or(0);
        let data = payload.data();
        let left = want - self.filled.len();
        if data.len() > left {
            return Err(StreamError::Overrun {
                name: tensor.name.clone(),
                got: data.len(),
                left,
            });
        }
        if self.filled.is_empty() && data.len() == want {
            tensor.data = payload.frame.slice(2..);
        } else {
            if self.filled.is_empty() {
                self.filled.reserve(want);
            }
            self.filled.extend_from_slice(data);
            if self.filled.len() < want {
                return Ok(false);
            }
            tensor.data = std::mem::take(&mut self.filled).freeze();
        }
        match tensors
            .iter()
            .skip(self.tensor + 1)
            .position(|t| t.follows())
        {
            Some(next) => {
                self.tensor += 1 + next;
                Ok(false)
            }
            None => Ok(true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Phase, WireDType};

    fn activations(sizes: &[usize]) -> ToServer {
        ToServer::Activations(Activations {
            job_id: 3,
            phase: Phase::Train { step: 5 },
            micro: 1,
            outputs: sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    let values: Vec<f32> = (0..n).map(|v| v as f32 * 0.5 + i as f32).collect();
                    WireTensor::from_f32(format!("t{i}"), &[n], &values, WireDType::F32)
                })
                .collect(),
            compute_ms: 2.0,
        })
    }

    fn assemble(frames: &[Bytes]) -> Result<Vec<ToServer>, String> {
        let mut assembler = Assembler::default();
        let mut out = Vec::new();
        for frame in frames {
            let incoming = read_frame::<ToServer>(frame, usize::MAX).map_err(|e| e.to_string())?;
            if let Some(message) = assembler.push(incoming).map_err(|e| e.to_string())? {
                out.push(message);
            }
        }
        Ok(out)
    }

    #[test]
    fn streamed_messages_reassemble_to_the_original_whatever_their_tensor_sizes() {
        // Element counts around the inline threshold and the chunk size.
        let small = STREAM_MIN_BYTES / 4 - 1;
        let chunk = CHUNK_BYTES / 4;
        let cases: &[(&[usize], usize)] = &[
            (&[10], 1),
            (&[small], 1),
            (&[small + 1], 2),
            (&[chunk], 2),
            (&[chunk + 1], 3),
            (&[3 * chunk + 7, 5, chunk], 1 + 4 + 1),
        ];
        for &(sizes, frames) in cases {
            let message = activations(sizes);
            let encoded = encode_streamed(&message).unwrap();
            assert_eq!(encoded.len(), frames, "{sizes:?}");
            assert_eq!(assemble(&encoded), Ok(vec![message]), "{sizes:?}");
        }
    }

    #[test]
    fn a_one_chunk_tensor_is_the_payload_frame_itself() {
        let message = activations(&[CHUNK_BYTES / 4]);
        let encoded = encode_streamed(&message).unwrap();
        let [ToServer::Activations(a)] = &assemble(&encoded).unwrap()[..] else {
            panic!()
        };
        assert!(
            encoded[1]
                .as_ptr_range()
                .contains(&a.outputs[0].data.as_ptr())
        );
    }

    #[test]
    fn payloads_out_of_place_are_refused() {
        let encoded = encode_streamed(&activations(&[CHUNK_BYTES])).unwrap();
        // A payload before its message, one message inside another, and a
        // payload longer than what is left.
        assert!(
            assemble(&encoded[1..])
                .unwrap_err()
                .contains("no message waiting")
        );
        let twice = [encoded[0].clone(), encoded[0].clone()];
        assert!(
            assemble(&twice)
                .unwrap_err()
                .contains("before the previous")
        );
        let mut long = encoded[1].to_vec();
        long.extend_from_slice(&[0; 8]);
        let overrun = [
            encoded[0].clone(),
            encoded[1].clone(),
            encoded[2].clone(),
            encoded[3].clone(),
            Bytes::from(long),
        ];
        assert!(assemble(&overrun).unwrap_err().contains("were left"));
        // A payload frame with no lane byte, or an unknown one.
        for frame in [vec![PAYLOAD_TAG], vec![PAYLOAD_TAG, 7, 0]] {
            assert!(read_frame::<ToServer>(&Bytes::from(frame), 1 << 10).is_err());
        }
    }

    #[test]
    fn the_lanes_assemble_independently() {
        let forward = ToProvider::Forward(Forward {
            job_id: 1,
            phase: Phase::Train { step: 0 },
            micro: 0,
            step_samples: 8,
            step_targets: 8,
            inputs: vec![WireTensor::from_f32(
                "x",
                &[CHUNK_BYTES / 2],
                &vec![1.0; CHUNK_BYTES / 2],
                WireDType::F32,
            )],
            labels: None,
        });
        let backward = ToProvider::Backward(Backward {
            job_id: 1,
            step: 0,
            micro: 1,
            grads: vec![WireTensor::from_f32(
                "y",
                &[CHUNK_BYTES / 2],
                &vec![2.0; CHUNK_BYTES / 2],
                WireDType::F32,
            )],
        });
        let (f, b) = (
            encode_streamed(&forward).unwrap(),
            encode_streamed(&backward).unwrap(),
        );
        // The relay may interleave the two lanes' frames.
        let interleaved = [&f[0], &b[0], &f[1], &b[1], &b[2], &f[2]];
        let mut assembler = Assembler::default();
        let mut out = Vec::new();
        for frame in interleaved {
            if let Some(m) = assembler
                .push(read_frame::<ToProvider>(frame, usize::MAX).unwrap())
                .unwrap()
            {
                out.push(m);
            }
        }
        assert_eq!(out, vec![backward, forward]);
    }
}
