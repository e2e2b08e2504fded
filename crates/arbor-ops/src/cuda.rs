//! CUDA plumbing shared by the ops: the fat binaries `build.rs` compiled
//! from `kernels/*.cu` (SASS for the build's architecture, so the first
//! launch in a fresh process runs without JIT, plus PTX for newer GPUs),
//! function lookup (each module loads once per device), launch shapes and
//! slice access.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DeviceRepr, LaunchArgs, LaunchConfig,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDevice, CudaStorage, DeviceId};
use candle_core::{DType, Layout, Result};

pub use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
pub use candle_core::cuda_backend::WrapErr;

/// Fat binary (sm SASS + PTX) of every kernel file, by module name.
pub const MODULES: &[(&str, &[u8])] = &[
    (
        "logprob",
        include_bytes!(concat!(env!("OUT_DIR"), "/logprob.fatbin")),
    ),
    (
        "ppo",
        include_bytes!(concat!(env!("OUT_DIR"), "/ppo.fatbin")),
    ),
    (
        "segment",
        include_bytes!(concat!(env!("OUT_DIR"), "/segment.fatbin")),
    ),
    (
        "paged_attention",
        include_bytes!(concat!(env!("OUT_DIR"), "/paged_attention.fatbin")),
    ),
    (
        "sample",
        include_bytes!(concat!(env!("OUT_DIR"), "/sample.fatbin")),
    ),
    (
        "decode",
        include_bytes!(concat!(env!("OUT_DIR"), "/decode.fatbin")),
    ),
    (
        "fused",
        include_bytes!(concat!(env!("OUT_DIR"), "/fused.fatbin")),
    ),
];

/// Loaded modules, by device and module name.
type ModuleCache = Mutex<HashMap<(DeviceId, &'static str), Arc<CudaModule>>>;

fn module(dev: &CudaDevice, name: &'static str) -> Result<Arc<CudaModule>> {
    static CACHE: OnceLock<ModuleCache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (dev.id(), name);
    if let Some(m) = cache.lock().expect("module cache").get(&key) {
        return Ok(m.clone());
    }
    let image = MODULES
        .iter()
        .find(|(m, _)| *m == name)
        .map(|(_, image)| *image)
        .ok_or_else(|| candle_core::Error::Msg(format!("arbor-ops: no kernel module {name}")))?;
    // `cuModuleLoadData` takes the fat binary as it is: the SASS that
    // matches the device, else the PTX compiled for it.
    let m = dev
        .cuda_stream()
        .context()
        .load_module(Ptx::from_binary(image.to_vec()))
        .w()?;
    cache.lock().expect("module cache").insert(key, m.clone());
    Ok(m)
}

/// A kernel of one of Arbor's modules, bound to the device's stream.
#[derive(Debug)]
pub struct Kernel {
    func: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Kernel {
    /// Function `name` of module `module` (a `kernels/<module>.cu`),
    /// looked up once per device.
    pub fn get(dev: &CudaDevice, module_name: &'static str, name: &str) -> Result<Kernel> {
        type Functions = Mutex<HashMap<(DeviceId, &'static str, String), CudaFunction>>;
        static FUNCTIONS: OnceLock<Functions> = OnceLock::new();
        let functions = FUNCTIONS.get_or_init(Default::default);
        let key = (dev.id(), module_name, name.to_string());
        let cached = functions.lock().expect("function cache").get(&key).cloned();
        let func = match cached {
            Some(f) => f,
            None => {
                let f = module(dev, module_name)?.load_function(name).w()?;
                functions
                    .lock()
                    .expect("function cache")
                    .insert(key, f.clone());
                f
            }
        };
        Ok(Kernel {
            func,
            stream: dev.cuda_stream(),
        })
    }

    /// The same function, launched on `stream` instead (a stream of the
    /// same context).
    pub fn on(self, stream: Arc<CudaStream>) -> Kernel {
        Kernel { stream, ..self }
    }

    /// A launch on the kernel's stream.
    pub fn builder(&self) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }
}

/// Grid-stride launch over `n` elements.
pub fn grid1d(n: usize, threads: u32) -> LaunchConfig {
    let blocks = n.div_ceil(threads as usize).clamp(1, 65_535 * 8) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Kernel-name suffix of a floating dtype.
pub fn suffix(dt: DType) -> Result<&'static str> {
    match dt {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        other => Err(candle_core::Error::Msg(format!(
            "arbor-ops CUDA kernels take f32, bf16 or f16, not {other:?}"
        ))),
    }
}

/// The contiguous view of a storage under `layout`.
pub fn view<'a, T: candle_core::cuda_backend::CudaDType + DeviceRepr>(
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<CudaView<'a, T>> {
    let (a, b) = l.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg("arbor-ops: CUDA op input must be contiguous".into())
    })?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// Wrap a fresh slice as storage.
pub fn wrap<T: candle_core::cuda_backend::CudaDType>(
    s: CudaSlice<T>,
    dev: &CudaDevice,
) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(s, dev.clone())
}

/// Fill value for poisoned outputs.
pub trait Poison:
    Copy + DeviceRepr + candle_core::cuda_backend::cudarc::driver::ValidAsZeroBits + 'static
{
    const NAN: Self;
}
impl Poison for f32 {
    const NAN: Self = f32::NAN;
}
impl Poison for ::half::bf16 {
    const NAN: Self = ::half::bf16::NAN;
}
impl Poison for ::half::f16 {
    const NAN: Self = ::half::f16::NAN;
}

