//! A header field the configuration writes, checked once: a fixed response's `headers`
//! ([`crate::route::ResponseHeaders`]) and the header rules of a site or route
//! ([`crate::rules::HeaderRules`]) read their fields through [`FieldTable`], so both refuse the
//! same names and values with the same words, and [`OWNED_HEADERS`] is the one list of the
//! fields ringmux keeps to itself.
//!
//! A name is a field name (RFC 9110 §5.1), lower case, no pseudo-header and none of
//! [`OWNED_HEADERS`]; a value is printable ASCII, spaces and tabs (§5.5); a table names each
//! field once (compared without case) and holds a bounded number of them. The messages say
//! what is expected; the reader (the configuration's or the site table's) names the key.

use http::{HeaderName, HeaderValue};

/// Header fields no configuration may set, add or remove, and why: ringmux writes each
/// itself, or it belongs to one connection only (RFC 9110 §7.6.1; HTTP/2 and HTTP/3 refuse a
/// message that carries one: RFC 9113 §8.2.2, RFC 9114 §4.2).
pub const OWNED_HEADERS: [(&str, &str); 14] = [
    ("alt-svc", "ringmux announces HTTP/3 with it"),
    ("forwarded", "the proxy writes it from the connection"),
    ("x-forwarded-for", "the proxy writes it from the connection"),
    (
        "x-forwarded-proto",
        "the proxy writes it from the connection",
    ),
    (
        "x-forwarded-host",
        "the proxy writes it from the connection",
    ),
    ("connection", "a hop-by-hop field"),
    ("keep-alive", "a hop-by-hop field"),
    ("proxy-connection", "a hop-by-hop field"),
    ("te", "a hop-by-hop field"),
    ("trailer", "a hop-by-hop field"),
    (
        "transfer-encoding",
        "a hop-by-hop field; the server frames the body",
    ),
    ("upgrade", "a hop-by-hop field"),
    ("content-length", "the server sets it from the body"),
    (
        "host",
        "a field of requests; the proxy passes the request's authority",
    ),
];

/// A header field refused: its name, its value, or the table it is in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderFieldError {
    #[error(
        "{0:?} is not a header field name: expected letters, digits and !#$%&'*+-.^_`|~ \
         (RFC 9110 §5.1)"
    )]
    Name(String),
    #[error("{0:?} is a pseudo-header, which only the protocol sets")]
    PseudoHeader(String),
    #[error("{name}: ringmux owns this field ({why}); it can be neither set nor removed")]
    Owned { name: String, why: &'static str },
    #[error("{name} = {value:?}: expected a header field value of printable ASCII")]
    Value { name: String, value: String },
    #[error("{0} is given twice (names are compared without case)")]
    Twice(String),
    #[error("{count} header fields; at most {most}")]
    TooMany { count: usize, most: usize },
}

/// A field name and value, both checked ([`FieldTable::field`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderField {
    pub name: HeaderName,
    pub value: HeaderValue,
}

impl HeaderField {
    /// The value as text (it was checked to be printable ASCII).
    pub fn value_str(&self) -> &str {
        self.value.to_str().unwrap_or_default()
    }
}

/// The fields of one table as the configuration writes it, read one by one: each name
/// checked and given once, at most as many as the table may hold.
#[derive(Debug, Default)]
pub struct FieldTable {
    seen: Vec<HeaderName>,
}

impl FieldTable {
    /// A table that will read `count` fields, refused when that is more than `most`.
    pub fn new(count: usize, most: usize) -> Result<FieldTable, HeaderFieldError> {
        match count <= most {
            true => Ok(FieldTable {
                seen: Vec::with_capacity(count),
            }),
            false => Err(HeaderFieldError::TooMany { count, most }),
        }
    }

    /// `name` as a field name the configuration may touch, not given before in this table.
    pub fn name(&mut self, name: &str) -> Result<HeaderName, HeaderFieldError> {
        if name.starts_with(':') {
            return Err(HeaderFieldError::PseudoHeader(name.to_string()));
        }
        let parsed = field_name(name)?;
        if let Some((_, why)) = OWNED_HEADERS.iter().find(|(n, _)| *n == parsed.as_str()) {
            return Err(HeaderFieldError::Owned {
                name: parsed.to_string(),
                why,
            });
        }
        if self.seen.contains(&parsed) {
            return Err(HeaderFieldError::Twice(parsed.to_string()));
        }
        self.seen.push(parsed.clone());
        Ok(parsed)
    }

    /// `name` and `value` as a field ([`FieldTable::name`]; the value printable ASCII,
    /// spaces and tabs).
    pub fn field(&mut self, name: &str, value: String) -> Result<HeaderField, HeaderFieldError> {
        let parsed = self.name(name)?;
        let printable = value
            .bytes()
            .all(|b| b == b'\t' || (0x20..0x7f).contains(&b));
        match HeaderValue::from_str(&value) {
            Ok(v) if printable => Ok(HeaderField {
                name: parsed,
                value: v,
            }),
            _ => Err(HeaderFieldError::Value {
                name: name.to_string(),
                value,
            }),
        }
    }
}

/// `name` as a field name (RFC 9110 §5.1), lower case; any name, owned or not (a CORS
/// preflight's allowed request fields are names only, never set).
pub fn field_name(name: &str) -> Result<HeaderName, HeaderFieldError> {
    HeaderName::from_bytes(name.as_bytes()).map_err(|_| HeaderFieldError::Name(name.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_values_and_tables_are_refused_saying_why() {
        let mut table = FieldTable::new(2, 2).unwrap();
        let f = table.field("X-A", "b\tc".into()).unwrap();
        assert_eq!((f.name.as_str(), f.value_str()), ("x-a", "b\tc"));
        assert_eq!(
            table.name("x-A"),
            Err(HeaderFieldError::Twice("x-a".into()))
        );
        let mut table = FieldTable::default();
        for (name, value, says) in [
            ("x a", "b", "\"x a\" is not a header field name"),
            ("", "b", "\"\" is not a header field name"),
            (":status", "200", "\":status\" is a pseudo-header"),
            (
                "Content-Length",
                "3",
                "content-length: ringmux owns this field (the server sets it",
            ),
            ("alt-svc", "x", "alt-svc: ringmux owns this field"),
            (
                "x-b",
                "b\nc",
                "x-b = \"b\\nc\": expected a header field value",
            ),
            ("x-c", "é", "x-c = \"é\": expected a header field value"),
        ] {
            let e = table.field(name, value.into()).unwrap_err().to_string();
            assert!(e.contains(says), "{name}: {e}");
        }
        assert_eq!(
            FieldTable::new(3, 2).unwrap_err().to_string(),
            "3 header fields; at most 2"
        );
        assert_eq!(field_name("Host").unwrap().as_str(), "host");
    }
}
