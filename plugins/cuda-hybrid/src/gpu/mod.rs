//! The device side: the CUDA context and stream, the compiled kernels, device buffers and
//! kernel launches.
//!
//! Everything runs on one stream of one context, in order; cudarc's per-buffer event tracking
//! is switched off (it only matters with several streams), and kernels get raw device
//! pointers, so buffers can be offset freely. Host-visible results are read only after
//! [`Gpu::sync`].

pub mod layers;
pub mod ops;
pub mod weights;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PinnedHostSlice, PushKernelArg, ValidAsZeroBits,
};
use specula_plugin_api::{ErrorKind, PluginError};

use crate::kernels;

/// A CUDA driver error as a plugin error, saying what was being done.
pub fn driver_error(what: &str, e: impl std::fmt::Debug) -> PluginError {
    let text = format!("{e:?}");
    let kind = if text.contains("OUT_OF_MEMORY") {
        ErrorKind::OutOfMemory
    } else {
        ErrorKind::Internal
    };
    PluginError::new(kind, format!("cuda-hybrid: {what}: {text}"))
}

/// A kernel argument: device pointers travel as `u64`.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    U64(u64),
    I32(i32),
    F32(f32),
}

/// Shorthand for an `i32` argument from a size or index that fits (checked by the callers'
/// shapes: every dimension of a loaded model is far below 2^31).
pub fn int(v: usize) -> Arg {
    Arg::I32(i32::try_from(v).expect("kernel dimension fits in i32"))
}

/// A device allocation with its raw address.
#[derive(Debug)]
pub struct DevBuf<T> {
    slice: CudaSlice<T>,
    ptr: u64,
}

impl<T> DevBuf<T> {
    /// Address of element `i`.
    pub fn at(&self, i: usize) -> u64 {
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }

    /// Address of element 0.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.slice.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    pub fn slice(&self) -> &CudaSlice<T> {
        &self.slice
    }

    pub fn bytes(&self) -> u64 {
        (self.slice.len() * std::mem::size_of::<T>()) as u64
    }
}

/// Facts about the device.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    /// The architecture the kernels were compiled for (at most the device's).
    pub kernel_arch: (i32, i32),
    pub total_memory: u64,
    pub free_memory: u64,
}

/// One device context with its stream and kernels.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
    pub info: DeviceInfo,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("info", &self.info).finish()
    }
}

/// The newest architecture NVRTC supports that the device can run (PTX of an older virtual
/// architecture runs on newer devices).
fn kernel_arch(device: (i32, i32)) -> Result<(i32, i32), PluginError> {
    use cudarc::nvrtc::sys;
    let mut count = 0;
    // SAFETY: out-parameter calls into NVRTC, which the caller has made sure is loadable.
    let supported: Vec<i32> = unsafe {
        if sys::nvrtcGetNumSupportedArchs(&mut count) != sys::nvrtcResult::NVRTC_SUCCESS {
            return Ok(device);
        }
        let mut archs = vec![0i32; count.max(0) as usize];
        if sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) != sys::nvrtcResult::NVRTC_SUCCESS {
            return Ok(device);
        }
        archs
    };
    let wanted = device.0 * 10 + device.1;
    let best = supported.iter().copied().filter(|&a| a <= wanted).max();
    match best {
        Some(a) => Ok((a / 10, a % 10)),
        None => Err(PluginError::unsupported(format!(
            "cuda-hybrid: the device's compute capability {}.{} is older than every architecture this NVRTC supports ({supported:?})",
            device.0, device.1
        ))),
    }
}

impl Gpu {
    /// Opens device `ordinal`: context, stream, and every kernel (compiled or from the caches).
    /// The driver and NVRTC must have been probed (see [`crate::driver`]).
    pub fn open(ordinal: usize, kernel_cache: Option<&Path>) -> Result<Self, PluginError> {
        let count = CudaContext::device_count().map_err(|e| {
            PluginError::unsupported(format!(
                "cuda-hybrid: the CUDA driver is installed but reports no usable device: {e:?}"
            ))
        })?;
        if count <= 0 {
            return Err(PluginError::unsupported(
                "cuda-hybrid: the CUDA driver is installed but there is no CUDA device",
            ));
        }
        if ordinal >= count as usize {
            return Err(PluginError::invalid_input(format!(
                "cuda-hybrid: option device = {ordinal}, but there are only {count} CUDA devices"
            )));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| driver_error(&format!("cannot open CUDA device {ordinal}"), e))?;
        // One stream, in order: no need for cudarc's cross-stream events.
        // SAFETY: every buffer of this backend is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let compute_capability = ctx
            .compute_capability()
            .map_err(|e| driver_error("cannot read the compute capability", e))?;
        if compute_capability < kernels::MIN_ARCH {
            return Err(PluginError::unsupported(format!(
                "cuda-hybrid: device {ordinal} has compute capability {}.{}; the kernels need {}.{} or newer",
                compute_capability.0, compute_capability.1, kernels::MIN_ARCH.0, kernels::MIN_ARCH.1
            )));
        }
        let arch = kernel_arch(compute_capability)?;
        let (free, total) = ctx
            .mem_get_info()
            .map_err(|e| driver_error("cannot read the free device memory", e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown".to_string());
        let mut driver_version = 0i32;
        // SAFETY: an out-parameter call into the loaded driver.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) };
        let nvrtc = kernels::nvrtc_version()?;
        let compiled = kernels::load_all(arch, kernel_cache)?;
        let mut functions = HashMap::new();
        for kernel in compiled.iter() {
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(kernel.ptx.clone()))
                .map_err(|e| {
                    driver_error(
                        &format!(
                            "cannot load the PTX of kernels/{} (driver for CUDA {}.{}, NVRTC {}.{}; \
                             a driver older than NVRTC cannot load its PTX: use an NVRTC no newer \
                             than the driver, option nvrtc_path)",
                            kernel.source.file,
                            driver_version / 1000,
                            driver_version % 1000 / 10,
                            nvrtc.0,
                            nvrtc.1
                        ),
                        e,
                    )
                })?;
            for &function in kernel.source.functions {
                let f = module.load_function(function).map_err(|e| {
                    driver_error(
                        &format!("kernels/{} has no function {function}", kernel.source.file),
                        e,
                    )
                })?;
                functions.insert(function, f);
            }
        }
        Ok(Self {
            ctx,
            stream,
            functions,
            info: DeviceInfo {
                ordinal,
                name,
                compute_capability,
                kernel_arch: arch,
                total_memory: total as u64,
                free_memory: free as u64,
            },
        })
    }

    fn function(&self, name: &str) -> Result<&CudaFunction, PluginError> {
        self.functions.get(name).ok_or_else(|| {
            PluginError::new(
                ErrorKind::Internal,
                format!("cuda-hybrid: kernel '{name}' was not loaded"),
            )
        })
    }

    /// Launches kernel `name` with `args` (in the order of its C signature).
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<(), PluginError> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let f = self.function(name)?;
        let mut builder = self.stream.launch_builder(f);
        for arg in args {
            match arg {
                Arg::Ptr(p) | Arg::U64(p) => builder.arg(p),
                Arg::I32(v) => builder.arg(v),
                Arg::F32(v) => builder.arg(v),
            };
        }
        let config = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the argument lists are written against the kernels' C signatures in
        // `kernels/*.cu` (see `ops`), and every pointer is a live allocation of this context
        // sized for the launch shape.
        unsafe { builder.launch(config) }
            .map_err(|e| driver_error(&format!("launching {name}"), e))?;
        Ok(())
    }

