//! What one write of a proxied request costs on loopback TCP, by system call: the parts of a
//! small answer (a 150-byte head, a 330-byte body, a 2-byte chunk end) handed to `writev(2)`
//! as they lie, against the same bytes copied into one buffer and sent with `send(2)`: the
//! choice behind `h1::write::GATHER_MAX`. A reader thread drains the far end. The writer's
//! time includes the loopback delivery that the kernel runs in the sender's context, as in
//! the gateway.

// Benchmark setup: failing loudly is right.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};

use criterion::{Criterion, criterion_group, criterion_main};

fn writes(c: &mut Criterion) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = vec![0u8; 1 << 20];
        while s.read(&mut buf).is_ok_and(|n| n > 0) {}
    });
    let mut w = TcpStream::connect(addr).unwrap();
    w.set_nodelay(true).unwrap();
    let head = vec![b'h'; 150];
    let body = vec![b'b'; 330];
    let tail = b"\r\n".to_vec();
    let total = head.len() + body.len() + tail.len();
    let mut group = c.benchmark_group("write_480_bytes");
    group.bench_function("writev_three_parts", |b| {
        b.iter(|| {
            let parts = [
                IoSlice::new(&head),
                IoSlice::new(&body),
                IoSlice::new(&tail),
            ];
            assert_eq!(w.write_vectored(&parts).unwrap(), total);
        });
    });
    let mut gathered = Vec::with_capacity(4096);
    group.bench_function("copy_then_send", |b| {
        b.iter(|| {
            gathered.clear();
            gathered.extend_from_slice(&head);
            gathered.extend_from_slice(&body);
            gathered.extend_from_slice(&tail);
            assert_eq!(w.write(&gathered).unwrap(), total);
        });
    });
    group.finish();
    drop(w);
    reader.join().unwrap();
}

criterion_group!(benches, writes);
criterion_main!(benches);
