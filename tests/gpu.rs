//! GPU memory (feature `cuda`): on a machine without a GPU — or without a
//! CUDA-enabled UCX — registration is a typed error naming what is missing,
//! never a panic. `scripts/gpu-check.sh` runs the with-GPU path.

use kvpoll::transport::ucx::{Context, ContextOptions};

#[test]
fn ucx_context_lists_host_memory_among_its_memory_types() {
    let ctx = Context::new(&ContextOptions::with_transports("tcp")).unwrap();
    let types = ctx.memory_types().unwrap();
    assert_ne!(
        types & (1 << ucx_sys::UCS_MEMORY_TYPE_HOST),
        0,
        "{types:#x}"
    );
}

#[cfg(feature = "cuda")]
mod cuda {
    use kvpoll::gpu::{driver_present, loopback_check, GpuError, GpuRegion};
    use kvpoll::transport::ucx::{Context, ContextOptions};

    #[test]
    fn gpu_region_without_a_gpu_or_cuda_ucx_is_a_typed_error_not_a_panic() {
        let ctx = Context::new(&ContextOptions::default()).unwrap();
        let ucx_cuda = ctx.supports_cuda().unwrap();
        match GpuRegion::allocate(&ctx, 0, 1 << 16) {
            Err(GpuError::NoDriver) => {
                assert!(!driver_present());
            }
            Err(GpuError::NoDevice { ordinal: 0, .. }) => assert!(driver_present()),
            Err(GpuError::UcxWithoutCuda) => assert!(driver_present() && !ucx_cuda),
            Ok(region) => {
                assert!(ucx_cuda);
                assert_eq!(region.len(), 1 << 16);
            }
            Err(other) => panic!("unexpected: {other}"),
        }
    }

    #[test]
    fn missing_driver_error_says_there_is_no_gpu() {
        if driver_present() {
            return; // a GPU machine: gpu-check.sh covers it
        }
        let err = loopback_check(0, 4096).unwrap_err();
        assert!(matches!(err, GpuError::NoDriver), "{err:?}");
        assert!(err.to_string().starts_with("no GPU"), "{err}");
    }

    #[test]
    fn out_of_range_device_ordinal_is_a_typed_error() {
        let ctx = Context::new(&ContextOptions::default()).unwrap();
        match GpuRegion::allocate(&ctx, 4096, 4096) {
            Err(GpuError::NoDriver) => assert!(!driver_present()),
            Err(GpuError::NoDevice { ordinal: 4096, .. }) => {}
            Err(other) => panic!("unexpected: {other}"),
            Ok(_) => panic!("GPU 4096 cannot exist"),
        }
    }
}
