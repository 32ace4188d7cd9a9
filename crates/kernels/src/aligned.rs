//! Buffers that start on a cache line.
//!
//! A large `Vec` starts 16 bytes into a 64-byte line, so every 64-byte register load or store
//! of data laid out in whole lines (interleaved weight groups, recurrent-state rows) would
//! touch two lines. [`AlignedVec`] over-allocates by one line and hands out the part that
//! starts on a boundary — in safe code.
//!
//! Zeroed buffers come from the allocator's zeroed allocation ([`try_zeroed_vec`]): large ones
//! are fresh pages the OS maps on first touch, so a cache or ring sized for the worst case
//! occupies memory only as far as it is used.

/// The alignment: one cache line.
pub const CACHE_LINE: usize = 64;

/// Types whose all-zero bytes are the value zero (the numbers caches and buffers hold).
///
/// # Safety
///
/// Every bit pattern of all zero bytes must be a valid value of the type.
pub unsafe trait Zeroable: Copy {}

// SAFETY: all-zero bytes are 0 (integers) or +0.0 (floats).
unsafe impl Zeroable for u8 {}
// SAFETY: as above.
unsafe impl Zeroable for i8 {}
// SAFETY: as above.
unsafe impl Zeroable for u16 {}
// SAFETY: as above.
unsafe impl Zeroable for i32 {}
// SAFETY: as above.
unsafe impl Zeroable for u32 {}
// SAFETY: as above.
unsafe impl Zeroable for f32 {}

/// `len` zeros, from the allocator's zeroed allocation (pages the OS maps lazily, not written
/// here), or `None` if the allocation fails or `T` has no size.
pub fn try_zeroed_vec<T: Zeroable>(len: usize) -> Option<Vec<T>> {
    if size_of::<T>() == 0 {
        return None;
    }
    let layout = std::alloc::Layout::array::<T>(len).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: the layout has a non-zero size (checked above).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of `len` values of `T`
    // (the layout a `Vec<T>` of capacity `len` frees with), and its zero bytes are `len`
    // valid values (`Zeroable`).
    Some(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// `len` values of `T` starting on a [`CACHE_LINE`] boundary.
pub struct AlignedVec<T> {
    buffer: Vec<T>,
    offset: usize,
    len: usize,
}

impl<T: Zeroable> AlignedVec<T> {
    /// `len` zeros ([`try_zeroed_vec`]); `None` if the allocation fails.
    pub fn try_zeroed(len: usize) -> Option<Self> {
        let size = size_of::<T>().max(1);
        let total = len.checked_add(CACHE_LINE.div_ceil(size))?;
        let buffer: Vec<T> = try_zeroed_vec(total)?;
        let offset = buffer.as_ptr().align_offset(CACHE_LINE).min(total - len);
        Some(Self {
            buffer,
            offset,
            len,
        })
    }

    /// `len` zeros (aborts if the allocation fails, as `vec!` does).
    pub fn zeroed(len: usize) -> Self {
        Self::try_zeroed(len).expect("allocating an aligned buffer")
    }

    pub fn as_slice(&self) -> &[T] {
        &self.buffer[self.offset..self.offset + self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.buffer[self.offset..self.offset + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T: Zeroable> Clone for AlignedVec<T> {
    /// The copy's buffer has its own offset to a boundary.
    fn clone(&self) -> Self {
        let mut copy = Self::zeroed(self.len);
        copy.as_mut_slice().copy_from_slice(self.as_slice());
        copy
    }
}

impl<T> std::fmt::Debug for AlignedVec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedVec")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_vectors_hold_zeros_grow_and_free() {
        for len in [0, 1, 1000, 1 << 22] {
            let mut halves: Vec<u16> = try_zeroed_vec(len).unwrap();
            let floats: Vec<f32> = try_zeroed_vec(len).unwrap();
            assert_eq!((halves.len(), floats.len()), (len, len));
            assert!(halves.iter().all(|&h| h == 0) && floats.iter().all(|&f| f == 0.0));
            halves.push(3); // a `Vec` like any other: it reallocates and frees normally
            assert_eq!(halves[len], 3);
        }
        assert!(try_zeroed_vec::<f32>(usize::MAX / 2).is_none());
    }

    #[test]
    fn starts_on_a_line_and_clones_keep_values() {
        for len in [0, 1, 17, 1000, 1 << 20] {
            let mut bytes = AlignedVec::<u8>::zeroed(len);
            let mut floats = AlignedVec::<f32>::zeroed(len);
            assert_eq!(bytes.as_slice().as_ptr() as usize % CACHE_LINE, 0);
            assert_eq!(floats.as_slice().as_ptr() as usize % CACHE_LINE, 0);
            assert_eq!((bytes.len(), floats.len()), (len, len));
            assert!(floats.as_slice().iter().all(|v| *v == 0.0));
            if len > 0 {
                bytes.as_mut_slice()[len - 1] = 7;
                floats.as_mut_slice()[0] = 1.5;
            }
            let (b, f) = (bytes.clone(), floats.clone());
            assert_eq!(b.as_slice(), bytes.as_slice());
            assert_eq!(f.as_slice(), floats.as_slice());
            assert_eq!(f.as_slice().as_ptr() as usize % CACHE_LINE, 0);
        }
        assert!(AlignedVec::<f32>::try_zeroed(usize::MAX).is_none());
    }
}
