//! The clients that call the management server: its URLs (`--server-url`) and their TLS
//! (`--server-ca`).

use anyhow::Context as _;

/// One `--server-url` entry: an `http(s)://host[:port][/prefix]` URL (a clap value parser: a
/// bad entry of a list is refused by name).
pub fn parse_server_url(text: &str) -> Result<String, String> {
    // clap names the value itself: "invalid value 'x' for '--server-url <URL>': …".
    let bad = |reason: &str| format!("not a server URL like http://server:30080: {reason}");
    let url = text.trim();
    if url.is_empty() {
        return Err(bad("empty (a stray comma?)"));
    }
    let uri: http::Uri = url.parse().map_err(|_| bad("it cannot be parsed"))?;
    match uri.scheme_str() {
        Some(s) if s.eq_ignore_ascii_case("http") || s.eq_ignore_ascii_case("https") => {}
        Some(_) => return Err(bad("the scheme must be http or https")),
        None => return Err(bad("missing http:// or https://")),
    }
    match uri.authority() {
        None => return Err(bad("missing host")),
        Some(a) if a.as_str().contains('@') => {
            return Err(bad("credentials in the URL are not supported"));
        }
        Some(_) => {}
    }
    if uri.query().is_some() {
        return Err(bad("a query string is not supported"));
    }
    Ok(url.to_owned())
}

/// TLS settings for the clients of the management API at `server_urls`: when any is `https`,
/// the `ca` bundle (`--server-ca`) or else the platform's root certificates, for all of them;
/// `None` when all are `http`.
pub fn server_tls(
    server_urls: &[String],
    ca: Option<&std::path::Path>,
) -> anyhow::Result<Option<std::sync::Arc<rustls::ClientConfig>>> {
    let mut tls = None;
    if let Some(secure) = server_urls.iter().find(|u| is_https(u)) {
        tls = control_client::tls::for_server_url(secure, ca)
            .context("the server's TLS settings (--server-ca)")?;
    }
    if tls.is_none() && ca.is_some() {
        tracing::warn!("--server-ca is not used: no server URL is https");
    }
    Ok(tls)
}

fn is_https(url: &str) -> bool {
    url.trim()
        .get(..8)
        .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_urls_are_checked() {
        for ok in [
            "http://server:30080",
            " https://10.0.0.1/faden/ ",
            "HTTP://[::1]:1",
        ] {
            assert_eq!(parse_server_url(ok).as_deref(), Ok(ok.trim()), "{ok}");
        }
        for bad in [
            "",
            "server:30080",
            "ftp://server",
            "http://",
            "http://u:p@s",
            "http://s/?a=1",
        ] {
            assert!(parse_server_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tls_is_built_when_any_url_is_https() {
        let urls = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let pem = testkit::certs::PemDir::new();
        let ca = pem.write_ca("ca", &testkit::certs::TestCa::new("test ca"));
        let plain = urls(&["http://a:1", "http://b:1"]);
        assert!(server_tls(&plain, Some(&ca)).unwrap().is_none());
        let mixed = urls(&["http://a:1", "https://b:1"]);
        assert!(server_tls(&mixed, Some(&ca)).unwrap().is_some());
    }
}
