//! The coordinator: one task that owns the live provider connections and the
//! running jobs. Socket loops and HTTP handlers talk to it through
//! [`Coordinator`]'s channel; it plans queued jobs onto idle providers, feeds
//! provider frames to each job's [`JobRun`] and carries out the effects
//! (frames, metrics, checkpoints, weights). One task means no locks around
//! job state, and the order of events is the order they happened.
//!
//! - `actor`: the task's loop and what each [`Event`] does;
//! - `schedule`: queued jobs onto idle providers, vacant stages onto
//!   standbys, stragglers' stages onto faster providers;
//! - `effects`: carrying out a run's effects (frames, database rows, files,
//!   live events);
//! - `faults`: what a provider's fault on a job costs it, and bans;
//! - `outbox`: each connection's queue of frames to send, bounded in bytes;
//! - `rates`: providers' claimed speed checked against their measured work;
//! - `verify`: spot checks re-run on a verifier, and tapped messages;
//! - `work`: what runs off the task (reading a job's model, starting a run,
//!   aggregating a sync, writing the weights) and comes back as an [`Event`].
//!
//! Nothing that takes long runs on the task itself: initialising a large
//! model's parameters, reading its data, combining the clusters' uploads
//! and writing files run on blocking threads, and their results come back
//! through the same channel as everything else, so heartbeats, other jobs
//! and HTTP calls are answered meanwhile.

mod actor;
mod credit;
mod effects;
mod faults;
mod outbox;
mod rates;
mod schedule;
mod verify;
mod work;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::time::Duration;

use rookery_plan::ProviderSpec;
use rookery_proto::api::{JobEvent, PlanView, ProviderWork};
use rookery_proto::stream::Payload;
use rookery_proto::{Bytes, Hello, ToProvider, ToServer};
use tokio::sync::{broadcast, mpsc, oneshot};

pub use self::faults::{BAN_AFTER_FAULTS, FaultAction, fault_action, is_banned};
pub use self::outbox::{DEFAULT_MAX_OUTBOX_BYTES, Outbox, OutboxReceiver, Overflow, outbox};
pub use self::rates::{LIE_FACTOR, LIE_STEPS, PLAN_SLACK, capped_claim, planning_gflops};
pub use self::schedule::{by_plan_id, plan_options};
pub use self::work::QueuedModel;
use crate::run::{Aggregated, Effect, JobRun};
use crate::store::Db;
use crate::store::checkpoints::{CheckpointWriter, ResumeWriter};
use crate::store::jobs::Ban;
use crate::store::requesters::Requester;

/// How often queued jobs are matched against idle providers.
const SCHEDULE_EVERY: Duration = Duration::from_millis(300);
/// Live events a slow subscriber may fall behind by before it is told it
/// lagged (and reloads what it shows).
const EVENT_BUFFER: usize = 4096;
/// Events the coordinator's queue holds before senders wait: at most 256
/// relayed frames of 512 KiB, 128 MiB, whatever the providers send.
const EVENT_QUEUE: usize = 256;
/// A job that syncs every step would write a log line per step; sync lines
/// are written at most this often per job, counting the syncs in between.
const SYNC_LOG_EVERY_MS: u64 = 2_000;

