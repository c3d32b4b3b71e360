//! A raw quinn application behind ringmux: ALPN `echo`, every bidirectional stream is echoed
//! back. Run it as ringmux's instances:
//!
//! ```text
//! cargo build --release --examples
//! target/release/ringmux --worker-cmd target/release/examples/echo
//! ```
//!
//! It counts the bytes it echoes with counters of its own ([`Worker::counter`]), which ringmux
//! exposes with no change of its own as `ringmux_worker_echo_bytes_total{instance="0",
//! direction="in"}` (and `"out"`), and the streams as `ringmux_worker_echo_streams_total`.

use ringmux_worker::Worker;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let worker = Worker::attach()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let tls = worker.tls_config(&[b"echo"])?;
        let endpoint = worker.endpoint(worker.server_config(tls)?)?;
        let mut drain = worker.drain_signal();
        let bytes_in = worker.counter("echo_bytes", &[("direction", "in")])?;
        let bytes_out = worker.counter("echo_bytes", &[("direction", "out")])?;
        let streams = worker.counter("echo_streams", &[])?;
        loop {
            let incoming = tokio::select! {
                i = endpoint.accept() => i,
                _ = drain.wait() => None,
            };
            let Some(incoming) = incoming else { break };
            let (bytes_in, bytes_out, streams) =
                (bytes_in.clone(), bytes_out.clone(), streams.clone());
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    streams.inc();
                    let (bytes_in, bytes_out) = (bytes_in.clone(), bytes_out.clone());
                    tokio::spawn(async move {
                        // What was read was written: copy returns once both are done.
                        if let Ok(n) = tokio::io::copy(&mut recv, &mut send).await {
                            bytes_in.add(n);
                            bytes_out.add(n);
                            let _ = send.finish();
                        }
                    });
                }
            });
        }
        // Draining: refuse new connections, let the open ones finish.
        endpoint.set_server_config(None);
        endpoint.wait_idle().await;
        Ok(())
    })
}
