//! TensorBoard event files (`events.out.tfevents.*`), written directly.
//!
//! Format: a TFRecord stream; each record is
//! `len: u64 LE | masked_crc32c(len): u32 LE | data | masked_crc32c(data): u32 LE`
//! with `masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8`, and `data` a
//! serialised `tensorflow.Event` protobuf:
//! `Event { double wall_time = 1; int64 step = 2; string file_version = 3;
//! Summary summary = 5 }`, `Summary { repeated Value value = 1 }`,
//! `Value { string tag = 1; float simple_value = 2 }`.

use std::io::Write;
use std::path::{Path, PathBuf};

fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(field: u32, wire: u8, out: &mut Vec<u8>) {
    varint(u64::from(field) << 3 | u64::from(wire), out);
}

fn bytes_field(field: u32, b: &[u8], out: &mut Vec<u8>) {
    key(field, 2, out);
    varint(b.len() as u64, out);
    out.extend_from_slice(b);
}

/// Serialised `Event` with a scalar summary (or a file version).
fn event(wall_time: f64, step: i64, body: EventBody<'_>) -> Vec<u8> {
    let mut e = Vec::new();
    key(1, 1, &mut e);
    e.extend_from_slice(&wall_time.to_le_bytes());
    key(2, 0, &mut e);
    varint(step as u64, &mut e);
    match body {
        EventBody::FileVersion(v) => bytes_field(3, v.as_bytes(), &mut e),
        EventBody::Scalars(vals) => {
            let mut summary = Vec::new();
            for (tag, v) in vals {
                let mut value = Vec::new();
                bytes_field(1, tag.as_bytes(), &mut value);
                key(2, 5, &mut value);
                value.extend_from_slice(&(*v as f32).to_le_bytes());
                bytes_field(1, &value, &mut summary);
            }
            bytes_field(5, &summary, &mut e);
        }
    }
    e
}

enum EventBody<'a> {
    FileVersion(&'a str),
    Scalars(&'a [(String, f64)]),
}

/// Appends scalar summaries to one event file.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// A new event file in `dir` (created), starting with the version record.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "arbor".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now.as_secs(),
            std::process::id()
        ));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        let mut w = EventWriter { path, file };
        w.record(&event(
            now.as_secs_f64(),
            0,
            EventBody::FileVersion("brain.Event:2"),
        ))?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut buf = Vec::with_capacity(data.len() + 16);
        buf.extend_from_slice(&len);
        buf.extend_from_slice(&masked_crc(&len).to_le_bytes());
        buf.extend_from_slice(data);
        buf.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.file.write_all(&buf)?;
        self.file.flush()
    }

    /// One event with every `(tag, value)` at `step`.
    pub fn scalars(&mut self, step: u64, values: &[(String, f64)]) -> std::io::Result<()> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        self.record(&event(now, step as i64, EventBody::Scalars(values)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Read the records back, check both CRCs, and decode the scalars with a
    /// minimal protobuf reader.
    #[test]
    fn records_roundtrip_with_valid_crcs() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(
            7,
            &[("reward".into(), 0.25), ("eval/pass_rate".into(), 0.5)],
        )
        .unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let mut recs = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            let len_b = &bytes[i..i + 8];
            let len = u64::from_le_bytes(len_b.try_into().unwrap()) as usize;
            assert_eq!(
                u32::from_le_bytes(bytes[i + 8..i + 12].try_into().unwrap()),
                masked_crc(len_b)
            );
            let data = &bytes[i + 12..i + 12 + len];
            assert_eq!(
                u32::from_le_bytes(bytes[i + 12 + len..i + 16 + len].try_into().unwrap()),
                masked_crc(data)
            );
            recs.push(data.to_vec());
            i += 16 + len;
        }
        assert_eq!(recs.len(), 2);
        let v = String::from_utf8_lossy(&recs[0]);
        assert!(v.contains("brain.Event:2"));
        // The scalar event holds both tags and the f32 values.
        let r = &recs[1];
        assert!(r.windows(6).any(|w| w == b"reward"));
        assert!(r
            .windows(0.25f32.to_le_bytes().len())
            .any(|w| w == 0.25f32.to_le_bytes()));
        assert!(r.windows(14).any(|w| w == b"eval/pass_rate"));
        // Step 7 as a varint after field 2's key (0x10).
        assert!(r.windows(2).any(|w| w == [0x10, 7]));
    }

    #[test]
    fn crc32c_known_value() {
        // CRC-32C of "123456789" is 0xE3069283.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }
}
