//! The device side: the CUDA context and stream, the compiled kernels, device buffers and
//! kernel launches.
//!
//! Everything runs on one stream of one context, in order; cudarc's per-buffer event tracking
//! is switched off (it only matters with several streams), and kernels get raw device
//! pointers, so buffers can be offset freely. Host-visible results are read only after
//! [`Gpu::sync`]. With CUDA graphs on ([`replay`]), a pass's work between
//! [`Gpu::begin_pass`] and [`Gpu::sync`] is recorded and issued at the `sync`, as a graph where
//! the same work was seen before.

pub mod emulator;
pub mod graph_ops;
pub mod model;
pub mod ops;
pub mod replay;
pub mod weights;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    LaunchConfig, PinnedHostSlice, PushKernelArg, ValidAsZeroBits,
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

/// Where a [`DevBuf`]'s memory is.
#[derive(Debug)]
enum Storage<T> {
    /// Device memory.
    Cuda(CudaSlice<T>),
    /// Host memory standing in for device memory on the [`emulator`] (16-byte aligned, as the
    /// kernels' vector loads need; device allocations are aligned further).
    Host(#[allow(dead_code)] Vec<u128>), // owns the memory behind `DevBuf::ptr`
}

/// A device allocation with its raw address.
#[derive(Debug)]
pub struct DevBuf<T> {
    storage: Storage<T>,
    len: usize,
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
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> u64 {
        (self.len * std::mem::size_of::<T>()) as u64
    }
}

/// Host memory the device reads from or writes to: page-locked on a real device (so copies
/// run at full speed and asynchronously), plain memory on the emulator.
#[derive(Debug)]
pub enum HostBuf {
    Pinned(PinnedHostSlice<f32>),
    Plain(Vec<f32>),
}

impl HostBuf {
    pub fn as_slice(&self) -> Result<&[f32], PluginError> {
        match self {
            HostBuf::Pinned(p) => p.as_slice().map_err(|e| driver_error("pinned memory", e)),
            HostBuf::Plain(v) => Ok(v),
        }
    }

    pub fn as_mut_slice(&mut self) -> Result<&mut [f32], PluginError> {
        match self {
            HostBuf::Pinned(p) => p
                .as_mut_slice()
                .map_err(|e| driver_error("pinned memory", e)),
            HostBuf::Plain(v) => Ok(v),
        }
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

/// A CUDA context with its stream and kernels.
struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
}

/// What executes the kernels.
enum Backing {
    Cuda(Cuda),
    Emulated(Arc<emulator::Emulator>),
}

/// A captured graph, used only under its [`Gpu`]'s replay lock.
struct Graph(CudaGraph);

// SAFETY: a `Graph` is reached only through its `Gpu`'s `replaying` mutex, so one thread at
// a time launches or drops it, as CUDA asks of graph objects.
unsafe impl Send for Graph {}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Graph")
    }
}

