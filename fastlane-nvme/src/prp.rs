//! Physical Region Page entries (NVMe Base Specification 2.0, section 4.1.1).
//!
//! A command names its data with PRP1 and PRP2. PRP1 may start anywhere dword-aligned inside a
//! page; every further entry is a page start, and every entry but the last runs to the end of
//! its page. One or two pages: PRP2 is the second page (or unused). More: PRP2 points to a PRP
//! list, one page of up to 512 entries that the driver fills. The driver limits one command to
//! the queue module's transfer size (at most 1 MiB, 257 pages when unaligned), so one list
//! page always suffices and lists are never chained.
//!
//! A request's memory is a list of IOVA chunks (one per segment). It can be described by PRPs
//! when the first chunk starts dword-aligned, every chunk after the first starts on a page
//! boundary, and every chunk before the last ends on one ([`prp_compatible`]). Otherwise the
//! queue copies through its bounce pages, which always qualify.

use super::regs::PAGE_SIZE;

const PAGE: u64 = PAGE_SIZE as u64;

/// Entries one PRP list page holds.
pub const PRP_LIST_ENTRIES: usize = PAGE_SIZE / 8;

/// Whether `chunks` (IOVA, length) can be named by PRPs as they are.
pub fn prp_compatible(chunks: impl IntoIterator<Item = (u64, u32)>) -> bool {
    let mut first = true;
    let mut prev_end_aligned = true;
    let mut any = false;
    for (iova, len) in chunks {
        if len == 0 {
            continue;
        }
        if first {
            if iova % 4 != 0 {
                return false;
            }
            first = false;
        } else if iova % PAGE != 0 || !prev_end_aligned {
            return false;
        }
        any = true;
        prev_end_aligned = (iova + u64::from(len)) % PAGE == 0;
    }
    any
}

/// Why [`build_prp`] could not describe the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrpError {
    /// No bytes.
    Empty,
    /// The chunks break the PRP layout rules (see [`prp_compatible`]).
    Layout,
    /// More entries than one list page holds.
    TooLong,
}

/// Build PRP1 and PRP2 for `chunks` (already [`prp_compatible`]). Entries after the first go
/// to `write_list(index, entry)` (index 0 is the list's first slot); the caller writes them
/// into the list page whose IOVA is `list_iova`. Returns `(prp1, prp2)`.
pub fn build_prp(
    chunks: impl IntoIterator<Item = (u64, u32)>,
    list_iova: u64,
    mut write_list: impl FnMut(usize, u64),
) -> Result<(u64, u64), PrpError> {
    let mut count = 0usize;
    let mut prp1 = 0u64;
    let mut second = 0u64;
    let mut prev_end_aligned = true;
    let mut push = |entry: u64, count: &mut usize| -> Result<(), PrpError> {
        match *count {
            0 => prp1 = entry,
            n => {
                if n > PRP_LIST_ENTRIES {
                    return Err(PrpError::TooLong);
                }
                if n == 1 {
                    second = entry;
                }
                write_list(n - 1, entry);
            }
        }
        *count += 1;
        Ok(())
    };
    for (iova, len) in chunks {
        if len == 0 {
            continue;
        }
        let end = iova + u64::from(len);
        if count == 0 {
            if iova % 4 != 0 {
                return Err(PrpError::Layout);
            }
        } else if iova % PAGE != 0 || !prev_end_aligned {
            return Err(PrpError::Layout);
        }
        push(iova, &mut count)?;
        let mut page = (iova & !(PAGE - 1)) + PAGE;
        while page < end {
            push(page, &mut count)?;
            page += PAGE;
        }
        prev_end_aligned = end % PAGE == 0;
    }
    match count {
        0 => Err(PrpError::Empty),
        1 => Ok((prp1, 0)),
        2 => Ok((prp1, second)),
        _ => Ok((prp1, list_iova)),
    }
}

