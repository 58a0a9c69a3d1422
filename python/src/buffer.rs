//! Host memory kvfabric allocates (a sealed memfd the agent maps too), exposed to Python through
//! the buffer protocol so numpy and torch view it without a copy.

use std::collections::BTreeMap;
use std::os::raw::c_int;
use std::sync::{Arc, Mutex, Weak};

use pyo3::ffi;
use pyo3::prelude::*;

use crate::agent::HostMemory;
use crate::error::{Error, Result};

/// Every live buffer by start address, so an array or tensor viewing one can be registered.
static LIVE: Mutex<BTreeMap<usize, Weak<HostMemory>>> = Mutex::new(BTreeMap::new());

/// `HostBuffer(nbytes)`: zeroed host memory transfers read and write in place.
///
/// View it with `numpy.frombuffer(buf, dtype)` or `torch.frombuffer(buf, dtype=...)`; arrays and
/// tensors made that way can be registered in its stead.
#[pyclass(module = "kvfabric._native", frozen, weakref)]
#[derive(Debug)]
pub struct HostBuffer {
    pub(crate) memory: Arc<HostMemory>,
}

fn start(m: &HostMemory) -> usize {
    // SAFETY: only the address is taken; no reference outlives this call.
    unsafe { m.as_slice() }.as_ptr() as usize
}

impl HostBuffer {
    /// The live buffer holding `[ptr, ptr + nbytes)`, and where that range starts in it.
    pub fn containing(ptr: usize, nbytes: u64) -> Option<(HostBuffer, u64)> {
        let live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
        let (&at, weak) = live.range(..=ptr).next_back()?;
        let memory = weak.upgrade()?;
        let offset = (ptr - at) as u64;
        (offset.checked_add(nbytes)? <= memory.len()).then_some((HostBuffer { memory }, offset))
    }
}

#[pymethods]
impl HostBuffer {
    /// The live buffer holding `nbytes` from address `ptr`, and the offset where they start.
    #[staticmethod]
    #[pyo3(name = "containing")]
    fn py_containing(ptr: usize, nbytes: u64) -> Option<(HostBuffer, u64)> {
        HostBuffer::containing(ptr, nbytes)
    }

    #[new]
    fn new(py: Python<'_>, nbytes: u64) -> Result<Self> {
        if nbytes == 0 {
            return Err(Error::invalid("nbytes", 0, "must be > 0"));
        }
        let memory = Arc::new(py.detach(|| HostMemory::alloc(nbytes))?);
        let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
        live.retain(|_, w| w.strong_count() > 0);
        live.insert(start(&memory), Arc::downgrade(&memory));
        Ok(HostBuffer { memory })
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.memory.len()
    }

    /// Address of the first byte in this process.
    #[getter]
    fn address(&self) -> usize {
        start(&self.memory)
    }

    fn __len__(&self) -> usize {
        self.memory.len() as usize
    }

    fn __repr__(&self) -> String {
        format!("HostBuffer(nbytes={})", self.memory.len())
    }

    /// # Safety
    /// Called by the interpreter with a view to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let memory = &slf.get().memory;
        let len = ffi::Py_ssize_t::try_from(memory.len())
            .map_err(|_| pyo3::exceptions::PyOverflowError::new_err("buffer too large"))?;
        // SAFETY: `view` is the interpreter's; the memory stays mapped while `slf` lives, and the
        // view holds a reference to `slf` (FillInfo takes one).
        let r = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                start(memory) as *mut std::ffi::c_void,
                len,
                0,
                flags,
            )
        };
        if r == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}
