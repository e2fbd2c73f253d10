//! One event loop per core, the way nginx and Envoy run: a thread per core, each running its
//! own current-thread tokio runtime, each accepting on its own listening socket of a shared
//! port (`SO_REUSEPORT`, the kernel spreads connections over them), with its own connections,
//! upstream pools and counters. A request is served start to end on the core that accepted
//! its connection: no work stealing, no wake-up of another thread, no cache line written by
//! every core.
//!
//! What the cores share is read far more often than written (the routing snapshot, published
//! to each core as its own copy; the engines' load readings) or written rarely (a failure, a
//! new connection's admission). The management API, the sync client and background work run on
//! the process's other runtime and never delay requests.

use std::io;
use std::net::SocketAddr;
use std::thread::JoinHandle;

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// The request-serving cores of a process.
#[derive(Debug)]
pub struct Cores {
    handles: Vec<Handle>,
    threads: Vec<JoinHandle<()>>,
    /// Ends every core's runtime (after the work spawned on it returned).
    stop: CancellationToken,
}

impl Cores {
    /// Starts `count` cores (at least one), their threads named `name-<i>`.
    pub fn start(count: usize, name: &str) -> io::Result<Self> {
        let stop = CancellationToken::new();
        let mut handles = Vec::new();
        let mut threads = Vec::new();
        for i in 0..count.max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            handles.push(runtime.handle().clone());
            let stop = stop.clone();
            let thread = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    // The runtime runs what is spawned on it while this waits.
                    runtime.block_on(stop.cancelled());
                    // Tasks still there (none, after a graceful stop) are dropped here.
                    drop(runtime);
                })?;
            threads.push(thread);
        }
        Ok(Self {
            handles,
            threads,
            stop,
        })
    }

    /// The number of cores.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// The runtime of core `i`.
    pub fn handle(&self, i: usize) -> &Handle {
        &self.handles[i % self.handles.len()]
    }

    /// Runs `work(i)` on each core `i`; the handles resolve when each has returned.
    pub fn spawn_each<F, Fut>(&self, work: F) -> Vec<tokio::task::JoinHandle<Fut::Output>>
    where
        F: Fn(usize) -> Fut,
        Fut: std::future::Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        self.handles
            .iter()
            .enumerate()
            // Ends when `work` does; the caller holds the handle.
            .map(|(i, handle)| handle.spawn(work(i)))
            .collect()
    }

    /// Runs `work(i, item)` on core `i` for each of `items` (one per core: the `i`-th item on
    /// core `i`; items beyond the cores are dropped).
    pub fn spawn_with<T, F, Fut>(
        &self,
        items: Vec<T>,
        work: F,
    ) -> Vec<tokio::task::JoinHandle<Fut::Output>>
    where
        F: Fn(usize, T) -> Fut,
        Fut: std::future::Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        self.handles
            .iter()
            .zip(items)
            .enumerate()
            // Ends when `work` does; the caller holds the handle.
            .map(|(i, (handle, item))| handle.spawn(work(i, item)))
            .collect()
    }

    /// Stops the cores' runtimes and waits for their threads. Work still running on them is
    /// dropped: stop it first.
    pub fn shutdown(mut self) {
        self.stop.cancel();
        for thread in std::mem::take(&mut self.threads) {
            let _ = thread.join();
        }
    }
}

impl Drop for Cores {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Binds `count` listening sockets to `addr` with `SO_REUSEPORT`, so that each core accepts on
/// its own (the kernel spreads new connections over them by their address hash). Port 0 is
/// resolved once: every socket gets the port the first one was given.
pub fn bind_reuseport(addr: SocketAddr, count: usize) -> io::Result<Vec<std::net::TcpListener>> {
    let mut addr = addr;
    let mut listeners = Vec::with_capacity(count.max(1));
    for _ in 0..count.max(1) {
        let socket = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )?;
        socket.set_reuse_address(true)?;
        socket.set_reuse_port(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        let listener: std::net::TcpListener = socket.into();
        addr = listener.local_addr()?;
        listeners.push(listener);
    }
    Ok(listeners)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_core_runs_its_own_work_on_its_own_thread() {
        let cores = Cores::start(3, "test-core").unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let names = rt.block_on(async {
            let mut names = Vec::new();
            for handle in cores.spawn_each(|i| async move {
                (i, std::thread::current().name().unwrap_or("").to_owned())
            }) {
                names.push(handle.await.unwrap());
            }
            names
        });
        assert_eq!(
            names,
            (0..3)
                .map(|i| (i, format!("test-core-{i}")))
                .collect::<Vec<_>>()
        );
        cores.shutdown();
    }

    #[test]
    fn sockets_of_one_port_share_it() {
        let listeners = bind_reuseport("127.0.0.1:0".parse().unwrap(), 3).unwrap();
        let ports: Vec<u16> = listeners
            .iter()
            .map(|l| l.local_addr().unwrap().port())
            .collect();
        assert!(ports.iter().all(|p| *p == ports[0] && *p != 0), "{ports:?}");
        // Every connection lands on one of them.
        let _client = std::net::TcpStream::connect(listeners[0].local_addr().unwrap()).unwrap();
    }
}
