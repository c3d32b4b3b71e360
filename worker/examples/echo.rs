//! A raw quinn application behind ringmux: ALPN `echo`, every bidirectional stream is echoed
//! back. Run it as ringmux's instances:
//!
//! ```text
//! cargo build --release --examples
//! target/release/ringmux --worker-cmd target/release/examples/echo
//! ```

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
        loop {
            let incoming = tokio::select! {
                i = endpoint.accept() => i,
                _ = drain.wait() => None,
            };
            let Some(incoming) = incoming else { break };
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    tokio::spawn(async move {
                        if tokio::io::copy(&mut recv, &mut send).await.is_ok() {
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
