//! Idle memory per tunnel, measured on both ends.
//!
//! The server end runs in this process: the management API listener of `faden server`
//! (`control::server::serve`) with the tunnel's `/connect` merged in, worker tokens checked by a
//! closure (`tok-<n>` is worker `n`) instead of the store. The worker end runs in a child
//! process (this binary with `client`), holding every tunnel client. Both use mimalloc with the
//! `no_thp` feature, as the `faden` binary does.
//!
//! After a warm-up batch of tunnels (one-time costs: runtime, first connection, allocator
//! arenas) the resident set of both processes is read (`VmRSS`); then `--tunnels` more tunnels
//! connect and sit idle for `--settle`, and the resident sets are read again. The difference
//! divided by the count is the idle cost of one tunnel on each end. With `--traffic BYTES`, each
//! tunnel then carries one echo of that many bytes each way (buffers grow under load), sits idle
//! again, and the resident sets are read a third time: what an idle tunnel keeps after load.
//!
//! ```text
//! cargo run --release -p tunnel --example idle_tunnels -- --tunnels 1000 --traffic 262144
//! cargo run --release -p tunnel --example idle_tunnels -- --tunnels 1000 --tls
//! ```

// A measurement tool: it prints its report and fails loudly.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::io::{BufRead as _, Write as _};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use control::admission::{AuthLimiter, PendingLimits};
use control::server::ListenerLimits;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tunnel::mux::TunnelStream;
use tunnel::{TunnelClient, TunnelClientConfig, TunnelServer, TunnelServerConfig, WorkerIdentity};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const WARMUP: usize = 32;
/// Tunnels connecting at once (the server caps pending handshakes).
const BATCH: usize = 100;

#[derive(Clone, Debug)]
struct Options {
    tunnels: usize,
    traffic: usize,
    settle: Duration,
    tls: bool,
}

fn parse_options(args: &[String]) -> Options {
    let mut options = Options {
        tunnels: 1000,
        traffic: 0,
        settle: Duration::from_secs(2),
        tls: false,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().expect("a value after the flag").clone();
        match arg.as_str() {
            "--tunnels" => options.tunnels = value().parse().expect("--tunnels N"),
            "--traffic" => options.traffic = value().parse().expect("--traffic BYTES"),
            "--settle" => {
                options.settle = Duration::from_secs_f64(value().parse().expect("--settle SECONDS"))
            }
            "--tls" => options.tls = true,
            other => panic!(
                "unknown argument {other:?}; usage: idle_tunnels [--tunnels N] [--traffic BYTES] [--settle SECONDS] [--tls]"
            ),
        }
    }
    options
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    if args.first().map(String::as_str) == Some("client") {
        runtime.block_on(client(&args[1..]));
    } else {
        runtime.block_on(server(parse_options(&args)));
    }
}

/// The worker end: reads `open URL FIRST COUNT` lines on stdin, starts that many tunnel clients
/// (`tok-FIRST` ...) and answers `up` once all of them are connected. Each stream is echoed.
async fn client(args: &[String]) {
    let ca = args
        .first()
        .filter(|a| !a.is_empty())
        .map(|path| tunnel::tls::client_config(&std::fs::read(path).unwrap()).unwrap());
    let shutdown = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    let mut lines = std::io::stdin().lock().lines();
    while let Some(Ok(line)) = tokio::task::block_in_place(|| lines.next()) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let ["open", url, first, count] = words[..] else {
            break;
        };
        let (first, count): (usize, usize) = (first.parse().unwrap(), count.parse().unwrap());
        let mut statuses = Vec::new();
        for worker in first..first + count {
            let mut config = TunnelClientConfig::new(url, format!("tok-{worker}"));
            config.tls = ca.clone();
            config.backoff_min = Duration::from_millis(50);
            config.backoff_max = Duration::from_millis(500);
            let client = TunnelClient::new(config).unwrap();
            statuses.push(client.status());
            let shutdown = shutdown.clone();
            tasks.spawn(async move { client.run(shutdown, echo).await });
        }
        for mut status in statuses {
            tokio::time::timeout(Duration::from_secs(30), status.wait_for(|s| s.connected))
                .await
                .expect("a tunnel did not come up within 30 s")
                .unwrap();
        }
        println!("up");
        std::io::stdout().flush().unwrap();
    }
    shutdown.cancel();
    while tasks.join_next().await.is_some() {}
}

/// The worker's stream handler: reads until the server's FIN, then sends it all back.
async fn echo(mut stream: TunnelStream) {
    let mut data = Vec::new();
    if stream.read_to_end(&mut data).await.is_ok() {
        let _ = stream.write_all(&data).await;
        let _ = stream.shutdown().await;
    }
}

