//! Batch-invariant f32 kernels: matrix multiply against packed weights, dot products,
//! RMSNorm, rotary embeddings, SiLU.
//!
//! # Why our own kernels
//!
//! A sequence's tokens must not depend on which other sequences share its step (DESIGN.md,
//! "Preemption is invisible"). BLAS-style GEMMs pick their reduction order by the shape of
//! the whole batch (split-K, different micro-kernels for the edge rows, a GEMV path for one
//! row), so a row's result changes in the last bits with the batch size; candle 0.11 on this
//! CPU differed in 93–95 % of outputs (measured before this engine was written; no script in
//! the repository reproduces it, docs/llm.md "Why our own kernels"). Here every output element of a
//! matrix multiply is accumulated by **one fused multiply-add per k, in ascending k**, in
//! every code path: the AVX-512 micro-kernel (8 rows × 32 columns), its edge variants for
//! fewer rows, and the scalar fallback (`f32::mul_add`, which rounds exactly as `vfmadd`).
//! K-blocking stores and reloads the partial sums, which is exact. So the result of a row is
//! bit-identical whatever the batch, the row's position in it, the thread count, and the
//! instruction set the dispatcher picked.
//!
//! Reductions along a row (dot products of attention, RMSNorm's sum of squares) use 16
//! lanes, each a sequential fused sum, folded in a fixed tree: again the same for every row
//! whatever else is in the step.
//!
//! # Layout
//!
//! Weights are packed once at load time ([`PackedMatrix`]): the `[out, in]` matrix of a
//! checkpoint becomes panels of 32 output columns, each `[in][32]` contiguous, so the
//! micro-kernel streams one panel while it broadcasts activations.

use std::sync::OnceLock;

use rayon::prelude::*;

/// Output columns per packed panel.
pub const PANEL: usize = 32;
/// K-block: the panel slice (`KC × 32 × 4` bytes = 32 KiB) stays in L1 across row blocks.
const KC: usize = 256;
/// Rows per micro-kernel call.
const MR: usize = 8;
/// Below this many multiply-adds a matmul runs on the calling thread.
const PARALLEL_MIN_FMAS: usize = 1 << 18;

/// Instruction set the kernels run with (chosen once per process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F with FMA.
    Avx512,
    /// AVX2 with FMA (the lane code is compiled for it; the matmul uses the portable kernel
    /// compiled with these features).
    Avx2,
    /// Portable code (`f32::mul_add`; slow without hardware FMA, same bits).
    Scalar,
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2+fma",
            Isa::Scalar => "scalar",
        })
    }
}

/// The instruction set in use. `FASTLANE_LLM_ISA=scalar|avx2|avx512` overrides detection
/// (a level the CPU lacks is ignored).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let want = std::env::var("FASTLANE_LLM_ISA").ok();
        detect(want.as_deref())
    })
}

