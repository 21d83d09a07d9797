//! Harness for the end-to-end tests.