/// What the coordinator hears about.
#[derive(Debug)]
pub enum Event {
    Connected {
        id: u64,
        /// The server-issued identity it proved (faults and bans follow it).
        identity: u64,
        /// The Requester whose token it presented.
        vouched_by: Option<Requester>,
        hello: Hello,
        tx: Outbox,
    },
    Disconnected {
        id: u64,
        /// Why the connection ended, for the job it leaves.
        reason: String,
    },
    Message {
        id: u64,
        message: ToServer,
    },
    /// The provider broke the protocol (a malformed frame, a bad payload) and
    /// its socket loop is dropping it; sent just before `Disconnected`.
    Fault {
        id: u64,
        reason: String,
    },
    /// Tensor bytes that follow a streamed message, already checked against
    /// what that message announced (the socket loop does that).
    Payload {
        id: u64,
        payload: Payload,
    },
    Cancel {
        job_id: u64,
    },
    /// The provider's link was measured.
    Measured {
        id: u64,
        bandwidth_mbps: f64,
    },
    /// The provider's donor changed its GPU cap (checked by the socket loop).
    DutyCycle {
        id: u64,
        duty_cycle: f64,
    },
    /// A queued job's model, read (by the upload, which checked the job
    /// against its data, or off the task for a job queued before a restart)
    /// so that it can be planned on every scheduling tick.
    Prepared {
        job_id: u64,
        model: Box<QueuedModel>,
    },
    /// Work off the task found the job cannot go on (its model or data
    /// cannot be read, or the work crashed): the job fails with `reason`.
    WorkFailed {
        job_id: u64,
        reason: String,
    },
    /// A job's run, built off the task (its data read, its parameters
    /// initialised or resumed, its `Assign` frames made), or why it cannot
    /// start.
    Started {
        job_id: u64,
        started: Result<Box<(JobRun, Vec<Effect>)>, String>,
    },
    /// A sync's aggregation, done off the task.
    Aggregated {
        job_id: u64,
        done: Box<Aggregated>,
    },
    /// A completed job's weights file is written (or not).
    WeightsWritten {
        job_id: u64,
        written: Result<(), String>,
    },
    /// Asks for the connected providers and what each is doing.
    Snapshot {
        reply: oneshot::Sender<Vec<LiveProvider>>,
    },
}

/// A connected provider as the coordinator sees it.
#[derive(Debug, Clone)]
pub struct LiveProvider {
    pub id: u64,
    pub identity: u64,
    pub hello: Hello,
    /// The Requester whose token it presented: trusted to verify that
    /// Requester's jobs ([`verify::trusted_for`]).
    pub vouched_by: Option<Requester>,
    /// What the server measured of its identity's stages, GFLOP/s.
    pub measured_gflops: Option<f64>,
    pub work: Option<ProviderWork>,
    /// Measured after `Welcome`; `None` until the probe comes back.
    pub bandwidth_mbps: Option<f64>,
}

impl LiveProvider {
    /// What the planner knows of it, if a job may be planned onto it now:
    /// idle and with its link measured, at the speed its donor's GPU cap
    /// leaves it ([`capped_claim`]). Browser tabs and `--backend wgpu`
    /// providers run our own kernels, so their GPU's buffer limit comes along.
    pub fn candidate(&self) -> Option<ProviderSpec> {
        if self.work.is_some() {
            return None;
        }
        Some(ProviderSpec {
            id: self.id.to_string(),
            kind: self.hello.kind,
            memory_bytes: self.hello.memory_bytes,
            gflops: planning_gflops(capped_claim(&self.hello), self.measured_gflops),
            bandwidth_mbps: self.bandwidth_mbps?,
            max_buffer_bytes: self.hello.max_buffer_bytes,
        })
    }
}

/// A cheap handle to the coordinator task.
#[derive(Debug, Clone)]
pub struct Coordinator {
    tx: mpsc::Sender<Event>,
    events: broadcast::Sender<JobEvent>,
}

impl Coordinator {
    /// Starts the coordinator on the current tokio runtime.
    pub fn spawn(db: Db, data_dir: PathBuf) -> Self {
        let (tx, rx) = mpsc::channel(EVENT_QUEUE);
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        tokio::spawn(
            Actor {
                // Weak: the task ends once every handle is gone, even while
                // work it started is still running.
                tx: tx.downgrade(),
                db,
                data_dir,
                providers: BTreeMap::new(),
                jobs: HashMap::new(),
                events: events.clone(),
                rates: rates::Rates::new(),
                verifying: HashMap::new(),
            }
            .run(rx),
        );
        Self { tx, events }
    }

    /// Waits while the coordinator's queue is full, so a flood from one
    /// connection (relayed frames) slows that connection's reading, not the
    /// server's memory. Best effort: when the coordinator is gone the
    /// server is shutting down.
    pub async fn send(&self, event: Event) {
        let _ = self.tx.send(event).await;
    }

