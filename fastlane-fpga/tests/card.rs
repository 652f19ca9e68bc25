//! The software card behind the ABI: ops give the same answers as the library, the rings
//! wrap (phase flips) without losing or duplicating a completion, and bad descriptors or a
//! lying doorbell get a status or a fault, not a crash.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fastlane_fpga::abi::{self, cpl_status, reg, Completion, Descriptor};
use fastlane_fpga::card::{Bar, Card, CardError, HostQueue, SoftBar, SoftCard, SoftCardConfig};
use fastlane_market::book::{BookConfig, OrderBooks};
use fastlane_market::event::{Event, KIND_TOP_OF_BOOK};
use fastlane_market::filter::SymbolFilter;
use fastlane_market::gen::{generate, GenConfig};
use fastlane_market::itch::{stock_from_str, FeedReader};

fn small_card() -> SoftCard {
    card_with(3, 2)
}

fn card_with(desc_ring_log2: u32, cpl_ring_log2: u32) -> SoftCard {
    SoftCard::new(SoftCardConfig {
        desc_ring_log2,
        cpl_ring_log2,
        book: BookConfig { orders_max: 1 << 16, levels_reserved: 8 },
        symbols: vec![stock_from_str("AAPL"), stock_from_str("MSFT")],
    })
    .expect("card")
}

fn reap_all(card: &mut SoftCard, want: usize) -> Vec<Completion> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = [Completion::default(); 8];
    while out.len() < want {
        let n = card.completions(&mut buf);
        out.extend_from_slice(&buf[..n]);
        card.check().expect("card healthy");
        assert!(Instant::now() < deadline, "only {} of {want} completions", out.len());
        if n == 0 {
            std::thread::yield_now();
        }
    }
    out
}

#[test]
fn crc_and_timestamp_ops_agree_with_the_library() {
    let mut card = small_card();
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + 3) as u8).collect();
    for len in [0usize, 1, 9, 4096, 10_000] {
        assert_eq!(card.crc32c(&data[..len], 0).unwrap(), crc32c::crc32c(&data[..len]));
    }
    let (a, b) = data.split_at(1234);
    let seed = card.crc32c(a, 0).unwrap();
    assert_eq!(card.crc32c(b, seed).unwrap(), crc32c::crc32c(&data));
    let t1 = card.timestamp().unwrap();
    let t2 = card.timestamp().unwrap();
    assert!(t2 >= t1);
    // The register clock, the op and the host-side clock are one clock.
    let r = card.register_clock_ns();
    assert!(r >= t2);
    assert!(card.clock().now_ns() >= r);
    std::thread::sleep(Duration::from_millis(2));
    assert!(card.register_clock_ns() >= r + 2_000_000);
}

