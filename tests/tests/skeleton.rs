//! The walking skeleton end to end: a real server, a real libtorch provider
//! and a real browser tab donating through WebGPU, all on loopback.

#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::time::Duration;

use fantoccini::Locator;
use rookery_e2e::{Browser, Server, start_native_provider};
use rookery_proto::ProviderKind;
use rookery_proto::api::{ProviderInfo, ProviderStatus};

fn connected(providers: &[ProviderInfo], kind: ProviderKind) -> Vec<&ProviderInfo> {
    providers
        .iter()
        .filter(|p| p.kind == kind && p.status == ProviderStatus::Connected)
        .collect()
}

/// Also the Donate page's controls as the server sees them: the tab's GPU
/// cap in the provider list (and on the Providers page), a pause's reason,
/// and no pause where the browser tells nothing of a battery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_native_and_a_browser_provider_join_and_the_killed_one_is_marked_gone()
-> anyhow::Result<()> {
    let server = Server::start(2000)?;
    let mut native = start_native_provider(&server, "e2e-native")?;

    let browser = Browser::start().await?;
    browser.start_donating(&server).await?;
    browser.screenshot("donate").await?;

    let providers = server
        .wait_for_providers(
            "one native and one browser provider",
            Duration::from_secs(60),
            |all| {
                all.len() == 2
                    && connected(all, ProviderKind::Native).len() == 1
                    && connected(all, ProviderKind::Browser).len() == 1
            },
        )
        .await?;
    let native_info = connected(&providers, ProviderKind::Native)[0].clone();
    let browser_info = connected(&providers, ProviderKind::Browser)[0].clone();
    assert!(
        native_info.device.starts_with("libtorch"),
        "native device: {}",
        native_info.device
    );
    assert_eq!(native_info.name, "e2e-native");
    assert!(
        native_info.gflops > 0.0 && native_info.memory_bytes > 0,
        "{native_info:?}"
    );
    assert!(!browser_info.device.is_empty(), "{browser_info:?}");
    assert!(
        !browser_info.device.contains("libtorch"),
        "{browser_info:?}"
    );
    assert!(
        browser_info.gflops > 0.0 && browser_info.memory_bytes > 0,
        "{browser_info:?}"
    );

    // The tab degrades cleanly where the browser tells nothing of a
    // battery: asked again (unticking and ticking the box) without
    // `navigator.getBattery`, it says so and keeps donating.
    let battery = battery_status(&browser).await?;
    anyhow::ensure!(
        battery.0 == "unavailable" || battery.0 == "charging",
        "headless Chromium has no battery to run on, so nothing pauses for one: {battery:?}"
    );
    browser
        .client
        .execute(
            "Object.defineProperty(Navigator.prototype, 'getBattery', \
             { value: undefined, configurable: true, writable: true });",
            Vec::new(),
        )
        .await?;
    for _ in 0..2 {
        browser
            .client
            .find(Locator::Css("#pause-on-battery"))
            .await?
            .click()
            .await?;
    }
    let battery = battery_status(&browser).await?;
    assert_eq!(
        battery,
        (
            "unavailable".to_string(),
            "battery status not available in this browser".to_string()
        )
    );
    let state = browser
        .client
        .find(Locator::Css("#donate-status"))
        .await?
        .attr("data-state")
        .await?;
    assert_eq!(state.as_deref(), Some("connected"), "no battery, no pause");

    // The donor caps the GPU at half: the server's provider list says so
    // at once (the planner counts the tab at half its GFLOP/s).
    assert_eq!(browser_info.duty_cycle, Some(1.0), "{browser_info:?}");
    browser
        .client
        .execute(
            "const cap = document.querySelector('#donate-cap'); cap.value = '50'; \
             cap.dispatchEvent(new Event('input', { bubbles: true }));",
            Vec::new(),
        )
        .await?;
    server
        .wait_for_providers("the tab's GPU cap at 50%", Duration::from_secs(10), |all| {
            all.iter()
                .any(|p| p.id == browser_info.id && p.duty_cycle == Some(0.5))
        })
        .await?;

    // The Providers page, opened in a second tab so the donating tab keeps running.
    let donating = browser.client.window().await?;
    let tab = browser.client.new_window(true).await?;
    browser.client.switch_to_window(tab.handle).await?;
    browser.client.goto(&server.http_url("/providers")).await?;
    // Signed out, it counts both providers but lists only this browser's
    // own (the credential its donating tab keeps), not the native one.
    let started = std::time::Instant::now();
    loop {
        let rows = browser
            .client
            .find_all(Locator::Css(
                "#providers tr.provider[data-status=connected]",
            ))
            .await?;
        let mut kinds = Vec::new();
        for row in &rows {
            kinds.push(row.attr("data-kind").await?.unwrap_or_default());
        }
        let mut count = None;
        for shown in browser
            .client
            .find_all(Locator::Css("#provider-count"))
            .await?
        {
            count = shown.attr("data-count").await?;
        }
        let mut caps = Vec::new();
        for cap in browser
            .client
            .find_all(Locator::Css("#providers tr.provider .gpu-cap"))
            .await?
        {
            caps.push(cap.text().await?);
        }
        if kinds == ["browser"] && count.as_deref() == Some("2") && caps == ["GPU cap 50%"] {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(30),
            "the Providers page shows connected rows of kinds {kinds:?}, a count of {count:?} \
             and caps {caps:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let shot = browser.screenshot("providers").await?;
    println!("Providers page screenshot: {}", shot.display());
    // Signed out, the home page is the Donate page, and the bar has no
    // Requester's pages in it.
    browser.client.goto(&server.http_url("/")).await?;
    browser
        .client
        .wait()
        .at_most(Duration::from_secs(30))
        .for_element(Locator::Css("#donate-start"))
        .await?;
    let requester_links = browser
        .client
        .find_all(Locator::Css("nav a[href='/jobs/new']"))
        .await?;
    anyhow::ensure!(requester_links.is_empty(), "a visitor sees New job");
    browser.client.find(Locator::Css("#sign-in")).await?;

    // Paused from its page, the tab leaves saying why (the provider list
    // shows it), and on resume it joins again.
    browser.client.switch_to_window(donating).await?;
    press_pause_and_wait_for(&browser, "paused").await?;
    server
        .wait_for_providers(
            "the paused tab gone, saying why",
            Duration::from_secs(10),
            |all| {
                all.iter().any(|p| {
                    p.id == browser_info.id
                        && p.status == ProviderStatus::Gone
                        && p.gone_reason
                            .as_deref()
                            .is_some_and(|r| r.contains("paused by the donor"))
                        && p.paused_reason.as_deref() == Some("paused from the Donate page")
                })
            },
        )
        .await?;
    press_pause_and_wait_for(&browser, "connected").await?;
    // It comes back with the cap its donor keeps.
    server
        .wait_for_providers("the resumed tab back", Duration::from_secs(30), |all| {
            let tabs = connected(all, ProviderKind::Browser);
            tabs.len() == 1 && tabs[0].duty_cycle == Some(0.5)
        })
        .await?;

    native.kill();
    let providers = server
        .wait_for_providers(
            "the killed native provider marked gone",
            Duration::from_secs(10),
            |all| {
                all.iter()
                    .any(|p| p.id == native_info.id && p.status == ProviderStatus::Gone)
            },
        )
        .await?;
    assert_eq!(
        connected(&providers, ProviderKind::Browser).len(),
        1,
        "the browser stays"
    );
    browser.client.clone().close().await?;
    Ok(())
}

/// What `#battery-status` says, once the browser has answered:
/// `(data-battery, text)`.
async fn battery_status(browser: &Browser) -> anyhow::Result<(String, String)> {
    let started = std::time::Instant::now();
    loop {
        let element = browser.client.find(Locator::Css("#battery-status")).await?;
        let state = element.attr("data-battery").await?.unwrap_or_default();
        if state != "unknown" {
            return Ok((state, element.text().await?));
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(10),
            "the battery status stayed unknown"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Presses the Donate page's Pause (or Resume) button and waits until the
/// donation's state is `state`.
async fn press_pause_and_wait_for(browser: &Browser, state: &str) -> anyhow::Result<()> {
    browser
        .client
        .find(Locator::Css("#donate-pause"))
        .await?
        .click()
        .await?;
    browser
        .wait_for_attr(
            "#donate-status",
            "data-state",
            state,
            Duration::from_secs(30),
        )
        .await
}
