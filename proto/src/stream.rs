//! Streamed tensors: every message that carries tensors crosses the wire in
//! frames of bounded size, however large its tensors are.
//!
//! A message with large tensors goes as its header (the message, each such
//! tensor with no bytes) followed by payload frames holding those bytes in
//! order, each at most [`CHUNK_BYTES`] and never over the frame limit. A
//! payload frame is [`PAYLOAD_TAG`], the [`Lane`] byte, then raw tensor bytes
//! (whole elements; an int8 tensor's scales whole); its first byte can never
//! start a protocol message, whose first byte is a small enum tag. Which messages stream, on which
//! lane, and the order their tensors follow in, is [`Streamed`]:
//!
//! | lane | to the server | to a provider |
//! |------|---------------|---------------|
//! | [`Lane::Forward`] | `Activations.outputs` | `Forward`: `labels`, then `inputs` |
//! | [`Lane::Backward`] | `Gradients.grads` | `Backward.grads` |
//! | [`Lane::Params`] | `Params.params`; `OptimizerState`: each param's `slots` | `Assign`: `params`, then each `optimizer_state` entry's `slots`; `SetParams.params`; `SetOptimizerState`: each param's `slots` |
//!
//! The server checks each activation or gradient payload as it arrives and
//! passes the very same frame on to the next stage, which assembles the
//! message ([`Assembler`]): the relay overlaps its two hops and never copies
//! a tensor out of a frame. Parameter traffic ends at its receiver, which
//! assembles it the same way. A relayed `Forward` to the Leaf streams its
//! labels itself (they come first) and then passes on the activations'
//! payloads.
//!
//! The rule for which tensors follow: a tensor of a streamed message follows
//! exactly when it has no bytes while its shape needs some. A sender streams
//! every tensor of [`STREAM_MIN_BYTES`] or more and any tensor that would
//! take the bytes left inline past [`INLINE_BUDGET`], so a header stays small
//! whatever the message.

use bytes::{Bytes, BytesMut};
use serde::de::DeserializeOwned;

use crate::tensor::{Invalid, int8_scale_bytes};
use crate::{
    Activations, Assignment, Backward, DecodeError, EncodeError, Forward, Gradients,
    OptimizerState, ParamSet, ToProvider, ToServer, WireDType, WireTensor, decode_frame, encode,
};

/// First byte of a payload frame.
pub const PAYLOAD_TAG: u8 = 0xFF;
/// Bytes before a payload frame's tensor bytes: the tag and the lane.
pub const PAYLOAD_HEADER_BYTES: usize = 2;
/// Largest run of tensor bytes in one payload frame (less when the frame
/// limit is smaller). Small enough that the server's two hops overlap,
/// large enough that per-frame costs stay small: `bench relay`'s median
/// ratio over 7 runs here was 0.54 with 256 KiB, 0.71 with 512 KiB and 0.63
/// with 1 MiB.
pub const CHUNK_BYTES: usize = 512 * 1024;
/// Tensors smaller than this travel inline: streaming them saves nothing.
pub const STREAM_MIN_BYTES: usize = 64 * 1024;
/// The most tensor bytes a header carries inline (less when the frame limit
/// is small): a stage's hundreds of biases must not add up to a frame over
/// the limit.
pub const INLINE_BUDGET: usize = 256 * 1024;
/// Bytes an [`Assembler`] reserves ahead for a tensor; a larger one grows
/// as its payloads arrive, so an announcement alone claims little memory.
const RESERVE_AHEAD: usize = 64 * 1024 * 1024;

/// Which flow a payload belongs to. A stage receives its inputs'
/// activations, its outputs' gradients and its parameters on separate
/// lanes, from different senders, so a payload names its lane to find its
/// message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Activations, Root to Leaf (and the server's data and labels).
    Forward = 0,
    /// Gradients, Leaf to Root.
    Backward = 1,
    /// Parameters and optimizer state, between a stage and the server.
    Params = 2,
}

const LANES: usize = 3;

