//! The demo's control protocol: framed, versioned and checksummed messages
//! over TCP, defined in the tool's library ([`kvpoll_cli::control`]) so that
//! its tests and fuzz targets use the very same decoder.

pub use kvpoll_cli::control::{Layout, Msg};
