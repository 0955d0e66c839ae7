//! Safe UCX layer.
