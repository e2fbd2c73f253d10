//! The gateway's transport for `tunnel` endpoints when the tunnel ends in another process: the
//! request goes to the server's proxy port (the endpoint's `proxy_address`, already in the
//! request URI the gateway planned), with the gateway's data-plane key as
//! `Proxy-Authorization`. The proxy port relays it over the worker's tunnel.

use std::time::Duration;

use bytes::Bytes;
use control::routing::Endpoint;
use gateway::error::{ErrorKind, GatewayError};
use gateway::upstream::{UpstreamBody, UpstreamFuture, first_byte_timeout};
use http::{HeaderValue, Request, header};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

/// [`gateway::Upstream`] through a remote proxy port.
#[derive(Clone, Debug)]
pub struct ProxyPortUpstream {
    client: Client<HttpConnector, Full<Bytes>>,
    proxy_authorization: HeaderValue,
}

impl ProxyPortUpstream {
    /// `key`: a data-plane (or admin) API key the proxy port accepts.
    pub fn new(
        key: &str,
        connect_timeout: Duration,
    ) -> Result<Self, http::header::InvalidHeaderValue> {
        let mut proxy_authorization = HeaderValue::from_str(&format!("Bearer {key}"))?;
        proxy_authorization.set_sensitive(true);
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            // Below the proxy port's own keep-alive idle time.
            .pool_idle_timeout(Duration::from_secs(3))
            .build(connector);
        Ok(Self {
            client,
            proxy_authorization,
        })
    }
}

impl gateway::Upstream for ProxyPortUpstream {
    fn send(
        &self,
        _endpoint: &Endpoint,
        mut request: Request<Full<Bytes>>,
        deadline: tokio::time::Instant,
    ) -> UpstreamFuture {
        request.headers_mut().insert(
            header::PROXY_AUTHORIZATION,
            self.proxy_authorization.clone(),
        );
        let client = self.client.clone();
        Box::pin(async move {
            let response = tokio::time::timeout_at(deadline, client.request(request))
                .await
                .map_err(|_| first_byte_timeout())?
                .map_err(|e| {
                    let kind = if e.is_connect() {
                        ErrorKind::UpstreamConnect
                    } else {
                        ErrorKind::UpstreamProtocol
                    };
                    GatewayError::new(kind, "the server's proxy port failed").with_cause(e)
                })?;
            Ok(response.map(UpstreamBody::from))
        })
    }
}
