//! Access control with the real binaries: a server that requires a join
//! token turns away a provider without it (which stops and says why) and
//! admits one with it; a Requester made with `rookery token create` while
//! the server runs can use the CLI, but neither Requester sees or touches
//! the other's jobs.

#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::process::Stdio;
use std::time::{Duration, Instant};

use rookery_e2e::{Server, provider_command, rookery};
use rookery_proto::api::ProviderStatus;
use rookery_test_support::workspace_root;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_tokens_and_requester_tokens_are_enforced_end_to_end() -> anyhow::Result<()> {
    let server = Server::start_with(2000, &["--provider-token", "open sesame"])?;
    let url = server.http_url("");

    // Without the token the provider is refused, and gives up instead of retrying.
    let mut refused = provider_command(&server, "no-token", &[])?
        .stderr(Stdio::piped())
        .spawn()?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = refused.try_wait()? {
            break status;
        }
        if started.elapsed() > Duration::from_secs(60) {
            refused.kill()?;
            anyhow::bail!("the provider without a token kept running");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut refused.stderr.take().unwrap(), &mut stderr)?;
    assert!(!status.success());
    assert!(stderr.contains("join token"), "{stderr}");

    let mut admitted =
        provider_command(&server, "with-token", &["--token", "open sesame"])?.spawn()?;
    server
        .wait_for_providers(
            "the provider with the token",
            Duration::from_secs(60),
            |all| all.len() == 1 && all[0].status == ProviderStatus::Connected,
        )
        .await?;
    admitted.kill()?;
    admitted.wait()?;

    // A second Requester, made while the server holds the database.
    let data_dir = server.data_dir().display().to_string();
    let (ok, bob, stderr) = rookery(&["token", "create", "bob", "--data-dir", &data_dir])?;
    assert!(ok, "{stderr}");
    let bob = bob.trim().to_string();
    let first = std::fs::read_to_string(server.data_dir().join("api-token"))?;
    let first = first.trim().to_string();

    let job = workspace_root().join("examples/mnist-job.toml");
    let job = job.display().to_string();
    let (ok, id, stderr) = rookery(&["submit", &job, "--server", &url, "--token", &first])?;
    assert!(ok, "{stderr}");
    let id = id.trim().to_string();

    let (ok, listed, stderr) = rookery(&["jobs", "--server", &url, "--token", &first])?;
    assert!(ok, "{stderr}");
    assert!(listed.starts_with(&format!("job {id} ")), "{listed}");
    let (ok, listed, stderr) = rookery(&["jobs", "--server", &url, "--token", &bob])?;
    assert!(ok, "{stderr}");
    assert_eq!(listed, "", "bob sees: {listed}");
    for command in ["cancel", "download", "watch"] {
        let (ok, _, stderr) = rookery(&[command, &id, "--server", &url, "--token", &bob])?;
        assert!(!ok, "bob could {command} job {id}");
        assert!(stderr.contains("not found"), "{command}: {stderr}");
    }
    let (ok, _, stderr) = rookery(&["jobs", "--server", &url, "--token", "wrong"])?;
    assert!(!ok);
    assert!(stderr.contains("token is wrong"), "{stderr}");
    // Bob's attempts changed nothing: the job is still its owner's to cancel.
    let (ok, cancelled, stderr) = rookery(&["cancel", &id, "--server", &url, "--token", &first])?;
    assert!(ok, "{stderr}");
    assert!(cancelled.contains("cancelled"), "{cancelled}");
    Ok(())
}
