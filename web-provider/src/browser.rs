//! The browser glue of a donation (wasm32 only): `window.location`,
//! `navigator.gpu`, the `WebSocket` and its event handlers, and the timers,
//! driving the socket-free `rookery_stage::session::ProviderSession` and the
//! measurements in `measure`.

use std::rc::Rc;
use std::time::Duration;

use futures_channel::mpsc;
use futures_util::StreamExt;
use gloo_timers::future::TimeoutFuture;
use rookery_kernels::{GpuContext, GpuError};
use rookery_proto::{Bytes, DonorCard, Hello, Phase, ToProvider, ToServer};
use rookery_stage::session::{
    Action, Backoff, DeviceOffer, Disconnect, ProviderSession, SessionPolicy, page_provider_url,
};
use rookery_stage::{CpuDevice, Device, GpuDevice, OwnFactory, StageWorker};
use wasm_bindgen::JsCast;
use wasm_bindgen::closure::Closure;
use web_sys::{BinaryType, CloseEvent, MessageEvent, WebSocket};

use crate::DonateStatus;
use crate::measure;
use crate::pace::{self, BusyDetector};

const NO_WEBGPU: &str = "This browser does not offer WebGPU, so it cannot donate its GPU. \
     Try a recent Chrome or Edge, or Firefox Nightly.";
const NO_ADAPTER: &str = "This browser offers WebGPU but found no GPU it may use. Check that \
     hardware acceleration is turned on in the browser's settings, or try another browser.";

pub(crate) fn default_server_url() -> Option<String> {
    let location = web_sys::window()?.location();
    page_provider_url(
        &location.protocol().ok()?,
        &location.host().ok()?,
        &location.search().ok()?,
    )
}

/// Whether `navigator.gpu` exists: wgpu would only fail later, and less
/// clearly, without it.
fn browser_offers_webgpu() -> bool {
    let Some(window) = web_sys::window() else {
        return false;
    };
    js_sys::Reflect::get(&window.navigator(), &"gpu".into())
        .map(|gpu| !gpu.is_undefined() && !gpu.is_null())
        .unwrap_or(false)
}

pub(crate) async fn donate(server_ws_url: String, on_status: impl Fn(DonateStatus) + 'static) {
    let on_status: Status = Rc::new(on_status);
    on_status(DonateStatus::Probing);
    if !browser_offers_webgpu() {
        on_status(DonateStatus::NoWebGpu {
            reason: format!("{NO_WEBGPU} {CPU_INSTEAD}"),
        });
        return donate_cpu(server_ws_url, on_status).await;
    }
    let gpu = match GpuContext::new().await {
        Ok(gpu) => gpu,
        Err(error) => {
            let reason = match error {
                // wgpu's list of backends it tried means nothing to a person.
                GpuError::NoAdapter { .. } => NO_ADAPTER.to_owned(),
                other => format!(
                    "This browser offers WebGPU but could not set up its GPU ({other}). \
                     Try reloading the page, or another browser."
                ),
            };
            on_status(DonateStatus::NoWebGpu {
                reason: format!("{reason} {CPU_INSTEAD}"),
            });
            return donate_cpu(server_ws_url, on_status).await;
        }
    };
    let adapter = gpu.adapter_description();
    on_status(DonateStatus::Benchmarking {
        adapter: adapter.clone(),
    });
    if let Err(error) = measure::self_check(&gpu).await {
        on_status(DonateStatus::Failed {
            reason: format!(
                "This GPU computed a wrong answer in a self-test, so this tab will not \
                 donate it ({error})."
            ),
        });
        return;
    }
    let gflops = match measure::measure_gflops(&gpu).await {
        Ok(gflops) => gflops,
        Err(error) => {
            on_status(DonateStatus::Failed {
                reason: format!("Measuring this GPU failed: {error}."),
            });
            return;
        }
    };
    // A failure here costs only the lines: the GPU passed its self-check.
    if let Ok(lines) = measure::kernel_speeds(&gpu).await {
        on_status(DonateStatus::KernelSpeeds { lines });
    }
    let max_buffer = gpu
        .max_storage_buffer_binding_size()
        .min(gpu.max_buffer_size());
    // Browsers do not reveal how much memory their GPU has; the largest
    // buffer the adapter allows is the closest honest figure.
    let memory = gpu.max_buffer_size();
    let stages = OwnFactory::new(GpuDevice::new(gpu));
    let offer = DeviceOffer {
        device: adapter,
        gflops,
        memory_bytes: memory,
        max_buffer_bytes: Some(max_buffer),
    };
    serve(&server_ws_url, offer, stages, on_status).await;
}

