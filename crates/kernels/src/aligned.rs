//! Buffers that start on a cache line.
//!
//! A large `Vec` starts 16 bytes into a 64-byte line, so every 64-byte register load or store
//! of data laid out in whole lines (interleaved weight groups, recurrent-state rows) would
//! touch two lines. [`AlignedVec`] over-allocates by one line and hands out the part that
//! starts on a boundary — in safe code.

/// The alignment: one cache line.
pub const CACHE_LINE: usize = 64;

/// `len` values of `T` starting on a [`CACHE_LINE`] boundary.
pub struct AlignedVec<T> {
    buffer: Vec<T>,
    offset: usize,
    len: usize,
}

impl<T: Copy + Default> AlignedVec<T> {
    /// `len` default (zero) values; `None` if the allocation fails.
    pub fn try_zeroed(len: usize) -> Option<Self> {
        let size = size_of::<T>().max(1);
        let total = len.checked_add(CACHE_LINE.div_ceil(size))?;
        let mut buffer = Vec::new();
        buffer.try_reserve_exact(total).ok()?;
        buffer.resize(total, T::default());
        let offset = buffer.as_ptr().align_offset(CACHE_LINE).min(total - len);
        Some(Self {
            buffer,
            offset,
            len,
        })
    }

    /// `len` default (zero) values (aborts if the allocation fails, as `vec!` does).
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

impl<T: Copy + Default> Clone for AlignedVec<T> {
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