/// The memory of the staging arena ([`replay::Staging`]).
enum StagingMemory {
    Pinned(#[allow(dead_code)] PinnedHostSlice<u8>), // owns the memory behind `Staging::base`
    Plain(#[allow(dead_code)] Vec<u128>),            // likewise, on the emulator
}

// SAFETY: the page-locked allocation is plain host memory owned by the `Gpu`; it is written
// only under the replay lock and read by the device's copies on the `Gpu`'s stream.
unsafe impl Send for StagingMemory {}

/// With CUDA graphs on: the recorder and the graphs it keeps.
struct Replaying {
    replay: replay::Replay<Graph>,
    _memory: StagingMemory,
}

/// One device with its stream and kernels — a CUDA device, or the host [`emulator`] in tests.
pub struct Gpu {
    /// `Some` with CUDA graphs on. (First: its graphs go before the kernels' modules.)
    replaying: Option<Mutex<Replaying>>,
    backing: Backing,
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
    let supported = kernels::supported_archs()?;
    let best = supported.iter().copied().filter(|&a| a <= device).max();
    best.ok_or_else(|| {
        PluginError::unsupported(format!(
            "cuda-hybrid: the device's compute capability {}.{} is older than every architecture this NVRTC supports ({supported:?})",
            device.0, device.1
        ))
    })
}

impl Gpu {
    /// Opens device `ordinal`: context, stream, and every kernel (compiled or from the caches);
    /// with `graphs`, passes are replayed as CUDA graphs ([`replay`]; on a stream of its own,
    /// since the legacy default stream cannot be captured). The driver and NVRTC must have
    /// been probed (see [`crate::driver`]).
    pub fn open(
        ordinal: usize,
        kernel_cache: Option<&Path>,
        graphs: bool,
    ) -> Result<Self, PluginError> {
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
        let stream = match graphs {
            true => ctx
                .new_stream()
                .map_err(|e| driver_error("cannot create a CUDA stream", e))?,
            false => ctx.default_stream(),
        };
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
        let replaying = match graphs {
            true => {
                // SAFETY: plain page-locked memory, written only through `Staging`.
                let mut memory =
                    unsafe { ctx.alloc_pinned_with_flags::<u8>(replay::STAGING_BYTES, 0) }
                        .map_err(|e| {
                            driver_error("cannot allocate the graphs' staging memory", e)
                        })?;
                let base = memory
                    .as_mut_slice()
                    .map_err(|e| driver_error("cannot map pinned memory", e))?
                    .as_mut_ptr() as u64;
                Some(Mutex::new(Replaying {
                    replay: replay::Replay::new(replay::Staging::new(base, replay::STAGING_BYTES)),
                    _memory: StagingMemory::Pinned(memory),
                }))
            }
            false => None,
        };
        Ok(Self {
            backing: Backing::Cuda(Cuda {
                ctx,
                stream,
                functions,
            }),
            info: DeviceInfo {
                ordinal,
                name,
                compute_capability,
                kernel_arch: arch,
                total_memory: total as u64,
                free_memory: free as u64,
            },
            replaying,
        })
    }

    /// The host emulator as the device (tests on machines without a GPU): device memory is
    /// host memory and kernels are the C++ build of `kernels/*.cu` that `emulator` loads.
    /// `memory` is the device memory it pretends to have. With `graphs`, passes are recorded
    /// and replayed as [`replay`] says, a kept "graph" being the recorded work issued again.
    pub fn emulated(emulator: Arc<emulator::Emulator>, memory: u64, graphs: bool) -> Self {
        let replaying = graphs.then(|| {
            let mut memory = vec![0u128; replay::STAGING_BYTES / 16];
            let base = memory.as_mut_ptr() as u64;
            Mutex::new(Replaying {
                replay: replay::Replay::new(replay::Staging::new(base, replay::STAGING_BYTES)),
                _memory: StagingMemory::Plain(memory),
            })
        });
        Self {
            backing: Backing::Emulated(emulator),
            info: DeviceInfo {
                ordinal: 0,
                name: "host emulator of the CUDA kernels".to_string(),
                compute_capability: (0, 0),
                kernel_arch: (0, 0),
                total_memory: memory,
                free_memory: memory,
            },
            replaying,
        }
    }

    /// Whether this is the host emulator.
    pub fn is_emulated(&self) -> bool {
        matches!(self.backing, Backing::Emulated(_))
    }

    /// Launches kernel `name` with `args` (in the order of its C signature); while a pass is
    /// recorded, records the launch.
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
        if let Some(mut replaying) = self.replaying() {
            if let Some(work) = replaying.replay.recording.as_mut() {
                work.launch(self.kernel_name(name)?, grid, block, args);
                return Ok(());
            }
        }
        self.launch_now(name, grid, block, args)
    }

    /// The loaded kernel named `name`, by the name the module table keeps.
    fn kernel_name(&self, name: &str) -> Result<&'static str, PluginError> {
        let known = match &self.backing {
            Backing::Cuda(cuda) => cuda.functions.get_key_value(name).map(|(k, _)| *k),
            Backing::Emulated(emulator) => emulator.kernel_name(name),
        };
        known.ok_or_else(|| {
            PluginError::new(
                ErrorKind::Internal,
                format!("cuda-hybrid: kernel '{name}' was not loaded"),
            )
        })
    }

