//! glibc malloc's mmap threshold, fixed at startup (issue 37, the amplification bound).
//!
//! Why: by default glibc raises its mmap threshold to the size of every mmapped block it frees
//! (up to 32 MiB). After one large request, the next one's buffers of that size (the body, a
//! decoded message, the rendered prompt, serde_json's scratch) come from the heap instead, and
//! what they free there stays resident. The same 16 MiB body then cost a router 1x to 5x itself
//! in peak RSS depending on what earlier requests had freed (measured on the debug build; 2x
//! and 3x with the threshold fixed, in every order tried). A fixed threshold keeps blocks of
//! [`MMAP_THRESHOLD`] and more in their own mappings, returned to the system when freed.
//! 4 MiB, not less: per-block KV buffers and most per-request vectors stay on the heap, where
//! reusing freed memory is cheaper than mapping fresh zeroed pages.

/// Blocks at least this large are always mmapped (glibc's default starts at 128 KiB and moves).
pub const MMAP_THRESHOLD: usize = 4 << 20;

/// Fixes the threshold. Called first in `main`, before any large allocation. An operator's own
/// `MALLOC_MMAP_THRESHOLD_` / `GLIBC_TUNABLES` setting is left as it is.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn fix_mmap_threshold() {
    let operator_set = std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some()
        || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("mmap_threshold"));
    if operator_set {
        return;
    }
    let Ok(threshold) = libc::c_int::try_from(MMAP_THRESHOLD) else {
        return;
    };
    // SAFETY: `mallopt` sets one malloc parameter and takes plain integers; no pointer is
    // involved. It returns 0 on failure, which only leaves glibc's default in place.
    let _ = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, threshold) };
}

/// Elsewhere (musl, macOS) there is no glibc threshold to fix.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn fix_mmap_threshold() {}
