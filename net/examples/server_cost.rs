//! The native HTTP/1 server (`listener::serve_native`, `h1::conn`) against hyper
//! (`listener::serve_with`: hyper's HTTP/1 through `framing::H1Guard`), the crate it replaces,
//! with the same trivial handler (a 64-byte answer), on one current-thread runtime as
//! `faden gateway --worker-threads 1` runs. The figures the native server is kept for:
//! docs/performance.md.
//!
//! - `serve native|hyper [--exit-after N]` listens on 127.0.0.1 (an ephemeral port, printed)
//!   and, with `--exit-after`, shuts down after N requests (for callgrind).
//! - `drive PORT N` sends N GETs one after another on one kept-alive connection.
//! - `idle native|hyper N` starts `serve` in a child process, opens N connections that each
//!   make one request and stay open, and prints the child's resident set growth per connection
//!   (after a warm-up batch, so the runtime and the allocator's first arenas are not counted).
//!
//! ```text
//! cargo build --profile bench -p net --example server_cost
//! target/release/examples/server_cost idle native 5000
//! valgrind --tool=callgrind target/release/examples/server_cost serve native --exit-after 6000
//! ```
//!
//! Both use mimalloc with `no_thp`, as the `faden` binary does.

// A measurement tool: it prints its report and fails loudly.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body_util::Full;
use net::config::ListenerConfig;
use net::listener::{ServeOptions, serve_native, serve_with};
use tokio_util::sync::CancellationToken;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BODY: &[u8] = b"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx";
const REQUEST: &[u8] =
    b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\nuser-agent: server_cost\r\naccept: */*\r\n\r\n";
const WARMUP: usize = 100;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["serve", mode] => serve(mode, None),
        ["serve", mode, "--exit-after", n] => serve(mode, Some(n.parse().unwrap())),
        ["drive", port, n] => drive(port.parse().unwrap(), n.parse().unwrap()),
        ["idle", mode, n] => idle(mode, n.parse().unwrap()),
        _ => panic!(
            "usage: serve native|hyper [--exit-after N] | drive PORT N | idle native|hyper N"
        ),
    }
}

fn serve(mode: &str, exit_after: Option<usize>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{}", listener.local_addr().unwrap().port());
        std::io::stdout().flush().unwrap();
        let config = ListenerConfig {
            drain_timeout: Duration::from_secs(1),
            ..ListenerConfig::default()
        };
        let options = ServeOptions {
            http1_only: true,
            ..ServeOptions::default()
        };
        let shutdown = CancellationToken::new();
        let served = Arc::new(AtomicUsize::new(0));
        let count = {
            let shutdown = shutdown.clone();
            move || {
                if exit_after.is_some_and(|n| served.fetch_add(1, Ordering::Relaxed) + 1 >= n) {
                    shutdown.cancel();
                }
            }
        };
        match mode {
            "native" => {
                let handler = move |_req, _peer| {
                    count();
                    async { Response::new(Full::new(Bytes::from_static(BODY))) }
                };
                serve_native(listener, &config, options, handler, shutdown, || {}).await;
            }
            "hyper" => {
                let handler = move |_req, _peer| {
                    count();
                    async { Response::new(Full::new(Bytes::from_static(BODY))) }
                };
                serve_with(listener, &config, options, handler, shutdown, || {}).await;
            }
            _ => panic!("mode: native or hyper"),
        }
    });
}

/// One request on `stream` and its whole answer (the body length is known: [`BODY`]).
fn exchange(stream: &mut TcpStream, buf: &mut Vec<u8>) {
    stream.write_all(REQUEST).unwrap();
    buf.clear();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).unwrap();
        assert!(n > 0, "the server closed");
        buf.extend_from_slice(&chunk[..n]);
        if let Some(head) = buf.windows(4).position(|w| w == b"\r\n\r\n")
            && buf.len() >= head + 4 + BODY.len()
        {
            return;
        }
    }
}

fn drive(port: u16, n: usize) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_nodelay(true).unwrap();
    let mut buf = Vec::new();
    for _ in 0..n {
        exchange(&mut stream, &mut buf);
    }
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn idle(mode: &str, n: usize) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["serve", mode])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut port = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut port)
        .unwrap();
    let port: u16 = port.trim().parse().unwrap();
    let mut buf = Vec::new();
    let open = |count: usize, conns: &mut Vec<TcpStream>, buf: &mut Vec<u8>| {
        for _ in 0..count {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
            stream.set_nodelay(true).unwrap();
            exchange(&mut stream, buf);
            conns.push(stream);
        }
    };
    let mut conns = Vec::with_capacity(WARMUP + n);
    open(WARMUP, &mut conns, &mut buf);
    std::thread::sleep(Duration::from_secs(1));
    let before = rss_kib(child.id());
    open(n, &mut conns, &mut buf);
    std::thread::sleep(Duration::from_secs(2));
    let after = rss_kib(child.id());
    println!(
        "{mode}: {n} idle keep-alive connections, RSS {before} -> {after} KiB, {:.0} bytes per connection",
        (after - before) as f64 * 1024.0 / n as f64
    );
    drop(conns);
    child.kill().unwrap();
    child.wait().unwrap();
}
