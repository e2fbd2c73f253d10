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
//! Both ends of the echo stream it through small buffers (the worker echoes as it reads, the
//! server counts what comes back), so the harness itself holds no per-echo buffer of the
//! payload's size whose freed memory the allocator might not have returned yet.
//! The echo phase's duration is printed too (a bulk throughput figure across many tunnels).
//!
//! ```text
//! cargo run --release -p tunnel --example idle_tunnels -- --tunnels 1000 --traffic 262144
//! cargo run --release -p tunnel --example idle_tunnels -- --tunnels 1000 --tls
//! ```
//!
//! To see which allocations an idle tunnel holds, build with the system allocator
//! (`--features system-alloc`), run both ends under a heap profiler (the worker through
//! `IDLE_TUNNELS_CLIENT_WRAPPER`, e.g. `heaptrack -o /tmp/worker`) with `--hold`, and once it
//! prints `holding`, stop the worker (`kill -STOP`), then `kill -9` the server and the worker:
//! what was live at that moment shows as leaked (killing one end first would let the other
//! close its tunnels and free them).

// A measurement tool: it prints its report and fails loudly.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

#[path = "../tests/common/connect.rs"]
mod connect;

use std::io::{BufRead as _, Write as _};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use control::server::ListenerLimits;
use net::admission::{AuthLimiter, PendingLimits};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tunnel::mux::TunnelStream;
use tunnel::{TunnelClient, TunnelClientConfig, TunnelServer, TunnelServerConfig, WorkerIdentity};

#[cfg(not(feature = "system-alloc"))]
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
    hold: bool,
}

fn parse_options(args: &[String]) -> Options {
    let mut options = Options {
        tunnels: 1000,
        traffic: 0,
        settle: Duration::from_secs(2),
        tls: false,
        hold: false,
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
            "--hold" => options.hold = true,
            other => panic!(
                "unknown argument {other:?}; usage: idle_tunnels [--tunnels N] [--traffic BYTES] [--settle SECONDS] [--tls] [--hold]"
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

/// The worker end: says its pid, reads `open URL FIRST COUNT` lines on stdin, starts that many
/// tunnel clients (`tok-FIRST` ...) and answers `up` once all of them are connected. Each
/// stream is echoed.
async fn client(args: &[String]) {
    println!("pid {}", std::process::id());
    std::io::stdout().flush().unwrap();
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

/// The worker's stream handler: sends back what it reads as it reads it (through a small
/// buffer, so that the harness keeps no large buffer of its own), then the FIN.
async fn echo(stream: TunnelStream) {
    let (mut read, mut write) = tokio::io::split(stream);
    if tokio::io::copy(&mut read, &mut write).await.is_ok() {
        let _ = write.shutdown().await;
    }
}

struct Child {
    process: std::process::Child,
    /// The worker's own pid (not a wrapper's).
    pid: u32,
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
            if let Some(pid) = line.strip_prefix("pid ") {
                self.pid = pid.parse().unwrap();
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
        connect::connect_router(&tunnels),
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

    // A wrapper (a profiler) for the worker process, if asked for.
    let wrapper = std::env::var("IDLE_TUNNELS_CLIENT_WRAPPER").unwrap_or_default();
    let mut words = wrapper.split_whitespace();
    let exe = std::env::current_exe().unwrap();
    let mut command = match words.next() {
        Some(program) => {
            let mut command = Command::new(program);
            command.args(words).arg(&exe);
            command
        }
        None => Command::new(&exe),
    };
    let mut process = command
        .args(["client", &ca_path])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdin = process.stdin.take().unwrap();
    let stdout = std::io::BufReader::new(process.stdout.take().unwrap()).lines();
    let pid = process.id();
    let mut child = Child {
        process,
        pid,
        stdin,
        stdout,
    };
    let server_pid = std::process::id();

    child.open(&url, 1, WARMUP).await;
    let child_pid = child.pid;
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
        let started = std::time::Instant::now();
        traffic(&tunnels, WARMUP + 1, n, options.traffic).await;
        let took = started.elapsed();
        let mib = (n * options.traffic) as f64 / f64::from(1 << 20);
        println!(
            "  echo phase: {mib:.0} MiB each way in {:.2} s ({:.0} MiB/s each way)",
            took.as_secs_f64(),
            mib / took.as_secs_f64()
        );
        tokio::time::sleep(options.settle).await;
        let (s2, c2) = (rss_kib(server_pid), rss_kib(child_pid));
        println!(
            "  after one {}-byte echo on each tunnel, idle again: server {s2} KiB ({:.1} KiB per tunnel), worker {c2} KiB ({:.1} KiB per tunnel)",
            options.traffic,
            per(s0, s2),
            per(c0, c2)
        );
    }
    if options.hold {
        println!("holding: server pid {server_pid}, worker pid {child_pid}");
        std::io::stdout().flush().unwrap();
        std::future::pending::<()>().await;
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
            // Counted through a small buffer, not collected: what stays in the process after
            // the echo is then the tunnels', not the harness's.
            let receive = async {
                let mut buf = vec![0u8; 16 * 1024];
                let mut received = 0;
                loop {
                    match read.read(&mut buf).await.unwrap() {
                        0 => break received,
                        n => received += n,
                    }
                }
            };
            let ((), received) = tokio::join!(send, receive);
            assert_eq!(received, payload.len());
        });
    }
    while let Some(done) = set.join_next().await {
        done.unwrap();
    }
}