const CPU_INSTEAD: &str = "This tab donates its CPU instead, running Rookery's reference \
     kernels compiled to WebAssembly (much slower than a GPU).";

/// The fallback without WebGPU: stages on the kernels' CPU references.
async fn donate_cpu(server_ws_url: String, on_status: Status) {
    let gflops = measure::measure_cpu_gflops(js_sys::Date::now);
    let offer = DeviceOffer {
        device: "this tab's CPU (no WebGPU; reference kernels)".to_owned(),
        gflops,
        // A tab's memory is not knowable either; wasm32 addresses 4 GiB and
        // browsers allow a fraction of it.
        memory_bytes: 1 << 30,
        max_buffer_bytes: None,
    };
    serve(&server_ws_url, offer, OwnFactory::new(CpuDevice), on_status).await;
}

type Status = Rc<dyn Fn(DonateStatus)>;

/// How a connection ended.
enum End {
    /// Try again after a pause; the text is for a person.
    Reconnect(String),
    /// Stop donating: reconnecting cannot help. The text is for a person.
    GiveUp(String),
    /// The donor paused donating; the loop waits for the resume.
    Paused,
}

thread_local! {
    /// Why the donor paused, while paused, and the running connection's
    /// event queue, so a pause ends it at once.
    static PAUSE: std::cell::RefCell<(Option<String>, Option<mpsc::UnboundedSender<Event>>)> =
        const { std::cell::RefCell::new((None, None)) };
}

/// Pauses donating with `reason` (the connection closes, saying why, and
/// the server gives its stage to another provider), or resumes with `None`.
pub(crate) fn set_paused(reason: Option<String>) {
    PAUSE.with(|pause| {
        let mut pause = pause.borrow_mut();
        if let (Some(reason), Some(events)) = (&reason, &pause.1) {
            let _ = events.unbounded_send(Event::Pause(reason.clone()));
        }
        pause.0 = reason;
    });
}

fn paused() -> Option<String> {
    PAUSE.with(|pause| pause.borrow().0.clone())
}

/// Where a browser keeps its donor's cap on GPU use, in percent.
const GPU_CAP_KEY: &str = "rookery.donor.gpu_cap";