#[cfg(target_arch = "x86_64")]
fn detect(want: Option<&str>) -> Isa {
    let has512 = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma");
    let has2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
    match want {
        Some("scalar") => Isa::Scalar,
        Some("avx2") if has2 => Isa::Avx2,
        _ if has512 && want != Some("avx2") => Isa::Avx512,
        _ if has2 => Isa::Avx2,
        _ => Isa::Scalar,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect(_want: Option<&str>) -> Isa {
    Isa::Scalar
}

/// A `[n, k]` weight matrix (checkpoint layout: `n` outputs of `k` inputs) packed in panels
/// of [`PANEL`] outputs, `[panel][k][PANEL]`, zero-padded to a whole panel.
#[derive(Clone)]
pub struct PackedMatrix {
    n: usize,
    k: usize,
    data: Vec<f32>,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix").field("n", &self.n).field("k", &self.k).finish()
    }
}

impl PackedMatrix {
    /// Packs a row-major `[n, k]` matrix.
    pub fn pack(w: &[f32], n: usize, k: usize) -> PackedMatrix {
        assert_eq!(w.len(), n * k, "matrix of {n}x{k} from {} values", w.len());
        let panels = n.div_ceil(PANEL);
        let mut data = vec![0.0f32; panels * k * PANEL];
        for j in 0..n {
            let (p, c) = (j / PANEL, j % PANEL);
            let base = p * k * PANEL + c;
            for (kk, &v) in w[j * k..(j + 1) * k].iter().enumerate() {
                data[base + kk * PANEL] = v;
            }
        }
        PackedMatrix { n, k, data }
    }

    /// Stacks matrices with the same `k` along `n` (fused projections: Q|K|V, gate|up).
    pub fn pack_stacked(parts: &[(&[f32], usize)], k: usize) -> PackedMatrix {
        let n: usize = parts.iter().map(|p| p.1).sum();
        let mut all = Vec::with_capacity(n * k);
        for (w, rows) in parts {
            assert_eq!(w.len(), rows * k);
            all.extend_from_slice(w);
        }
        PackedMatrix::pack(&all, n, k)
    }

    /// Outputs.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Inputs.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes of packed weights (what one pass over the matrix reads).
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }

    /// Output `j`'s weight for input `kk` (tests).
    pub fn get(&self, j: usize, kk: usize) -> f32 {
        self.data[(j / PANEL) * self.k * PANEL + kk * PANEL + j % PANEL]
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: each task writes a disjoint set of output columns (its panels); the pointer is
// only used inside `matmul`, which returns after every task has finished.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so closures capture the whole `SendPtr`, not its field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `y[m, n] = x[m, k] · Wᵀ` (row-major `x` and `y`). Batch-invariant (module docs).
pub fn matmul(x: &[f32], m: usize, w: &PackedMatrix, y: &mut [f32]) {
    let (n, k) = (w.n, w.k);
    assert!(x.len() >= m * k, "x holds {} values, need {m}x{k}", x.len());
    assert!(y.len() >= m * n, "y holds {} values, need {m}x{n}", y.len());
    if m == 0 || n == 0 {
        return;
    }
    let panels = n.div_ceil(PANEL);
    let out = SendPtr(y.as_mut_ptr());
    let isa = isa();
    let run = |p0: usize, p1: usize| {
        let mut p = p0;
        while p < p1 {
            // One row (a decode): two panels at once, two weight streams per core.
            #[cfg(target_arch = "x86_64")]
            if m == 1 && isa == Isa::Avx512 && p + 1 < p1 && (p + 2) * PANEL <= n {
                let a = &w.data[p * k * PANEL..(p + 1) * k * PANEL];
                let b = &w.data[(p + 1) * k * PANEL..(p + 2) * k * PANEL];
                // SAFETY: the CPU has AVX-512F and FMA; panels p and p+1 are whole (checked),
                // so columns p*32..p*32+64 of row 0 are inside y and this task's own.
                unsafe { avx512::row_two_panels(&x[..k], a, b, out.get().wrapping_add(p * PANEL)) };
                p += 2;
                continue;
            }
            // SAFETY: panel p writes columns p*32..min(n, p*32+32) of rows 0..m of y, which
            // has m*n values (asserted above); tasks own disjoint panel ranges.
            unsafe { panel_rows(isa, x, m, k, w, p, out.get(), n) };
            p += 1;
        }
    };
    if m * n * k < PARALLEL_MIN_FMAS || panels == 1 {
        run(0, panels);
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    // A few tasks per thread so an uneven split evens out; never fewer panels than 1.
    let per = panels.div_ceil(threads * 2).max(1);
    (0..panels.div_ceil(per)).into_par_iter().for_each(|t| {
        let p0 = t * per;
        run(p0, (p0 + per).min(panels));
    });
}

/// One panel for all rows, K-blocked.
///
/// # Safety
///
/// `y` points at `m * n` writable floats that no one else touches in panel `p`'s columns.
#[allow(clippy::too_many_arguments)] // the kernel's geometry, passed flat on purpose
unsafe fn panel_rows(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &PackedMatrix,
    p: usize,
    y: *mut f32,
    n: usize,
) {
    let cols = (n - p * PANEL).min(PANEL);
    let panel = &w.data[p * k * PANEL..(p + 1) * k * PANEL];
    let mut k0 = 0;
    while k0 < k {
        let k1 = (k0 + KC).min(k);
        let mut r0 = 0;
        while r0 < m {
            let rows = (m - r0).min(MR);
            let job = Tile {
                x: &x[r0 * k..],
                ldx: k,
                panel,
                k0,
                k1,
                // SAFETY: row r0 column p*32 is inside y (r0 < m, p*32 < n).
                y: unsafe { y.add(r0 * n + p * PANEL) },
                ldy: n,
                rows,
                cols,
            };
            // SAFETY: the tile's rows and columns are inside y, owned by this panel's task.
            unsafe { tile(isa, &job) };
            r0 += rows;
        }
        k0 = k1;
    }
}

struct Tile<'a> {
    x: &'a [f32],
    ldx: usize,
    panel: &'a [f32],
    k0: usize,
    k1: usize,
    y: *mut f32,
    ldy: usize,
    rows: usize,
    cols: usize,
}

/// # Safety
///
/// `t.y` addresses `t.rows` rows of `t.ldy` floats with `t.cols` writable columns each.
unsafe fn tile(isa: Isa, t: &Tile<'_>) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        let kernel: unsafe fn(&Tile<'_>) = match t.rows {
            8 => avx512::tile::<8>,
            7 => avx512::tile::<7>,
            6 => avx512::tile::<6>,
            5 => avx512::tile::<5>,
            4 => avx512::tile::<4>,
            3 => avx512::tile::<3>,
            2 => avx512::tile::<2>,
            _ => avx512::tile::<1>,
        };
        // SAFETY: the CPU has AVX-512F and FMA (`detect`); `t.rows` matches the kernel's
        // row count; the caller guarantees `t.y`.
        unsafe { kernel(t) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: the CPU has AVX2 and FMA; the caller guarantees `t.y`.
        unsafe { tile_avx2(t) };
        return;
    }
    // SAFETY: the caller guarantees `t.y`.
    unsafe { tile_portable(t) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
/// # Safety
///
/// As [`tile`], on a CPU with AVX2 and FMA.
unsafe fn tile_avx2(t: &Tile<'_>) {
    // SAFETY: forwarded.
    unsafe { tile_portable(t) }
}

/// The reference kernel: per output, `acc = fma(x[k], w[k], acc)` for k ascending.
///
/// # Safety
///
/// As [`tile`].
#[inline(always)]
unsafe fn tile_portable(t: &Tile<'_>) {
    let mut acc = [[0.0f32; PANEL]; MR];
    for (r, a) in acc.iter_mut().enumerate().take(t.rows) {
        if t.k0 > 0 {
            for (c, v) in a.iter_mut().enumerate().take(t.cols) {
                // SAFETY: row r < rows, column c < cols (caller's contract).
                *v = unsafe { *t.y.wrapping_add(r * t.ldy + c) };
            }
        }
    }
    for kk in t.k0..t.k1 {
        let w = &t.panel[kk * PANEL..kk * PANEL + PANEL];
        for (r, a) in acc.iter_mut().enumerate().take(t.rows) {
            let xv = t.x[r * t.ldx + kk];
            for c in 0..PANEL {
                a[c] = xv.mul_add(w[c], a[c]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate().take(t.rows) {
        for (c, v) in a.iter().enumerate().take(t.cols) {
            // SAFETY: as above.
            unsafe { *t.y.wrapping_add(r * t.ldy + c) = *v };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Tile, PANEL};

    /// `R` rows × 32 columns: two zmm accumulators per row, one FMA per k each.
    ///
    /// # Safety
    ///
    /// AVX-512F and FMA present; `t.y` as in [`super::tile`]; `t.rows == R`.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn tile<const R: usize>(t: &Tile<'_>) {
        let mask: __mmask16 = if t.cols >= 16 { 0xffff } else { ((1u32 << t.cols) - 1) as u16 };
        let mask_hi: __mmask16 = match t.cols {
            32.. => 0xffff,
            0..=16 => 0,
            c => ((1u32 << (c - 16)) - 1) as u16,
        };
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        if t.k0 > 0 {
            for (r, a) in acc.iter_mut().enumerate() {
                let row = t.y.wrapping_add(r * t.ldy);
                // SAFETY: row r < R = rows of the tile; the mask covers only columns < cols.
                a[0] = unsafe { _mm512_maskz_loadu_ps(mask, row) };
                // SAFETY: as above, columns 16.. under `mask_hi`.
                a[1] = unsafe { _mm512_maskz_loadu_ps(mask_hi, row.wrapping_add(16)) };
            }
        }
        let xp = t.x.as_ptr();
        let wp = t.panel.as_ptr();
        // The loop reads x[r * ldx + kk] for r < R and panel[kk * 32 .. kk * 32 + 32] for
        // kk < k1: both inside their slices, which the caller cut to these sizes.
        assert!(t.x.len() >= (R - 1) * t.ldx + t.k1 && t.panel.len() >= t.k1 * PANEL);
        for kk in t.k0..t.k1 {
            // SAFETY: kk < k1, so the 32 panel values are in bounds (asserted above).
            let b0 = unsafe { _mm512_loadu_ps(wp.wrapping_add(kk * PANEL)) };
            // SAFETY: as above.
            let b1 = unsafe { _mm512_loadu_ps(wp.wrapping_add(kk * PANEL + 16)) };
            for a in acc.iter_mut().enumerate() {
                let (r, a) = a;
                // SAFETY: r < R and kk < k1: in bounds (asserted above).
                let xv = _mm512_set1_ps(unsafe { *xp.wrapping_add(r * t.ldx + kk) });
                a[0] = _mm512_fmadd_ps(xv, b0, a[0]);
                a[1] = _mm512_fmadd_ps(xv, b1, a[1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let row = t.y.wrapping_add(r * t.ldy);
            // SAFETY: as for the loads.
            unsafe { _mm512_mask_storeu_ps(row, mask, a[0]) };
            // SAFETY: as for the loads.
            unsafe { _mm512_mask_storeu_ps(row.wrapping_add(16), mask_hi, a[1]) };
        }
    }

    /// [`fold`](super::fold) of one register: lanes `l + w` into `l` for w = 8, 4, 2, 1.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn fold16(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
        _mm_cvtss_f32(s1)
    }

    /// [`super::attend_head`] for a head of `V` × 16 floats.
    ///
    /// # Safety
    ///
    /// AVX-512F and FMA present; `q` and `out` hold `V * 16` floats, and so does every slice
    /// `key` and `value` return.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn attend<'a, const V: usize>(
        q: &[f32],
        n: usize,
        key: impl Fn(usize) -> &'a [f32],
        value: impl Fn(usize) -> &'a [f32],
        scale: f32,
        sc: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        assert!(q.len() == V * 16 && out.len() == V * 16);
        let mut qv = [_mm512_setzero_ps(); V];
        for (c, r) in qv.iter_mut().enumerate() {
            // SAFETY: c * 16 + 16 <= q.len() (asserted).
            *r = unsafe { _mm512_loadu_ps(q.as_ptr().wrapping_add(c * 16)) };
        }
        sc.clear();
        let mut max = f32::NEG_INFINITY;
        for j in 0..n {
            let k = key(j);
            assert!(k.len() == V * 16);
            let mut acc = _mm512_setzero_ps();
            for (c, qc) in qv.iter().enumerate() {
                // SAFETY: c * 16 + 16 <= k.len() (asserted).
                let kc = unsafe { _mm512_loadu_ps(k.as_ptr().wrapping_add(c * 16)) };
                acc = _mm512_fmadd_ps(*qc, kc, acc);
            }
            let v = fold16(acc) * scale;
            max = max.max(v);
            sc.push(v);
        }
        let mut sum = 0.0f32;
        for v in sc.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        let mut o = [_mm512_setzero_ps(); V];
        for (j, &e) in sc.iter().enumerate() {
            let vals = value(j);
            assert!(vals.len() == V * 16);
            let ev = _mm512_set1_ps(e);
            for (c, oc) in o.iter_mut().enumerate() {
                // SAFETY: c * 16 + 16 <= vals.len() (asserted).
                let vc = unsafe { _mm512_loadu_ps(vals.as_ptr().wrapping_add(c * 16)) };
                *oc = _mm512_fmadd_ps(ev, vc, *oc);
            }
        }
        let inv = _mm512_set1_ps(1.0 / sum);
        for (c, oc) in o.iter().enumerate() {
            let r = _mm512_mul_ps(*oc, inv);
            // SAFETY: c * 16 + 16 <= out.len() (asserted).
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().wrapping_add(c * 16), r) };
        }
    }

    /// One row against two whole panels (64 outputs at `y`), over all of k: per output one
    /// FMA per k in ascending k, exactly as [`tile`] does, so the result is the same bits.
    ///
    /// # Safety
    ///
    /// AVX-512F and FMA present; `a` and `b` hold `x.len() * 32` floats; `y..y+64` writable.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn row_two_panels(x: &[f32], a: &[f32], b: &[f32], y: *mut f32) {
        let k = x.len();
        assert!(a.len() >= k * PANEL && b.len() >= k * PANEL);
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        for (kk, &xk) in x.iter().enumerate() {
            let xv = _mm512_set1_ps(xk);
            // SAFETY: kk < k, so the 32 floats of row kk of each panel are in bounds
            // (asserted above).
            let a0 = unsafe { _mm512_loadu_ps(pa.wrapping_add(kk * PANEL)) };
            // SAFETY: as above.
            let a1 = unsafe { _mm512_loadu_ps(pa.wrapping_add(kk * PANEL + 16)) };
            // SAFETY: as above.
            let b0 = unsafe { _mm512_loadu_ps(pb.wrapping_add(kk * PANEL)) };
            // SAFETY: as above.
            let b1 = unsafe { _mm512_loadu_ps(pb.wrapping_add(kk * PANEL + 16)) };
            acc[0] = _mm512_fmadd_ps(xv, a0, acc[0]);
            acc[1] = _mm512_fmadd_ps(xv, a1, acc[1]);
            acc[2] = _mm512_fmadd_ps(xv, b0, acc[2]);
            acc[3] = _mm512_fmadd_ps(xv, b1, acc[3]);
        }
        for (i, v) in acc.iter().enumerate() {
            // SAFETY: y..y+64 is writable (caller's contract); i * 16 + 16 <= 64.
            unsafe { _mm512_storeu_ps(y.wrapping_add(i * 16), *v) };
        }
    }
}

/// One query head's attention over keys `0..n` with the AVX-512 kernel when this CPU runs it
/// and the head is 32, 64 or 128 wide; `false` (nothing written) otherwise, and the caller runs
/// the lane code. The operations are those of the lane code: each score is [`dot`] (16 lanes,
/// one FMA per element in ascending order, the same fold) times `scale`, the softmax is the
/// same scalar code, and each output element is one FMA per key in ascending key order, so
/// the result is the same bits. What differs is where the output lives: in registers for the
/// whole run of keys, not in memory (the lane code's `axpy` reloads and stores `out` for every
/// key, a store-to-load chain that made it most of a prefill's attention time).
pub(crate) fn attend_head<'a>(
    q: &[f32],
    n: usize,
    key: impl Fn(usize) -> &'a [f32],
    value: impl Fn(usize) -> &'a [f32],
    scale: f32,
    sc: &mut Vec<f32>,
    out: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 && out.len() == q.len() {
        match q.len() {
            // SAFETY: the CPU has AVX-512F and FMA; q and out are 2 × 16 floats.
            32 => unsafe { avx512::attend::<2>(q, n, key, value, scale, sc, out) },
            // SAFETY: as above, 4 × 16 floats.
            64 => unsafe { avx512::attend::<4>(q, n, key, value, scale, sc, out) },
            // SAFETY: as above, 8 × 16 floats.
            128 => unsafe { avx512::attend::<8>(q, n, key, value, scale, sc, out) },
            _ => return false,
        }
        return true;
    }
    let _ = (q, n, &key, &value, scale, sc, out);
    false
}

/// Lanes of the row reductions.
const LANES: usize = 16;

/// Dot product in 16 sequential lanes folded in a fixed tree (the same result for the same
/// inputs wherever it runs).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let chunks = a.len() / LANES;
    for i in 0..chunks {
        let (ca, cb) = (&a[i * LANES..i * LANES + LANES], &b[i * LANES..i * LANES + LANES]);
        for l in 0..LANES {
            acc[l] = ca[l].mul_add(cb[l], acc[l]);
        }
    }
    for i in chunks * LANES..a.len() {
        let l = i % LANES;
        acc[l] = a[i].mul_add(b[i], acc[l]);
    }
    fold(acc)
}

#[inline(always)]
fn fold(mut acc: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

/// `out += s * v` elementwise (lane-wise fused, so it vectorises without reordering).
#[inline(always)]
pub fn axpy(out: &mut [f32], s: f32, v: &[f32]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o = s.mul_add(*x, *o);
    }
}

/// Defines `fn $name` that runs `$imp` compiled for the process's instruction set: the
/// lane code inlined into it (`dot`, `axpy`, `mul_add`) becomes vector FMAs instead of
/// `fmaf` calls. `$imp` must be `#[inline(always)]`.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) = $imp:path;) => {
        $(#[$m])*
        $vis fn $name($($a: $t),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn v512($($a: $t),*) {
                    $imp($($a),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v2($($a: $t),*) {
                    $imp($($a),*)
                }
                match $crate::kernels::isa() {
                    // SAFETY: `isa()` saw AVX-512F and FMA on this CPU.
                    $crate::kernels::Isa::Avx512 => return unsafe { v512($($a),*) },
                    // SAFETY: `isa()` saw AVX2 and FMA on this CPU.
                    $crate::kernels::Isa::Avx2 => return unsafe { v2($($a),*) },
                    $crate::kernels::Isa::Scalar => {}
                }
            }
            $imp($($a),*)
        }
    };
}
pub(crate) use multiversion;

multiversion! {
    /// RMSNorm of each of the `rows` rows of `x` (width `w.len()`) into `out`.
    pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, rows: usize, out: &mut [f32]) = rms_norm_impl;
}

#[inline(always)]
fn rms_norm_impl(x: &[f32], w: &[f32], eps: f32, rows: usize, out: &mut [f32]) {
    let d = w.len();
    for r in 0..rows {
        let xr = &x[r * d..(r + 1) * d];
        let ss = dot(xr, xr);
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, xv), wv) in out[r * d..(r + 1) * d].iter_mut().zip(xr).zip(w) {
            *o = (xv * inv) * wv;
        }
    }
}

