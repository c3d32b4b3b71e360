//! ringmux's system tests share this library: [`harness`], a real ringmux on loopback and what
//! the tests check it with. The tests themselves are one binary, `tests/system`, a module per
//! topic. The clients, temporary folders and tool probes are the test kit's
//! (`ringmux-testkit`), which every crate's own tests may use too.

pub mod harness;
