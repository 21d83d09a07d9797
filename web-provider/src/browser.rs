//! The browser glue of a donation (wasm32 only): `window.location`,
//! `navigator.gpu`, the `WebSocket` and its event handlers, and the timers,
//! driving the platform-free logic in `session`.

use std::rc::Rc;

use futures_channel::mpsc;
use futures_util::StreamExt;
use gloo_timers::future::TimeoutFuture;
use rookery_kernels::{GpuContext, GpuError};
use rookery_proto::ToProvider;
use rookery_stage::{CpuDevice, Device, GpuDevice, OwnFactory, StageWorker};
use wasm_bindgen::JsCast;
use wasm_bindgen::closure::Closure;
use web_sys::{BinaryType, CloseEvent, MessageEvent, WebSocket};

use crate::DonateStatus;
use crate::session::{self, Backoff, Reaction};

const NO_WEBGPU: &str = "This browser does not offer WebGPU, so it cannot donate its GPU. \
     Try a recent Chrome or Edge, or Firefox Nightly.";
const NO_ADAPTER: &str = "This browser offers WebGPU but found no GPU it may use. Check that \
     hardware acceleration is turned on in the browser's settings, or try another browser.";

pub(crate) fn default_server_url() -> Option<String> {
    let location = web_sys::window()?.location();
    session::provider_url(
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
    if let Err(error) = session::self_check(&gpu).await {
        on_status(DonateStatus::Failed {
            reason: format!(
                "This GPU computed a wrong answer in a self-test, so this tab will not \
                 donate it ({error})."
            ),
        });
        return;
    }
    let gflops = match session::measure_gflops(&gpu).await {
        Ok(gflops) => gflops,
        Err(error) => {
            on_status(DonateStatus::Failed {
                reason: format!("Measuring this GPU failed: {error}."),
            });
            return;
        }
    };
    let max_buffer = gpu
        .max_storage_buffer_binding_size()
        .min(gpu.max_buffer_size());
    // Browsers do not reveal how much memory their GPU has; the largest
    // buffer the adapter allows is the closest honest figure.
    let memory = gpu.max_buffer_size();
    let stages = OwnFactory::new(GpuDevice::new(gpu));
    serve(
        &server_ws_url,
        Donor {
            adapter,
            gflops,
            memory,
            max_buffer: Some(max_buffer),
        },
        stages,
        on_status,
    )
    .await;
}

const CPU_INSTEAD: &str = "This tab donates its CPU instead, running Rookery's reference \
     kernels compiled to WebAssembly (much slower than a GPU).";

/// The fallback without WebGPU: stages on the kernels' CPU references.
async fn donate_cpu(server_ws_url: String, on_status: Status) {
    let gflops = session::measure_cpu_gflops(js_sys::Date::now);
    let donor = Donor {
        adapter: "this tab's CPU (no WebGPU; reference kernels)".to_owned(),
        gflops,
        // A tab's memory is not knowable either; wasm32 addresses 4 GiB and
        // browsers allow a fraction of it.
        memory: 1 << 30,
        max_buffer: None,
    };
    serve(&server_ws_url, donor, OwnFactory::new(CpuDevice), on_status).await;
}

/// What this tab offers.
struct Donor {
    adapter: String,
    gflops: f64,
    memory: u64,
    max_buffer: Option<u64>,
}

type Status = Rc<dyn Fn(DonateStatus)>;

/// Connects, and reconnects after every drop, donating the device of
/// `stages` (each connection gets a fresh worker on it).
async fn serve<D>(server_ws_url: &str, donor: Donor, stages: OwnFactory<D>, on_status: Status)
where
    D: Device + 'static,
{
    let hello =
        match session::hello_frame(&donor.adapter, donor.memory, donor.gflops, donor.max_buffer) {
            Ok(frame) => frame,
            Err(error) => {
                on_status(DonateStatus::Failed {
                    reason: error.to_string(),
                });
                return;
            }
        };
    let mut backoff = Backoff::new();
    loop {
        on_status(DonateStatus::Connecting {
            adapter: donor.adapter.clone(),
            gflops: donor.gflops,
        });
        let end = connect_once(
            server_ws_url,
            &hello,
            &donor,
            stages.clone(),
            &on_status,
            &mut backoff,
        )
        .await;
        match end {
            Reaction::GiveUp(reason) => {
                on_status(DonateStatus::Failed { reason });
                return;
            }
            Reaction::Reconnect(reason) => {
                let delay_ms = backoff.next_delay_ms();
                on_status(DonateStatus::Reconnecting {
                    reason: format!("{reason}; trying again in {} s", delay_ms / 1000),
                });
                TimeoutFuture::new(delay_ms).await;
            }
            // `connect_once` only ends with one of the two above.
            Reaction::Ignore
            | Reaction::Welcomed { .. }
            | Reaction::Answer(_)
            | Reaction::Train(_) => {}
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
}

/// One connection, from opening the socket to its end; returns why it ended,
/// as `Reconnect` or `GiveUp`. Training messages go to a stage worker that
/// runs in its own task, so heartbeats and link probes are answered while a
/// micro-batch computes.
async fn connect_once<D>(
    url: &str,
    hello: &[u8],
    donor: &Donor,
    stages: OwnFactory<D>,
    on_status: &Status,
    backoff: &mut Backoff,
) -> Reaction
where
    D: Device + 'static,
{
    let (events, mut incoming) = mpsc::unbounded();
    let socket = match Socket::open(url, events.clone()) {
        Ok(socket) => Rc::new(socket),
        Err(reason) => return Reaction::GiveUp(reason),
    };
    let mut inbox = session::Inbox::default();
    let mut opened = false;
    let mut welcomed: Option<u64> = None;
    let mut training: Option<mpsc::UnboundedSender<ToProvider>> = None;
    let mut seq = 0u64;
    while let Some(event) = incoming.next().await {
        match event {
            Event::Open => {
                opened = true;
                if let Err(reason) = socket.send(hello) {
                    return Reaction::Reconnect(reason);
                }
            }
            Event::Frame(frame) => {
                let message = match inbox.push(frame) {
                    Ok(Some(message)) => message,
                    Ok(None) => continue,
                    Err(reason) => return Reaction::Reconnect(reason),
                };
                match session::react(message) {
                    Reaction::Ignore => {}
                    Reaction::Welcomed {
                        provider_id,
                        heartbeat_interval_ms,
                    } => {
                        if welcomed.is_none() {
                            welcomed = Some(provider_id);
                            backoff.reset();
                            start_heartbeat(events.clone(), heartbeat_interval_ms);
                            on_status(DonateStatus::Connected {
                                provider_id,
                                adapter: donor.adapter.clone(),
                                gflops: donor.gflops,
                            });
                            let (to_worker, from_session) = mpsc::unbounded();
                            training = Some(to_worker);
                            wasm_bindgen_futures::spawn_local(train(
                                from_session,
                                StageWorker::new(stages.clone()),
                                socket.clone(),
                                events.clone(),
                                Progress {
                                    provider_id,
                                    adapter: donor.adapter.clone(),
                                    gflops: donor.gflops,
                                    on_status: on_status.clone(),
                                },
                            ));
                        }
                    }
                    Reaction::Answer(reply) => {
                        if let Err(reason) = socket.send(&reply) {
                            return Reaction::Reconnect(reason);
                        }
                    }
                    Reaction::Train(message) => {
                        let Some(worker) = &training else {
                            return Reaction::Reconnect(
                                "the server sent training work before welcoming this tab"
                                    .to_owned(),
                            );
                        };
                        if worker.unbounded_send(message).is_err() {
                            return Reaction::Reconnect("the stage worker stopped".to_owned());
                        }
                    }
                    end @ (Reaction::Reconnect(_) | Reaction::GiveUp(_)) => return end,
                }
            }
            Event::Text => {
                return Reaction::Reconnect(
                    "the server sent text where this tab expected binary frames".to_owned(),
                );
            }
            Event::HeartbeatDue => {
                seq += 1;
                let sent = session::heartbeat_frame(seq)
                    .map_err(|e| e.to_string())
                    .and_then(|frame| socket.send(&frame));
                if let Err(reason) = sent {
                    return Reaction::Reconnect(reason);
                }
            }
            Event::WorkerLost(reason) => return Reaction::Reconnect(reason),
            Event::Closed { code, reason } => {
                let detail = if reason.is_empty() {
                    format!("code {code}")
                } else {
                    format!("code {code}: {reason}")
                };
                return Reaction::Reconnect(if opened {
                    format!("the connection to the server closed ({detail})")
                } else {
                    format!("cannot reach the server at {url} ({detail})")
                });
            }
            Event::Error => {
                // Browsers hide the cause of WebSocket errors on purpose.
                return Reaction::Reconnect(if opened {
                    "the connection to the server failed".to_owned()
                } else {
                    format!("cannot reach the server at {url}")
                });
            }
        }
    }
    Reaction::Reconnect("the connection ended".to_owned())
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
    events: mpsc::UnboundedSender<Event>,
    progress: Progress,
) {
    while let Some(message) = messages.next().await {
        let job_id = rookery_stage::worker::job_of(&message);
        for reply in worker.handle(message).await {
            let sent = session::reply_frames(&reply)
                .and_then(|frames| frames.iter().try_for_each(|f| socket.send(f)));
            if let Err(reason) = sent {
                let _ = events.unbounded_send(Event::WorkerLost(reason));
                return;
            }
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
            },
            _ => DonateStatus::Connected {
                provider_id: progress.provider_id,
                adapter: progress.adapter.clone(),
                gflops: progress.gflops,
            },
        };
        (progress.on_status)(status);
    }
}

/// Queues a heartbeat every `interval_ms` until the session that owns the
/// receiving end is over.
fn start_heartbeat(events: mpsc::UnboundedSender<Event>, interval_ms: u32) {
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