    /// A zeroed device buffer of `len` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<DevBuf<T>, PluginError> {
        let slice = self.stream.alloc_zeros::<T>(len.max(1)).map_err(|e| {
            driver_error(
                &format!(
                    "cannot allocate {} bytes of device memory",
                    len * std::mem::size_of::<T>()
                ),
                e,
            )
        })?;
        let ptr = slice.device_ptr(&self.stream).0;
        Ok(DevBuf { slice, ptr })
    }

    /// A device copy of `data`.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<DevBuf<T>, PluginError> {
        let slice = self.stream.clone_htod(data).map_err(|e| {
            driver_error(
                &format!(
                    "cannot copy {} bytes to the device",
                    std::mem::size_of_val(data)
                ),
                e,
            )
        })?;
        let ptr = slice.device_ptr(&self.stream).0;
        Ok(DevBuf { slice, ptr })
    }

    /// Page-locked host memory of `len` values (the hand-off buffers).
    pub fn pinned(&self, len: usize) -> Result<PinnedHostSlice<f32>, PluginError> {
        // SAFETY: plain page-locked memory (flags 0: cached, readable by the CPU at full speed);
        // zeroed below before anything reads it.
        let mut buffer = unsafe { self.ctx.alloc_pinned_with_flags::<f32>(len.max(1), 0) }
            .map_err(|e| {
                driver_error(
                    &format!("cannot allocate {len} floats of pinned host memory"),
                    e,
                )
            })?;
        buffer
            .as_mut_slice()
            .map_err(|e| driver_error("cannot map pinned memory", e))?
            .fill(0.0);
        Ok(buffer)
    }

    /// Copies `src` (host) into device memory at `dst` (f32 elements).
    pub fn copy_to_device(
        &self,
        src: &PinnedHostSlice<f32>,
        len: usize,
        dst: &mut DevBuf<f32>,
        at: usize,
    ) -> Result<(), PluginError> {
        if len == 0 {
            return Ok(());
        }
        let mut view = dst.slice.slice_mut(at..at + len);
        let host = src
            .as_slice()
            .map_err(|e| driver_error("cannot map pinned memory", e))?;
        self.stream
            .memcpy_htod(&host[..len], &mut view)
            .map_err(|e| driver_error("copy to the device", e))
    }

    /// Copies `len` f32 values of device memory at `src[at..]` into pinned host memory.
    pub fn copy_to_host(
        &self,
        src: &DevBuf<f32>,
        at: usize,
        len: usize,
        dst: &mut PinnedHostSlice<f32>,
    ) -> Result<(), PluginError> {
        if len == 0 {
            return Ok(());
        }
        let view = src.slice.slice(at..at + len);
        let host = dst
            .as_mut_slice()
            .map_err(|e| driver_error("cannot map pinned memory", e))?;
        self.stream
            .memcpy_dtoh(&view, &mut host[..len])
            .map_err(|e| driver_error("copy to the host", e))
    }

    /// Zeroes `len` f32 values of `buf` from `at`.
    pub fn zero_range(
        &self,
        buf: &mut DevBuf<f32>,
        at: usize,
        len: usize,
    ) -> Result<(), PluginError> {
        if len == 0 {
            return Ok(());
        }
        let mut view = buf.slice.slice_mut(at..at + len);
        self.stream
            .memset_zeros(&mut view)
            .map_err(|e| driver_error("clearing device memory", e))
    }

    /// Waits for everything queued on the stream.
    pub fn sync(&self) -> Result<(), PluginError> {
        self.stream
            .synchronize()
            .map_err(|e| driver_error("the device reported an error", e))
    }
}
