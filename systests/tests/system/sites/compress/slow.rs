//! Slow readers through compression: curl reading at 20 KiB/s (`--limit-rate`), over HTTP/1.1
//! and HTTP/2, a file of a few hundred KiB and a proxied body, both coded by ringmux on the
//! way; each decodes to its source byte for byte. curl pauses its reads to keep to the rate
//! (the coded file takes several seconds), so what the coder writes waits on the client.

use super::*;

/// The file's size: a few hundred KiB of text that codes to about half.
const FILE_BYTES: usize = 300 * 1024;
/// The proxied body's size.
const TEXT_BYTES: usize = 400 * 1024;

/// Lines of a counter and 32 hex digits from a fixed-seed generator: text a coder halves, not
/// one it shrinks to nothing (so the coded body still takes seconds at the client's rate).
fn half_compressible(n: usize) -> Vec<u8> {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut out = Vec::with_capacity(n + 64);
    let mut line = 0u64;
    while out.len() < n {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let more = seed.wrapping_mul(0x2545_f491_4f6c_dd1d);
        out.extend_from_slice(format!("line {line}: {seed:016x}{more:016x}\n").as_bytes());
        line += 1;
    }
    out.truncate(n);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_get_every_coded_byte() {
    use std::os::unix::fs::PermissionsExt;
    if !tool::CURL.present() {
        return;
    }
    bounded(LIMIT, async {
        let s = Setup::new();
        let big = half_compressible(FILE_BYTES);
        let file = s.dir.path().join("root/big.txt");
        std::fs::write(&file, &big).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let rm = s.start();
        let dir = s.dir.path();
        let text_path = format!("/api/text/{TEXT_BYTES}");
        let text = upstream_text(TEXT_BYTES);
        let mut runs = Vec::new();
        for version in ["--http1.1", "--http2"] {
            for (path, want) in [("/big.txt", &big), (text_path.as_str(), &text)] {
                let rm = &rm;
                runs.push(async move {
                    let args = [version, "--compressed", "--limit-rate", "20k"];
                    (version, path, want, curl(rm, dir, &args, path).await)
                });
            }
        }
        for (version, path, want, got) in futures_util::future::join_all(runs).await {
            let what = format!("{version} {path}");
            assert_eq!(got.status, 200, "{what}");
            let coding = got.header("content-encoding");
            assert!(coding.is_some(), "{what}: not coded: {:?}", got.headers);
            assert_eq!(got.body.len(), want.len(), "{what}: {coding:?}");
            assert!(
                got.body == *want,
                "{what}: {coding:?}: not the source byte for byte"
            );
        }
    })
    .await
}