    /// [`Gpu::launch`], issued now.
    fn launch_now(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<(), PluginError> {
        let cuda = match &self.backing {
            Backing::Cuda(cuda) => cuda,
            Backing::Emulated(emulator) => return emulator.launch(name, grid, block, args),
        };
        let f = cuda.functions.get(name).ok_or_else(|| {
            PluginError::new(
                ErrorKind::Internal,
                format!("cuda-hybrid: kernel '{name}' was not loaded"),
            )
        })?;
        let mut builder = cuda.stream.launch_builder(f);
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

    fn host_buf<T>(len: usize) -> DevBuf<T> {
        const _: () = assert!(std::mem::align_of::<u128>() == 16);
        let words = (len.max(1) * std::mem::size_of::<T>()).div_ceil(16);
        let storage = vec![0u128; words];
        let ptr = storage.as_ptr() as u64;
        DevBuf {
            storage: Storage::Host(storage),
            len,
            ptr,
        }
    }

    /// A zeroed device buffer of `len` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<DevBuf<T>, PluginError> {
        let cuda = match &self.backing {
            Backing::Cuda(cuda) => cuda,
            Backing::Emulated(_) => return Ok(Self::host_buf(len)),
        };
        let slice = cuda.stream.alloc_zeros::<T>(len.max(1)).map_err(|e| {
            driver_error(
                &format!(
                    "cannot allocate {} bytes of device memory",
                    len * std::mem::size_of::<T>()
                ),
                e,
            )
        })?;
        let ptr = slice.device_ptr(&cuda.stream).0;
        Ok(DevBuf {
            storage: Storage::Cuda(slice),
            len,
            ptr,
        })
    }

    /// A device copy of `data`.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<DevBuf<T>, PluginError> {
        let cuda = match &self.backing {
            Backing::Cuda(cuda) => cuda,
            Backing::Emulated(_) => {
                let buf = Self::host_buf::<T>(data.len());
                // SAFETY: the buffer holds at least `data.len()` elements of T, 16-byte aligned.
                unsafe {
                    std::ptr::copy_nonoverlapping(data.as_ptr(), buf.ptr as *mut T, data.len())
                };
                return Ok(buf);
            }
        };
        let slice = cuda.stream.clone_htod(data).map_err(|e| {
            driver_error(
                &format!(
                    "cannot copy {} bytes to the device",
                    std::mem::size_of_val(data)
                ),
                e,
            )
        })?;
        let ptr = slice.device_ptr(&cuda.stream).0;
        Ok(DevBuf {
            storage: Storage::Cuda(slice),
            len: data.len(),
            ptr,
        })
    }

    /// The hand-off buffer of `len` values (page-locked on a real device).
    pub fn pinned(&self, len: usize) -> Result<HostBuf, PluginError> {
        let cuda = match &self.backing {
            Backing::Cuda(cuda) => cuda,
            Backing::Emulated(_) => return Ok(HostBuf::Plain(vec![0.0; len.max(1)])),
        };
        // SAFETY: plain page-locked memory (flags 0: cached, readable by the CPU at full
        // speed); zeroed below before anything reads it.
        let mut buffer = unsafe { cuda.ctx.alloc_pinned_with_flags::<f32>(len.max(1), 0) }
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
        Ok(HostBuf::Pinned(buffer))
    }

    /// Copies the first `len` values of `src` into `dst[at..]` (queued on the stream: `src`
    /// must not change before the next [`Gpu::sync`]).
    pub fn copy_to_device(
        &self,
        src: &HostBuf,
        len: usize,
        dst: &mut DevBuf<f32>,
        at: usize,
    ) -> Result<(), PluginError> {
        if len == 0 {
            return Ok(());
        }
        let host = &src.as_slice()?[..len];
        check_range("a copy to the device", at, len, dst.len)?;
        if self.record(replay::Op::Copy {
            kind: replay::CopyKind::HostToDevice,
            src: host.as_ptr() as u64,
            dst: dst.at(at),
            bytes: (4 * len) as u64,
        }) {
            return Ok(());
        }
        match (&self.backing, &mut dst.storage) {
            (Backing::Cuda(cuda), Storage::Cuda(slice)) => {
                let mut view = slice.slice_mut(at..at + len);
                cuda.stream
                    .memcpy_htod(host, &mut view)
                    .map_err(|e| driver_error("copy to the device", e))
            }
            (Backing::Emulated(_), Storage::Host(_)) if at + len <= dst.len => {
                // SAFETY: in bounds of the host stand-in buffer, checked above.
                unsafe {
                    std::ptr::copy_nonoverlapping(host.as_ptr(), (dst.ptr as *mut f32).add(at), len)
                };
                Ok(())
            }
            _ => Err(PluginError::new(
                ErrorKind::Internal,
                "cuda-hybrid: copy between a device and a buffer it does not own",
            )),
        }
    }