/// The part of `chunks` that covers bytes `start..start+len` of their concatenation, for
/// splitting a request into commands.
pub fn clip(chunks: &[(u64, u32)], start: u64, len: u64) -> impl Iterator<Item = (u64, u32)> + '_ {
    let end = start + len;
    let mut pos = 0u64;
    chunks.iter().filter_map(move |&(iova, clen)| {
        let c_start = pos;
        let c_end = pos + u64::from(clen);
        pos = c_end;
        let lo = c_start.max(start);
        let hi = c_end.min(end);
        (lo < hi).then(|| (iova + (lo - c_start), (hi - lo) as u32))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(chunks: &[(u64, u32)]) -> Result<(u64, u64, Vec<u64>), PrpError> {
        let mut list = Vec::new();
        let (p1, p2) = build_prp(chunks.iter().copied(), 0xdead_0000, |i, e| {
            assert_eq!(i, list.len());
            list.push(e);
        })?;
        Ok((p1, p2, list))
    }

    #[test]
    fn one_and_two_pages() {
        assert_eq!(build(&[(0x10000, 4096)]).unwrap(), (0x10000, 0, vec![]));
        assert_eq!(build(&[(0x10200, 512)]).unwrap(), (0x10200, 0, vec![]));
        // Unaligned 4 KiB spans two pages.
        let (p1, p2, _) = build(&[(0x10200, 4096)]).unwrap();
        assert_eq!((p1, p2), (0x10200, 0x11000));
        let (p1, p2, _) = build(&[(0x10000, 8192)]).unwrap();
        assert_eq!((p1, p2), (0x10000, 0x11000));
    }

    #[test]
    fn list_for_more_than_two_pages() {
        // 1 MiB in 256 separate pages (as from a guest) and as one contiguous chunk.
        let pages: Vec<(u64, u32)> = (0..256u64).map(|i| (0x100000 + i * 0x3000, 4096)).collect();
        let (p1, p2, list) = build(&pages).unwrap();
        assert_eq!((p1, p2), (0x100000, 0xdead_0000));
        assert_eq!(list.len(), 255);
        assert_eq!(list[0], 0x103000);
        assert_eq!(list[254], 0x100000 + 255 * 0x3000);
        let (_, _, list) = build(&[(0x200000, 1 << 20)]).unwrap();
        assert_eq!(list.len(), 255);
        // Unaligned start: 257 pages.
        let (p1, _, list) = build(&[(0x200800, 1 << 20)]).unwrap();
        assert_eq!(p1, 0x200800);
        assert_eq!(list.len(), 256);
        assert_eq!(*list.last().unwrap(), 0x300000);
    }

    #[test]
    fn layout_rules() {
        assert!(prp_compatible([(0x1000, 4096), (0x5000, 100)]));
        assert!(prp_compatible([(0x1e00, 512), (0x5000, 4096)]));
        assert!(!prp_compatible([(0x1002, 512)]), "not dword aligned");
        assert!(!prp_compatible([(0x1000, 512), (0x5000, 4096)]), "first ends mid-page");
        assert!(!prp_compatible([(0x1000, 4096), (0x5200, 512)]), "second starts mid-page");
        assert!(!prp_compatible([]));
        assert_eq!(build(&[(0x1000, 512), (0x5000, 4096)]), Err(PrpError::Layout));
        assert_eq!(build(&[]), Err(PrpError::Empty));
        assert_eq!(build(&[(0x0, 514 * 4096)]).map(|_| ()), Err(PrpError::TooLong));
        assert!(build(&[(0x0, 513 * 4096)]).is_ok(), "PRP1 + 512 list entries");
    }

    #[test]
    fn clipping() {
        let chunks = [(0x1000, 4096), (0x8000, 8192), (0x20000, 4096)];
        let c: Vec<_> = clip(&chunks, 0, 16384).collect();
        assert_eq!(c, chunks.to_vec());
        let c: Vec<_> = clip(&chunks, 2048, 8192).collect();
        assert_eq!(c, vec![(0x1800, 2048), (0x8000, 6144)]);
        let c: Vec<_> = clip(&chunks, 10240, 6144).collect();
        assert_eq!(c, vec![(0x9800, 2048), (0x20000, 4096)]);
        // Every piece of a compatible list stays compatible.
        let big = [(0x100200, (3 << 20) - 512)];
        for k in 0..3u64 {
            let piece: Vec<_> = clip(&big, k << 20, 1 << 20).collect();
            assert!(prp_compatible(piece.iter().copied()));
            assert!(build(&piece).is_ok());
        }
    }
}
