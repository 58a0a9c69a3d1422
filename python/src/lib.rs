//! `kvfabric._native`: the Rust half of the `kvfabric` Python package (see python/README.md).

mod agent;
mod batch;
mod buffer;
mod client;
mod error;
mod pulls;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<buffer::HostBuffer>()?;
    m.add_class::<client::Client>()?;
    m.add_class::<client::CudaRegion>()?;
    m.add_class::<client::Region>()?;
    m.add_class::<client::Segment>()?;
    m.add_class::<client::Ops>()?;
    m.add_class::<client::Transfer>()?;
    m.add_class::<client::SegmentEvent>()?;
    m.add_class::<client::Watch>()?;
    m.add_class::<pulls::Pulls>()?;
    m.add_class::<pulls::Pulled>()?;
    m.add_function(wrap_pyfunction!(client::columns, m)?)?;
    m.add_function(wrap_pyfunction!(client::block_table, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
