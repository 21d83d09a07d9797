//! Rookery's job description and the data side of training, with no network,
//! tokio, tch or GPU: plain data and files, usable by the server, the
//! reference trainer and command-line tools alike.
//!
//! - [`spec`]: the Requester's job file ([`JobSpec`], TOML or JSON): which model,
//!   which data, how to train; parsed, defaulted and validated before anything runs.
//! - [`file`]: the job file as written ([`JobFile`]), public so clients
//!   build and serialise the same type the server reads.
//! - [`data`]: dataset readers (IDX, `.npy`, `.npz`, safetensors, CSV, token
//!   files cut into next-token windows) into a [`Dataset`], and the checks of
//!   a dataset against the model.
//! - [`order`]: the data order the server owns (per-epoch permutation, sharding
//!   of each step's samples over clusters, micro-batch ranges), so a Root's inputs,
//!   a Leaf's labels and the single-process reference all see the same batches.
//! - [`weights`]: safetensors weights files that `torch`'s `load_state_dict` reads.
//! - [`prepare`]: a job's model and data read and checked against each other
//!   ([`Prepared`]), as the server does before accepting or planning a job.

pub mod data;
pub mod error;
pub mod file;
pub mod order;
pub mod prepare;
pub mod spec;
pub mod weights;

pub use data::{
    Dataset, Labels, Samples, Split, TokenIds, TokenWindows, load_split, validate_against_model,
};
pub use error::JobError;
pub use file::{
    Clusters, DataFile, JobFile, LossFile, LrScheduleFile, ModelFile, OptimizerFile,
    OuterOptimizerFile, SyncFile, TrainingFile,
};
pub use order::{Schedule, epoch_permutation, micro_batch_ranges};
pub use prepare::{PrepareError, Prepared, prepare};
pub use spec::{
    ASYNC_SYNC_EVERY, Aggregation, DataFormat, DataRef, DataSpec, JobSpec, MAX_PUBLIC_NAME_CHARS,
    ModelSection, ModelSource, OuterOptimizer, PipelineSchedule, TokenDType, TrainingSpec,
    WireDType,
};
pub use weights::{WeightTensor, read_safetensors, to_safetensors_bytes, write_safetensors};
