//! Checks shared by the cargo-fuzz targets (`fuzz/`) and the corpus replay test: what the
//! decoder and the book promise for any input bytes.

use crate::book::{BookConfig, OrderBooks};
use crate::event::Event;
use crate::itch::Side;
use crate::itch::{decode, encode, FeedReader, MAX_MESSAGE_LEN};
use crate::reference::ReferenceBooks;

/// Decode `data` as a feed: never panics, accounts for every message, and every decoded
/// message re-encodes to the exact bytes it came from.
pub fn check_decoder(data: &[u8]) {
    let mut r = FeedReader::new(data);
    let mut frames = 0u64;
    while let Some(frame) = r.next_frame() {
        let Ok((_, payload)) = frame else { break };
        frames += 1;
        if let Ok(m) = decode(payload) {
            let mut buf = [0u8; 2 + MAX_MESSAGE_LEN];
            let n = encode(&m, &mut buf);
            assert_eq!(&buf[2..n], payload, "re-encoding differs for {m:?}");
            let _ = Event::from_message(&m);
        }
    }
    let mut r = FeedReader::new(data);
    let seen = r.by_ref().count() as u64;
    let s = r.stats();
    assert_eq!(s.messages + s.errors(), seen);
    assert!(seen >= frames);
    assert!(s.bytes as usize <= data.len());
}

/// Feed `data` to the book and the reference model; they must agree after every message.
pub fn check_book(data: &[u8]) {
    let orders_max = 64;
    let mut book = OrderBooks::new(BookConfig { orders_max, levels_reserved: 4 });
    let mut model = ReferenceBooks::new(orders_max);
    for m in FeedReader::new(data).flatten() {
        let a = book.apply(&m);
        let b = model.apply(&m);
        assert_eq!(a, b, "top-of-book change after {m:?}");
        for side in [Side::Buy, Side::Sell] {
            assert!(
                book.levels(m.locate, side).eq(model.levels(m.locate, side)),
                "levels after {m:?}"
            );
        }
        assert_eq!(*book.stats(), model.stats, "stats after {m:?}");
        assert_eq!(book.live_orders(), model.live_orders());
    }
}