impl Lane {
    fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            0 => Some(Lane::Forward),
            1 => Some(Lane::Backward),
            2 => Some(Lane::Params),
            _ => None,
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// Whether the server passes this lane's payloads on to another stage
    /// (rather than assembling them itself).
    pub fn is_relayed(self) -> bool {
        matches!(self, Lane::Forward | Lane::Backward)
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
        &self.frame[PAYLOAD_HEADER_BYTES..]
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

/// The messages whose tensors may follow them: on which lane, and in which
/// order (the order their payloads arrive in).
pub trait Streamed {
    fn lane(&self) -> Option<Lane>;
    fn streamed_tensors(&self) -> Vec<&WireTensor>;
    fn streamed_tensors_mut(&mut self) -> Vec<&mut WireTensor>;
}

impl Streamed for ToServer {
    fn lane(&self) -> Option<Lane> {
        match self {
            ToServer::Activations(_) => Some(Lane::Forward),
            ToServer::Gradients(_) => Some(Lane::Backward),
            ToServer::Params(_) | ToServer::OptimizerState(_) => Some(Lane::Params),
            _ => None,
        }
    }

    fn streamed_tensors(&self) -> Vec<&WireTensor> {
        match self {
            ToServer::Activations(Activations { outputs: t, .. })
            | ToServer::Gradients(Gradients { grads: t, .. })
            | ToServer::Params(ParamSet { params: t, .. }) => t.iter().collect(),
            ToServer::OptimizerState(OptimizerState { params, .. }) => {
                params.iter().flat_map(|p| &p.slots).collect()
            }
            _ => Vec::new(),
        }
    }

    fn streamed_tensors_mut(&mut self) -> Vec<&mut WireTensor> {
        match self {
            ToServer::Activations(Activations { outputs: t, .. })
            | ToServer::Gradients(Gradients { grads: t, .. })
            | ToServer::Params(ParamSet { params: t, .. }) => t.iter_mut().collect(),
            ToServer::OptimizerState(OptimizerState { params, .. }) => {
                params.iter_mut().flat_map(|p| &mut p.slots).collect()
            }
            _ => Vec::new(),
        }
    }
}

impl Streamed for ToProvider {
    fn lane(&self) -> Option<Lane> {
        match self {
            ToProvider::Forward(_) => Some(Lane::Forward),
            ToProvider::Backward(_) => Some(Lane::Backward),
            ToProvider::Assign(_) | ToProvider::SetParams(_) | ToProvider::SetOptimizerState(_) => {
                Some(Lane::Params)
            }
            _ => None,
        }
    }

    fn streamed_tensors(&self) -> Vec<&WireTensor> {
        match self {
            // Labels first: the server streams a relayed Forward's labels
            // itself, before the activations' payloads it passes on.
            ToProvider::Forward(Forward { inputs, labels, .. }) => {
                labels.iter().chain(inputs.iter()).collect()
            }
            ToProvider::Backward(Backward { grads: t, .. })
            | ToProvider::SetParams(ParamSet { params: t, .. }) => t.iter().collect(),
            ToProvider::SetOptimizerState(OptimizerState { params, .. }) => {
                params.iter().flat_map(|p| &p.slots).collect()
            }
            ToProvider::Assign(a) => {
                let Assignment {
                    params,
                    optimizer_state,
                    ..
                } = &**a;
                params
                    .iter()
                    .chain(optimizer_state.iter().flat_map(|p| &p.slots))
                    .collect()
            }
            _ => Vec::new(),
        }
    }

    fn streamed_tensors_mut(&mut self) -> Vec<&mut WireTensor> {
        match self {
            ToProvider::Forward(Forward { inputs, labels, .. }) => {
                labels.iter_mut().chain(inputs.iter_mut()).collect()
            }
            ToProvider::Backward(Backward { grads: t, .. })
            | ToProvider::SetParams(ParamSet { params: t, .. }) => t.iter_mut().collect(),
            ToProvider::SetOptimizerState(OptimizerState { params, .. }) => {
                params.iter_mut().flat_map(|p| &mut p.slots).collect()
            }
            ToProvider::Assign(a) => {
                let Assignment {
                    params,
                    optimizer_state,
                    ..
                } = &mut **a;
                params
                    .iter_mut()
                    .chain(optimizer_state.iter_mut().flat_map(|p| &mut p.slots))
                    .collect()
            }
            _ => Vec::new(),
        }
    }
}

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
        .into_iter()
        .filter(|t| t.follows())
        .filter_map(WireTensor::expected_len)
        .collect()
}

/// Tensor bytes in one payload frame under a frame limit of `limit`: whole
/// elements of any type (a multiple of 8), at most [`CHUNK_BYTES`].
pub fn chunk_bytes(limit: usize) -> usize {
    let room = limit.saturating_sub(PAYLOAD_HEADER_BYTES);
    CHUNK_BYTES.min(room - room % 8)
}

/// Encodes a message as its frames, none over `limit` bytes: the header,
/// then the payload frames of the tensors that follow it (see the module's
/// rule). Fails only when even the header with every tensor streamed is
/// over the limit (a message of very many tensors under a tiny limit).
pub fn encode_streamed<T: Streamed + serde::Serialize + Clone>(
    message: &T,
    limit: usize,
) -> Result<Vec<Bytes>, EncodeError> {
    let Some(lane) = message.lane() else {
        return Ok(vec![fits(encode(message)?, limit)?.into()]);
    };
    let chunk = chunk_bytes(limit);
    if chunk == 0 {
        return Err(EncodeError(format!(
            "a frame limit of {limit} bytes leaves no room for tensor bytes"
        )));
    }
    let budget = INLINE_BUDGET.min(limit / 4);
    let mut inline = 0usize;
    let mut streams = |t: &WireTensor| {
        let len = t.data.len();
        if len == 0 {
            return false;
        }
        if len >= STREAM_MIN_BYTES || inline + len > budget {
            return true;
        }
        inline += len;
        false
    };
    let picked: Vec<bool> = message
        .streamed_tensors()
        .into_iter()
        .map(&mut streams)
        .collect();
    if !picked.contains(&true) {
        return Ok(vec![fits(encode(message)?, limit)?.into()]);
    }
    let mut header = message.clone();
    let mut payloads = Vec::new();
    for (tensor, streamed) in header.streamed_tensors_mut().into_iter().zip(picked) {
        if streamed {
            payloads.push(std::mem::take(&mut tensor.data));
        }
    }
    let mut frames = vec![Bytes::from(fits(encode(&header)?, limit)?)];
    for data in &payloads {
        for piece in data.chunks(chunk) {
            let mut frame = Vec::with_capacity(PAYLOAD_HEADER_BYTES + piece.len());
            frame.extend_from_slice(&[PAYLOAD_TAG, lane as u8]);
            frame.extend_from_slice(piece);
            frames.push(frame.into());
        }
    }
    Ok(frames)
}

fn fits(frame: Vec<u8>, limit: usize) -> Result<Vec<u8>, EncodeError> {
    if frame.len() > limit {
        return Err(EncodeError(format!(
            "the message's header is {} bytes, over the frame limit of {limit} bytes, with every large tensor streamed",
            frame.len()
        )));
    }
    Ok(frame)
}

/// Why frames cannot be assembled into messages, or a payload is refused.
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
    #[error("an empty payload frame for tensor `{name}`")]
    Empty { name: String },
    #[error("a payload of {got} bytes is not whole {dtype} elements of tensor `{name}`")]
    Partial {
        name: String,
        got: usize,
        dtype: &'static str,
    },
    #[error("tensor `{name}`: element {index} is not finite")]
    NotFinite { name: String, index: usize },
    /// An int8 tensor's invalid scale or value.
    #[error(transparent)]
    Invalid(crate::TensorError),
    #[error(
        "a message announcing {announced} bytes of tensors to follow, over the {limit} bytes this receiver accepts"
    )]
    TooLarge { announced: usize, limit: usize },
}

