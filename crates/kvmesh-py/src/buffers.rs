//! Byte views of Python buffers that stay usable with the GIL released.
//!
//! pyo3's safe accessors (`as_slice`, `copy_to_slice`) need the GIL, but the connector copies
//! whole KV blocks (tens of MB in one engine step) between vLLM's tensors and the CPU tier, and
//! those copies must not stop vLLM's other threads. This is the crate's one `unsafe` code: each
//! view is checked for what makes it sound (a C-contiguous buffer of bytes, writable for a
//! mutable view), and it borrows the `PyBuffer`, which keeps the exporter's memory alive for as
//! long as the view exists. What the checks cannot see is left to the caller, who passes buffers
//! it owns (a tensor it just allocated): nobody else writes that memory during the call.
#![allow(unsafe_code)]

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

fn check(buf: &PyBuffer<u8>) -> PyResult<()> {
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err(
            "buffer must be C-contiguous (call .contiguous() on the tensor)",
        ));
    }
    Ok(())
}

/// The buffer's bytes, readable without the GIL.
pub(crate) fn bytes(buf: &PyBuffer<u8>) -> PyResult<&[u8]> {
    check(buf)?;
    let len = buf.len_bytes();
    if len == 0 {
        return Ok(&[]);
    }
    let ptr = buf.buf_ptr().cast::<u8>().cast_const();
    // SAFETY: `ptr` is the start of `len` contiguous bytes (checked above) that the exporter
    // keeps allocated while `buf`, which the returned slice borrows, is alive. Writers other
    // than the caller are excluded by this module's contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// The buffer's bytes, writable without the GIL.
pub(crate) fn bytes_mut(buf: &mut PyBuffer<u8>) -> PyResult<&mut [u8]> {
    check(buf)?;
    if buf.readonly() {
        return Err(PyValueError::new_err("buffer must be writable"));
    }
    let len = buf.len_bytes();
    if len == 0 {
        return Ok(&mut []);
    }
    let ptr = buf.buf_ptr().cast::<u8>();
    // SAFETY: as in `bytes`, and the exporter declared the memory writable; the `&mut` borrow
    // of `buf` makes this the only view this crate hands out until it ends.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
}
