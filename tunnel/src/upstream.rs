//! The gateway's transport for `tunnel` endpoints, in process: each request opens a yamux
//! stream to the endpoint's worker and speaks HTTP/1.1 to its worker proxy on it. The answer
//! streams back as it arrives (nothing is buffered); dropping the answer resets the stream,
//! which cancels the request on the worker.

use bytes::Bytes;
use control::routing::Endpoint;
use gateway::error::{ErrorKind, GatewayError};
use gateway::headers::X_GPUSTACK_MODEL_INSTANCE;
use gateway::upstream::{UpstreamFuture, instance_host};
use http::{HeaderValue, Request, Uri, header};
use http_body_util::Full;

use crate::server::TunnelServer;

/// [`gateway::Upstream`] over the in-process tunnel registry.
#[derive(Clone, Debug)]
pub struct TunnelUpstream {
    server: TunnelServer,
}

impl TunnelUpstream {
    pub fn new(server: TunnelServer) -> Self {
        Self { server }
    }
}

/// Turns a proxied request into the one sent on a stream: origin-form target, `Host` from the
/// original authority, and the instance header (the gateway sets it; added if missing).
pub(crate) fn to_origin_form<B>(
    request: &mut Request<B>,
    instance: Option<HeaderValue>,
) -> Result<(), http::Error> {
    let authority = request.uri().authority().cloned();
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    *request.uri_mut() = Uri::try_from(path)?;
    *request.version_mut() = http::Version::HTTP_11;
    let headers = request.headers_mut();
    if let Some(authority) = authority {
        if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
            headers.insert(header::HOST, host);
        }
    }
    if let Some(instance) = instance {
        if !headers.contains_key(X_GPUSTACK_MODEL_INSTANCE) {
            headers.insert(X_GPUSTACK_MODEL_INSTANCE, instance);
        }
    }
    Ok(())
}

impl gateway::Upstream for TunnelUpstream {
    fn send(&self, endpoint: &Endpoint, mut request: Request<Full<Bytes>>) -> UpstreamFuture {
        let server = self.server.clone();
        let worker = endpoint.worker_id;
        let instance = HeaderValue::from_str(&instance_host(endpoint)).ok();
        Box::pin(async move {
            to_origin_form(&mut request, instance).map_err(|e| {
                GatewayError::new(ErrorKind::UpstreamConnect, "invalid request target")
                    .with_cause(e)
            })?;
            let stream = server.open_stream(worker).await.map_err(|e| {
                GatewayError::new(
                    ErrorKind::UpstreamConnect,
                    "the worker's tunnel is not available",
                )
                .with_cause(e)
            })?;
            crate::http::send_request(stream, request)
                .await
                .map_err(|e| {
                    GatewayError::new(
                        ErrorKind::UpstreamProtocol,
                        "the model instance failed before answering (through the tunnel)",
                    )
                    .with_cause(e)
                })
        })
    }
}
