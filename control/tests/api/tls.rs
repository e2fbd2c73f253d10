//! The management API over TLS, and its clients: a CA bundle, a pinned certificate, and the
//! refusals (another CA, https without settings, plain HTTP on the TLS port).

use std::sync::Arc;

use control_client::client::{ApiClient, ClientError};
use control_client::sync::{self, SyncConfig, SyncError};
use http::{Method, StatusCode};
use testkit::certs::{PemDir, TestCa, server_config};
use tokio_util::sync::CancellationToken;

use crate::common;

#[tokio::test]
async fn api_over_tls_with_ca_bundle_pinned_certificate_and_refusals() {
    let ca = TestCa::new("api test ca");
    let cert = ca.server_cert();
    let pem = PemDir::new();
    let (chain, _) = pem.write_cert("api", &cert);
    let ca_path = pem.write_ca("ca", &ca);
    let other_path = pem.write_ca("other", &TestCa::new("another ca"));
    let tls = server_config(&cert, None, &[b"h2", b"http/1.1"]);
    let t = common::start_with(tempfile::tempdir().unwrap(), |c| c.tls = Some(tls)).await;
    let port = t.server.api_addr.port();
    let url = format!("https://127.0.0.1:{port}");
    let key = t.server.admin_key.clone();

    // Trusting the CA bundle.
    let client = control_client::tls::client_config(Some(&ca_path)).unwrap();
    let api = ApiClient::with_tls(&url, Some(client.clone())).unwrap();
    let (status, body) = api.call(Method::GET, "/healthz", "", None).await.unwrap();
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok"[..]));
    let (status, _) = api
        .call(Method::GET, "/v2/clusters", &key, None)
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);

    // Pinned to the server's own certificate (the server's in-process clients).
    let pinned = control_client::tls::pinned_client_config_for(&chain).unwrap();
    let api = ApiClient::with_tls(&url, Some(pinned)).unwrap();
    let (status, _) = api.call(Method::GET, "/healthz", "", None).await.unwrap();
    assert_eq!(status, StatusCode::OK);
    // A pin on another certificate is refused.
    let stranger = control_client::tls::pinned_client_config(ca.server_cert().cert_der()).unwrap();
    let api = ApiClient::with_tls(&url, Some(stranger)).unwrap();
    assert!(api.call(Method::GET, "/healthz", "", None).await.is_err());

    // Another CA: refused, saying why.
    let other = control_client::tls::client_config(Some(&other_path)).unwrap();
    let api = ApiClient::with_tls(&url, Some(other)).unwrap();
    let err = api
        .call(Method::GET, "/healthz", "", None)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("UnknownIssuer"), "{err}");

    // https without TLS settings is refused up front; plain HTTP on the TLS port gets nothing.
    assert!(matches!(ApiClient::new(&url), Err(ClientError::NoTls(_))));
    let plain = ApiClient::new(&format!("http://127.0.0.1:{port}")).unwrap();
    assert!(plain.call(Method::GET, "/healthz", "", None).await.is_err());

    // The sync client follows the API over https.
    let cancel = CancellationToken::new();
    assert!(matches!(
        sync::spawn(SyncConfig::new(&url, &key), cancel.clone()),
        Err(SyncError::HttpsNeedsTls { .. })
    ));
    let mut config = SyncConfig::new(&url, &key);
    config.tls = Some(Arc::clone(&client));
    let handle = sync::spawn(config, cancel.clone()).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), handle.wait_synced())
        .await
        .expect("the sync client never synced over https");
    assert!(handle.is_synced());
    cancel.cancel();
    t.stop().await;
}
