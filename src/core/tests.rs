//! Unit tests of the core: see tests/core_*.rs for whole-protocol runs.
