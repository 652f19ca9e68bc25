//! The per-message path allocates nothing: decode, filter, book update and event
//! normalization over the second half of a feed, after the first half has created every
//! locate's book, run under a counting allocator.

use fastlane_market::book::{BookConfig, OrderBooks};
use fastlane_market::event::Event;
use fastlane_market::filter::SymbolFilter;
use fastlane_market::gen::{generate, GenConfig};
use fastlane_market::itch::{stock_from_str, FeedReader};
use fastlane_util::CountingAlloc;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

#[test]
fn steady_state_decode_and_book_do_not_allocate() {
    CountingAlloc::count_this_thread();
    let feed =
        generate(&GenConfig { messages: 100_000, symbols: 8, seed: 3, itchy_compatible: false });
    let mut books = OrderBooks::new(BookConfig { orders_max: 1 << 17, levels_reserved: 256 });
    let mut filter = SymbolFilter::new(&[stock_from_str("AAPL"), stock_from_str("NVDA")]);
    let mut reader = FeedReader::new(&feed);
    let mut sink = 0u64;
    let mut run = |reader: &mut FeedReader<'_>, n: usize| {
        for m in reader.by_ref().take(n).flatten() {
            filter.admit(&m);
            sink = sink.wrapping_add(Event::from_message(&m).timestamp_ns);
            if let Some(t) = books.apply(&m) {
                sink = sink.wrapping_add(Event::top_of_book(&t, &m).price.into());
            }
        }
    };
    run(&mut reader, 50_000);
    let before = CountingAlloc::allocations();
    assert!(before > 0, "the counter sees this thread's allocations (the feed, the books)");
    run(&mut reader, 50_000);
    let after = CountingAlloc::allocations();
    assert_eq!(reader.stats().messages, 100_000);
    assert_eq!(after - before, 0, "allocations on the per-message path");
    assert_ne!(sink, 0);
}
