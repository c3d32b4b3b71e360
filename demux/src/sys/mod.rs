//! Every system call of the demux outside quinn-udp and the ring crate, each wrapped once, on
//! `nix` where it has a wrapper, one file per topic: `sockets.rs`, waiting (`poll.rs`),
//! `signals.rs`, `files.rs` and pipes, `process.rs`, starting a worker (`spawn.rs`), confining
//! it and the demux (`confine.rs`), and the counting allocator ([`alloc`]). The unsafe of the
//! demux lives here, in `spawn.rs` and `alloc.rs` alone, the only modules of the crate allowed
//! it; the rest of the crate calls these safe functions through the re-exports below.
//!
//! This module imports nothing of the crate above it: what it needs from the rest (the
//! workers' system-call filter) arrives compiled, as plain data ([`SyscallFilter`]).
//!
//! Kinds of error that escape: each function returns `io::Result`; `EINTR` is retried inside,
//! `WouldBlock` escapes from the non-blocking ones (named so), everything else as the kernel
//! said it.

use std::io;

use nix::errno::Errno;

#[allow(unsafe_code)]
pub mod alloc;
mod confine;
mod files;
mod poll;
mod process;
mod signals;
mod sockets;
#[allow(unsafe_code)]
mod spawn;

pub use confine::{
    harden_demux, landlock_abi, landlock_gaps, make_non_dumpable, may_drop_bounding_set,
    may_switch_user, worker_domain, FsAccess, SyscallFilter, WorkerDomain,
};
pub use files::{
    log_pipe, pseudo_file_system, read_operator_file, read_operator_text, read_some, sealed_memfd,
    write_all_or_fail, OperatorFile, MAX_CONFIG_FILE, MAX_PEM_FILE,
};
pub use poll::{
    clear_wake, poll_readable, poll_which, wait_readable, wait_writable, wake, wake_fd,
};
pub use process::{children, kill_and_reap, pidfd_open, pin_to_cpu, set_timer_slack, ChildProcess};
pub use signals::{block_all_signals, read_signal, shutdown_signals, signal_fd};
pub use sockets::{
    attach_reuseport_program, force_buffer, is_disconnect, lock_filter, queued_bytes, recv_packet,
    send_iov, send_packet, send_with_fds, sending_socket, seqpacket_pair, shut_down, size_buffers,
    switch_off, tcp_listener, udp_socket, RecvCmsg, NEVER_STEER_PROGRAM,
};
pub use spawn::{prepare_worker, WorkerSetup};

/// Runs `f` again while it fails with `EINTR`.
fn retry<T>(mut f: impl FnMut() -> nix::Result<T>) -> io::Result<T> {
    loop {
        match f() {
            Err(Errno::EINTR) => continue,
            r => return r.map_err(io::Error::from),
        }
    }
}
