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
    use kvpoll::gpu::{driver_present, loopback_check, DeviceMemory, GpuError, GpuRegion};
    use kvpoll::transport::ucx::{Context, ContextOptions};
    use kvpoll::{BlockId, Engine, RegionError};

    const BS: u64 = 4096;

    fn engine() -> Engine {
        Engine::builder()
            .block_size(BS)
            .ucx(ContextOptions::with_transports("tcp"))
            .build()
            .unwrap()
    }

    /// What registering `base..base+len` as device memory must say on a
    /// machine with this driver: no driver, or (with one) not device memory.
    fn assert_refused_as_not_device(err: &GpuError) {
        match err {
            GpuError::NoDriver => assert!(!driver_present(), "{err}"),
            GpuError::NoDevice { .. } | GpuError::NotDeviceMemory { .. } => {
                assert!(driver_present(), "{err}")
            }
            other => panic!("unexpected: {other}"),
        }
    }

    #[test]
    fn host_memory_given_as_device_memory_is_refused_and_registers_nothing() {
        let mut e = engine();
        let mut host = vec![0u8; 4 * BS as usize];
        // SAFETY: the engine refuses it (asserted), so nothing keeps it.
        let err =
            unsafe { e.register_device_memory(host.as_mut_ptr() as u64, host.len()) }.unwrap_err();
        match &err {
            RegionError::Device(inner) => assert_refused_as_not_device(inner),
            other => panic!("unexpected: {other}"),
        }
        assert!(err.to_string().starts_with("device memory: "), "{err}");
        // Nothing was registered: the next region is region 0, of any size.
        assert_eq!(e.register(8).unwrap(), 0);
        e.write_block(0, BlockId(7), &[9u8; BS as usize]).unwrap();
        let mut back = [0u8; BS as usize];
        e.read_block(0, BlockId(7), &mut back).unwrap();
        assert_eq!(back, [9u8; BS as usize]);
    }

    #[test]
    fn device_memory_of_a_partial_block_or_at_null_is_refused_before_cuda_is_asked() {
        let mut e = engine();
        // SAFETY: both are refused before anything is mapped.
        let partial = unsafe { e.register_device_memory(0x7f00_0000_0000, BS as usize + 1) };
        assert!(
            matches!(partial, Err(RegionError::NotWholeBlocks { .. })),
            "{partial:?}"
        );
        let null = unsafe { e.register_device_memory(0, BS as usize) };
        assert!(
            matches!(null, Err(RegionError::NullMemory { .. })),
            "{null:?}"
        );
    }

    #[test]
    fn probing_an_address_cuda_does_not_own_is_a_typed_error_not_a_crash() {
        let host = vec![1u8; 8192];
        for (base, len) in [(host.as_ptr() as u64, host.len()), (0x10, 4096), (0, 0)] {
            let err = DeviceMemory::probe(base, len).unwrap_err();
            assert_refused_as_not_device(&err);
            if let GpuError::NotDeviceMemory {
                base: b, len: l, ..
            } = err
            {
                assert_eq!((b, l), (base, len));
            }
        }
    }

    #[test]
    fn without_a_driver_the_refusal_says_there_is_no_gpu() {
        if driver_present() {
            return; // a GPU machine: gpu-check.sh covers it
        }
        let mut e = engine();
        // SAFETY: refused (asserted).
        let err = unsafe { e.register_device_memory(0x7f00_0000_0000, BS as usize) }.unwrap_err();
        assert!(
            matches!(err, RegionError::Device(GpuError::NoDriver)),
            "{err:?}"
        );
        assert!(err.to_string().contains("no GPU"), "{err}");
    }

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