struct Child {
    process: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl Child {
    async fn open(&mut self, url: &str, first: usize, count: usize) {
        writeln!(self.stdin, "open {url} {first} {count}").unwrap();
        self.stdin.flush().unwrap();
        // Lines other than `up` (from a wrapper such as a profiler) are skipped.
        loop {
            let line = tokio::task::block_in_place(|| self.stdout.next())
                .expect("the client process ended")
                .unwrap();
            if line == "up" {
                break;
            }
        }
    }
}

async fn server(options: Options) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = TunnelServerConfig {
        max_pending_handshakes: BATCH * 2,
        max_pending_per_ip: 0,
        ..TunnelServerConfig::default()
    };
    let tunnels = TunnelServer::builder(config, |token: String| async move {
        let worker_id = token.strip_prefix("tok-")?.parse().ok()?;
        Some(WorkerIdentity {
            worker_id,
            cluster_id: 1,
        })
    })
    .build();
    let shutdown = CancellationToken::new();
    let limits = ListenerLimits {
        pending: PendingLimits {
            max_pending: BATCH * 2,
            max_pending_per_source: 0,
        },
        ..ListenerLimits::default()
    };
    let pem = testkit::certs::PemDir::new();
    let (tls, ca_path) = if options.tls {
        let ca = testkit::certs::TestCa::new("idle_tunnels");
        let config = testkit::certs::server_config(&ca.server_cert(), None, &[b"http/1.1"]);
        let ca_path = pem.write_ca("ca", &ca);
        (
            Some(tokio_rustls::TlsAcceptor::from(config)),
            ca_path.display().to_string(),
        )
    } else {
        (None, String::new())
    };
    let serve = tokio::spawn(control::server::serve(
        listener,
        tunnels.router(),
        shutdown.clone(),
        Duration::from_secs(1),
        limits,
        Arc::new(AuthLimiter::default()),
        tls,
    ));
    let url = format!(
        "{}://127.0.0.1:{}",
        if options.tls { "https" } else { "http" },
        addr.port()
    );

    let mut process = Command::new(std::env::current_exe().unwrap())
        .args(["client", &ca_path])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdin = process.stdin.take().unwrap();
    let stdout = std::io::BufReader::new(process.stdout.take().unwrap()).lines();
    let mut child = Child {
        process,
        stdin,
        stdout,
    };
    let child_pid = child.process.id();
    let server_pid = std::process::id();

    child.open(&url, 1, WARMUP).await;
    wait_connected(&tunnels, WARMUP).await;
    tokio::time::sleep(options.settle).await;
    let (s0, c0) = (rss_kib(server_pid), rss_kib(child_pid));

    let n = options.tunnels;
    let mut opened = 0;
    while opened < n {
        let count = BATCH.min(n - opened);
        child.open(&url, WARMUP + 1 + opened, count).await;
        opened += count;
    }
    wait_connected(&tunnels, WARMUP + n).await;
    tokio::time::sleep(options.settle).await;
    let (s1, c1) = (rss_kib(server_pid), rss_kib(child_pid));

    let per = |before: u64, after: u64| (after as f64 - before as f64) / n as f64;
    println!(
        "idle_tunnels: {n} tunnels over {} (after {WARMUP} warm-up tunnels), settle {:?}",
        if options.tls { "wss" } else { "ws" },
        options.settle
    );
    println!(
        "  server RSS {s0} -> {s1} KiB: {:.1} KiB per tunnel",
        per(s0, s1)
    );
    println!(
        "  worker RSS {c0} -> {c1} KiB: {:.1} KiB per tunnel",
        per(c0, c1)
    );

    if options.traffic > 0 {
        traffic(&tunnels, WARMUP + 1, n, options.traffic).await;
        tokio::time::sleep(options.settle).await;
        let (s2, c2) = (rss_kib(server_pid), rss_kib(child_pid));
        println!(
            "  after one {}-byte echo on each tunnel, idle again: server {s2} KiB ({:.1} KiB per tunnel), worker {c2} KiB ({:.1} KiB per tunnel)",
            options.traffic,
            per(s0, s2),
            per(c0, c2)
        );
    }

    drop(child.stdin);
    let _ = tokio::task::block_in_place(|| child.process.wait());
    shutdown.cancel();
    tunnels.shutdown().await;
    let _ = serve.await;
}

async fn wait_connected(tunnels: &TunnelServer, n: usize) {
    tokio::time::timeout(Duration::from_secs(30), async {
        while tunnels.connected().len() < n {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the server did not see every tunnel within 30 s");
}

/// One echo of `bytes` bytes on each of `count` tunnels from worker `first` on, 64 at a time.
async fn traffic(tunnels: &TunnelServer, first: usize, count: usize, bytes: usize) {
    let payload = Arc::new(vec![0x5au8; bytes]);
    let mut set = tokio::task::JoinSet::new();
    for worker in first..first + count {
        if set.len() >= 64 {
            set.join_next().await.unwrap().unwrap();
        }
        let (tunnels, payload) = (tunnels.clone(), payload.clone());
        set.spawn(async move {
            let mut stream = tunnels.open_stream(worker as i64).await.unwrap();
            let (mut read, mut write) = tokio::io::split(&mut stream);
            let send = async {
                write.write_all(&payload).await.unwrap();
                write.shutdown().await.unwrap();
            };
            let mut back = Vec::with_capacity(payload.len());
            let receive = read.read_to_end(&mut back);
            let ((), received) = tokio::join!(send, receive);
            assert_eq!(received.unwrap(), payload.len());
        });
    }
    while let Some(done) = set.join_next().await {
        done.unwrap();
    }
}
