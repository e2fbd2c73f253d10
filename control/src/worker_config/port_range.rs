//! Inclusive port ranges, written `"start-end"`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An inclusive port range, written `"start-end"` (e.g. `"40000-40063"`).
///
/// Invariant (enforced by [`PortRange::new`] and parsing): `1 <= start <= end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PortRange {
    pub start: u16,
    pub end: u16,
}

impl PortRange {
    /// A range, or why it is invalid (port 0, or start after end).
    pub fn new(start: u16, end: u16) -> Result<PortRange, String> {
        if start == 0 || end == 0 {
            return Err(format!(
                "ports must be between 1 and 65535, got {start}-{end}"
            ));
        }
        if start > end {
            return Err(format!("start {start} is greater than end {end}"));
        }
        Ok(PortRange { start, end })
    }

    /// Number of ports in the range.
    pub fn len(&self) -> usize {
        usize::from(self.end.saturating_sub(self.start)) + 1
    }

    /// Always false: a valid range holds at least one port.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether `port` lies in the range.
    pub fn contains(&self, port: u16) -> bool {
        (self.start..=self.end).contains(&port)
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.start, self.end)
    }
}

impl FromStr for PortRange {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let shape_error =
            || format!("expected \"start-end\" such as \"40000-40063\", got {text:?}");
        let (start, end) = text.trim().split_once('-').ok_or_else(shape_error)?;
        let start = parse_port_number(start).ok_or_else(shape_error)?;
        let end = parse_port_number(end).ok_or_else(shape_error)?;
        if !(1..=65535).contains(&start) || !(1..=65535).contains(&end) {
            return Err(format!(
                "ports must be between 1 and 65535, got {start}-{end}"
            ));
        }
        // Both are in 1..=65535, so the conversions succeed.
        let start = u16::try_from(start).map_err(|_| shape_error())?;
        let end = u16::try_from(end).map_err(|_| shape_error())?;
        PortRange::new(start, end)
    }
}

/// ASCII digits only (no sign, no spaces inside); large values saturate so that `"99999"` is
/// reported as out of range rather than as a malformed range.
fn parse_port_number(text: &str) -> Option<u32> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(text.parse::<u32>().unwrap_or(u32::MAX))
}

impl Serialize for PortRange {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PortRange {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}