/// Checks one payload that continues tensor `name` of type `dtype`, of
/// which `done` bytes have arrived and `left` are still owed: non-empty,
/// no longer than what is left, whole elements, every float finite. An
/// int8 tensor's payloads may end anywhere in its values but only between
/// its scales, each scale finite and non-negative, no value -128.
pub fn check_payload(
    name: &str,
    dtype: WireDType,
    done: usize,
    left: usize,
    data: &[u8],
) -> Result<(), StreamError> {
    if data.is_empty() {
        return Err(StreamError::Empty { name: name.into() });
    }
    if data.len() > left {
        return Err(StreamError::Overrun {
            name: name.into(),
            got: data.len(),
            left,
        });
    }
    let partial = || StreamError::Partial {
        name: name.into(),
        got: data.len(),
        dtype: dtype.as_str(),
    };
    let total = done.saturating_add(left);
    if dtype == WireDType::I8Block {
        // Scales are whole f32s, so a payload starts and ends on one's
        // boundary while it is among them.
        let split = int8_scale_bytes(total).ok_or_else(partial)?;
        let end = done + data.len();
        if (done < split && !done.is_multiple_of(4)) || (end < split && !end.is_multiple_of(4)) {
            return Err(partial());
        }
    } else if !data.len().is_multiple_of(dtype.size()) {
        return Err(partial());
    }
    match dtype.first_invalid(data, done, total) {
        Some(Invalid::NotFinite(index)) => Err(StreamError::NotFinite {
            name: name.into(),
            index,
        }),
        Some(bad) => Err(StreamError::Invalid(bad.error(name))),
        None => Ok(()),
    }
}

