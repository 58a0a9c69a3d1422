//! Compiles the C++ class NIXL instantiates (shim/plugin.cpp) into the plugin.

fn main() {
    println!("cargo:rerun-if-changed=shim/plugin.cpp");
    println!("cargo:rerun-if-changed=shim/nixl_abi.h");
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .file("shim/plugin.cpp")
        .define(
            "KVF_VERSION",
            Some(format!("\"{}\"", env!("CARGO_PKG_VERSION")).as_str()),
        )
        .flag_if_supported("-fvisibility=hidden")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .compile("kvfabric_nixl_shim");
}