    /// Every job event from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<JobEvent> {
        self.events.subscribe()
    }

    /// Tells live subscribers about a change made outside the coordinator
    /// (a submitted or cancelled job).
    pub fn publish(&self, event: JobEvent) {
        let _ = self.events.send(event);
    }

    /// The connected providers; empty if the coordinator is gone.
    pub async fn snapshot(&self) -> Vec<LiveProvider> {
        let (reply, answer) = oneshot::channel();
        self.send(Event::Snapshot { reply }).await;
        answer.await.unwrap_or_default()
    }
}

/// A frame for a provider's socket loop to send.
#[derive(Debug)]
pub enum Outgoing {
    Message(ToProvider),
    /// A payload frame passed on exactly as it arrived.
    Payload(Bytes),
    /// Drop the provider: send it an `Error` with `reason` and close.
    Close {
        reason: String,
    },
}

struct Live {
    identity: u64,
    vouched_by: Option<Requester>,
    hello: Hello,
    tx: Outbox,
    job: Option<u64>,
    /// Where the payload frames this provider still owes go, in order.
    routes: VecDeque<Route>,
    /// Until its link is measured, a provider is not planned onto.
    bandwidth_mbps: Option<f64>,
    /// The stage it runs, for the dashboard.
    work: Option<ProviderWork>,
}

/// The destination of the bytes that follow one streamed message: the
/// provider its relayed message went to, or nowhere when the job dropped it.
struct Route {
    to: Option<u64>,
    left: usize,
    /// A copy being made of the message, for a spot check.
    capture: Option<verify::Capture>,
}

/// Everything the coordinator keeps about one job, from its first
/// scheduling tick in the queue until it finishes; a job that leaves is
/// forgotten by removing its entry.
#[derive(Default)]
struct JobEntry {
    /// The run, once the job has started.
    run: Option<JobRun>,
    /// The queued job's model (without parameter values or data), read
    /// once, so that waiting for providers does not reload it on every
    /// scheduling tick.
    model: Option<QueuedModel>,
    /// The model is being read off the task.
    loading: bool,
    /// The run is being built off the task on the providers it was planned
    /// onto: the plan as the dashboard shows it, to store once it starts.
    starting: Option<PlanView>,
    /// The last reason the queued job gave for waiting, to write it only
    /// when it changes.
    waiting: Option<String>,
    /// Micro-batches per step of the running job.
    micro_batches: u64,
    /// When the last sync line was written, and syncs since.
    sync_log: (u64, u64),
    /// Faults per provider identity: reconnecting (which gives a new
    /// connection id) or renaming does not wipe a provider's record on the
    /// job, and nobody can add to another's by taking its name.
    faults: HashMap<u64, u32>,
    /// The job's bans as last read from or written to the database (which
    /// is the source of truth, across restarts).
    bans: Vec<Ban>,
    /// The stages the running job last said it waits for a provider for.
    short: Option<String>,
    /// The task writing the checkpoint file.
    checkpoint: Option<CheckpointWriter>,
    /// The task writing the resume file.
    resume: Option<ResumeWriter>,
    /// Its spot checks so far.
    spot_checks: verify::Tally,
    /// Credit earned on the job: work since its last checkpoint, and work
    /// a checkpoint accepted that is not yet written.
    credit: credit::Pending,
    /// Checks waiting for a verifier to finish the one before.
    queued_checks: VecDeque<Box<crate::run::Verification>>,
    /// The Requester who submitted it, once it starts: whose vouched-for
    /// providers may verify it.
    owner: Option<u64>,
}

struct Actor {
    /// For work off the task to report back.
    tx: mpsc::WeakSender<Event>,
    db: Db,
    data_dir: PathBuf,
    providers: BTreeMap<u64, Live>,
    /// Queued jobs the scheduler has looked at, and running jobs.
    jobs: HashMap<u64, JobEntry>,
    events: broadcast::Sender<JobEvent>,
    /// Measured speeds by identity.
    rates: rates::Rates,
    /// Providers re-running a spot check, by connection.
    verifying: HashMap<u64, verify::Verifying>,
}
