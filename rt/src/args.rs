//! The command line of every kvfabric binary, parsed the same way: `--help` and `--version`
//! print and exit 0; anything else wrong prints clap's message and exits 64 (sysexits
//! EX_USAGE), as a bad setting found after parsing does.

use std::process::ExitCode;

/// sysexits EX_USAGE: the command line or environment is wrong.
pub const EXIT_USAGE: u8 = 64;

/// The parsed arguments, or the exit code a binary returns at once.
pub fn parse<T: clap::Parser>() -> Result<T, ExitCode> {
    T::try_parse().map_err(|e| {
        let _ = e.print();
        if e.use_stderr() {
            ExitCode::from(EXIT_USAGE)
        } else {
            ExitCode::SUCCESS
        }
    })
}
