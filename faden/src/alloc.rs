//! The global allocator: mimalloc, called the way its fast paths expect.
//!
//! The `mimalloc` crate passes every Rust allocation to `mi_malloc_aligned`. mimalloc v3 then
//! takes its slow generic aligned path for anything that is not a naturally aligned small block
//! (blocks over 1 KiB, and sizes whose bin is not a power of two, such as 48 bytes). That path
//! costs about 260 instructions per allocation instead of about 30, and it may round the block
//! up. The gateway's direct path made 2.7 such calls per request (callgrind).
//!
//! The plain functions already give every alignment a Rust layout can ask for up to 16 bytes.
//! Every mimalloc block is 8-aligned, and every block of 16 bytes or more is 16-aligned: the
//! first block of a page starts 16-aligned, and bin sizes from 16 up are multiples of 16
//! (mimalloc's own invariant, asserted in `alloc.c`). So a layout with `align <= 16` and
//! `align <= size` uses `mi_malloc` / `mi_zalloc` / `mi_realloc`. This is the rule std's system
//! allocator applies to `malloc`. Anything else keeps the aligned functions, and `mi_free`
//! frees both kinds.
//!
//! The only `unsafe` code in the workspace: implementing `GlobalAlloc` requires it. The tests
//! below allocate every size and alignment pair up to 4 KiB and 64-byte alignment, and check
//! the alignment and the contents.

#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// Largest alignment that every block of at least that size has (mimalloc's
/// `MI_MAX_ALIGN_SIZE`).
const PLAIN_ALIGN: usize = 16;

/// mimalloc as the global allocator (see the module documentation).
#[derive(Debug)]
pub struct Mimalloc;

#[inline]
fn plain(align: usize, size: usize) -> bool {
    align <= PLAIN_ALIGN && align <= size
}

// SAFETY: every pointer returned comes from mimalloc with at least `layout.align()` alignment
// (module documentation), or is null on failure; `dealloc` and `realloc` only receive pointers
// this allocator returned, which `mi_free` / `mi_realloc*` accept whichever function made them.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: plain FFI calls; mimalloc returns null or a block of `layout.size()` bytes.
        unsafe {
            if plain(layout.align(), layout.size()) {
                mi::mi_malloc(layout.size()).cast()
            } else {
                mi::mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`, zeroed.
        unsafe {
            if plain(layout.align(), layout.size()) {
                mi::mi_zalloc(layout.size()).cast()
            } else {
                mi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from this allocator (GlobalAlloc's contract).
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator with `layout` (GlobalAlloc's contract); the
        // new block keeps `layout.align()` by the same rule as `alloc`.
        unsafe {
            if plain(layout.align(), new_size) {
                mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    /// Every size up to 4 KiB (and some larger) with every alignment up to 64: aligned, and
    /// the bytes written survive a grow and a shrink.
    #[test]
    fn every_layout_is_aligned_and_keeps_its_bytes() {
        let sizes = (1..=4096).chain([8191, 8192, 65_536, 1 << 20]);
        for size in sizes {
            for align in [1, 2, 4, 8, 16, 32, 64] {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: non-zero size; freed with the same allocator and layout.
                unsafe {
                    let p = Mimalloc.alloc(layout);
                    assert!(!p.is_null());
                    assert_eq!(p as usize % align, 0, "size {size} align {align}");
                    p.write_bytes(0xA5, size);
                    let grown = Mimalloc.realloc(p, layout, size * 2 + 16);
                    assert_eq!(
                        grown as usize % align,
                        0,
                        "grown: size {size} align {align}"
                    );
                    assert!((0..size).all(|i| *grown.add(i) == 0xA5));
                    let big = Layout::from_size_align(size * 2 + 16, align).unwrap();
                    let shrunk = Mimalloc.realloc(grown, big, size.div_ceil(2));
                    assert_eq!(
                        shrunk as usize % align,
                        0,
                        "shrunk: size {size} align {align}"
                    );
                    assert!((0..size.div_ceil(2)).all(|i| *shrunk.add(i) == 0xA5));
                    let small = Layout::from_size_align(size.div_ceil(2), align).unwrap();
                    Mimalloc.dealloc(shrunk, small);

                    let z = Mimalloc.alloc_zeroed(layout);
                    assert_eq!(z as usize % align, 0, "zeroed: size {size} align {align}");
                    assert!((0..size).all(|i| *z.add(i) == 0));
                    Mimalloc.dealloc(z, layout);
                }
            }
        }
    }
}