    /// Copies `len` values of `src[at..]` into the start of `dst` (queued on the stream: read
    /// `dst` after [`Gpu::sync`]).
    pub fn copy_to_host(
        &self,
        src: &DevBuf<f32>,
        at: usize,
        len: usize,
        dst: &mut HostBuf,
    ) -> Result<(), PluginError> {
        if len == 0 {
            return Ok(());
        }
        let host = &mut dst.as_mut_slice()?[..len];
        check_range("a copy to the host", at, len, src.len)?;
        if self.record(replay::Op::Copy {
            kind: replay::CopyKind::DeviceToHost,
            src: src.at(at),
            dst: host.as_mut_ptr() as u64,
            bytes: (4 * len) as u64,
        }) {
            return Ok(());
        }
        match (&self.backing, &src.storage) {
            (Backing::Cuda(cuda), Storage::Cuda(slice)) => {
                let view = slice.slice(at..at + len);
                cuda.stream
                    .memcpy_dtoh(&view, host)
                    .map_err(|e| driver_error("copy to the host", e))
            }
            (Backing::Emulated(_), Storage::Host(_)) if at + len <= src.len => {
                // SAFETY: in bounds of the host stand-in buffer, checked above.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (src.ptr as *const f32).add(at),
                        host.as_mut_ptr(),
                        len,
                    )
                };
                Ok(())
            }
            _ => Err(PluginError::new(
                ErrorKind::Internal,
                "cuda-hybrid: copy between a device and a buffer it does not own",
            )),
        }
    }

    /// Copies `len` values of `src[src_at..]` into `dst[dst_at..]` on the device (queued on
    /// the stream).
    pub fn copy_device<T: DeviceRepr>(
        &self,
        src: &DevBuf<T>,
        src_at: usize,
        dst: &mut DevBuf<T>,
        dst_at: usize,
        len: usize,
    ) -> Result<(), PluginError> {
        if len == 0 {
            return Ok(());
        }
        if src_at + len > src.len || dst_at + len > dst.len {
            return Err(PluginError::new(
                ErrorKind::Internal,
                format!(
                    "cuda-hybrid: a device copy of {len} values from {src_at} of {} into {dst_at} of {}",
                    src.len, dst.len
                ),
            ));
        }
        if self.record(replay::Op::Copy {
            kind: replay::CopyKind::DeviceToDevice,
            src: src.at(src_at),
            dst: dst.at(dst_at),
            bytes: (len * std::mem::size_of::<T>()) as u64,
        }) {
            return Ok(());
        }
        match (&self.backing, &src.storage, &mut dst.storage) {
            (Backing::Cuda(cuda), Storage::Cuda(from), Storage::Cuda(to)) => {
                let from = from.slice(src_at..src_at + len);
                let mut to = to.slice_mut(dst_at..dst_at + len);
                cuda.stream
                    .memcpy_dtod(&from, &mut to)
                    .map_err(|e| driver_error("copy on the device", e))
            }
            (Backing::Emulated(_), Storage::Host(_), Storage::Host(_)) => {
                // SAFETY: both ranges are inside their host stand-in buffers (checked above),
                // which are distinct allocations (`dst` is borrowed mutably, `src` shared).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (src.ptr as *const T).add(src_at),
                        (dst.ptr as *mut T).add(dst_at),
                        len,
                    )
                };
                Ok(())
            }
            _ => Err(PluginError::new(
                ErrorKind::Internal,
                "cuda-hybrid: copy between buffers of another device",
            )),
        }
    }

    /// Copies `len` values of `buf[from..]` to `buf[to..]` (ranges that do not overlap), on
    /// the device (queued on the stream).
    pub fn copy_within<T: DeviceRepr>(
        &self,
        buf: &mut DevBuf<T>,
        from: usize,
        to: usize,
        len: usize,
    ) -> Result<(), PluginError> {
        if len == 0 {
            return Ok(());
        }
        if from.max(to) + len > buf.len || from.abs_diff(to) < len {
            return Err(PluginError::new(
                ErrorKind::Internal,
                format!(
                    "cuda-hybrid: a device copy of {len} values from {from} to {to} inside a buffer of {}",
                    buf.len
                ),
            ));
        }
        let size = std::mem::size_of::<T>();
        if self.record(replay::Op::Copy {
            kind: replay::CopyKind::DeviceToDevice,
            src: buf.at(from),
            dst: buf.at(to),
            bytes: (len * size) as u64,
        }) {
            return Ok(());
        }
        match (&self.backing, &buf.storage) {
            (Backing::Cuda(cuda), Storage::Cuda(_)) => {
                cuda.ctx
                    .bind_to_thread()
                    .map_err(|e| driver_error("binding the CUDA context", e))?;
                // SAFETY: both ranges lie inside the allocation behind `buf.ptr` and do not
                // overlap (checked above); the copy is ordered on the one stream every
                // launch and copy uses.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        buf.ptr + (to * size) as u64,
                        buf.ptr + (from * size) as u64,
                        len * size,
                        cuda.stream.cu_stream(),
                    )
                }
                .map_err(|e| driver_error("copy on the device", e))
            }
            (Backing::Emulated(_), Storage::Host(_)) => {
                // SAFETY: both ranges are inside the host stand-in buffer and do not overlap
                // (checked above).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (buf.ptr as *const T).add(from),
                        (buf.ptr as *mut T).add(to),
                        len,
                    )
                };
                Ok(())
            }
            _ => Err(PluginError::new(
                ErrorKind::Internal,
                "cuda-hybrid: copy inside a buffer of another device",
            )),
        }
    }

    /// Writes `data` into `dst[at..]` (a copy from pageable host memory: `data` may change
    /// once this returns).
    pub fn write<T: DeviceRepr>(
        &self,
        data: &[T],
        dst: &mut DevBuf<T>,
        at: usize,
    ) -> Result<(), PluginError> {
        if data.is_empty() {
            return Ok(());
        }
        if at + data.len() > dst.len {
            return Err(PluginError::new(
                ErrorKind::Internal,
                format!(
                    "cuda-hybrid: writing {} values at {at} of a device buffer of {}",
                    data.len(),
                    dst.len
                ),
            ));
        }
        if self.record_write(data, dst.at(at))? {
            return Ok(());
        }
        match (&self.backing, &mut dst.storage) {
            (Backing::Cuda(cuda), Storage::Cuda(slice)) => {
                let mut view = slice.slice_mut(at..at + data.len());
                cuda.stream
                    .memcpy_htod(data, &mut view)
                    .map_err(|e| driver_error("copy to the device", e))
            }
            (Backing::Emulated(_), Storage::Host(_)) => {
                // SAFETY: in bounds of the host stand-in buffer (checked above).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        data.as_ptr(),
                        (dst.ptr as *mut T).add(at),
                        data.len(),
                    )
                };
                Ok(())
            }
            _ => Err(PluginError::new(
                ErrorKind::Internal,
                "cuda-hybrid: copy to a buffer of another device",
            )),
        }
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
        check_range("clearing device memory", at, len, buf.len)?;
        if self.record(replay::Op::Zero {
            dst: buf.at(at),
            bytes: (4 * len) as u64,
        }) {
            return Ok(());
        }
        match (&self.backing, &mut buf.storage) {
            (Backing::Cuda(cuda), Storage::Cuda(slice)) => {
                let mut view = slice.slice_mut(at..at + len);
                cuda.stream
                    .memset_zeros(&mut view)
                    .map_err(|e| driver_error("clearing device memory", e))
            }
            (Backing::Emulated(_), Storage::Host(_)) if at + len <= buf.len => {
                // SAFETY: in bounds of the host stand-in buffer, checked above.
                unsafe { std::ptr::write_bytes((buf.ptr as *mut f32).add(at), 0, len) };
                Ok(())
            }
            _ => Err(PluginError::new(
                ErrorKind::Internal,
                "cuda-hybrid: clearing a buffer of another device",
            )),
        }
    }

    /// A host copy of a whole buffer (waits for the stream). For tests and diagnostics.
    pub fn download<T: DeviceRepr + Copy + Default>(
        &self,
        buf: &DevBuf<T>,
    ) -> Result<Vec<T>, PluginError> {
        self.sync()?;
        match (&self.backing, &buf.storage) {
            (Backing::Cuda(cuda), Storage::Cuda(slice)) => {
                let mut all = cuda
                    .stream
                    .clone_dtoh(slice)
                    .map_err(|e| driver_error("copy to the host", e))?;
                all.truncate(buf.len);
                Ok(all)
            }
            (Backing::Emulated(_), Storage::Host(_)) => {
                let mut out = vec![T::default(); buf.len];
                // SAFETY: the host stand-in buffer holds `len` elements of T.
                unsafe {
                    std::ptr::copy_nonoverlapping(buf.ptr as *const T, out.as_mut_ptr(), buf.len)
                };
                Ok(out)
            }
            _ => Err(PluginError::new(
                ErrorKind::Internal,
                "cuda-hybrid: reading a buffer of another device",
            )),
        }
    }

    /// Waits for everything queued on the stream; a pass being recorded is issued first
    /// (as a graph where it can be, see [`replay`]) and its recording ends.
    pub fn sync(&self) -> Result<(), PluginError> {
        let Some(mut replaying) = self.replaying() else {
            return self.wait();
        };
        let issued = match replaying.replay.recording.take() {
            Some(work) => {
                replaying.replay.unwaited = true;
                self.issue_recorded(&mut replaying.replay, work)
            }
            None => Ok(()),
        };
        let waited = self.wait();
        if waited.is_ok() {
            // Nothing staged is read any more.
            replaying.replay.unwaited = false;
            replaying.replay.staging.reset();
        }
        issued?;
        waited
    }

    /// Waits for the stream.
    fn wait(&self) -> Result<(), PluginError> {
        match &self.backing {
            Backing::Cuda(cuda) => cuda
                .stream
                .synchronize()
                .map_err(|e| driver_error("the device reported an error", e)),
            Backing::Emulated(_) => Ok(()),
        }
    }
}

