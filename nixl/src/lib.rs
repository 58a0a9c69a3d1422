//! kvfabric as a NIXL backend plugin (`libplugin_KVFABRIC.so`): an inference engine that moves
//! KV through NIXL (vLLM's NixlConnector, SGLang, Dynamo) gets kvfabric's agents by setting
//! `NIXL_PLUGIN_DIR` and `backends: ["KVFABRIC"]`, nothing else.
//!
//! NIXL instantiates the C++ class in `shim/plugin.cpp`, which forwards every call here
//! (`ffi`). What NIXL registers becomes a segment of the node's agent open to the fabric
//! (`Registration::fabric_access`): NIXL's metadata carries segment names and offsets, never
//! a key, and a peer reaches the memory only through an agent of the same fabric. Transfers
//! are agent batches (one per pair of segments), notifications go to the peer's inbox segment
//! (`Client::notify`), and the agent picks the path (shm, CUDA IPC, tcp, RDMA) per pair.
//!
//! Not offered yet (answered NIXL_ERR_NOT_SUPPORTED): VRAM registration, local transfers
//! (`supportsLocal` is false), memory views, cost estimates.

// The crate is named as NIXL names plugin files.
#![allow(non_snake_case)]

mod backend;
pub mod ffi;
mod fork;
mod metadata;
mod moved;
mod request;
mod status;

pub use status::Status;

unsafe extern "C" {
    /// The plugin table the C++ shim defines.
    fn kvf_shim_plugin() -> *mut std::ffi::c_void;
}

/// NIXL's entry point: the plugin table (API version, engine factory, name, version).
#[unsafe(no_mangle)]
pub extern "C" fn nixl_plugin_init() -> *mut std::ffi::c_void {
    // SAFETY: returns a pointer to a static table; no argument, no state.
    unsafe { kvf_shim_plugin() }
}

/// NIXL's exit point: nothing to release (engines are destroyed one by one).
#[unsafe(no_mangle)]
pub extern "C" fn nixl_plugin_fini() {}
