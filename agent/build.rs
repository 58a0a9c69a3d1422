// Generates the gRPC code of agent/proto at build time (protoc is installed by scripts/test.sh and
// scripts/bench.sh; etcd-client's own build needs it too).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        .compile_protos(&["proto/kvfabric/v1/agent.proto"], &["proto"])?;
    Ok(())
}
