//! Loom models of the typed SPSC ring (`fastlane_ring::spsc`).
//!
//! Run with:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test -p fastlane-ring --test loom --release
//! ```
//!
//! Besides the assertions below, the ring itself tells loom about every slot access (a
//! `loom::cell::UnsafeCell` per slot, compiled in only under `--cfg loom`), so loom fails a model
//! when a slot is written and read without a happens-before edge between the two, e.g. if the
//! `Release`/`Acquire` pair on `tail` or `head` were weakened. A lost wake-up in the park
//! handshake shows up as a deadlock.
//!
//! `LOOM_MAX_PREEMPTIONS` overrides the default preemption bound of 3.
#![cfg(loom)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use fastlane_ring::spsc::{channel_with, Consumer, PopError, Producer, PushError};
use fastlane_ring::WaitStrategy;
use loom::thread;

/// Never parks, so the channel skips `notify` and the models stay small.
const SPIN: WaitStrategy = WaitStrategy::BusySpin;
/// Parks at once, so every wait goes through the futex handshake.
const PARK: WaitStrategy = WaitStrategy::SpinYieldPark { spins: 0, yields: 0 };

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

/// Pushes, yielding to the other thread while the ring is full.
fn push_spin<T>(tx: &mut Producer<T>, mut value: T) {
    loop {
        match tx.push(value) {
            Ok(()) => return,
            Err(e) => value = e.into_inner(),
        }
        thread::yield_now();
    }
}

/// Pops, yielding to the other thread while the ring is empty.
fn pop_spin<T>(rx: &mut Consumer<T>) -> T {
    loop {
        if let Ok(value) = rx.pop() {
            return value;
        }
        thread::yield_now();
    }
}

#[test]
fn push_pop() {
    model(|| {
        let (mut tx, mut rx) = channel_with::<Box<u32>>(2, SPIN);
        let producer = thread::spawn(move || {
            for i in 0..2 {
                push_spin(&mut tx, Box::new(i));
            }
        });
        for i in 0..2 {
            assert_eq!(*pop_spin(&mut rx), i);
        }
        producer.join().unwrap();
        assert_eq!(rx.pop(), Err(PopError::Empty));
    });
}

#[test]
fn wrap_around_with_more_items_than_slots() {
    model(|| {
        let (mut tx, mut rx) = channel_with::<u32>(2, SPIN);
        let producer = thread::spawn(move || {
            for i in 0..5 {
                push_spin(&mut tx, i);
            }
        });
        for i in 0..5 {
            assert_eq!(pop_spin(&mut rx), i);
        }
        producer.join().unwrap();
    });
}

#[test]
fn full_and_empty_are_reported_not_overrun() {
    model(|| {
        let (mut tx, mut rx) = channel_with::<u32>(2, SPIN);
        let producer = thread::spawn(move || {
            // The ring starts empty and only we fill it: two pushes fit whatever the consumer
            // does. The third fits only if the consumer took something already.
            tx.push(0).unwrap();
            tx.push(1).unwrap();
            assert!(tx.len() <= 2);
            match tx.push(2) {
                Ok(()) => true,
                Err(PushError::Full(v)) => {
                    assert_eq!(v, 2, "a full ring hands the value back");
                    false
                }
                Err(e) => panic!("unexpected {e:?}"),
            }
        });
        let mut got = Vec::new();
        // Take at most two, whatever is there; an empty ring must say so, not invent items.
        for _ in 0..2 {
            match rx.pop() {
                Ok(v) => got.push(v),
                Err(PopError::Empty) => thread::yield_now(),
                Err(e) => panic!("unexpected {e:?}"),
            }
        }
        let third_pushed = producer.join().unwrap();
        while let Ok(v) = rx.pop() {
            got.push(v);
        }
        let expected: Vec<u32> = if third_pushed { vec![0, 1, 2] } else { vec![0, 1] };
        assert_eq!(got, expected);
    });
}

#[test]
fn chunks_commit_across_the_wrap() {
    model(|| {
        let (mut tx, mut rx) = channel_with::<u32>(4, SPIN);
        // Move both indices to 3, so a chunk of 3 is slots 3, 0, 1.
        for i in 0..3 {
            tx.push(i).unwrap();
            assert_eq!(rx.pop(), Ok(i));
        }
        let producer = thread::spawn(move || {
            let chunk = tx.write_chunk_uninit(3).unwrap();
            assert_eq!(chunk.fill_from_iter(10..), 3);
            // Needs two slots the consumer hands back with its first commit.
            loop {
                if let Ok(chunk) = tx.write_chunk_uninit(2) {
                    assert_eq!(chunk.fill_from_iter(20..), 2);
                    break;
                }
                thread::yield_now();
            }
        });
        let chunk = loop {
            if let Ok(chunk) = rx.read_chunk(3) {
                break chunk;
            }
            thread::yield_now();
        };
        assert_eq!(chunk.as_slices(), (&[10][..], &[11, 12][..]));
        chunk.commit(2);
        let mut got = Vec::new();
        while got.len() < 3 {
            match rx.read_chunk(1) {
                Ok(chunk) => got.extend(chunk),
                Err(_) => thread::yield_now(),
            }
        }
        assert_eq!(got, vec![12, 20, 21]);
        producer.join().unwrap();
    });
}