/// An output buffer of `n` elements: zeros, or NaN when
/// [`crate::set_poison`] is on (so a kernel that leaves an element unwritten
/// fails its check).
pub fn alloc_out<T: Poison>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
    if crate::poison() {
        dev.clone_htod(&vec![T::NAN; n])
    } else {
        dev.alloc_zeros::<T>(n)
    }
}

/// The device's default memory pool, where candle's stream-ordered
/// allocations (`cuMemAllocAsync`) come from.
fn default_pool(
    dev: &CudaDevice,
) -> Result<candle_core::cuda_backend::cudarc::driver::sys::CUmemoryPool> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let stream = dev.cuda_stream();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer; the device handle is live.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, stream.context().cu_device()) }
        .result()
        .w()?;
    Ok(pool)
}

/// Bytes of the default memory pool in use now, and its high-water mark
/// since the last [`reset_pool_peak`] (the pool's own accounting, so it
/// counts every tensor candle allocates, not cuBLAS' fixed workspace).
pub fn pool_used_bytes(dev: &CudaDevice) -> Result<(u64, u64)> {
    use candle_core::cuda_backend::cudarc::driver::sys::{
        cuMemPoolGetAttribute, CUmemPool_attribute as A,
    };
    let pool = default_pool(dev)?;
    let (mut now, mut high) = (0u64, 0u64);
    for (attr, out) in [
        (A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &mut now),
        (A::CU_MEMPOOL_ATTR_USED_MEM_HIGH, &mut high),
    ] {
        // SAFETY: both attributes are cuuint64_t values.
        unsafe { cuMemPoolGetAttribute(pool, attr, out as *mut u64 as *mut std::ffi::c_void) }
            .result()
            .w()?;
    }
    Ok((now, high))
}

/// Resets the default pool's high-water mark to the bytes in use now.
pub fn reset_pool_peak(dev: &CudaDevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys::{
        cuMemPoolSetAttribute, CUmemPool_attribute as A,
    };
    let pool = default_pool(dev)?;
    let mut zero = 0u64;
    // SAFETY: the attribute is a cuuint64_t; 0 is the only value allowed.
    unsafe {
        cuMemPoolSetAttribute(
            pool,
            A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            &mut zero as *mut u64 as *mut std::ffi::c_void,
        )
    }
    .result()
    .w()
}

/// Sets a freshly opened device up for Arbor's single-threaded use, as the
/// [`crate::GpuCut`]s `events` and `pool` say: no per-tensor event
/// tracking (for tensors created from now on), and a default memory pool
/// that keeps freed memory for the next allocation instead of returning it
/// to the driver. Call it before loading anything on the device.
pub fn tune_device(dev: &CudaDevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys::{
        cuMemPoolSetAttribute, CUmemPool_attribute as A,
    };
    if crate::GpuCut::Events.on() {
        // SAFETY: Arbor drives each device from one thread, on candle's
        // stream; the one other stream, the engine's dedicated GPU step,
        // orders itself against candle's with explicit joins (an event
        // each way) at the start and end of each of its steps, so no tensor
        // is read before it is written or freed while in use, which is
        // what the events guard against.
        unsafe { dev.disable_event_tracking() };
    }
    if crate::GpuCut::Pool.on() {
        let pool = default_pool(dev)?;
        let mut keep = u64::MAX;
        // SAFETY: the release threshold is a cuuint64_t attribute.
        unsafe {
            cuMemPoolSetAttribute(
                pool,
                A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut keep as *mut u64 as *mut std::ffi::c_void,
            )
        }
        .result()
        .w()?;
    }
    Ok(())
}

/// The device's peak memory bandwidth in bytes/s from its attributes:
/// 2 (double data rate) x memory clock x bus width. `None` where the driver
/// does not report them.
pub fn peak_bandwidth(dev: &CudaDevice) -> Option<f64> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    let ctx = dev.cuda_stream().context().clone();
    let clock_khz = ctx
        .attribute(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
        .ok()?;
    let bus_bits = ctx
        .attribute(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
        .ok()?;
    (clock_khz > 0 && bus_bits > 0).then(|| 2.0 * clock_khz as f64 * 1e3 * bus_bits as f64 / 8.0)
}

/// The device address of contiguous tensor `t`'s first element (any
/// dtype), for kernels that take raw pointers. The tensor must outlive
/// every launch that uses the address.
pub fn tensor_ptr(t: &candle_core::Tensor, stream: &CudaStream) -> Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use candle_core::cuda_backend::CudaStorageSlice as S;
    let (s, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*s else {
        candle_core::bail!("a tensor is not on a CUDA device");
    };
    let (start, _) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("a tensor is not contiguous".into()))?;
    let (p, size) = match &s.slice {
        S::U8(x) => (x.device_ptr(stream).0, 1),
        S::U32(x) => (x.device_ptr(stream).0, 4),
        S::I64(x) => (x.device_ptr(stream).0, 8),
        S::BF16(x) => (x.device_ptr(stream).0, 2),
        S::F16(x) => (x.device_ptr(stream).0, 2),
        S::F32(x) => (x.device_ptr(stream).0, 4),
        S::F64(x) => (x.device_ptr(stream).0, 8),
        _ => candle_core::bail!("tensor_ptr: unsupported dtype {:?}", t.dtype()),
    };
    Ok(p + (size * start) as u64)
}