/// Puts streamed messages back together on the receiving side, checking
/// each payload ([`check_payload`]) as it arrives; a payload that is a whole
/// tensor is used as it is, without a copy.
#[derive(Debug)]
pub struct Assembler<T> {
    lanes: [Option<Waiting<T>>; LANES],
    max_message_bytes: usize,
}

#[derive(Debug)]
struct Waiting<T> {
    message: T,
    /// Index into the streamed tensors of the one being filled.
    tensor: usize,
    filled: BytesMut,
}

impl<T: Streamed> Assembler<T> {
    /// An assembler that refuses a message announcing more than
    /// `max_message_bytes` of tensors to follow (the receiver's memory, say).
    pub fn new(max_message_bytes: usize) -> Self {
        Self {
            lanes: [None, None, None],
            max_message_bytes,
        }
    }

    /// Whether a message is partly received on some lane.
    pub fn is_idle(&self) -> bool {
        self.lanes.iter().all(Option::is_none)
    }

    /// Takes one frame; returns a message once it is complete.
    pub fn push(&mut self, incoming: Incoming<T>) -> Result<Option<T>, StreamError> {
        match incoming {
            Incoming::Message(message) => {
                let Some(lane) = message.lane() else {
                    return Ok(Some(message));
                };
                let tensors = message.streamed_tensors();
                let Some(first) = tensors.iter().position(|t| t.follows()) else {
                    return Ok(Some(message));
                };
                let announced = tensors
                    .iter()
                    .filter(|t| t.follows())
                    .filter_map(|t| t.expected_len())
                    .try_fold(0usize, usize::checked_add)
                    .unwrap_or(usize::MAX);
                if announced > self.max_message_bytes {
                    return Err(StreamError::TooLarge {
                        announced,
                        limit: self.max_message_bytes,
                    });
                }
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
        let mut tensors = self.message.streamed_tensors_mut();
        let tensor = &mut tensors[self.tensor];
        let want = tensor.expected_len().unwrap_or(0);
        let data = payload.data();
        let done = self.filled.len();
        check_payload(&tensor.name, tensor.dtype, done, want - done, data)?;
        if done == 0 && data.len() == want {
            tensor.data = payload.frame.slice(PAYLOAD_HEADER_BYTES..);
        } else {
            if done == 0 {
                self.filled.reserve(want.min(RESERVE_AHEAD));
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
    use crate::{ParamOptimState, Phase};

    const NO_CAP: usize = usize::MAX;

    fn tensor(name: &str, n: usize, offset: f32) -> WireTensor {
        let values: Vec<f32> = (0..n).map(|v| v as f32 * 0.5 + offset).collect();
        WireTensor::from_f32(name, &[n], &values, WireDType::F32)
    }

    fn activations(sizes: &[usize]) -> ToServer {
        ToServer::Activations(Activations {
            job_id: 3,
            phase: Phase::Train { step: 5 },
            micro: 1,
            outputs: sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| tensor(&format!("t{i}"), n, i as f32))
                .collect(),
            compute_ms: 2.0,
        })
    }

    fn assemble_with<T: Streamed + DeserializeOwned>(
        frames: &[Bytes],
        cap: usize,
    ) -> Result<Vec<T>, String> {
        let mut assembler = Assembler::new(cap);
        let mut out = Vec::new();
        for frame in frames {
            let incoming = read_frame::<T>(frame, NO_CAP).map_err(|e| e.to_string())?;
            if let Some(message) = assembler.push(incoming).map_err(|e| e.to_string())? {
                out.push(message);
            }
        }
        if !assembler.is_idle() {
            return Err("a message was left incomplete".into());
        }
        Ok(out)
    }

    fn assemble(frames: &[Bytes]) -> Result<Vec<ToServer>, String> {
        assemble_with(frames, NO_CAP)
    }

    /// A stage's parameters: `big` large weights and many small biases.
    fn params(big: usize, biases: usize) -> Vec<WireTensor> {
        (0..big)
            .map(|i| tensor(&format!("w{i}"), 100_000 + i, 0.25))
            .chain((0..biases).map(|i| tensor(&format!("b{i}"), 5_000, -1.0)))
            .collect()
    }

    fn optimizer_state(params: &[WireTensor]) -> Vec<ParamOptimState> {
        params
            .iter()
            .map(|p| ParamOptimState {
                name: p.name.clone(),
                steps: 4,
                slots: ["exp_avg", "exp_avg_sq"]
                    .iter()
                    .map(|slot| tensor(slot, p.numel(), 0.125))
                    .collect(),
            })
            .collect()
    }

    fn every_to_server() -> Vec<ToServer> {
        let p = params(3, 70);
        vec![
            activations(&[300_000, 7]),
            ToServer::Gradients(Gradients {
                job_id: 1,
                step: 2,
                micro: 0,
                grads: vec![tensor("g", 200_000, 1.0)],
                compute_ms: 1.0,
            }),
            ToServer::Params(ParamSet {
                job_id: 1,
                step: 2,
                params: p.clone(),
            }),
            ToServer::OptimizerState(OptimizerState {
                job_id: 1,
                step: 2,
                params: optimizer_state(&p),
            }),
        ]
    }

    fn every_to_provider() -> Vec<ToProvider> {
        let p = params(2, 90);
        let labels: Vec<i64> = (0..40_000).collect();
        vec![
            ToProvider::Forward(Forward {
                job_id: 1,
                phase: Phase::Train { step: 0 },
                micro: 0,
                step_samples: 8,
                step_targets: 8,
                inputs: vec![tensor("x", 150_000, 0.0), tensor("mask", 3, 0.0)],
                labels: Some(WireTensor::from_i64("labels", &[labels.len()], &labels)),
            }),
            ToProvider::Backward(Backward {
                job_id: 1,
                step: 0,
                micro: 1,
                grads: vec![tensor("y", 70_000, 2.0)],
            }),
            ToProvider::Assign(Box::new(Assignment {
                job_id: 1,
                cluster: 0,
                stage: 1,
                stages: 3,
                graph_json: "{}".into(),
                first: 2,
                end: 5,
                outputs: vec!["h".into()],
                params: p.clone(),
                optimizer: rookery_model::OptimizerConfig::Adam {
                    lr: 1e-3,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.0,
                    amsgrad: false,
                },
                loss: rookery_model::Loss::cross_entropy(),
                batch_size: 8,
                micro_batches: 2,
                wire_dtype: WireDType::F32,
                seed: 1,
                start_step: 4,
                optimizer_state: optimizer_state(&p),
                lr_schedule: rookery_model::LrSchedule::default(),
                clip_grad_norm: None,
                public_name: None,
                schedule: crate::PipelineSchedule::Gpipe,
                sync_int8: false,
                precision: Default::default(),
            })),
            ToProvider::SetOptimizerState(OptimizerState {
                job_id: 1,
                step: 4,
                params: optimizer_state(&p),
            }),
            ToProvider::SetParams(ParamSet {
                job_id: 1,
                step: 4,
                params: p,
            }),
        ]
    }

    #[test]
    fn every_tensor_message_splits_into_frames_within_the_limit_and_reassembles() {
        // A frame limit far below the messages' sizes, as a test server sets.
        for limit in [256 * 1024, 1 << 20, 4 << 20] {
            for message in every_to_server() {
                let frames = encode_streamed(&message, limit).unwrap();
                assert!(frames.len() >= 2, "{limit}: not streamed");
                assert!(frames.iter().all(|f| f.len() <= limit), "{limit}");
                assert_eq!(assemble(&frames), Ok(vec![message]));
            }
            for message in every_to_provider() {
                let frames = encode_streamed(&message, limit).unwrap();
                assert!(frames.len() >= 2, "{limit}: not streamed");
                assert!(frames.iter().all(|f| f.len() <= limit), "{limit}");
                assert_eq!(assemble_with(&frames, NO_CAP), Ok(vec![message]));
            }
        }
    }

    #[test]
    fn many_small_tensors_stream_once_the_inline_budget_is_spent() {
        // 200 biases of 20 KB each: none is large, together they are 4 MB.
        let message = ToServer::Params(ParamSet {
            job_id: 1,
            step: 0,
            params: params(0, 200),
        });
        let frames = encode_streamed(&message, 1 << 20).unwrap();
        assert!(frames[0].len() < INLINE_BUDGET + 16 * 1024);
        assert_eq!(
            frames.len(),
            1 + 200 - INLINE_BUDGET / 20_000,
            "one payload per streamed bias"
        );
        assert_eq!(assemble(&frames), Ok(vec![message]));
    }

    #[test]
    fn messages_without_tensors_or_with_small_ones_are_one_frame() {
        for message in [
            ToServer::Heartbeat { seq: 1 },
            activations(&[10, 20]),
            ToServer::Params(ParamSet {
                job_id: 1,
                step: 0,
                params: vec![tensor("b", 30, 0.0)],
            }),
        ] {
            let frames = encode_streamed(&message, 1 << 20).unwrap();
            assert_eq!(frames, vec![Bytes::from(encode(&message).unwrap())]);
        }
    }

    #[test]
    fn a_header_over_the_limit_is_an_error_not_an_oversized_frame() {
        // Thousands of tensors whose names alone outgrow a 16 KiB limit.
        let message = ToServer::Params(ParamSet {
            job_id: 1,
            step: 0,
            params: (0..2000)
                .map(|i| tensor(&format!("a.rather.long.parameter.name.{i}"), 1, 0.0))
                .collect(),
        });
        let error = encode_streamed(&message, 16 * 1024).unwrap_err();
        assert!(
            error.to_string().contains("over the frame limit"),
            "{error}"
        );
        assert!(encode_streamed(&activations(&[100]), 3).is_err());
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
            let encoded = encode_streamed(&message, 64 << 20).unwrap();
            assert_eq!(encoded.len(), frames, "{sizes:?}");
            assert_eq!(assemble(&encoded), Ok(vec![message]), "{sizes:?}");
        }
    }

    #[test]
    fn a_one_chunk_tensor_is_the_payload_frame_itself() {
        let message = activations(&[CHUNK_BYTES / 4]);
        let encoded = encode_streamed(&message, 64 << 20).unwrap();
        let [ToServer::Activations(a)] = &assemble(&encoded).unwrap()[..] else {
            panic!()
        };
        assert!(
            encoded[1]
                .as_ptr_range()
                .contains(&a.outputs[0].data.as_ptr())
        );
    }

    fn payload(lane: Lane, bytes: &[u8]) -> Bytes {
        let mut frame = vec![PAYLOAD_TAG, lane as u8];
        frame.extend_from_slice(bytes);
        frame.into()
    }

    #[test]
    fn payloads_out_of_place_are_refused() {
        let encoded = encode_streamed(&activations(&[CHUNK_BYTES]), 64 << 20).unwrap();
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
        // Too few payloads: the message never completes.
        assert!(
            assemble(&encoded[..3])
                .unwrap_err()
                .contains("left incomplete")
        );
    }

    #[test]
    fn payloads_that_do_not_match_their_tensor_are_refused() {
        let message = ToServer::Params(ParamSet {
            job_id: 1,
            step: 0,
            params: vec![tensor("w", 100_000, 0.0)],
        });
        let frames = encode_streamed(&message, 1 << 20).unwrap();
        let header = frames[0].clone();
        let nan = f32::NAN.to_le_bytes().repeat(3);
        let cases: [(Vec<Bytes>, &str); 5] = [
            // Parameters on the activations' lane.
            (
                vec![header.clone(), payload(Lane::Forward, &[0; 8])],
                "no message waiting",
            ),
            (vec![header.clone(), payload(Lane::Params, &[])], "empty"),
            (
                vec![header.clone(), payload(Lane::Params, &[0; 6])],
                "not whole f32",
            ),
            (
                vec![
                    header.clone(),
                    payload(Lane::Params, &[&[0; 8][..], &nan[..]].concat()),
                ],
                "element 2 is not finite",
            ),
            (
                vec![header.clone(), payload(Lane::Params, &vec![0; 400_004])],
                "were left",
            ),
        ];
        for (frames, want) in cases {
            let error = assemble(&frames).unwrap_err();
            assert!(error.contains(want), "{error} lacks {want}");
        }
        // The element index counts from the tensor's start, not the frame's.
        let mut late = vec![header, payload(Lane::Params, &[0; 1000])];
        late.push(payload(Lane::Params, &nan));
        assert!(
            assemble(&late)
                .unwrap_err()
                .contains("element 250 is not finite")
        );
    }

    #[test]
    fn int8_tensors_stream_and_each_payload_is_checked_where_it_falls() {
        // 300 000 values: 18 752 bytes of scales, then the values, in chunks.
        let n = 300_000;
        let values: Vec<f32> = (0..n).map(|v| (v as f32 * 0.37).sin()).collect();
        let t = WireTensor::from_f32("a", &[n], &values, WireDType::I8Block);
        let (total, split) = (t.data.len(), 4 * n.div_ceil(64));
        assert_eq!(total, split + n);
        let message = ToServer::Activations(Activations {
            job_id: 3,
            phase: Phase::Train { step: 5 },
            micro: 1,
            outputs: vec![t.clone()],
            compute_ms: 2.0,
        });
        let frames = encode_streamed(&message, 1 << 20).unwrap();
        assert_eq!(frames.len(), 1 + total.div_ceil(CHUNK_BYTES));
        assert_eq!(assemble(&frames), Ok(vec![message]));
        let check = |from: usize, to: usize, data: &[u8]| {
            check_payload("a", WireDType::I8Block, from, total - from, &data[from..to])
                .map_err(|e| e.to_string())
        };
        // Among the scales a payload starts and ends on a scale's boundary;
        // among the values, anywhere.
        assert!(check(0, 6, &t.data).unwrap_err().contains("not whole int8"));
        assert!(check(2, 8, &t.data).unwrap_err().contains("not whole int8"));
        assert_eq!(check(0, split + 3, &t.data), Ok(()));
        assert_eq!(check(split + 3, total, &t.data), Ok(()));
        // A bad scale or a -128 is found by its index in the whole tensor.
        let mut bad = t.data.to_vec();
        bad[8..12].copy_from_slice(&(-1.0f32).to_le_bytes());
        bad[split + 1000] = 0x80;
        let error = check(4, 16, &bad).unwrap_err();
        assert!(error.contains("int8 block 2"), "{error}");
        let error = check(split + 997, split + 1003, &bad).unwrap_err();
        assert!(error.contains("int8 element 1000 is -128"), "{error}");
        let mut frames = frames;
        let mut first = frames[1].to_vec();
        first[PAYLOAD_HEADER_BYTES + 4..PAYLOAD_HEADER_BYTES + 8]
            .copy_from_slice(&f32::NAN.to_le_bytes());
        frames[1] = first.into();
        let error = assemble(&frames).unwrap_err();
        assert!(error.contains("int8 block 1"), "{error}");
    }

    #[test]
    fn a_message_announcing_more_than_the_receiver_accepts_is_refused_at_once() {
        let message = ToServer::Params(ParamSet {
            job_id: 1,
            step: 0,
            params: vec![tensor("w", 100_000, 0.0)],
        });
        let frames = encode_streamed(&message, 1 << 20).unwrap();
        let error = assemble_with::<ToServer>(&frames[..1], 399_999).unwrap_err();
        assert!(error.contains("over the 399999 bytes"), "{error}");
        assert_eq!(
            assemble_with::<ToServer>(&frames, 400_000),
            Ok(vec![message])
        );
        // A shape whose size overflows does not follow: the message is
        // complete as it is, and its receiver's size check refuses it.
        let mut huge = tensor("w", 1, 0.0);
        huge.shape = vec![u32::MAX, u32::MAX, u32::MAX];
        huge.data = Bytes::new();
        let header = ToServer::Params(ParamSet {
            job_id: 1,
            step: 0,
            params: vec![tensor("a", 1, 0.0), huge],
        });
        let mut assembler = Assembler::new(1 << 30);
        assert_eq!(
            assembler.push(Incoming::Message(header.clone())),
            Ok(Some(header))
        );
    }

    #[test]
    fn the_lanes_assemble_independently() {
        let forward = every_to_provider().remove(0);
        let backward = every_to_provider().remove(1);
        let set = every_to_provider().remove(3);
        let limit = 256 * 1024;
        let (f, b, s) = (
            encode_streamed(&forward, limit).unwrap(),
            encode_streamed(&backward, limit).unwrap(),
            encode_streamed(&set, limit).unwrap(),
        );
        // Frames of the three lanes, interleaved, each lane's in order.
        let mut lanes = [f.iter(), b.iter(), s.iter()];
        let mut interleaved = Vec::new();
        while interleaved.len() < f.len() + b.len() + s.len() {
            for lane in &mut lanes {
                interleaved.extend(lane.next().cloned());
            }
        }
        let mut out = assemble_with::<ToProvider>(&interleaved, NO_CAP).unwrap();
        out.sort_by_key(|m| format!("{:?}", m.lane()));
        assert_eq!(out, vec![backward, forward, set]);
    }

    #[test]
    fn a_relayed_forward_streams_its_labels_before_the_activations_it_passes_on() {
        // The server's header (inputs announced by the previous stage,
        // labels of its own), then the previous stage's payloads.
        let activations = activations(&[200_000]);
        let sent = encode_streamed(&activations, 1 << 20).unwrap();
        let ToServer::Activations(header) = read_frame::<ToServer>(&sent[0], NO_CAP)
            .map(|i| match i {
                Incoming::Message(m) => m,
                Incoming::Payload(_) => unreachable!(),
            })
            .unwrap()
        else {
            unreachable!()
        };
        let labels: Vec<i64> = (0..30_000).collect();
        let relayed = ToProvider::Forward(Forward {
            job_id: 3,
            phase: Phase::Train { step: 5 },
            micro: 1,
            step_samples: 8,
            step_targets: 8,
            inputs: header.outputs,
            labels: Some(WireTensor::from_i64("labels", &[labels.len()], &labels)),
        });
        let mut frames = encode_streamed(&relayed, 1 << 20).unwrap();
        assert_eq!(frames.len(), 2, "the header and the labels' payload");
        frames.extend(sent[1..].iter().cloned());
        let [ToProvider::Forward(got)] = &assemble_with::<ToProvider>(&frames, NO_CAP).unwrap()[..]
        else {
            panic!()
        };
        let ToServer::Activations(original) = activations else {
            unreachable!()
        };
        assert_eq!(got.inputs, original.outputs);
        assert_eq!(got.labels.as_ref().unwrap().to_i64().unwrap(), labels);
    }
}
