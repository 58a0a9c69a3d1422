//! The generated gRPC code is committed (building needs no protoc); it must match the .proto files.

use std::path::Path;

#[test]
fn committed_grpc_code_is_up_to_date() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir().unwrap();
    tonic_prost_build::configure()
        .out_dir(out.path())
        .compile_protos(
            &[
                root.join("proto/csi/v1/csi.proto"),
                root.join("proto/pluginregistration/api.proto"),
            ],
            &[root.join("proto")],
        )
        .expect("protoc runs (apt-get install protobuf-compiler)");
    let mut stale = Vec::new();
    for file in ["csi.v1.rs", "pluginregistration.rs"] {
        let generated = std::fs::read_to_string(out.path().join(file)).unwrap();
        let committed_path = root.join("src/gen").join(file);
        if std::env::var_os("KVFABRIC_BLESS").is_some() {
            std::fs::write(&committed_path, &generated).unwrap();
        }
        if std::fs::read_to_string(&committed_path).unwrap_or_default() != generated {
            stale.push(committed_path.display().to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "{stale:?} stale or missing: run `KVFABRIC_BLESS=1 cargo test -p kvfabric-csi --test \
         proto_fresh` and commit the result"
    );
}
