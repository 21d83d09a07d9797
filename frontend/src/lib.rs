//! Rookery's dashboard: a Leptos client-side app served by the Rookery server
//! as static files (`index.html`, `style.css`, `pkg/`). A Requester signs in
//! with the API token, creates jobs, watches them live and downloads their
//! weights; anyone sees the providers and can donate this browser's GPU.
//!
//! A library (the pages and their pure helpers) under a small binary, so the
//! component tests in `tests/` mount pieces of it in headless Chromium.
//! Built for `wasm32-unknown-unknown`; it also compiles natively so the
//! workspace lints and unit-tests it.

pub mod api;
pub mod app;
pub mod chart;
pub mod donate;
pub mod format;
pub mod job_detail;
pub mod jobs;
pub mod leaderboard;
pub mod new_job;
pub mod providers;
pub mod signin;
