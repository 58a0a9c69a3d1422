//! The binary's exits: 0 for --help, 64 (EX_USAGE) for a bad or missing setting.

use std::process::Command;

fn run(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvfabric-csi"))
        .args(args)
        .env_remove("KVFABRIC_NODE_NAME")
        .output()
        .expect("runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text)
}

#[test]
fn help_is_success_and_bad_settings_exit_64() {
    let (code, text) = run(&["--help"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("--kubelet-dir"), "{text}");
    let (code, text) = run(&[]);
    assert_eq!(code, Some(64), "no node id: {text}");
    let (code, text) = run(&["--node-id", "n", "--max-volumes", "0"]);
    assert_eq!(code, Some(64), "{text}");
    assert!(text.contains("--max-volumes"), "{text}");
    let (code, text) = run(&["--node-id", "n", "--socket-root", "relative"]);
    assert_eq!(code, Some(64), "{text}");
}