thread_local! {
    /// This tab's cap in percent, once read or set.
    static GPU_CAP: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

pub(crate) fn stored_gpu_cap() -> u32 {
    if let Some(percent) = GPU_CAP.with(std::cell::Cell::get) {
        return percent;
    }
    let percent = local_storage()
        .and_then(|storage| storage.get_item(GPU_CAP_KEY).ok().flatten())
        .and_then(|text| text.trim().parse::<u32>().ok())
        .map_or(100, |p| p.clamp(pace::MIN_CAP_PERCENT, 100));
    GPU_CAP.with(|cap| cap.set(Some(percent)));
    percent
}

pub(crate) fn set_gpu_cap(percent: u32) {
    let percent = percent.clamp(pace::MIN_CAP_PERCENT, 100);
    GPU_CAP.with(|cap| cap.set(Some(percent)));
    if let Some(storage) = local_storage() {
        let _ = storage.set_item(GPU_CAP_KEY, &percent.to_string());
    }
    PAUSE.with(|pause| {
        if let Some(events) = &pause.borrow().1 {
            let _ = events.unbounded_send(Event::DutyCycle(pace::duty_cycle_of_percent(percent)));
        }
    });
}

/// The share of the time this tab's GPU may compute now.
fn duty_cycle() -> f64 {
    pace::duty_cycle_of_percent(stored_gpu_cap())
}

/// The browser's high-resolution clock, ms (the date's where it has none).
fn now_ms() -> f64 {
    web_sys::window()
        .and_then(|window| window.performance())
        .map_or_else(js_sys::Date::now, |performance| performance.now())
}

impl From<Disconnect> for End {
    fn from(disconnect: Disconnect) -> Self {
        match disconnect {
            Disconnect::Lost(reason) => End::Reconnect(reason),
            Disconnect::VersionMismatch(message) => End::GiveUp(format!(
                "This page and the server speak different protocol versions ({message}). \
                 Reload the page to get the server's current version."
            )),
            Disconnect::Refused(message) => End::GiveUp(message),
        }
    }
}

/// Where a tab keeps the credential the server issued it: the origin's
/// local storage, so every tab of this browser on this server is one donor
/// whose record survives reloads.
const CREDENTIAL_KEY: &str = "rookery.provider.credential";

fn local_storage() -> Option<web_sys::Storage> {
    web_sys::window()?.local_storage().ok().flatten()
}

pub(crate) fn stored_credential() -> Option<String> {
    local_storage()?.get_item(CREDENTIAL_KEY).ok().flatten()
}

/// Where a tab keeps the name and team its donor chose for the
/// leaderboard (the Donate page writes them).
const DONOR_NAME_KEY: &str = "rookery.donor.name";
const DONOR_TEAM_KEY: &str = "rookery.donor.team";

pub(crate) fn stored_donor() -> Option<DonorCard> {
    let storage = local_storage()?;
    let read = |key| {
        storage
            .get_item(key)
            .ok()
            .flatten()
            .filter(|v: &String| !v.trim().is_empty())
    };
    Some(DonorCard {
        name: read(DONOR_NAME_KEY)?,
        team: read(DONOR_TEAM_KEY),
    })
}

pub(crate) fn keep_donor(name: &str, team: &str) {
    if let Some(storage) = local_storage() {
        let _ = storage.set_item(DONOR_NAME_KEY, name.trim());
        let _ = storage.set_item(DONOR_TEAM_KEY, team.trim());
    }
}

/// A tab that cannot store it (private browsing may refuse) still donates,
/// as a new identity on its next visit.
fn keep_credential(credential: &str) {
    if let Some(storage) = local_storage() {
        let _ = storage.set_item(CREDENTIAL_KEY, credential);
    }
}

/// The browser's clock, as the session counts time.
fn now() -> Duration {
    Duration::from_secs_f64(js_sys::Date::now().max(0.0) / 1e3)
}

/// Connects, and reconnects after every drop, donating the device of
/// `stages` (each connection gets a fresh worker on it).
async fn serve<D>(server_ws_url: &str, offer: DeviceOffer, stages: OwnFactory<D>, on_status: Status)
where
    D: Device + 'static,
{
    let policy = SessionPolicy::BROWSER;
    let adapter = offer.device.clone();
    let gflops = offer.gflops;
    let mut hello = policy.hello("browser tab", offer);
    let mut backoff = policy.backoff();
    loop {
        if let Some(reason) = paused() {
            on_status(DonateStatus::Paused { reason });
            while paused().is_some() {
                TimeoutFuture::new(250).await;
            }
            backoff = policy.backoff();
        }
        // Read afresh each time: another tab of this origin may have been
        // issued the credential meanwhile.
        hello.credential = stored_credential();
        hello.donor = stored_donor();
        hello.duty_cycle = duty_cycle();
        on_status(DonateStatus::Connecting {
            adapter: adapter.clone(),
            gflops,
        });
        let end = connect_once(
            server_ws_url,
            &hello,
            stages.clone(),
            &on_status,
            &mut backoff,
        )
        .await;
        match end {
            End::GiveUp(reason) => {
                on_status(DonateStatus::Failed { reason });
                return;
            }
            // The top of the loop waits for the resume.
            End::Paused => {}
            End::Reconnect(reason) => {
                let delay = backoff.next_delay();
                on_status(DonateStatus::Reconnecting {
                    reason: format!("{reason}; trying again in {} s", delay.as_secs()),
                });
                TimeoutFuture::new(u32::try_from(delay.as_millis()).unwrap_or(u32::MAX)).await;
            }
        }
    }
}

/// What the socket and the heartbeat timer tell the session loop.
enum Event {
    Open,
    Frame(Vec<u8>),
    /// A text frame: the protocol has none, so the server is not a Rookery
    /// server or is broken.
    Text,
    Closed {
        code: u16,
        reason: String,
    },
    Error,
    HeartbeatDue,
    /// The stage worker cannot send its replies: the session is over.
    WorkerLost(String),
    /// The donor paused: close, saying why.
    Pause(String),
    /// The donor changed the cap on GPU use: tell the server.
    DutyCycle(f64),
}

/// One connection, from opening the socket to its end. Training messages go
/// to a stage worker that runs in its own task, so heartbeats and link probes
/// are answered while a micro-batch computes.
async fn connect_once<D>(
    url: &str,
    hello: &Hello,
    stages: OwnFactory<D>,
    on_status: &Status,
    backoff: &mut Backoff,
) -> End
where
    D: Device + 'static,
{
    let (events, mut incoming) = mpsc::unbounded();
    let socket = match Socket::open(url, events.clone()) {
        Ok(socket) => Rc::new(socket),
        Err(reason) => return End::GiveUp(reason),
    };
    PAUSE.with(|pause| pause.borrow_mut().1 = Some(events.clone()));
    let mut session = ProviderSession::new(SessionPolicy::BROWSER, hello.clone());
    let hello_duty_cycle = hello.duty_cycle;
    let mut opened = false;
    let mut training: Option<mpsc::UnboundedSender<ToProvider>> = None;
    let end = loop {
        let Some(event) = incoming.next().await else {
            break End::Reconnect("the connection ended".to_owned());
        };
        let action = match event {
            Event::Open => {
                opened = true;
                let first = session.opened(now());
                if let Err(reason) = send(&socket, &first, session.max_frame_bytes()) {
                    break End::Reconnect(reason);
                }
                // The cap changed while the socket opened.
                let duty_cycle = duty_cycle();
                (duty_cycle != hello_duty_cycle)
                    .then_some(Action::Send(ToServer::DutyCycle { duty_cycle }))
            }
            Event::DutyCycle(duty_cycle) if opened => {
                Some(Action::Send(ToServer::DutyCycle { duty_cycle }))
            }
            // Announced once the socket opens.
            Event::DutyCycle(_) => None,
            Event::Frame(frame) => session.frame(&Bytes::from(frame), now()),
            Event::HeartbeatDue => Some(session.heartbeat_due(now())),
            Event::Text => {
                break End::Reconnect(
                    "the server sent text where this tab expected binary frames".to_owned(),
                );
            }
            Event::WorkerLost(reason) => break End::Reconnect(reason),
            Event::Pause(reason) => {
                socket.close_saying(&format!("{}{reason}", rookery_proto::api::PAUSED_BY_DONOR));
                break End::Paused;
            }
            Event::Closed { code, reason } => {
                let detail = if reason.is_empty() {
                    format!("code {code}")
                } else {
                    format!("code {code}: {reason}")
                };
                break End::Reconnect(if opened {
                    format!("the connection to the server closed ({detail})")
                } else {
                    format!("cannot reach the server at {url} ({detail})")
                });
            }
            Event::Error => {
                // Browsers hide the cause of WebSocket errors on purpose.
                break End::Reconnect(if opened {
                    "the connection to the server failed".to_owned()
                } else {
                    format!("cannot reach the server at {url}")
                });
            }
        };
        match action {
            None => {}
            Some(Action::Send(message)) => {
                if let Err(reason) = send(&socket, &message, session.max_frame_bytes()) {
                    break End::Reconnect(reason);
                }
            }
            Some(Action::Joined {
                provider_id,
                heartbeat_interval,
                issued_credential,
                ..
            }) => {
                if let Some(credential) = issued_credential {
                    keep_credential(&credential);
                }
                start_heartbeat(events.clone(), heartbeat_interval);
                let (adapter, gflops) = (hello.device.clone(), hello.gflops);
                on_status(DonateStatus::Connected {
                    provider_id,
                    adapter: adapter.clone(),
                    gflops,
                });
                let (to_worker, from_session) = mpsc::unbounded();
                training = Some(to_worker);
                wasm_bindgen_futures::spawn_local(train(
                    from_session,
                    StageWorker::new(stages.clone()),
                    socket.clone(),
                    session.max_frame_bytes(),
                    events.clone(),
                    Progress {
                        provider_id,
                        adapter,
                        gflops,
                        on_status: on_status.clone(),
                    },
                ));
            }
            Some(Action::Credit(gflop)) => on_status(DonateStatus::Credited { gflop }),
            Some(Action::Train(message)) => {
                // The session hands out training work only once welcomed.
                let Some(worker) = &training else {
                    break End::Reconnect("the stage worker is missing".to_owned());
                };
                if worker.unbounded_send(message).is_err() {
                    break End::Reconnect("the stage worker stopped".to_owned());
                }
            }
            Some(Action::End(disconnect)) => break disconnect.into(),
        }
    };
    PAUSE.with(|pause| pause.borrow_mut().1 = None);
    if session.earned_quick_reconnect(now()) {
        backoff.reset();
    }
    end
}

/// Sends `message`: large tensors go as payload frames after it, none
/// over the frame limit the server announced, as native providers send them.
fn send(socket: &Socket, message: &ToServer, max_frame_bytes: usize) -> Result<(), String> {
    rookery_proto::stream::encode_streamed(message, max_frame_bytes)
        .map_err(|error| format!("cannot encode a message: {error}"))?
        .iter()
        .try_for_each(|frame| socket.send(frame))
}

/// What the Donate page shows while a stage trains.
struct Progress {
    provider_id: u64,
    adapter: String,
    gflops: f64,
    on_status: Status,
}

/// The stage worker's task: one training message at a time, replies straight
/// onto the socket, progress to the page. It ends when the session drops its
/// queue.
async fn train<D: Device + 'static>(
    mut messages: mpsc::UnboundedReceiver<ToProvider>,
    mut worker: StageWorker<OwnFactory<D>>,
    socket: Rc<Socket>,
    max_frame_bytes: usize,
    events: mpsc::UnboundedSender<Event>,
    progress: Progress,
) {
    let mut public_name = None;
    let mut detector = BusyDetector::new();
    while let Some(message) = messages.next().await {
        let job_id = rookery_stage::worker::job_of(&message);
        if let ToProvider::Assign(assignment) = &message {
            public_name.clone_from(&assignment.public_name);
            detector.reset();
        }
        let micro_batch = matches!(
            &message,
            ToProvider::Forward(f) if matches!(f.phase, Phase::Train { .. })
        );
        let started = now_ms();
        let replies = worker.handle(message).await;
        // Replies carry read-back results, so the GPU's work is done.
        let busy_ms = now_ms() - started;
        for reply in replies {
            if let Err(reason) = send(&socket, &reply, max_frame_bytes) {
                let _ = events.unbounded_send(Event::WorkerLost(reason));
                return;
            }
        }
        if micro_batch && let Some(busy) = detector.observe(busy_ms) {
            (progress.on_status)(DonateStatus::DeviceBusy(busy));
        }
        let status = match (worker.progress(), job_id) {
            (Some((stage, stages, micro_batches)), Some(job_id)) => DonateStatus::Training {
                provider_id: progress.provider_id,
                adapter: progress.adapter.clone(),
                gflops: progress.gflops,
                job_id,
                stage,
                stages,
                micro_batches,
                public_name: public_name.clone(),
            },
            _ => DonateStatus::Connected {
                provider_id: progress.provider_id,
                adapter: progress.adapter.clone(),
                gflops: progress.gflops,
            },
        };
        (progress.on_status)(status);
        // The donor's cap: idle so the GPU works that share of the time.
        let idle = pace::idle_ms(busy_ms, duty_cycle());
        if idle >= 1.0 {
            TimeoutFuture::new(idle.min(f64::from(u32::MAX)) as u32).await;
        }
    }
}

