//! The gateway's transport for `tunnel` endpoints when the tunnel ends in another process: the
//! request goes to the server's proxy port (the endpoint's `proxy_address`, the planned
//! route's authority) in absolute form, with the instance header, the worker credential and the
//! gateway's data-plane key as `Proxy-Authorization`. The proxy port relays it over the
//! worker's tunnel.
//!
//! The proxy port is one more HTTP/1.1 upstream, so its connections live in a [`Pool`] with the
//! gateway's pool settings, like those to instances: keyed by the proxy port's address, closed
//! after the idle timeout (3 s by default, below the proxy port's keep-alive idle time),
//! checked before reuse, with the first-byte timer kept per connection and a dropped response
//! closing its connection, which cancels the relayed request.

use crate::config::GatewayConfig;
use crate::error::{ErrorKind, GatewayError};
use crate::upstream::{UpstreamBody, UpstreamFuture, UpstreamRequest};
use control_client::routing::Endpoint;
use http::uri::Scheme;
use http::{HeaderValue, header};
use net::pool::{Pool, PoolConfig};

/// [`crate::Upstream`] through a remote proxy port.
#[derive(Clone, Debug)]
pub struct ProxyPortUpstream {
    pool: Pool,
    proxy_authorization: HeaderValue,
}

impl ProxyPortUpstream {
    /// `key`: a data-plane (or admin) API key the proxy port accepts; `config`: the gateway's
    /// connect timeout and pool settings.
    pub fn new(
        key: &str,
        config: &GatewayConfig,
    ) -> Result<Self, http::header::InvalidHeaderValue> {
        let mut proxy_authorization = HeaderValue::from_str(&format!("Bearer {key}"))?;
        proxy_authorization.set_sensitive(true);
        let pool = Pool::new(pool_config(config));
        Ok(Self {
            pool,
            proxy_authorization,
        })
    }

    /// The same upstream with a pool of its own (one per core), for `config`'s settings.
    pub fn with_own_pool(&self, config: &GatewayConfig) -> Self {
        Self {
            pool: Pool::new(pool_config(config)),
            proxy_authorization: self.proxy_authorization.clone(),
        }
    }
}

fn pool_config(config: &GatewayConfig) -> PoolConfig {
    PoolConfig {
        connect_timeout: config.timeouts.connect,
        idle_timeout: config.pool_idle_timeout,
        max_idle: config.pool_max_idle_per_host,
    }
}

impl crate::Upstream for ProxyPortUpstream {
    fn send(
        &self,
        _endpoint: &Endpoint,
        request: UpstreamRequest,
        deadline: tokio::time::Instant,
    ) -> UpstreamFuture {
        let request = request.into_absolute(Scheme::HTTP).map(|mut request| {
            request.headers_mut().insert(
                header::PROXY_AUTHORIZATION,
                self.proxy_authorization.clone(),
            );
            request
        });
        let pool = self.pool.clone();
        Box::pin(async move {
            pool.send_as::<_, UpstreamBody>(request?, Some(deadline))
                .await
                .map_err(through_proxy_port)
        })
    }
}

/// The pool's errors name the model instance; these name the proxy port in front of it. The
/// kind stays, so the gateway's retry rule reads them as before.
fn through_proxy_port(e: net::pool::PoolError) -> GatewayError {
    let e = GatewayError::from(e);
    let message = match e.kind {
        ErrorKind::UpstreamConnect => "cannot connect to the server's proxy port",
        ErrorKind::UpstreamProtocol => "the server's proxy port failed before answering",
        _ => return e,
    };
    GatewayError::new(e.kind, message).with_cause(e)
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::disallowed_methods
    )]

    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use crate::Upstream as _;
    use crate::upstream::Route;
    use bytes::Bytes;
    use control_client::model::ProxyMode;
    use http::uri::Authority;
    use http::{HeaderMap, Method};
    use http_body_util::BodyExt as _;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpListener;
    use tokio::sync::mpsc;

    use super::*;

    fn endpoint() -> Endpoint {
        Endpoint {
            instance_id: 7,
            model_id: 3,
            worker_id: 1,
            worker_name: "w".into(),
            cluster_id: 1,
            address: "10.255.0.7".into(),
            instance_port: 40000,
            worker_port: 10150,
            proxy_mode: ProxyMode::Tunnel,
            proxy_address: None,
        }
    }

    /// A planned request for the tunnel path to the proxy port at `proxy`.
    fn request(proxy: &str, path: &'static str, body: &'static [u8]) -> UpstreamRequest {
        UpstreamRequest {
            method: Method::POST,
            path_and_query: http::uri::PathAndQuery::from_static(path),
            headers: HeaderMap::new(),
            body: Bytes::from_static(body),
            route: Route::Tunnel {
                proxy: Authority::try_from(proxy).unwrap(),
                instance: HeaderValue::from_static("model-3-7.static"),
                authorization: None,
            },
        }
    }

    /// A stand-in for the proxy port: counts connections, hands each request head to `heads`
    /// and answers every request with `ok` on the same keep-alive connection.
    async fn stand_in() -> (
        std::net::SocketAddr,
        Arc<AtomicUsize>,
        mpsc::Receiver<String>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = mpsc::channel(8);
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut sock, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        let mut chunk = [0u8; 4096];
                        let n = sock.read(&mut chunk).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        // The gateway's bodies are small: head and body come in one piece.
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8(buf[..end].to_vec()).unwrap();
                            let length = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length: "))
                                .map_or(0, |n| n.trim().parse::<usize>().unwrap());
                            buf.drain(..end + 4 + length);
                            tx.send(head).await.unwrap();
                            sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                                .await
                                .unwrap();
                        }
                    }
                });
            }
        });
        (addr, accepted, rx)
    }

    #[tokio::test]
    async fn requests_go_to_the_proxy_port_with_its_credential_on_one_kept_connection() {
        let (addr, accepted, mut heads) = stand_in().await;
        let upstream = ProxyPortUpstream::new("fdn_key", &GatewayConfig::default()).unwrap();
        for _ in 0..3 {
            let request = request(
                &addr.to_string(),
                "/v1/chat/completions",
                b"{\"model\":\"demo\"}",
            );
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            let response = upstream.send(&endpoint(), request, deadline).await.unwrap();
            assert_eq!(response.status(), 200);
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"ok");
            let head = heads.recv().await.unwrap().to_ascii_lowercase();
            assert!(
                head.starts_with("post /v1/chat/completions http/1.1"),
                "{head}"
            );
            assert!(
                head.contains("proxy-authorization: bearer fdn_key"),
                "{head}"
            );
            assert!(
                head.contains("x-gpustack-model-instance: model-3-7.static"),
                "{head}"
            );
            assert!(head.contains(&format!("host: {addr}")), "{head}");
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one kept-alive connection"
        );
    }

    #[tokio::test]
    async fn a_proxy_port_that_is_down_is_a_connect_error_naming_it() {
        let port = testkit::free_port();
        let upstream = ProxyPortUpstream::new("fdn_key", &GatewayConfig::default()).unwrap();
        let request = request(&format!("127.0.0.1:{port}"), "/v1/completions", b"{}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let err = upstream
            .send(&endpoint(), request, deadline)
            .await
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::UpstreamConnect);
        assert!(err.message.contains("proxy port"), "{err:?}");
    }
}