#[test]
fn parked_consumer_is_woken_by_push() {
    model(|| {
        let (mut tx, mut rx) = channel_with::<u32>(2, PARK);
        let producer = thread::spawn(move || {
            tx.push(7).unwrap();
            tx
        });
        assert_eq!(rx.pop_blocking(None), Ok(7));
        drop(producer.join().unwrap());
    });
}

/// The producer's cached `head` is stale here (it never needs to reload it): a scheme that
/// notified only when the producer's view said the ring was empty would miss the consumer that
/// drained the ring and parked, and this model would deadlock.
#[test]
fn parked_consumer_is_woken_by_push_after_it_drained_the_ring() {
    model(|| {
        let (mut tx, mut rx) = channel_with::<u32>(4, PARK);
        let producer = thread::spawn(move || {
            for i in 0..3 {
                tx.push(i).unwrap();
            }
            tx
        });
        for i in 0..3 {
            assert_eq!(rx.pop_blocking(None), Ok(i));
        }
        drop(producer.join().unwrap());
    });
}

#[test]
fn parked_producer_is_woken_by_pop() {
    model(|| {
        let (mut tx, mut rx) = channel_with::<u32>(1, PARK);
        tx.push(1).unwrap();
        let producer = thread::spawn(move || {
            tx.push_blocking(2, None).unwrap();
            tx
        });
        assert_eq!(pop_spin(&mut rx), 1);
        assert_eq!(rx.pop_blocking(None), Ok(2));
        drop(producer.join().unwrap());
    });
}

#[test]
fn parked_consumer_is_woken_by_producer_drop() {
    model(|| {
        let (mut tx, mut rx) = channel_with::<u32>(2, PARK);
        let producer = thread::spawn(move || {
            tx.push(7).unwrap();
            drop(tx);
        });
        assert_eq!(rx.pop_blocking(None), Ok(7));
        assert_eq!(rx.pop_blocking(None), Err(PopError::Abandoned));
        producer.join().unwrap();
    });
}

#[test]
fn parked_producer_is_woken_by_consumer_drop() {
    model(|| {
        let (mut tx, rx) = channel_with::<u32>(1, PARK);
        tx.push(1).unwrap();
        let consumer = thread::spawn(move || drop(rx));
        assert_eq!(tx.push_blocking(2, None), Err(PushError::Abandoned(2)));
        consumer.join().unwrap();
    });
}

/// Counts drops in a plain (not modelled) atomic: it is only read after both threads joined.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
fn leftovers_are_dropped_exactly_once() {
    model(|| {
        let drops = Arc::new(AtomicUsize::new(0));
        let (mut tx, mut rx) = channel_with::<Counted>(2, SPIN);
        let d = drops.clone();
        let producer = thread::spawn(move || {
            tx.push(Counted(d.clone())).unwrap();
            tx.push(Counted(d)).unwrap();
            drop(tx);
        });
        // Take one if it is there already; leave the rest to whichever side goes last.
        drop(rx.pop());
        drop(rx);
        producer.join().unwrap();
        assert_eq!(drops.load(Ordering::Relaxed), 2);
    });
}

/// A consumer that moves an item out through a chunk iterator, forgets the iterator and is
/// dropped: the slot must still be handed back, with the ordering that lets the producer reuse
/// it, and the item must not be dropped again.
#[test]
fn forgotten_chunk_iterator_hands_its_slot_back_on_drop() {
    model(|| {
        let drops = Arc::new(AtomicUsize::new(0));
        let (mut tx, mut rx) = channel_with::<Counted>(1, SPIN);
        let d = drops.clone();
        let producer = thread::spawn(move || {
            tx.push(Counted(d.clone())).unwrap();
            push_spin(&mut tx, Counted(d));
        });
        let chunk = loop {
            if let Ok(chunk) = rx.read_chunk(1) {
                break chunk;
            }
            thread::yield_now();
        };
        let mut it = chunk.into_iter();
        let first = it.next().unwrap();
        std::mem::forget(it);
        drop(rx);
        drop(first);
        producer.join().unwrap();
        assert_eq!(drops.load(Ordering::Relaxed), 2);
    });
}