/// Rotary embedding tables: `cos[pos][i]`, `sin[pos][i]` for `i < head_dim / 2`.
#[derive(Debug, Clone)]
pub struct Rope {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    /// Tables for `positions` positions, Hugging Face Llama convention (rotate-half, the
    /// frequency of pair `i` is `theta^(-2i/d)`).
    pub fn new(head_dim: usize, theta: f64, positions: usize) -> Rope {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for i in 0..half {
                let inv = theta.powf(-((2 * i) as f64) / head_dim as f64);
                let a = p as f64 * inv;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Rope { half, cos, sin }
    }

    /// Positions covered.
    pub fn positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotates one head vector `v` (length `2 * half`) for position `pos`.
    #[inline(always)]
    pub fn apply(&self, v: &mut [f32], pos: usize) {
        let h = self.half;
        let (c, s) = (&self.cos[pos * h..(pos + 1) * h], &self.sin[pos * h..(pos + 1) * h]);
        let (lo, hi) = v.split_at_mut(h);
        for i in 0..h {
            let (a, b) = (lo[i], hi[i]);
            lo[i] = a * c[i] - b * s[i];
            hi[i] = b * c[i] + a * s[i];
        }
    }
}

/// `gate[i] = silu(gate[i]) * up[i]` over rows of the fused `[gate | up]` output.
pub fn silu_mul(gu: &[f32], rows: usize, inter: usize, out: &mut [f32]) {
    for r in 0..rows {
        let g = &gu[r * 2 * inter..r * 2 * inter + inter];
        let u = &gu[r * 2 * inter + inter..(r + 1) * 2 * inter];
        for ((o, gv), uv) in out[r * inter..(r + 1) * inter].iter_mut().zip(g).zip(u) {
            *o = gv / (1.0 + (-gv).exp()) * uv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()
    }

    fn reference(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f32;
                for kk in 0..k {
                    acc = x[i * k + kk].mul_add(w[j * k + kk], acc);
                }
                y[i * n + j] = acc;
            }
        }
        y
    }

