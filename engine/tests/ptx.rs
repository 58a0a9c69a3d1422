//! copy.ptx is generated from copy.cu (scripts/gen-ptx.sh) and committed, because the engine
//! loads it at run time. This fails when copy.cu changed and the PTX was not regenerated.

use sha2::{Digest, Sha256};

const CU: &str = include_str!("../src/cuda/copy.cu");
const PTX: &str = include_str!("../src/cuda/copy.ptx");

#[test]
fn committed_ptx_was_generated_from_the_current_copy_cu() {
    let hash: String = Sha256::digest(CU.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let recorded = PTX
        .lines()
        .find_map(|l| l.strip_prefix("// copy.cu sha256: "))
        .expect("copy.ptx records the hash of the copy.cu it came from");
    assert_eq!(
        recorded.trim(),
        hash,
        "copy.ptx is stale: run scripts/gen-ptx.sh and commit engine/src/cuda/copy.ptx"
    );
    for kernel in ["kvf_copy", "kvf_copy_table", "kvf_fill", "kvf_verify"] {
        assert!(
            PTX.contains(&format!(".entry {kernel}(")),
            "copy.ptx lacks {kernel}"
        );
    }
}

/// With an nvcc at hand (NVCC=/path/to/nvcc), regenerating must give the committed text.
#[test]
fn regenerating_with_nvcc_reproduces_the_committed_ptx() {
    let Ok(nvcc) = std::env::var("NVCC") else {
        println!("skipped: set NVCC to an nvcc binary to regenerate copy.ptx");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("copy.ptx");
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/src/cuda/copy.cu");
    let status = std::process::Command::new(nvcc)
        .args(["-arch=compute_90", "--ptx", "-O3", "-o"])
        .arg(&out)
        .arg(src)
        .status()
        .unwrap();
    assert!(status.success());
    let fresh = std::fs::read_to_string(out).unwrap();
    let committed: String = PTX.lines().skip(2).map(|l| format!("{l}\n")).collect();
    assert_eq!(
        fresh.trim_end(),
        committed.trim_end(),
        "copy.ptx differs from nvcc's output"
    );
}
