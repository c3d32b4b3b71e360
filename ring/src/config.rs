//! Ring geometry: [`RingConfig`], its defaults and its bounds. Every bad value is refused with
//! an error that names the field, the value and the accepted range; the consumer's spin
//! ([`crate::SpinPolicy`]) is refused the same way. Where the values come from (the demux's
//! `--ring-slots`, `--slot-bytes` and `--spin-us`, or their `RINGMUX_*` variables) is the
//! caller's business: it names its own flag from [`RingField`].

use crate::layout::DESC_BYTES;

/// Geometry of one ring: what the producer creates and the consumer checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingConfig {
    /// Number of slots: a power of two in [`RingConfig::SLOTS_RANGE`].
    pub slots: u32,
    /// Bytes per slot, descriptor included: a multiple of 64 in [`RingConfig::SLOT_BYTES_RANGE`].
    pub slot_bytes: u32,
}

impl Default for RingConfig {
    /// 4096 slots of 2 KiB (8 MiB a ring): a 64-byte descriptor and up to 1984 payload bytes, more
    /// than the 1500-byte Ethernet MTU; room for about 4 ms of a 1 M datagram/s burst.
    fn default() -> Self {
        RingConfig {
            slots: 4096,
            slot_bytes: 2048,
        }
    }
}

/// A setting of the ring, as a [`ConfigError`] names it: a field of [`RingConfig`], or the
/// consumer's spin ([`crate::SpinPolicy::from_micros`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingField {
    Slots,
    SlotBytes,
    SpinUs,
}

impl RingField {
    /// The setting's name.
    pub fn name(self) -> &'static str {
        match self {
            RingField::Slots => "slots",
            RingField::SlotBytes => "slot_bytes",
            RingField::SpinUs => "spin_us",
        }
    }
}

/// A setting of the ring outside its accepted range.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{}={value} is not valid: expected {expected}", field.name())]
pub struct ConfigError {
    pub field: RingField,
    /// The value given.
    pub value: u32,
    /// The accepted range, in words.
    pub expected: &'static str,
}

impl RingConfig {
    pub const SLOTS_RANGE: (u32, u32) = (4, 1 << 20);
    pub const SLOT_BYTES_RANGE: (u32, u32) = (DESC_BYTES + 1216, DESC_BYTES + 65536);

    const SLOTS_EXPECTED: &'static str = "a power of two from 4 to 1048576";
    const SLOT_BYTES_EXPECTED: &'static str =
        "a multiple of 64 from 1280 (64-byte descriptor + 1216-byte payload, QUIC's 1200-byte minimum with room) to 65600";

    /// Checks every field against its range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let (lo, hi) = Self::SLOTS_RANGE;
        if !self.slots.is_power_of_two() || self.slots < lo || self.slots > hi {
            return Err(err(RingField::Slots, self.slots, Self::SLOTS_EXPECTED));
        }
        let (lo, hi) = Self::SLOT_BYTES_RANGE;
        if !self.slot_bytes.is_multiple_of(64) || self.slot_bytes < lo || self.slot_bytes > hi {
            return Err(err(
                RingField::SlotBytes,
                self.slot_bytes,
                Self::SLOT_BYTES_EXPECTED,
            ));
        }
        Ok(())
    }

    /// Largest datagram a slot carries.
    pub fn payload_capacity(&self) -> usize {
        (self.slot_bytes - DESC_BYTES) as usize
    }
}

fn err(field: RingField, value: u32, expected: &'static str) -> ConfigError {
    ConfigError {
        field,
        value,
        expected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_hold_an_ethernet_frame() {
        let c = RingConfig::default();
        assert_eq!(c.validate(), Ok(()));
        assert!(c.payload_capacity() >= 1500);
        let small = RingConfig {
            slots: 1024,
            slot_bytes: 1600,
        };
        assert_eq!(small.validate(), Ok(()));
    }

    #[test]
    fn bad_values_name_the_field_value_and_range() {
        let d = RingConfig::default();
        for (bad, field, value) in [
            (RingConfig { slots: 1000, ..d }, RingField::Slots, 1000),
            (RingConfig { slots: 2, ..d }, RingField::Slots, 2),
            (
                RingConfig {
                    slots: 1 << 21,
                    ..d
                },
                RingField::Slots,
                1 << 21,
            ),
            (
                RingConfig {
                    slot_bytes: 1500,
                    ..d
                },
                RingField::SlotBytes,
                1500,
            ),
            (
                RingConfig {
                    slot_bytes: 64,
                    ..d
                },
                RingField::SlotBytes,
                64,
            ),
            (
                RingConfig {
                    slot_bytes: 65664,
                    ..d
                },
                RingField::SlotBytes,
                65664,
            ),
        ] {
            let e = bad.validate().unwrap_err();
            assert_eq!((e.field, e.value), (field, value), "{bad:?}");
            let msg = e.to_string();
            assert!(
                msg.contains(field.name())
                    && msg.contains(&value.to_string())
                    && msg.contains("expected"),
                "{msg}"
            );
        }
    }
}