/// Many more descriptors than ring slots (8 descriptors, 4 completions): the phase bit must
/// flip correctly for every completion to arrive exactly once, in order.
#[test]
fn rings_wrap_and_tags_come_back_in_order() {
    let mut card = small_card();
    let data = b"123456789";
    let mut next_tag = 0u32;
    let mut seen = 0u32;
    let mut buf = [Completion::default(); 3];
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen < 1000 {
        while next_tag < 1000 {
            let d = Descriptor {
                op: abi::OP_CRC32C,
                tag: next_tag,
                src_addr: data.as_ptr() as u64,
                src_len: data.len() as u32,
                ..Descriptor::default()
            };
            // SAFETY: `data` is a static string, alive and unmodified for the whole program.
            match unsafe { card.enqueue(d) } {
                Ok(()) => next_tag += 1,
                Err(CardError::Full(back)) => {
                    assert_eq!(back, d);
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        card.doorbell();
        let n = card.completions(&mut buf);
        for c in &buf[..n] {
            assert_eq!(c.tag, seen);
            assert_eq!(c.status, cpl_status::OK);
            assert_eq!(c.value, 0xE306_9283);
            seen += 1;
        }
        assert!(Instant::now() < deadline);
    }
    assert_eq!(card.in_flight(), 0);
    let report = card.shutdown().expect("engine report");
    assert_eq!(report.descriptors, 1000);
}

#[test]
fn bad_descriptors_get_a_status() {
    let mut card = card_with(3, 3);
    let cases = [
        (Descriptor { op: 0x7f, tag: 1, ..Descriptor::default() }, cpl_status::UNSUPPORTED_OP),
        (
            Descriptor { op: abi::OP_CRC32C, tag: 2, src_len: 8, ..Descriptor::default() },
            cpl_status::BAD_DESCRIPTOR,
        ),
        (
            Descriptor {
                op: abi::OP_ITCH,
                tag: 3,
                dst_len: 64,
                dst_addr: 0,
                ..Descriptor::default()
            },
            cpl_status::BAD_DESCRIPTOR,
        ),
        (
            Descriptor {
                op: abi::OP_ITCH,
                tag: 4,
                dst_len: 64,
                dst_addr: 12,
                ..Descriptor::default()
            },
            cpl_status::BAD_DESCRIPTOR,
        ),
        (Descriptor { op: abi::OP_NOP, tag: 5, ..Descriptor::default() }, cpl_status::OK),
    ];
    for (d, _) in &cases {
        // SAFETY: none of these descriptors names memory the card may touch: null or zero
        // lengths (the card rejects them before any access), or no memory at all.
        unsafe { card.post(*d).unwrap() };
    }
    let got = reap_all(&mut card, cases.len());
    for (c, (d, status)) in got.iter().zip(&cases) {
        assert_eq!((c.tag, c.status), (d.tag, *status));
    }
}

/// A host that claims more descriptors than the ring holds: the card halts with a fault
/// instead of reading stale slots.
#[test]
fn doorbell_overrun_halts_the_card() {
    let card = small_card();
    let bar: &SoftBar = card.bar();
    bar.write32(reg::DESC_PROD, 1000);
    let deadline = Instant::now() + Duration::from_secs(10);
    while card.check().is_ok() {
        assert!(Instant::now() < deadline, "card did not halt");
        std::thread::yield_now();
    }
    assert!(matches!(card.check(), Err(CardError::Halted { fault: 1 })));
    assert_eq!(bar.read32(reg::ERROR_COUNT), 1);
}

#[test]
fn host_queue_refuses_a_bar_that_is_not_ours() {
    let bar = Arc::new(SoftBar::new());
    bar.write32(reg::ID, 0x1234);
    assert!(matches!(HostQueue::new(bar, 4, 4), Err(CardError::BadMagic { id: 0x1234 })));
    let bar = Arc::new(SoftBar::new());
    bar.write32(reg::VERSION, 2 << 16);
    assert!(matches!(HostQueue::new(bar, 4, 4), Err(CardError::Version { major: 2, .. })));
}

/// Every message of a feed through the card, one descriptor each: the events and top-of-book
/// changes equal what the library computes directly, and so do the card's final books.
#[test]
fn itch_through_the_card_matches_the_library() {
    let feed =
        generate(&GenConfig { messages: 20_000, symbols: 6, seed: 5, itchy_compatible: false });
    let mut card = small_card();
    let flags = abi::ITCH_EVENTS | abi::ITCH_BOOK | abi::ITCH_FILTER;
    let mut got: Vec<Event> = Vec::new();
    let mut reader = FeedReader::new(&feed);
    let mut posted = 0u64;
    let mut reaped = 0u64;
    let mut errors = 0u64;
    while let Some(frame) = reader.next_frame() {
        let (offset, payload) = frame.unwrap();
        let bytes = &feed[offset as usize..offset as usize + 2 + payload.len()];
        loop {
            match card.submit_itch(bytes, flags) {
                Ok(_) => break,
                Err(CardError::Full(_)) => {
                    reaped += card
                        .reap_itch(|c, ev| {
                            errors += u64::from(c.errors);
                            got.extend_from_slice(ev)
                        })
                        .unwrap() as u64
                }
                Err(e) => panic!("{e}"),
            }
        }
        posted += 1;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while reaped < posted {
        reaped += card
            .reap_itch(|c, ev| {
                errors += u64::from(c.errors);
                got.extend_from_slice(ev)
            })
            .unwrap() as u64;
        assert!(Instant::now() < deadline);
    }
    assert_eq!(errors, 0);
    // The same work in the library.
    let mut books = OrderBooks::new(BookConfig { orders_max: 1 << 16, levels_reserved: 8 });
    let mut filter = SymbolFilter::new(&[stock_from_str("AAPL"), stock_from_str("MSFT")]);
    let mut want = Vec::new();
    for m in FeedReader::new(&feed).map(Result::unwrap) {
        if filter.admit(&m) {
            want.push(Event::from_message(&m));
            if let Some(t) = books.apply(&m) {
                want.push(Event::top_of_book(&t, &m));
            }
        }
    }
    assert_eq!(got.len(), want.len());
    assert!(got == want, "event streams differ");
    assert!(got.iter().filter(|e| e.kind == KIND_TOP_OF_BOOK).count() > 100);
    let report = card.shutdown().unwrap();
    assert_eq!(report.decode.messages, 20_000);
    assert!(report.filtered_out > 0);
    for l in [1u16, 2] {
        assert_eq!(report.books.top(l), books.top(l));
    }
}

/// An output buffer too small for the input: the card stops at a message boundary and says
/// how far it got; posting the rest continues exactly there.
#[test]
fn dst_full_reports_progress() {
    let feed = generate(&GenConfig { messages: 100, symbols: 2, seed: 1, itchy_compatible: false });
    let mut card = small_card();
    let mut dst = vec![Event::default(); 10];
    let mut pos = 0usize;
    let mut events = 0usize;
    let mut rounds = 0;
    while pos < feed.len() {
        let d = Descriptor {
            op: abi::OP_ITCH,
            flags: abi::ITCH_EVENTS,
            tag: rounds,
            src_addr: feed[pos..].as_ptr() as u64,
            src_len: (feed.len() - pos) as u32,
            dst_len: (dst.len() * size_of::<Event>()) as u32,
            dst_addr: dst.as_mut_ptr() as u64,
            ..Descriptor::default()
        };
        // SAFETY: `feed` and `dst` outlive the call and neither is touched until the
        // completion below has been reaped (reap_all waits for it).
        unsafe { card.post(d).unwrap() };
        let c = reap_all(&mut card, 1)[0];
        assert_eq!(
            c.status,
            if c.value as usize == feed.len() - pos {
                cpl_status::OK
            } else {
                cpl_status::DST_FULL
            }
        );
        assert!(c.events as usize <= dst.len());
        pos += c.value as usize;
        events += c.events as usize;
        rounds += 1;
    }
    assert_eq!(events, 100);
    assert_eq!(rounds, 10);
}
