//! A counting global allocator for the memory benchmarks: live and peak
//! heap bytes by allocation accounting (exact, unlike RSS, and unaffected
//! by the allocator's caching). Counting is off until [`enable`] (only
//! `arbor bench logprob-memory` turns it on); until then each allocation
//! costs one relaxed load more than the system allocator.
//!
//! Counts are signed bytes allocated minus freed since counting began, so a
//! block allocated before and freed after [`enable`] lowers them: what a
//! benchmark reads is the difference from a base ([`live`] before,
//! [`peak`] after), which is exact either way.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

static ON: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

pub struct Counting;

fn grow(bytes: usize) {
    if ON.load(Ordering::Relaxed) {
        let b = bytes as isize;
        let now = LIVE.fetch_add(b, Ordering::Relaxed) + b;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

fn shrink(bytes: usize) {
    if ON.load(Ordering::Relaxed) {
        LIVE.fetch_sub(bytes as isize, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards its arguments to the system allocator
// unchanged and returns its result; the counters only observe sizes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `l` is passed on as is.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grow(l.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grow(l.size());
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from this allocator, i.e. from `System`, with `l`.
        unsafe { System.dealloc(p, l) };
        shrink(l.size());
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: `p` came from `System` with `l`; `new` is the caller's.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            if new >= l.size() {
                grow(new - l.size());
            } else {
                shrink(l.size() - new);
            }
        }
        q
    }
}

/// Start counting (for the rest of the process).
pub fn enable() {
    ON.store(true, Ordering::Relaxed);
}

/// Heap bytes live now, relative to when counting began.
pub fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// Restart peak tracking from the current live bytes.
pub fn reset_peak() {
    PEAK.store(live(), Ordering::Relaxed);
}

/// Peak live heap bytes since the last [`reset_peak`].
pub fn peak() -> isize {
    PEAK.load(Ordering::Relaxed)
}
