//! Writes the TransferFabric CRD into the Helm chart (`charts/kvfabric/crds/`).
#![forbid(unsafe_code)]

use std::process::ExitCode;

fn main() -> ExitCode {
    let path = kvfabric_crds::crd_yaml_path();
    let result = kvfabric_crds::crd_yaml().and_then(|yaml| {
        std::fs::write(&path, yaml).map_err(|source| kvfabric_crds::Error::Io {
            path: path.display().to_string(),
            source,
        })
    });
    match result {
        Ok(()) => {
            println!("wrote {}", path.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("crdgen: {e}");
            ExitCode::FAILURE
        }
    }
}
