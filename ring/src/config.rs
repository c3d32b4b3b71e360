//! Ring geometry and tuning: [`RingConfig`], its defaults, its bounds, and the `RINGMUX_*`
//! environment variables that override it. Every bad value is refused with an error that names
//! the variable, the value and the accepted range.

use std::time::Duration;

use crate::layout::DESC_BYTES;

/// Geometry of one ring and the consumer's spin budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingConfig {
    /// Number of slots: a power of two in [`RingConfig::SLOTS_RANGE`].
    pub slots: u32,
    /// Bytes per slot, descriptor included: a multiple of 64 in [`RingConfig::SLOT_BYTES_RANGE`].
    pub slot_bytes: u32,
    /// How long an idle consumer polls the ring before it sleeps on the doorbell, in µs.
    pub spin_us: u32,
}

impl Default for RingConfig {
    /// 4096 slots of 2 KiB (8 MiB a ring): a 64-byte descriptor and up to 1984 payload bytes, more
    /// than the 1500-byte Ethernet MTU; room for about 4 ms of a 1 M datagram/s burst.
    ///
    /// Spin 50 µs: on these virtualised machines a doorbell costs the waker ~11 µs and the sleeper
    /// ~9 µs of CPU and ~28 µs of latency (measured with the C reference forwarder beside
    /// `ring/benches/ring.rs`, bench/RESULTS.md), the price of receiving 25–30
    /// datagrams. A consumer that keeps polling for 50 µs after its ring runs dry rides out the
    /// gaps between receive batches at any load above ~20 k datagrams/s, so doorbells vanish under
    /// load (the reference measured 0.0002 per datagram with ~50 µs), while an idle worker still
    /// goes to sleep within 50 µs and burns no CPU.
    fn default() -> Self {
        RingConfig {
            slots: 4096,
            slot_bytes: 2048,
            spin_us: 50,
        }
    }
}

/// A tuning value outside its accepted range.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{name}={value:?} is not valid: expected {expected}")]
pub struct ConfigError {
    /// The variable or field, e.g. `RINGMUX_RING_SLOTS`.
    pub name: &'static str,
    /// The value as given.
    pub value: String,
    /// The accepted range, in words.
    pub expected: &'static str,
}

impl RingConfig {
    pub const SLOTS_RANGE: (u32, u32) = (4, 1 << 20);
    pub const SLOT_BYTES_RANGE: (u32, u32) = (DESC_BYTES + 1216, DESC_BYTES + 65536);
    pub const SPIN_US_MAX: u32 = 1_000_000;

    const SLOTS_EXPECTED: &'static str = "a power of two from 4 to 1048576";
    const SLOT_BYTES_EXPECTED: &'static str =
        "a multiple of 64 from 1280 (64-byte descriptor + 1216-byte payload, QUIC's 1200-byte minimum with room) to 65600";
    const SPIN_EXPECTED: &'static str = "microseconds from 0 to 1000000";

    /// The defaults, overridden by `RINGMUX_RING_SLOTS`, `RINGMUX_SLOT_BYTES`, `RINGMUX_SPIN_US`.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::default().with_overrides(|name| std::env::var(name).ok())
    }

    /// Applies overrides looked up by variable name (the environment, or a test's map).
    pub fn with_overrides(
        mut self,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        if let Some(v) = lookup("RINGMUX_RING_SLOTS") {
            self.slots = parse_u32("RINGMUX_RING_SLOTS", &v, Self::SLOTS_EXPECTED)?;
        }
        if let Some(v) = lookup("RINGMUX_SLOT_BYTES") {
            self.slot_bytes = parse_u32("RINGMUX_SLOT_BYTES", &v, Self::SLOT_BYTES_EXPECTED)?;
        }
        if let Some(v) = lookup("RINGMUX_SPIN_US") {
            self.spin_us = parse_u32("RINGMUX_SPIN_US", &v, Self::SPIN_EXPECTED)?;
        }
        self.validate()?;
        Ok(self)
    }

    /// Checks every field against its range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let (lo, hi) = Self::SLOTS_RANGE;
        if !self.slots.is_power_of_two() || self.slots < lo || self.slots > hi {
            return Err(err("RINGMUX_RING_SLOTS", self.slots, Self::SLOTS_EXPECTED));
        }
        let (lo, hi) = Self::SLOT_BYTES_RANGE;
        if !self.slot_bytes.is_multiple_of(64) || self.slot_bytes < lo || self.slot_bytes > hi {
            return Err(err(
                "RINGMUX_SLOT_BYTES",
                self.slot_bytes,
                Self::SLOT_BYTES_EXPECTED,
            ));
        }
        if self.spin_us > Self::SPIN_US_MAX {
            return Err(err("RINGMUX_SPIN_US", self.spin_us, Self::SPIN_EXPECTED));
        }
        Ok(())
    }

    /// Largest datagram a slot carries.
    pub fn payload_capacity(&self) -> usize {
        (self.slot_bytes - DESC_BYTES) as usize
    }

    /// The consumer's spin budget.
    pub fn spin(&self) -> Duration {
        Duration::from_micros(u64::from(self.spin_us))
    }
}

fn parse_u32(name: &'static str, value: &str, expected: &'static str) -> Result<u32, ConfigError> {
    value.trim().parse::<u32>().map_err(|_| ConfigError {
        name,
        value: value.to_owned(),
        expected,
    })
}

fn err(name: &'static str, value: u32, expected: &'static str) -> ConfigError {
    ConfigError {
        name,
        value: value.to_string(),
        expected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(vars: &[(&str, &str)]) -> Result<RingConfig, ConfigError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RingConfig::default().with_overrides(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_are_valid_and_hold_an_ethernet_frame() {
        let c = with(&[]).unwrap();
        assert_eq!(c, RingConfig::default());
        assert!(c.payload_capacity() >= 1500);
    }

    #[test]
    fn overrides_apply() {
        let c = with(&[
            ("RINGMUX_RING_SLOTS", "1024"),
            ("RINGMUX_SLOT_BYTES", "1600"),
            ("RINGMUX_SPIN_US", "0"),
        ])
        .unwrap();
        assert_eq!(
            c,
            RingConfig {
                slots: 1024,
                slot_bytes: 1600,
                spin_us: 0
            }
        );
    }

    #[test]
    fn bad_values_name_the_variable_value_and_range() {
        for (var, val) in [
            ("RINGMUX_RING_SLOTS", "1000"),
            ("RINGMUX_RING_SLOTS", "2"),
            ("RINGMUX_RING_SLOTS", "lots"),
            ("RINGMUX_SLOT_BYTES", "1500"),
            ("RINGMUX_SLOT_BYTES", "64"),
            ("RINGMUX_SPIN_US", "-1"),
            ("RINGMUX_SPIN_US", "2000000"),
        ] {
            let e = with(&[(var, val)]).unwrap_err();
            assert_eq!(e.name, var);
            let msg = e.to_string();
            assert!(
                msg.contains(var) && msg.contains(val) && msg.contains("expected"),
                "{msg}"
            );
        }
    }
}
