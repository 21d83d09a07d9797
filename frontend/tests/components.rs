//! Component tests in headless Chromium: pieces of the dashboard mounted
//! into a real DOM. The loss chart draws a hundred thousand points as a few
//! hundred segments and redraws when a point arrives; the cluster diagram
//! shows each stage's role, provider kind, device and size; the New job
//! form marks every missing or malformed field without sending anything,
//! and shows only the inputs its choices take (token data has no labels
//! files but a sequence length);
//! the sign-in form refuses an empty token. Run from `frontend/` with
//! `CHROMEDRIVER=/usr/bin/chromedriver \
//!  CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=<wasm-bindgen-test-runner> \
//!  cargo test -p rookery-frontend --target wasm32-unknown-unknown --test components`
//! (`cargo xtask test` does).
#![cfg(target_arch = "wasm32")]
// Clippy's test exemption only knows `#[test]`, not `#[wasm_bindgen_test]`.
#![allow(clippy::unwrap_used)]

use leptos::prelude::*;
use leptos_router::components::Router;
use rookery_frontend::api::Auth;
use rookery_frontend::chart::{BUCKETS, LineChart};
use rookery_frontend::job_detail::plan_diagram;
use rookery_frontend::leaderboard::leaderboard_table;
use rookery_frontend::new_job::NewJobPage;
use rookery_frontend::signin::SignIn;
use rookery_proto::ProviderKind;
use rookery_proto::api::{ClusterView, LeaderboardEntry, PlanView, StageView};
use wasm_bindgen::JsCast;
use wasm_bindgen_test::{wasm_bindgen_test, wasm_bindgen_test_configure};

wasm_bindgen_test_configure!(run_in_browser);

/// A fresh element in the page to mount into; tests run in one page.
fn host() -> web_sys::HtmlElement {
    let document = web_sys::window().unwrap().document().unwrap();
    let host = document
        .create_element("div")
        .unwrap()
        .unchecked_into::<web_sys::HtmlElement>();
    document.body().unwrap().append_child(&host).unwrap();
    host
}

fn query(root: &web_sys::HtmlElement, css: &str) -> Option<web_sys::Element> {
    root.query_selector(css).unwrap()
}

fn count(root: &web_sys::HtmlElement, css: &str) -> u32 {
    root.query_selector_all(css).unwrap().length()
}

/// Lets Leptos run its scheduled effects and renders.
async fn settle() {
    gloo_timers::future::TimeoutFuture::new(50).await;
}

#[wasm_bindgen_test]
async fn a_hundred_thousand_loss_points_draw_as_a_few_hundred_and_grow_live() {
    let root = host();
    let points = RwSignal::new(
        (0..100_000)
            .map(|i| (i as f64, 2.5 / (1.0 + i as f64 / 1000.0)))
            .collect::<Vec<_>>(),
    );
    let _mounted = leptos::mount::mount_to(root.clone(), move || {
        view! { <LineChart id="loss-chart" title="Training loss per step" x_label="steps" points=points /> }
    });
    settle().await;
    let svg = query(&root, "svg#loss-chart").unwrap();
    assert_eq!(svg.get_attribute("data-points").as_deref(), Some("100000"));
    let d = query(&root, "path.chart-line")
        .unwrap()
        .get_attribute("d")
        .unwrap();
    let segments = d.matches('L').count();
    assert!(
        (100..=2 * BUCKETS + 2).contains(&segments),
        "{segments} segments"
    );
    // Axis labels name the range: the first loss and the last step.
    let ticks: Vec<String> = {
        let list = root.query_selector_all("text.chart-tick").unwrap();
        (0..list.length())
            .map(|i| list.item(i).unwrap().text_content().unwrap_or_default())
            .collect()
    };
    assert!(ticks.contains(&"2.50".to_string()), "{ticks:?}");
    assert!(ticks.iter().any(|t| t == "100k steps"), "{ticks:?}");
    // In the narrowest chart column (20rem, less the figure's padding and
    // border: 292 pixels of drawing), tick text is drawn at 10 pixels or
    // more: its size times the drawing's scale.
    svg.set_attribute("style", "width: 292px").unwrap();
    settle().await;
    let scale = svg.get_bounding_client_rect().width() / rookery_frontend::chart::WIDTH;
    let tick = query(&root, "text.chart-tick").unwrap();
    let font: f64 = web_sys::window()
        .unwrap()
        .get_computed_style(&tick)
        .unwrap()
        .unwrap()
        .get_property_value("font-size")
        .unwrap()
        .trim_end_matches("px")
        .parse()
        .unwrap();
    assert!(font * scale >= 10.0, "{font} px at scale {scale}");

    points.update(|p| p.push((100_000.0, 0.01)));
    settle().await;
    assert_eq!(svg.get_attribute("data-points").as_deref(), Some("100001"));
    root.remove();
}

