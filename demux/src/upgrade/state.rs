//! The hand-over's document: everything a new process image takes over, written by the old
//! image into a memfd as JSON. Its descriptors are [`Fds`], by number here; taking them
//! ([`State::take`]) gives the same document with the descriptors owned, nothing else changed.

use std::os::fd::{OwnedFd, RawFd};

use ringmux_proto::sites::SiteTable;
use serde::{Deserialize, Serialize};

use super::fds::Fds;
use super::{Compat, Refusal};
use crate::metrics::counters::CounterSnapshot;
use crate::sessions::SessionEntry;

/// Everything a new image takes over, its descriptors held as `F`: numbers in the document
/// (open in the new image, their close-on-exec flag cleared by the old one), owned once taken.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct State<F> {
    pub compat: Compat,
    /// `--forward` of the old image: the new one must run the same mode.
    pub forward: String,
    pub instances: u8,
    /// The shared keys (`KeySet::to_bytes`), hex.
    pub keys: String,
    /// The site table, certificates and keys included: in the document its JSON as a string
    /// (`sites_as_json_text`), as every image of format 4 wrote it.
    #[serde(with = "sites_as_json_text")]
    pub sites: SiteTable,
    /// Every descriptor, by name (`public_fd`, `lanes`, …: at the document's top level).
    #[serde(flatten)]
    pub fds: Fds<F>,
    pub active_generation: u64,
    pub counters: CounterSnapshot,
    pub sessions: Vec<SessionEntry>,
    /// When the old image received its last datagram (`CLOCK_MONOTONIC`, ns): the new one
    /// measures the hand-over's pause from it.
    pub last_recv_ns: u64,
    /// The old image's command line, byte for byte: what an image going back to the old binary
    /// runs it with (the new binary may have been a wrapper that changed its own).
    pub argv: Vec<Vec<u8>>,
    /// Where the `ringmux` binary is on disk, bytes: what the next upgrade executes (an image
    /// that went back to the old binary runs a deleted file, whose path says so).
    pub binary: Vec<u8>,
}

impl State<RawFd> {
    /// Every descriptor number the state names.
    pub fn fds(&self) -> Vec<RawFd> {
        self.fds.numbers()
    }

    /// Checks what a new image can check before it touches a descriptor: the format, the mode
    /// and instances it runs, and that every descriptor is open and named once.
    pub fn check(&self, forward: &str, instances: u8) -> Result<(), Refusal> {
        if let Some(why) = self.compat.refusal(&Compat::ours()) {
            return Err(why.into());
        }
        if self.forward != forward || self.instances != instances {
            return Err(Refusal::OtherConfiguration {
                running_forward: self.forward.clone(),
                running_instances: self.instances,
                forward: forward.to_string(),
                instances,
            });
        }
        let lanes = usize::from(instances) * usize::from(ringmux_proto::GENERATION_SLOTS);
        if self.fds.lanes.len() != lanes {
            return Err(Refusal::LaneCount {
                lanes: self.fds.lanes.len(),
                instances,
            });
        }
        let mut fds = self.fds();
        fds.sort_unstable();
        if let Some(w) = fds.windows(2).find(|w| w[0] == w[1]) {
            return Err(Refusal::NamedTwice { fd: w[0] });
        }
        for fd in fds {
            if fd < 3 || !ringmux_inherit::is_open(fd) {
                return Err(Refusal::NotOpen { fd });
            }
        }
        Ok(())
    }

    /// [`State::check`]s the state, then takes every descriptor it names (each close-on-exec
    /// again). On an error nothing was taken.
    pub fn take(self, forward: &str, instances: u8) -> Result<State<OwnedFd>, Refusal> {
        self.check(forward, instances)?;
        let fds = self.fds.try_map(|fd| {
            ringmux_inherit::adopt(fd, true).map_err(|e| Refusal::Untakeable {
                fd,
                source: e.into(),
            })
        })?;
        Ok(State {
            compat: self.compat,
            forward: self.forward,
            instances: self.instances,
            keys: self.keys,
            sites: self.sites,
            fds,
            active_generation: self.active_generation,
            counters: self.counters,
            sessions: self.sessions,
            last_recv_ns: self.last_recv_ns,
            argv: self.argv,
            binary: self.binary,
        })
    }
}

/// The site table in the document: its JSON ([`SiteTable::to_json`]) as a string, read back
/// with [`SiteTable::from_json`]'s checks. The table stays typed everywhere else; this string
/// is the shape every image of state format 4 writes and reads, so that images before and
/// after the table was typed hand over to each other.
mod sites_as_json_text {
    use ringmux_proto::sites::SiteTable;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(table: &SiteTable, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&table.to_json())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SiteTable, D::Error> {
        let text = String::deserialize(d)?;
        SiteTable::from_json(text.as_bytes()).map_err(serde::de::Error::custom)
    }
}