/// Queues a heartbeat every `interval` until the session that owns the
/// receiving end is over.
fn start_heartbeat(events: mpsc::UnboundedSender<Event>, interval: Duration) {
    let interval_ms = u32::try_from(interval.as_millis()).unwrap_or(u32::MAX);
    wasm_bindgen_futures::spawn_local(async move {
        loop {
            TimeoutFuture::new(interval_ms).await;
            if events.unbounded_send(Event::HeartbeatDue).is_err() {
                break;
            }
        }
    });
}

/// A `WebSocket` whose events go to a channel. Dropping it detaches the
/// handlers before their closures are freed (a freed closure that the
/// browser still calls is an error) and closes the socket.
struct Socket {
    ws: WebSocket,
    _on_open: Closure<dyn FnMut(web_sys::Event)>,
    _on_message: Closure<dyn FnMut(MessageEvent)>,
    _on_close: Closure<dyn FnMut(CloseEvent)>,
    _on_error: Closure<dyn FnMut(web_sys::Event)>,
}

impl Socket {
    fn open(url: &str, events: mpsc::UnboundedSender<Event>) -> Result<Self, String> {
        let ws = WebSocket::new(url).map_err(|error| {
            format!(
                "{url} is not a usable server address ({})",
                js_error_text(&error)
            )
        })?;
        ws.set_binary_type(BinaryType::Arraybuffer);
        // Sends fail only once the session is over and nobody listens.
        let on_open = {
            let events = events.clone();
            Closure::new(move |_: web_sys::Event| {
                let _ = events.unbounded_send(Event::Open);
            })
        };
        let on_message = {
            let events = events.clone();
            Closure::new(move |message: MessageEvent| {
                let event = match message.data().dyn_into::<js_sys::ArrayBuffer>() {
                    Ok(buffer) => Event::Frame(js_sys::Uint8Array::new(&buffer).to_vec()),
                    Err(_) => Event::Text,
                };
                let _ = events.unbounded_send(event);
            })
        };
        let on_close = {
            let events = events.clone();
            Closure::new(move |close: CloseEvent| {
                let _ = events.unbounded_send(Event::Closed {
                    code: close.code(),
                    reason: close.reason(),
                });
            })
        };
        let on_error = Closure::new(move |_: web_sys::Event| {
            let _ = events.unbounded_send(Event::Error);
        });
        ws.set_onopen(Some(on_open.as_ref().unchecked_ref()));
        ws.set_onmessage(Some(on_message.as_ref().unchecked_ref()));
        ws.set_onclose(Some(on_close.as_ref().unchecked_ref()));
        ws.set_onerror(Some(on_error.as_ref().unchecked_ref()));
        Ok(Self {
            ws,
            _on_open: on_open,
            _on_message: on_message,
            _on_close: on_close,
            _on_error: on_error,
        })
    }

    /// Closes normally with `reason` (cut to the 123 bytes a close frame holds).
    fn close_saying(&self, reason: &str) {
        let mut end = reason.len().min(123);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        let _ = self.ws.close_with_code_and_reason(1000, &reason[..end]);
    }

    fn send(&self, frame: &[u8]) -> Result<(), String> {
        self.ws
            .send_with_u8_array(frame)
            .map_err(|error| format!("sending to the server failed ({})", js_error_text(&error)))
    }
}

impl Drop for Socket {
    fn drop(&mut self) {
        self.ws.set_onopen(None);
        self.ws.set_onmessage(None);
        self.ws.set_onclose(None);
        self.ws.set_onerror(None);
        // Closing an already closed socket is a no-op; nothing to report.
        let _ = self.ws.close();
    }
}

/// A thrown JavaScript value in words.
fn js_error_text(error: &wasm_bindgen::JsValue) -> String {
    error
        .dyn_ref::<js_sys::Error>()
        .map(|e| String::from(e.message()))
        .or_else(|| error.as_string())
        .unwrap_or_else(|| format!("{error:?}"))
}
