//! `faden probe URL`: one HTTP GET that exits 0 on a 2xx answer, for health checks run inside
//! the image, which has no shell and no curl (compose's `healthcheck`, Docker's `HEALTHCHECK`).

use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Options of `faden probe`.
#[derive(Debug, Args, Clone)]
pub struct ProbeArgs {
    /// The URL to GET (plain http), e.g. http://127.0.0.1:8080/readyz.
    #[arg(value_name = "URL")]
    pub url: http::Uri,
    /// Longest wait for the answer's status line.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

pub async fn run(args: ProbeArgs) -> anyhow::Result<()> {
    let status = get(&args.url, args.timeout).await?;
    anyhow::ensure!(status.is_success(), "{}: {status}", args.url);
    Ok(())
}

/// The status of a GET of `url`.
async fn get(url: &http::Uri, timeout: Duration) -> anyhow::Result<http::StatusCode> {
    anyhow::ensure!(
        url.scheme_str() == Some("http"),
        "{url}: only http:// URLs are probed"
    );
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let answer = tokio::time::timeout(timeout, client.get(url.clone()))
        .await
        .with_context(|| format!("{url}: no answer within {timeout:?}"))?
        .with_context(|| format!("{url}"))?;
    Ok(answer.status())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::{ProbeArgs, run};

    /// Accepts one connection on `listener` and answers its request with `status_line`.
    async fn answer_once(listener: TcpListener, status_line: &str) {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 1024];
        let _ = conn.read(&mut buf).await.unwrap();
        let answer = format!("{status_line}\r\ncontent-length: 0\r\n\r\n");
        conn.write_all(answer.as_bytes()).await.unwrap();
    }

    /// `faden probe` against a server on 127.0.0.1 that answers with `status_line`.
    async fn probe_answered_by(status_line: &str) -> anyhow::Result<()> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/readyz", listener.local_addr().unwrap());
        let (result, ()) = tokio::join!(run(args(&url)), answer_once(listener, status_line));
        result
    }

    fn args(url: &str) -> ProbeArgs {
        ProbeArgs {
            url: url.parse().unwrap(),
            timeout: Duration::from_secs(10),
        }
    }

    #[tokio::test]
    async fn a_2xx_answer_passes_and_anything_else_fails() {
        probe_answered_by("HTTP/1.1 200 OK").await.unwrap();
        probe_answered_by("HTTP/1.1 204 No Content").await.unwrap();
        let err = probe_answered_by("HTTP/1.1 503 Service Unavailable")
            .await
            .unwrap_err();
        assert!(err.to_string().contains("503"), "{err}");
    }

    #[tokio::test]
    async fn a_refused_connection_and_https_fail() {
        // A port that was free a moment ago: nothing listens there.
        let port = testkit::free_port();
        assert!(
            run(args(&format!("http://127.0.0.1:{port}/healthz")))
                .await
                .is_err()
        );
        let err = run(args("https://127.0.0.1:1/healthz")).await.unwrap_err();
        assert!(err.to_string().contains("only http://"), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_server_fails_at_the_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/readyz", listener.local_addr().unwrap());
        let mut probe = args(&url);
        probe.timeout = Duration::from_secs(5);
        // Accepted (by the backlog) but never answered.
        let err = run(probe).await.unwrap_err();
        assert!(err.to_string().contains("no answer within"), "{err}");
        drop(listener);
    }
}