#[wasm_bindgen_test]
async fn an_empty_chart_says_so() {
    let root = host();
    let _mounted = leptos::mount::mount_to(root.clone(), move || {
        view! { <LineChart id="empty-chart" title="Test loss" x_label="epochs" points=Signal::derive(Vec::new) dots=true /> }
    });
    settle().await;
    assert_eq!(
        query(&root, "svg#empty-chart")
            .unwrap()
            .get_attribute("data-points")
            .as_deref(),
        Some("0")
    );
    assert_eq!(count(&root, "path.chart-line"), 0);
    assert!(root.text_content().unwrap().contains("No data yet"));
    root.remove();
}

fn stage(role: &str, provider: u64, kind: ProviderKind, params: u64) -> StageView {
    StageView {
        role: role.into(),
        provider,
        provider_name: format!("p{provider}"),
        provider_kind: kind,
        device: format!("device {provider}"),
        provider_memory_bytes: 1 << 30,
        nodes: 3,
        first_node: "a".into(),
        last_node: "b".into(),
        param_count: params,
        memory_bytes: 3 << 20,
        compute_s: 0.002,
        transfer_s: 0.001,
        time_s: 0.003,
    }
}

#[wasm_bindgen_test]
async fn each_cluster_draws_as_a_chain_from_root_to_leaf() {
    let root = host();
    let plan = PlanView {
        clusters: vec![
            ClusterView {
                stages: vec![
                    stage("root", 1, ProviderKind::Native, 1000),
                    stage("stem", 2, ProviderKind::Browser, 20_000),
                    stage("leaf", 3, ProviderKind::Native, 330),
                ],
                bottleneck_s: 0.003,
            },
            ClusterView {
                stages: vec![stage("single", 4, ProviderKind::Native, 21_330)],
                bottleneck_s: 0.004,
            },
        ],
        standbys: vec![],
        param_count: 21_330,
        param_bytes: 85_320,
        bottleneck_s: 0.004,
        micro_batch: 16,
    };
    let _mounted = leptos::mount::mount_to(root.clone(), move || plan_diagram(&plan));
    settle().await;
    assert_eq!(count(&root, ".cluster"), 2);
    let nodes = root
        .query_selector_all(".cluster[data-cluster='0'] .stage-node")
        .unwrap();
    let seen: Vec<(String, String)> = (0..nodes.length())
        .map(|i| {
            let node = nodes.item(i).unwrap().unchecked_into::<web_sys::Element>();
            (
                node.get_attribute("data-role").unwrap(),
                node.get_attribute("data-kind").unwrap(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("root".to_string(), "native".to_string()),
            ("stem".to_string(), "browser".to_string()),
            ("leaf".to_string(), "native".to_string()),
        ]
    );
    // Arrows between the stages of a chain, none after the last.
    assert_eq!(count(&root, ".cluster[data-cluster='0'] .stage-arrow"), 2);
    assert_eq!(count(&root, ".cluster[data-cluster='1'] .stage-arrow"), 0);
    let stem = query(&root, ".stage-node[data-role='stem']")
        .unwrap()
        .text_content()
        .unwrap();
    assert!(stem.contains("#2 p2"), "{stem}");
    assert!(stem.contains("device 2"), "{stem}");
    assert!(stem.contains("20,000 params"), "{stem}");
    assert!(stem.contains("3.0 MiB"), "{stem}");
    root.remove();
}

fn click(root: &web_sys::HtmlElement, css: &str) {
    query(root, css)
        .unwrap()
        .unchecked_into::<web_sys::HtmlElement>()
        .click();
}

fn set_value(root: &web_sys::HtmlElement, css: &str, value: &str) {
    let input = query(root, css)
        .unwrap()
        .unchecked_into::<web_sys::HtmlInputElement>();
    input.set_value(value);
    input
        .dispatch_event(&web_sys::Event::new("input").unwrap())
        .unwrap();
}

/// The New Job page, mounted and settled; keep the handle to keep it mounted.
async fn new_job_page() -> (web_sys::HtmlElement, impl Sized) {
    let root = host();
    let mounted = leptos::mount::mount_to(root.clone(), move || {
        provide_context(Auth::from_storage());
        view! {
            <Router>
                <NewJobPage />
            </Router>
        }
    });
    settle().await;
    (root, mounted)
}

#[wasm_bindgen_test]
async fn the_new_job_form_marks_each_missing_or_bad_field_before_sending() {
    let (root, _mounted) = new_job_page().await;
    set_value(&root, "#batch-size", "0");
    set_value(&root, "#clusters", "several");
    click(&root, "#preview-plan");
    settle().await;
    let errors = root.query_selector_all(".field-error").unwrap();
    let mut ids: Vec<String> = (0..errors.length())
        .map(|i| {
            errors
                .item(i)
                .unwrap()
                .unchecked_into::<web_sys::Element>()
                .id()
        })
        .collect();
    ids.sort();
    assert_eq!(
        ids,
        [
            "error-batch-size",
            "error-clusters",
            "error-model-file",
            "error-train-inputs",
            "error-train-labels"
        ]
    );
    // Nothing was sent, so no plan and no server error.
    assert!(query(&root, "#plan-preview").is_none());
    assert!(query(&root, "#form-error").is_none());
    // Fixing a field clears its mark on the next try.
    set_value(&root, "#batch-size", "32");
    click(&root, "#preview-plan");
    settle().await;
    assert!(query(&root, "#error-batch-size").is_none());
    assert!(query(&root, "#error-clusters").is_some());
    root.remove();
}

/// Picks `value` in a select as a user would: the value, then `change`.
fn choose(root: &web_sys::HtmlElement, css: &str, value: &str) {
    let select = query(root, css).unwrap();
    js_sys::Reflect::set(&select, &"value".into(), &value.into()).unwrap();
    select
        .dispatch_event(&web_sys::Event::new("change").unwrap())
        .unwrap();
}

#[wasm_bindgen_test]
async fn token_data_swaps_the_labels_inputs_for_the_sequence_length() {
    let (root, _mounted) = new_job_page().await;
    assert!(query(&root, "#train-labels").is_some());
    assert!(query(&root, "#test-labels").is_some());
    assert!(query(&root, "#scale").is_some());
    assert!(query(&root, "#seq-len").is_none());
    assert!(query(&root, "#token-dtype").is_none());

    choose(&root, "#data-format", "tokens");
    settle().await;
    assert!(query(&root, "#train-labels").is_none());
    assert!(query(&root, "#test-labels").is_none());
    assert!(query(&root, "#scale").is_none(), "token ids are not scaled");
    assert!(query(&root, "#seq-len").is_some());
    assert!(query(&root, "#token-dtype").is_some());
    let label = query(&root, "label[for=train-inputs]")
        .unwrap()
        .text_content()
        .unwrap();
    assert_eq!(label, "Training tokens");
    // Checked before sending: the missing window length, and no labels.
    click(&root, "#preview-plan");
    settle().await;
    assert!(query(&root, "#error-seq-len").is_some());
    assert!(query(&root, "#error-train-labels").is_none());

    // Only the chosen loss's options and the chosen schedule's fields.
    assert!(query(&root, "#class-axis").is_some());
    choose(&root, "#loss", "mse");
    choose(&root, "#lr-schedule", "step");
    settle().await;
    assert!(query(&root, "#class-axis").is_none());
    assert!(query(&root, "#ignore-index").is_none());
    assert!(query(&root, "#step-size").is_some());
    assert!(query(&root, "#warmup-steps").is_none());
    assert!(query(&root, "#clip-grad-norm").is_some());

    choose(&root, "#data-format", "idx");
    settle().await;
    assert!(query(&root, "#train-labels").is_some());
    assert!(query(&root, "#seq-len").is_none());
    root.remove();
}

#[wasm_bindgen_test]
async fn sign_in_asks_for_a_token_before_calling_the_server() {
    let root = host();
    let _mounted = leptos::mount::mount_to(root.clone(), move || {
        provide_context(Auth::from_storage());
        view! { <SignIn /> }
    });
    settle().await;
    click(&root, "#signin button[type=submit]");
    settle().await;
    let error = query(&root, "#signin-error")
        .unwrap()
        .text_content()
        .unwrap();
    assert!(error.contains("Paste the API token"), "{error}");
    root.remove();
}

#[wasm_bindgen_test]
async fn the_leaderboard_ranks_donors_with_their_team_and_credit_in_readable_units() {
    let entry = |name: &str, team: Option<&str>, credit: f64| LeaderboardEntry {
        name: name.into(),
        team: team.map(Into::into),
        credit,
    };
    let root = host();
    let entries = vec![
        entry("alice", Some("ravens"), 3_200.0),
        entry("anonymous", None, 0.0125),
    ];
    let _mounted = leptos::mount::mount_to(root.clone(), move || leaderboard_table(&entries));
    settle().await;
    assert_eq!(count(&root, "#leaderboard tr.donor"), 2);
    let first = query(&root, "tr.donor[data-rank='1']").unwrap();
    let text = first.text_content().unwrap();
    assert!(
        text.contains("alice") && text.contains("ravens") && text.contains("3.20 TFLOP"),
        "{text}"
    );
    let second = query(&root, "tr.donor[data-rank='2']").unwrap();
    assert!(second.text_content().unwrap().contains("12.50 MFLOP"));

    let empty = host();
    let _none = leptos::mount::mount_to(empty.clone(), || leaderboard_table(&[]));
    settle().await;
    assert!(query(&empty, "#leaderboard").is_none());
    assert!(
        empty
            .text_content()
            .unwrap()
            .contains("No accepted work yet")
    );
}

#[wasm_bindgen_test]
async fn a_donors_leaderboard_name_and_team_are_kept_for_the_tabs_next_hello() {
    let root = host();
    let _mounted = leptos::mount::mount_to(root.clone(), rookery_frontend::donate::DonatePage);
    settle().await;
    set_value(&root, "#donor-name", " Ada ");
    set_value(&root, "#donor-team", "ravens");
    settle().await;
    assert_eq!(
        rookery_web_provider::stored_donor(),
        Some(rookery_proto::DonorCard {
            name: "Ada".into(),
            team: Some("ravens".into()),
        })
    );
    // A blank name is anonymous, whatever the team.
    set_value(&root, "#donor-name", "  ");
    settle().await;
    assert_eq!(rookery_web_provider::stored_donor(), None);
    root.remove();
}

/// The Donate page mounted with its donation at hand, as the app provides
/// it; keep the handle to keep it mounted.
async fn donate_page() -> (
    web_sys::HtmlElement,
    rookery_frontend::donate::Donation,
    impl Sized,
) {
    use rookery_frontend::donate::{DonatePage, Donation};
    let root = host();
    let slot = std::rc::Rc::new(std::cell::Cell::new(None));
    let mounted = leptos::mount::mount_to(root.clone(), {
        let slot = slot.clone();
        move || {
            let donation = Donation::new();
            slot.set(Some(donation));
            provide_context(donation);
            view! { <DonatePage /> }
        }
    });
    settle().await;
    (root, slot.get().unwrap(), mounted)
}

fn training(public_name: Option<&str>) -> rookery_web_provider::DonateStatus {
    rookery_web_provider::DonateStatus::Training {
        provider_id: 4,
        adapter: "SwiftShader".into(),
        gflops: 10.0,
        job_id: 9,
        stage: 0,
        stages: 2,
        micro_batches: 3,
        public_name: public_name.map(str::to_owned),
    }
}

#[wasm_bindgen_test]
async fn the_donate_page_names_a_public_job_and_calls_a_private_one_private() {
    let (root, donation, _mounted) = donate_page().await;
    assert!(query(&root, "#donate-job").is_none(), "not training yet");
    donation
        .status
        .set(Some(training(Some("Handwritten digits for the Lab"))));
    settle().await;
    let job = query(&root, "#donate-job").unwrap();
    assert_eq!(job.get_attribute("data-public").as_deref(), Some("true"));
    assert!(
        job.text_content()
            .unwrap()
            .contains("Handwritten digits for the Lab")
    );
    donation.status.set(Some(training(None)));
    settle().await;
    let job = query(&root, "#donate-job").unwrap();
    assert_eq!(job.get_attribute("data-public").as_deref(), Some("false"));
    let text = job.text_content().unwrap();
    assert!(text.contains("a private job"), "{text}");
    assert!(!text.contains("Handwritten"), "{text}");
    root.remove();
}

#[wasm_bindgen_test]
async fn the_donate_page_lists_the_gpus_kernel_speeds_once_measured() {
    use rookery_web_provider::KernelSpeed;
    let (root, donation, _mounted) = donate_page().await;
    assert!(
        query(&root, "#donate-kernels").is_none(),
        "nothing measured yet"
    );
    donation.kernel_speeds.set(vec![
        KernelSpeed {
            name: "matmul 256x256x256 (16x16 x 8x8 d8 vec4)".into(),
            gflops: 12.5,
        },
        KernelSpeed {
            name: "matmul 256x256x256 mixed (plain) (16x16 x 8x8 d8 vec4)".into(),
            gflops: 7.25,
        },
    ]);
    settle().await;
    let list = query(&root, "#donate-kernels").unwrap();
    let text = list.text_content().unwrap();
    assert!(
        text.contains("matmul 256x256x256 (16x16 x 8x8 d8 vec4): 12.5 GFLOP/s"),
        "{text}"
    );
    assert!(text.contains("mixed (plain)"), "{text}");
    assert_eq!(list.query_selector_all("li").unwrap().length(), 2);
    root.remove();
}

/// Replaces `navigator.getBattery` with `script`'s value for the test
/// (`undefined`: a browser without it); [`restore_battery`] undoes it.
fn fake_get_battery(script: &str) {
    js_sys::eval(&format!(
        "window.__realGetBattery = Object.getOwnPropertyDescriptor(Navigator.prototype, 'getBattery'); \
         Object.defineProperty(Navigator.prototype, 'getBattery', \
         {{ value: {script}, configurable: true, writable: true }});"
    ))
    .unwrap();
}

fn restore_battery() {
    js_sys::eval(
        "if (window.__realGetBattery) { \
           Object.defineProperty(Navigator.prototype, 'getBattery', window.__realGetBattery); \
         } else { delete Navigator.prototype.getBattery; }",
    )
    .unwrap();
}

#[wasm_bindgen_test]
async fn without_get_battery_the_donate_page_says_so_and_never_pauses_for_it() {
    fake_get_battery("undefined");
    let (root, donation, _mounted) = donate_page().await;
    let status = query(&root, "#battery-status").unwrap();
    assert_eq!(
        status.get_attribute("data-battery").as_deref(),
        Some("unavailable")
    );
    assert_eq!(
        status.text_content().unwrap().trim(),
        "battery status not available in this browser"
    );
    assert_eq!(donation.paused.get_untracked(), None);
    restore_battery();
    root.remove();
}

#[wasm_bindgen_test]
async fn on_battery_the_donation_pauses_and_resumes_once_charging_or_unticked() {
    use rookery_frontend::donate::ON_BATTERY;
    js_sys::eval("window.__battery = new EventTarget(); window.__battery.charging = false;")
        .unwrap();
    fake_get_battery("() => Promise.resolve(window.__battery)");
    let (root, donation, _mounted) = donate_page().await;
    let battery = || {
        query(&root, "#battery-status")
            .unwrap()
            .get_attribute("data-battery")
    };
    assert_eq!(battery().as_deref(), Some("discharging"));
    assert_eq!(donation.paused.get_untracked().as_deref(), Some(ON_BATTERY));
    // Plugged in: it resumes.
    js_sys::eval(
        "window.__battery.charging = true; \
         window.__battery.dispatchEvent(new Event('chargingchange'));",
    )
    .unwrap();
    settle().await;
    assert_eq!(battery().as_deref(), Some("charging"));
    assert_eq!(donation.paused.get_untracked(), None);
    // Unplugged again: paused again, until the donor unticks the box.
    js_sys::eval(
        "window.__battery.charging = false; \
         window.__battery.dispatchEvent(new Event('chargingchange'));",
    )
    .unwrap();
    settle().await;
    assert_eq!(donation.paused.get_untracked().as_deref(), Some(ON_BATTERY));
    click(&root, "#pause-on-battery");
    settle().await;
    assert_eq!(donation.paused.get_untracked(), None);
    restore_battery();
    root.remove();
}

#[wasm_bindgen_test]
async fn the_gpu_cap_is_kept_in_percent_for_the_next_visit() {
    let (root, donation, _mounted) = donate_page().await;
    set_value(&root, "#donate-cap", "50");
    settle().await;
    assert_eq!(rookery_web_provider::stored_gpu_cap(), 50);
    assert_eq!(donation.gpu_cap.get_untracked(), 50);
    assert_eq!(
        query(&root, "#donate-cap-value")
            .unwrap()
            .text_content()
            .as_deref(),
        Some("50%")
    );
    let stored = web_sys::window()
        .unwrap()
        .local_storage()
        .unwrap()
        .unwrap()
        .get_item("rookery.donor.gpu_cap")
        .unwrap();
    assert_eq!(stored.as_deref(), Some("50"));
    set_value(&root, "#donate-cap", "100");
    settle().await;
    assert_eq!(rookery_web_provider::stored_gpu_cap(), 100);
    root.remove();
}