/// Makes sure `cuda`'s stream is out of capture mode after a failed capture (cudarc's
/// `end_capture` can return early), dropping whatever graph the capture left.
fn leave_capture(cuda: &Cuda) {
    let stream = cuda.stream.cu_stream();
    // SAFETY: `stream` is this context's live stream; a graph `end_capture` hands back is
    // ours to destroy.
    unsafe {
        let capturing = cudarc::driver::result::stream::is_capturing(stream);
        if matches!(capturing, Ok(status) if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        {
            if let Ok(graph) = cudarc::driver::result::stream::end_capture(stream) {
                if !graph.is_null() {
                    let _ = cudarc::driver::result::graph::destroy(graph);
                }
            }
        }
    }
}

/// Fails unless `at .. at + len` lies inside a buffer of `buf_len` elements.
fn check_range(what: &str, at: usize, len: usize, buf_len: usize) -> Result<(), PluginError> {
    match at.checked_add(len) {
        Some(end) if end <= buf_len => Ok(()),
        _ => Err(PluginError::new(
            ErrorKind::Internal,
            format!("cuda-hybrid: {what} of {len} values at {at} of a buffer of {buf_len}"),
        )),
    }
}

/// Recording and replaying passes ([`replay`]).
impl Gpu {
    /// The recorder, with CUDA graphs on.
    fn replaying(&self) -> Option<MutexGuard<'_, Replaying>> {
        self.replaying
            .as_ref()
            .map(|r| r.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Starts recording a pass whose longest sequence has `rows` rows (with CUDA graphs on and
    /// at most [`replay::MAX_ROWS`] rows; otherwise nothing): its launches and copies are kept
    /// until [`Gpu::sync`] issues them. A recording a failed pass left unissued is issued
    /// first, as the work it asked for.
    pub fn begin_pass(&self, rows: usize) -> Result<(), PluginError> {
        let Some(mut replaying) = self.replaying() else {
            return Ok(());
        };
        if let Some(stale) = replaying.replay.recording.take() {
            replaying.replay.unwaited = true;
            self.issue(&stale)?;
        }
        if replaying.replay.unwaited {
            self.wait()?;
            replaying.replay.unwaited = false;
        }
        // Every copy staged so far has been waited for: the arena is free.
        replaying.replay.staging.reset();
        if rows > replay::MAX_ROWS {
            replaying.replay.stats.unrecorded += 1;
        } else {
            replaying.replay.start();
        }
        Ok(())
    }

    /// Ends a pass that failed before its [`Gpu::sync`]: issues what it recorded (the work
    /// it asked for, as without graphs) and waits for it, so that what comes before the next
    /// pass is issued as it is asked for. Errors are the failed pass's to report, not this.
    pub fn abandon_pass(&self) {
        let Some(mut replaying) = self.replaying() else {
            return;
        };
        if let Some(work) = replaying.replay.recording.take() {
            replaying.replay.unwaited = true;
            let _ = self.issue(&work);
        }
        if self.wait().is_ok() {
            replaying.replay.unwaited = false;
            replaying.replay.staging.reset();
        }
    }

    /// How the recorded passes went, with CUDA graphs on.
    pub fn replay_stats(&self) -> Option<replay::ReplayStats> {
        self.replaying().map(|r| r.replay.stats)
    }

    /// Records `op` if a pass is being recorded; whether it did.
    fn record(&self, op: replay::Op) -> bool {
        match self.replaying() {
            Some(mut replaying) => match replaying.replay.recording.as_mut() {
                Some(work) => {
                    work.ops.push(op);
                    true
                }
                None => false,
            },
            None => false,
        }
    }

    /// Records a write of pageable `data` to device address `dst`, staged in the arena, if a
    /// pass is being recorded; whether it did. Where the arena is full, the pass's work so
    /// far is issued as it is and its recording ends (the write is then the caller's).
    fn record_write<T: DeviceRepr>(&self, data: &[T], dst: u64) -> Result<bool, PluginError> {
        let Some(mut replaying) = self.replaying() else {
            return Ok(false);
        };
        let Replaying { replay, .. } = &mut *replaying;
        if replay.recording.is_none() {
            return Ok(false);
        }
        // SAFETY: `DeviceRepr` values are plain data that the device copies byte for byte.
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
        };
        if let Some(src) = replay.staging.stage(bytes) {
            if let Some(work) = replay.recording.as_mut() {
                work.ops.push(replay::Op::Copy {
                    kind: replay::CopyKind::HostToDevice,
                    src,
                    dst,
                    bytes: bytes.len() as u64,
                });
            }
            return Ok(true);
        }
        if let Some(work) = replay.recording.take() {
            replay.stats.passes += 1;
            replay.stats.issued += 1;
            replay.unwaited = true;
            self.issue(&work)?;
            replay.recycle(work);
        }
        Ok(false)
    }

    /// Issues a recorded pass: as the graph kept for the same work, as a graph captured now
    /// if the work was seen before, else as it is.
    fn issue_recorded(
        &self,
        replay: &mut replay::Replay<Graph>,
        work: replay::Work,
    ) -> Result<(), PluginError> {
        if work.ops.is_empty() {
            return Ok(());
        }
        let key = work.key();
        let issued = match replay.decide(key, &work) {
            replay::Decision::Replay(kept) => match &kept.graph {
                Some(graph) => graph
                    .0
                    .launch()
                    .map_err(|e| driver_error("launching a CUDA graph", e)),
                None => self.issue(&kept.work),
            },
            replay::Decision::Issue => self.issue(&work),
            replay::Decision::Capture => {
                let graph = match &self.backing {
                    Backing::Cuda(cuda) => {
                        let graph = self.capture(cuda, &work);
                        if graph.is_none() {
                            replay.stats.capture_failed += 1;
                        }
                        graph
                    }
                    Backing::Emulated(_) => None,
                };
                let issued = match &graph {
                    Some(graph) => graph
                        .0
                        .launch()
                        .map_err(|e| driver_error("launching a CUDA graph", e)),
                    None => self.issue(&work),
                };
                replay.keep(key, work, graph);
                return issued;
            }
        };
        replay.recycle(work);
        issued
    }

    /// `work` captured as a CUDA graph, or `None` (with a warning) where the capture failed —
    /// its work is then issued as it is, now and whenever it recurs.
    fn capture(&self, cuda: &Cuda, work: &replay::Work) -> Option<Graph> {
        let captured = (|| {
            // An error cudarc keeps from an earlier call would make `end_capture` return
            // before ending the capture: report it first.
            cuda.ctx
                .check_err()
                .map_err(|e| driver_error("an earlier CUDA call", e))?;
            cuda.stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(|e| driver_error("starting a CUDA graph capture", e))?;
            let issued = self.issue(work);
            let graph = cuda
                .stream
                .end_capture(sys::CUgraphInstantiate_flags(0))
                .map_err(|e| driver_error("capturing a CUDA graph", e));
            issued?;
            graph?.ok_or_else(|| {
                PluginError::new(ErrorKind::Internal, "cuda-hybrid: an empty CUDA graph")
            })
        })();
        match captured {
            Ok(graph) => Some(Graph(graph)),
            Err(e) => {
                leave_capture(cuda);
                tracing::warn!("cuda-hybrid: a pass runs without a CUDA graph: {e}");
                None
            }
        }
    }

    /// Issues recorded work as it is: each launch and copy, in order.
    fn issue(&self, work: &replay::Work) -> Result<(), PluginError> {
        if let Backing::Cuda(cuda) = &self.backing {
            // The raw copies below need the context current on this thread (cudarc's own
            // calls make it so themselves).
            cuda.ctx
                .bind_to_thread()
                .map_err(|e| driver_error("binding the CUDA context", e))?;
        }
        for op in &work.ops {
            match *op {
                replay::Op::Launch {
                    kernel,
                    grid,
                    block,
                    first,
                    count,
                } => self.launch_now(kernel, grid, block, work.launch_args(first, count))?,
                replay::Op::Copy {
                    kind,
                    src,
                    dst,
                    bytes,
                } => self.copy_now(kind, src, dst, bytes as usize)?,
                replay::Op::Zero { dst, bytes } => self.zero_now(dst, bytes as usize)?,
            }
        }
        Ok(())
    }

    /// A recorded copy, issued now.
    fn copy_now(
        &self,
        kind: replay::CopyKind,
        src: u64,
        dst: u64,
        bytes: usize,
    ) -> Result<(), PluginError> {
        use replay::CopyKind::*;
        match &self.backing {
            Backing::Cuda(cuda) => {
                let stream = cuda.stream.cu_stream();
                // SAFETY: the copy was recorded by one of the checked copies above: `src` and
                // `dst` are live device allocations of this context, or page-locked host
                // memory the `Gpu`'s owner keeps until the pass's `sync`, each holding `bytes`
                // bytes; the copy is ordered on the one stream every launch and copy uses.
                unsafe {
                    match kind {
                        HostToDevice => cudarc::driver::result::memcpy_htod_async(
                            dst,
                            std::slice::from_raw_parts(src as *const u8, bytes),
                            stream,
                        ),
                        DeviceToHost => cudarc::driver::result::memcpy_dtoh_async(
                            std::slice::from_raw_parts_mut(dst as *mut u8, bytes),
                            src,
                            stream,
                        ),
                        DeviceToDevice => {
                            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream)
                        }
                    }
                }
                .map_err(|e| driver_error("a recorded copy", e))
            }
            Backing::Emulated(_) => {
                // SAFETY: as above, with host memory standing in for device memory; the
                // recorded ranges do not overlap (checked when recorded).
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
                Ok(())
            }
        }
    }

    /// A recorded clearing of `bytes` bytes at device address `dst`, issued now.
    fn zero_now(&self, dst: u64, bytes: usize) -> Result<(), PluginError> {
        match &self.backing {
            // SAFETY: recorded by `zero_range` from a live allocation of this context holding
            // `bytes` bytes at `dst`; ordered on the one stream.
            Backing::Cuda(cuda) => unsafe {
                cudarc::driver::result::memset_d8_async(dst, 0, bytes, cuda.stream.cu_stream())
            }
            .map_err(|e| driver_error("clearing device memory", e)),
            Backing::Emulated(_) => {
                // SAFETY: as above, with host memory standing in for device memory.
                unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) };
                Ok(())
            }
        }
    }
}
