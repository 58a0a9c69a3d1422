//! The CRD committed in the chart must match the Rust types.

#[test]
fn committed_crd_is_up_to_date() {
    let path = kvfabric_crds::crd_yaml_path();
    let generated = kvfabric_crds::crd_yaml().expect("CRD renders");
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is stale or missing: run `cargo run -p kvfabric-crds --bin crdgen` and commit the result",
        path.display()
    );
}
