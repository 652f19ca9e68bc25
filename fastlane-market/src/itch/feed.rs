//! Walking a length-prefixed feed: [`FeedReader`] and the [`DecodeStats`] it keeps.

use super::*;

/// Counts of what a [`FeedReader`] decoded and rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeStats {
    /// Messages decoded, by type byte.
    pub by_type: [u64; 256],
    /// Messages decoded, all types.
    pub messages: u64,
    /// Bytes consumed (prefixes included).
    pub bytes: u64,
    /// Feeds that ended inside a prefix or a message.
    pub truncated: u64,
    /// Zero-length messages.
    pub empty: u64,
    /// Messages of a type ITCH 5.0 does not define.
    pub unknown_type: u64,
    /// Messages whose length prefix disagrees with their type.
    pub length_mismatch: u64,
    /// Messages with a field value we cannot use.
    pub bad_field: u64,
}

impl Default for DecodeStats {
    fn default() -> Self {
        Self {
            by_type: [0; 256],
            messages: 0,
            bytes: 0,
            truncated: 0,
            empty: 0,
            unknown_type: 0,
            length_mismatch: 0,
            bad_field: 0,
        }
    }
}

impl DecodeStats {
    /// All rejected messages.
    pub fn errors(&self) -> u64 {
        self.truncated + self.empty + self.unknown_type + self.length_mismatch + self.bad_field
    }

    /// Count one error.
    pub fn count_error(&mut self, e: &ItchError) {
        match e {
            ItchError::Truncated { .. } => self.truncated += 1,
            ItchError::Empty { .. } => self.empty += 1,
            ItchError::UnknownType { .. } => self.unknown_type += 1,
            ItchError::LengthMismatch { .. } => self.length_mismatch += 1,
            ItchError::BadField { .. } => self.bad_field += 1,
        }
    }
}

/// Walks a length-prefixed ITCH feed held in memory, yielding messages and errors.
///
/// After an error inside a well-framed message it skips that message (the length prefix says
/// where the next one starts); after a truncation it stops.
#[derive(Debug, Clone)]
pub struct FeedReader<'a> {
    buf: &'a [u8],
    pos: usize,
    stats: DecodeStats,
}

impl<'a> FeedReader<'a> {
    /// A reader at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0, stats: DecodeStats::default() }
    }

    /// Byte offset of the next length prefix.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// What has been decoded and rejected so far.
    pub fn stats(&self) -> &DecodeStats {
        &self.stats
    }

    /// The next framed message as raw bytes (type byte first), without decoding it:
    /// `(offset of its prefix, payload)`. Errors only for truncation (then the reader stops).
    #[inline(always)]
    pub fn next_frame(&mut self) -> Option<Result<(u64, &'a [u8]), ItchError>> {
        let rest = &self.buf[self.pos..];
        if rest.is_empty() {
            return None;
        }
        let offset = self.pos as u64;
        if rest.len() < 2 {
            self.pos = self.buf.len();
            return Some(Err(ItchError::Truncated { offset, needed: 2, available: rest.len() }));
        }
        let len = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
        let Some(payload) = rest.get(2..2 + len) else {
            self.pos = self.buf.len();
            return Some(Err(ItchError::Truncated {
                offset,
                needed: 2 + len,
                available: rest.len(),
            }));
        };
        self.pos += 2 + len;
        self.stats.bytes += 2 + len as u64;
        Some(Ok((offset, payload)))
    }
}

impl FeedReader<'_> {
    /// The next message that decodes; rejected ones are counted in [`stats`](Self::stats)
    /// and skipped. `None` at the end of the feed (or at a truncation, also counted).
    #[inline(always)]
    pub fn next_message(&mut self) -> Option<Message> {
        loop {
            match self.next()? {
                Ok(m) => return Some(m),
                Err(_) => continue,
            }
        }
    }
}

impl Iterator for FeedReader<'_> {
    type Item = Result<Message, ItchError>;

    #[inline(always)]
    fn next(&mut self) -> Option<Self::Item> {
        let r = match self.next_frame()? {
            Ok((offset, payload)) => decode_at(payload, offset),
            Err(e) => Err(e),
        };
        match &r {
            Ok(m) => {
                self.stats.messages += 1;
                self.stats.by_type[usize::from(m.msg_type)] += 1;
            }
            Err(e) => self.stats.count_error(e),
        }
        Some(r)
    }
}