    #[test]
    fn matmul_is_the_sequential_fma_sum_bit_for_bit() {
        // Odd sizes: partial panels, partial row blocks, k not a multiple of KC.
        for &(m, n, k) in &[(1, 5, 3), (1, 130, 300), (3, 33, 300), (9, 70, 513), (17, 64, 256)] {
            let x = rand_vec(m * k, 1);
            let w = rand_vec(n * k, 2);
            let p = PackedMatrix::pack(&w, n, k);
            let mut y = vec![0.0; m * n];
            matmul(&x, m, &p, &mut y);
            let r = reference(&x, m, &w, n, k);
            for (i, (a, b)) in y.iter().zip(&r).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "({m},{n},{k}) element {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn a_row_is_the_same_alone_and_anywhere_in_a_batch() {
        let (n, k) = (200, 700);
        let w = PackedMatrix::pack(&rand_vec(n * k, 3), n, k);
        let rows = 37;
        let x = rand_vec(rows * k, 4);
        let mut all = vec![0.0; rows * n];
        matmul(&x, rows, &w, &mut all);
        for r in [0, 5, 8, 36] {
            let mut one = vec![0.0; n];
            matmul(&x[r * k..(r + 1) * k], 1, &w, &mut one);
            assert_eq!(one, all[r * n..(r + 1) * n], "row {r}");
        }
    }

    #[test]
    fn dot_matches_its_lane_definition_and_norm_is_unit_rms() {
        let a = rand_vec(77, 5);
        let b = rand_vec(77, 6);
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
        assert!((f64::from(dot(&a, &b)) - exact).abs() < 1e-4);
        let w = vec![1.0; 77];
        let mut out = vec![0.0; 77];
        rms_norm(&a, &w, 0.0, 1, &mut out);
        let ms: f32 = out.iter().map(|v| v * v).sum::<f32>() / 77.0;
        assert!((ms - 1.0).abs() < 1e-4, "{ms}");
    }

    #[test]
    fn rope_rotates_pairs_and_keeps_the_norm() {
        let rope = Rope::new(8, 10000.0, 16);
        let mut v = rand_vec(8, 7);
        let before: f32 = v.iter().map(|x| x * x).sum();
        let v0 = v.clone();
        rope.apply(&mut v, 0);
        assert_eq!(v, v0, "position 0 is the identity");
        rope.apply(&mut v, 5);
        let after: f32 = v.iter().map(|x| x * x).sum();
        assert!((before - after).abs() < 1e-5);
        assert_ne!(v, v0);
    }
}
