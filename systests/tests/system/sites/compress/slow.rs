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

/// The site with `/big.txt`, `n` bytes of [`half_compressible`] text, and ringmux serving it.
fn start_with_big_file(n: usize) -> (Setup, Vec<u8>, Ringmux) {
    use std::os::unix::fs::PermissionsExt;
    let s = Setup::new();
    let big = half_compressible(n);
    let file = s.dir.path().join("root/big.txt");
    std::fs::write(&file, &big).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let rm = s.start();
    (s, big, rm)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_get_every_coded_byte() {
    if !tool::CURL.present() {
        return;
    }
    bounded(LIMIT, async {
        let (s, big, rm) = start_with_big_file(FILE_BYTES);
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

/// The file over HTTP/3.
const H3_FILE_BYTES: usize = 2 << 20;
/// The proxied body over HTTP/3.
const H3_TEXT_BYTES: usize = 4 << 20;
/// What the client reads per second of each body, coded.
const H3_RATE: u64 = 256 << 10;
/// The client's receive window per stream: the worker may send no further ahead than this.
const H3_WINDOW: u32 = 64 << 10;

/// Over HTTP/3, with the house's client reading at [`H3_RATE`] through a window of
/// [`H3_WINDOW`] (h3 has no `--limit-rate`): a file and a proxied body, both coded in br on the
/// way, decode to their sources byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_http3_readers_get_every_coded_byte() {
    use ringmux_testkit::client::{client_config, with_receive_window, H3Client};
    bounded(LIMIT, async {
        let (_s, big, rm) = start_with_big_file(H3_FILE_BYTES);
        let config = with_receive_window(client_config(None).unwrap(), H3_WINDOW);
        let client = H3Client::new(config, rm.listen).unwrap();
        let conn = client.connect(rm.listen, "c.test").await.unwrap();
        let text_path = format!("/api/text/{H3_TEXT_BYTES}");
        let reads = ["/big.txt", text_path.as_str()].map(|path| {
            let request = http::Request::get(path)
                .header("accept-encoding", "br")
                .body(())
                .unwrap();
            let conn = &conn;
            async move {
                let r = conn.start_request(request).await.expect("GET");
                let coding = r.headers().get("content-encoding").cloned();
                let got = r.read_body_at(H3_RATE, true).await.expect("the body");
                (path, coding, got)
            }
        });
        let text = upstream_text(H3_TEXT_BYTES);
        for (path, coding, got) in futures_util::future::join_all(reads).await {
            let want = if path == "/big.txt" { &big } else { &text };
            assert_eq!(got.status, 200, "{path}");
            let coding = coding.map(|c| c.to_str().unwrap().to_owned());
            assert_eq!(coding.as_deref(), Some("br"), "{path}: {:?}", got.headers);
            let body = got.body.expect("kept");
            assert!(body.len() < want.len(), "{path}: coded smaller");
            assert!(
                decode(coding.as_deref(), &body) == *want,
                "{path}: not the source byte for byte"
            );
        }
    })
    .await
}
