//! The credential that opens the worker proxies of each cluster that synced `worker`-mode
//! workers belong to, read through the management API with the sync's key:
//!
//! - from a GPUStack server, the cluster's registration token
//!   (`GET /v2/clusters/{id}/registration-token`, an admin key): GPUStack's worker reverse proxy
//!   accepts its worker token or its cluster's registration token and checks either locally;
//!   only the second can be read through the API. Any other key would make the worker ask the
//!   server's `/token-auth` on every request.
//! - from a faden server, the cluster's worker proxy credential
//!   (`GET /v2/clusters/{id}/proxy-credential`, a data-plane key is enough): it opens the
//!   cluster's worker proxies and nothing else (`tokens::worker_proxy_credential`).
//!
//! With it, the gateway's `worker` path needs no credential from the operator. A token is
//! fetched when a cluster is first seen, refetched every [`REFRESH`] (a rotated token is picked
//! up), and a cluster whose fetch failed is tried again after [`RETRY`].

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::HeaderValue;
use http_body_util::{BodyExt, Limited};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::model::ProxyMode;
use crate::sync::{Api, SyncConfig, SyncError, SyncHandle};

/// A cluster's token is read again this often.
pub const REFRESH: Duration = Duration::from_secs(600);
/// A failed fetch is tried again after this long.
pub const RETRY: Duration = Duration::from_secs(5);
/// Largest answer read.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// The tokens known now, by cluster id, as `Bearer` header values. Reads take no lock.
#[derive(Default)]
pub struct ClusterTokens {
    tokens: ArcSwap<HashMap<i64, HeaderValue>>,
}

impl fmt::Debug for ClusterTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let clusters: BTreeSet<i64> = self.tokens.load().keys().copied().collect();
        f.debug_struct("ClusterTokens")
            .field("clusters", &clusters)
            .finish()
    }
}

impl ClusterTokens {
    /// `Authorization: Bearer <registration token>` for a worker of `cluster_id`, once fetched.
    pub fn authorization(&self, cluster_id: i64) -> Option<HeaderValue> {
        self.tokens.load().get(&cluster_id).cloned()
    }
}

/// Which credential is read for a cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterSecret {
    /// GPUStack's registration token (an admin key reads it).
    RegistrationToken,
    /// faden's worker proxy credential (a data-plane key reads it).
    ProxyCredential,
}

impl ClusterSecret {
    fn path(self, cluster_id: i64) -> String {
        match self {
            ClusterSecret::RegistrationToken => {
                format!("/v2/clusters/{cluster_id}/registration-token")
            }
            ClusterSecret::ProxyCredential => {
                format!("/v2/clusters/{cluster_id}/proxy-credential")
            }
        }
    }
}

/// Which credential to read now: `faden gateway` learns the server's kind from the sync.
pub type SecretProbe = Arc<dyn Fn() -> ClusterSecret + Send + Sync>;

/// Starts following the clusters of `sync`'s workers from the server `config` names, reading
/// for each the credential `secret` names (the sync's key must be allowed to read it). Ends when
/// `cancel` fires.
pub fn spawn(
    config: &SyncConfig,
    sync: SyncHandle,
    secret: SecretProbe,
    cancel: CancellationToken,
) -> Result<Arc<ClusterTokens>, SyncError> {
    let fetcher = Fetcher {
        api: Api::new(config)?,
        timeout: config.request_timeout,
        secret,
    };
    let tokens = Arc::new(ClusterTokens::default());
    let follow = follow(fetcher, sync, Arc::clone(&tokens));
    // Ends when `cancel` fires.
    net::task::spawn(
        cancel
            .run_until_cancelled_owned(follow)
            .instrument(tracing::info_span!("cluster_tokens")),
    );
    Ok(tokens)
}

struct Fetcher {
    /// The sync client's view of the server: its key, TLS and error reading.
    api: Api,
    timeout: Duration,
    secret: SecretProbe,
}

impl Fetcher {
    async fn fetch(&self, cluster_id: i64) -> Result<HeaderValue, String> {
        #[derive(serde::Deserialize)]
        struct Answer {
            token: String,
        }
        let path = (self.secret)().path(cluster_id);
        let answer = async {
            let response = self.api.get(&path).await.map_err(|e| e.to_string())?;
            let body = Limited::new(response.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            let answer: Answer = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
            let mut value = HeaderValue::try_from(format!("Bearer {}", answer.token))
                .map_err(|_| "the token is not a valid header value".to_owned())?;
            value.set_sensitive(true);
            Ok(value)
        };
        tokio::time::timeout(self.timeout, answer)
            .await
            .map_err(|_| format!("no answer within {:?}", self.timeout))?
    }
}

/// Fetches what is missing or due whenever the synced workers change, and at the next due time.
async fn follow(fetcher: Fetcher, sync: SyncHandle, tokens: Arc<ClusterTokens>) {
    let mut snapshots = sync.snapshots();
    // When each cluster is due to be fetched (again).
    let mut due: HashMap<i64, Instant> = HashMap::new();
    loop {
        let clusters: BTreeSet<i64> = sync
            .objects()
            .workers
            .values()
            .filter(|w| w.proxy_mode == ProxyMode::Worker)
            .map(|w| w.cluster_id)
            .collect();
        due.retain(|id, _| clusters.contains(id));
        let now = Instant::now();
        let mut current = HashMap::clone(&tokens.tokens.load());
        current.retain(|id, _| clusters.contains(id));
        for &cluster_id in &clusters {
            if due.get(&cluster_id).is_some_and(|at| *at > now) {
                continue;
            }
            match fetcher.fetch(cluster_id).await {
                Ok(token) => {
                    tracing::debug!(cluster_id, "worker proxy credential read");
                    current.insert(cluster_id, token);
                    due.insert(cluster_id, Instant::now() + REFRESH);
                }
                Err(error) => {
                    tracing::warn!(cluster_id, %error, retry_in = ?RETRY, "cannot read the cluster's worker proxy credential; its worker-mode workers get 502 until it is read");
                    due.insert(cluster_id, Instant::now() + RETRY);
                }
            }
        }
        tokens.tokens.store(Arc::new(current));
        let next = due.values().min().copied();
        tokio::select! {
            changed = snapshots.changed() => {
                if changed.is_err() {
                    return; // the sync stopped
                }
            }
            () = sleep_until(next) => {}
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
