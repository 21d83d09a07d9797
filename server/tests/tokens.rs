//! `rookery token create` and `revoke` as a person runs them, against the
//! data dir a server opens: the printed token works, only its digest is on
//! disk, names are unique, and a revoked token is refused by a server
//! already running.

#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::path::Path;
use std::process::{Command, Output};

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use rookery_server::{AppState, Limits, app};
use tower::ServiceExt;

fn rookery_token(args: &[&str], data_dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rookery"))
        .arg("token")
        .args(args)
        .arg("--data-dir")
        .arg(data_dir)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

async fn list_jobs(state: &AppState, token: &str) -> StatusCode {
    app(state.clone())
        .oneshot(
            Request::get("/api/jobs")
                .header(header::AUTHORIZATION, format!("Bearer {token}"))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap()
        .status()
}

#[tokio::test]
async fn a_created_token_works_once_stored_only_as_a_digest() {
    let dir = tempfile::tempdir().unwrap();
    let created = rookery_token(&["create", "alice"], dir.path());
    assert!(created.status.success(), "{}", text(&created.stderr));
    let token = text(&created.stdout).trim().to_string();
    assert_eq!(token.len(), 64, "{token}");
    assert!(text(&created.stderr).contains("shown only this once"));

    let again = rookery_token(&["create", "alice"], dir.path());
    assert!(!again.status.success());
    assert!(
        text(&again.stderr).contains("a Requester named `alice` exists already"),
        "{}",
        text(&again.stderr)
    );
    let bad = rookery_token(&["create", "a b"], dir.path());
    assert!(!bad.status.success());
    assert!(text(&bad.stderr).contains("letters, digits"));

    let state = AppState::open(dir.path(), Limits::default(), None)
        .await
        .unwrap();
    assert_eq!(list_jobs(&state, &token).await, StatusCode::OK);
    assert_eq!(
        list_jobs(&state, state.api_token.secret()).await,
        StatusCode::OK
    );
    assert_eq!(
        list_jobs(&state, &token[..63]).await,
        StatusCode::UNAUTHORIZED
    );
    let listed = rookery_token(&["list"], dir.path());
    assert_eq!(text(&listed.stdout), "alice\ndefault\n");

    // Neither token appears in any database file, WAL included.
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap() == "api-token" {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        for secret in [token.as_str(), state.api_token.secret()] {
            assert!(
                !bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
                "{} holds a token",
                path.display()
            );
        }
    }
}

/// Starts `rookery serve` on `data_dir`, returns what it printed up to its
/// listening line, and stops it.
fn serve_once(data_dir: &Path) -> String {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_rookery"))
        .args(["serve", "--addr", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut printed = String::new();
    let stdout = child.stdout.take().unwrap();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        printed += &line;
        printed.push('\n');
        if line.contains("listening on") {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    printed
}

#[test]
fn the_api_token_is_printed_only_when_it_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let first = serve_once(dir.path());
    let secret = std::fs::read_to_string(dir.path().join("api-token")).unwrap();
    let secret = secret.trim();
    assert!(first.contains(secret), "{first}");
    let again = serve_once(dir.path());
    assert!(!again.contains(secret), "{again}");
    assert!(again.contains("api-token"), "{again}");
}

/// `rookery token revoke` beside a server already open on the data dir:
/// the revoked token is refused from the next request, another Requester's
/// still works, and `create` gives the same name a new token that works.
#[tokio::test]
async fn a_revoked_token_is_refused_by_a_running_server_while_others_still_work() {
    let dir = tempfile::tempdir().unwrap();
    let create = |name: &str| {
        let created = rookery_token(&["create", name], dir.path());
        assert!(created.status.success(), "{}", text(&created.stderr));
        text(&created.stdout).trim().to_string()
    };
    let (alice, bob) = (create("alice"), create("bob"));
    let state = AppState::open(dir.path(), Limits::default(), None)
        .await
        .unwrap();
    assert_eq!(list_jobs(&state, &alice).await, StatusCode::OK);

    let revoked = rookery_token(&["revoke", "alice"], dir.path());
    assert!(revoked.status.success(), "{}", text(&revoked.stderr));
    assert!(
        text(&revoked.stderr).contains("`rookery token create alice`"),
        "{}",
        text(&revoked.stderr)
    );
    assert_eq!(list_jobs(&state, &alice).await, StatusCode::UNAUTHORIZED);
    assert_eq!(list_jobs(&state, &bob).await, StatusCode::OK);
    assert_eq!(
        list_jobs(&state, state.api_token.secret()).await,
        StatusCode::OK
    );
    let listed = rookery_token(&["list"], dir.path());
    assert_eq!(text(&listed.stdout), "alice (revoked)\nbob\ndefault\n");

    let unknown = rookery_token(&["revoke", "carol"], dir.path());
    assert!(!unknown.status.success());
    assert!(
        text(&unknown.stderr).contains("there is no Requester named `carol`"),
        "{}",
        text(&unknown.stderr)
    );

    let renewed = rookery_token(&["create", "alice"], dir.path());
    assert!(renewed.status.success(), "{}", text(&renewed.stderr));
    assert!(text(&renewed.stderr).contains("its jobs back"));
    let renewed = text(&renewed.stdout).trim().to_string();
    assert_eq!(list_jobs(&state, &renewed).await, StatusCode::OK);
    assert_eq!(list_jobs(&state, &alice).await, StatusCode::UNAUTHORIZED);
}

/// The data dir's own token is a Requester's like any other: revoking
/// `default` refuses it at once and deletes the file that held it; `create
/// default` writes a new one there, which a restarted server keeps.
#[tokio::test]
async fn revoking_the_data_dirs_own_token_deletes_it_and_create_writes_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let state = AppState::open(dir.path(), Limits::default(), None)
        .await
        .unwrap();
    let old = state.api_token.secret().to_string();
    let revoked = rookery_token(&["revoke", "default"], dir.path());
    assert!(revoked.status.success(), "{}", text(&revoked.stderr));
    assert!(!dir.path().join("api-token").exists());
    assert_eq!(list_jobs(&state, &old).await, StatusCode::UNAUTHORIZED);

    let created = rookery_token(&["create", "default"], dir.path());
    assert!(created.status.success(), "{}", text(&created.stderr));
    let new = text(&created.stdout).trim().to_string();
    let file = std::fs::read_to_string(dir.path().join("api-token")).unwrap();
    assert_eq!(file.trim(), new);
    assert_eq!(list_jobs(&state, &new).await, StatusCode::OK);
    // A working token is not replaced behind its holder's back.
    let again = rookery_token(&["create", "default"], dir.path());
    assert!(!again.status.success());
    assert_eq!(
        std::fs::read_to_string(dir.path().join("api-token")).unwrap(),
        file
    );

    drop(state);
    let restarted = AppState::open(dir.path(), Limits::default(), None)
        .await
        .unwrap();
    assert_eq!(restarted.api_token.secret(), new);
    assert_eq!(list_jobs(&restarted, &new).await, StatusCode::OK);
    assert_eq!(list_jobs(&restarted, &old).await, StatusCode::UNAUTHORIZED);
}
