//! The generated gRPC code is committed (so building needs no protoc); it must match the .proto.

use std::path::Path;

#[test]
fn committed_grpc_code_is_up_to_date() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir().unwrap();
    tonic_prost_build::configure()
        .out_dir(out.path())
        .compile_protos(
            &[root.join("kvfabric/v1/agent.proto")],
            &[root.to_path_buf()],
        )
        .expect("protoc runs (apt-get install protobuf-compiler)");
    let generated = std::fs::read_to_string(out.path().join("kvfabric.v1.rs")).unwrap();
    let committed_path = root.join("src/gen/kvfabric.v1.rs");
    if std::env::var_os("KVFABRIC_BLESS").is_some() {
        std::fs::write(&committed_path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is stale or missing: run `KVFABRIC_BLESS=1 cargo test -p kvfabric-proto --test \
         proto_fresh` and commit the result",
        committed_path.display()
    );
}
