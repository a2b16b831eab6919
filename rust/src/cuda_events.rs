//! CUDA events made, recorded and read through the CUDA driver the process has already
//! loaded: the tracer's GPU times (`shardline.comm.trace.device`), many events a call; and
//! the streams the tracer runs a group's asynchronous ops on, which wait on such events.
//!
//! The tracer reads one or two events per NCCL op. Through torch each reading is a Python
//! call of a few microseconds that holds the GIL, which the training thread needs to launch
//! its next kernel; here one call reads a whole list with the GIL released, at the driver's
//! own cost. Event handles are the driver's `CUevent`s, which the CUDA runtime's
//! `cudaEvent_t` (torch's events) also are.
//!
//! The driver is looked for with `dlopen(RTLD_NOLOAD)`: only a `libcuda.so.1` that torch has
//! loaded is used, and nothing is loaded here. Without one, `Driver::get` finds none and
//! the caller reads its events through torch.
//!
//! Each call names the GPU its events belong to. Where the calling thread's current CUDA
//! context is another GPU's (or none), that GPU's primary context (the one torch uses) is made
//! current for the call and the thread's own put back after it.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Mutex, OnceLock};

use crate::error::{Error, Result};

type CuResult = c_int;
/// `CUevent`, `CUstream` and `CUcontext`: opaque driver handles.
type Handle = *mut c_void;

const CUDA_SUCCESS: CuResult = 0;
/// `CU_EVENT_DEFAULT`: an event that keeps its time (timing is on unless disabled).
const CU_EVENT_DEFAULT: c_uint = 0;
/// `CU_EVENT_DISABLE_TIMING`: an event without a time, which streams wait on and the host
/// queries faster (the CUDA guide's advice for events used only to order work).
const CU_EVENT_DISABLE_TIMING: c_uint = 2;
/// `CUDA_ERROR_NOT_READY`: what `cuEventQuery` says of an event the GPU has not reached.
const CUDA_ERROR_NOT_READY: CuResult = 600;
/// `CU_STREAM_NON_BLOCKING`: a stream that does not wait on the legacy default stream (as
/// torch's own streams).
const CU_STREAM_NON_BLOCKING: c_uint = 1;

/// The driver entry points used here, with `cuda.h`'s signatures.
struct Driver {
    event_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CuResult,
    event_record: unsafe extern "C" fn(Handle, Handle) -> CuResult,
    event_elapsed: unsafe extern "C" fn(*mut f32, Handle, Handle) -> CuResult,
    event_query: unsafe extern "C" fn(Handle) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CuResult,
    stream_wait_event: unsafe extern "C" fn(Handle, Handle, c_uint) -> CuResult,
    ctx_get_current: unsafe extern "C" fn(*mut Handle) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(Handle) -> CuResult,
    ctx_get_device: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut Handle, c_int) -> CuResult,
    error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

/// Looks up `name` in `handle` as a function of type `F`.
///
/// # Safety
/// `F` must be an `extern "C"` function pointer type with the symbol's C signature, and the
/// library must stay loaded for as long as the pointer is used.
unsafe fn symbol<F: Copy>(handle: *mut c_void, name: &CStr) -> Option<F> {
    // SAFETY: `handle` is a live dlopen handle and `name` a C string.
    let found = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if found.is_null() {
        return None;
    }
    // SAFETY: the caller vouches that `F` is the symbol's function pointer type; a function
    // pointer has a data pointer's size on every platform CUDA runs on.
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&found) })
}

impl Driver {
    /// The driver the process has loaded; `None` where torch has loaded none yet. Found
    /// once; until then each call looks again (CUDA may be initialised later).
    fn get() -> Option<&'static Driver> {
        static FOUND: OnceLock<Driver> = OnceLock::new();
        if let Some(driver) = FOUND.get() {
            return Some(driver);
        }
        let driver = Driver::find()?;
        Some(FOUND.get_or_init(|| driver))
    }

    fn find() -> Option<Driver> {
        // SAFETY: with RTLD_NOLOAD, dlopen only looks for a library already loaded and
        // returns a handle to it, or null; it loads nothing and runs no code. The handle is
        // never closed, so every function found stays mapped for the process's life.
        let lib = unsafe {
            libc::dlopen(
                c"libcuda.so.1".as_ptr(),
                libc::RTLD_NOLOAD | libc::RTLD_LAZY,
            )
        };
        if lib.is_null() {
            return None;
        }
        // SAFETY: each lookup's type is `cuda.h`'s signature of that function, none of which
        // has changed since CUDA 4; `lib` stays loaded (above).
        unsafe {
            Some(Driver {
                event_create: symbol(lib, c"cuEventCreate")?,
                event_record: symbol(lib, c"cuEventRecord")?,
                event_elapsed: symbol(lib, c"cuEventElapsedTime")?,
                event_query: symbol(lib, c"cuEventQuery")?,
                stream_create: symbol(lib, c"cuStreamCreate")?,
                stream_wait_event: symbol(lib, c"cuStreamWaitEvent")?,
                ctx_get_current: symbol(lib, c"cuCtxGetCurrent")?,
                ctx_set_current: symbol(lib, c"cuCtxSetCurrent")?,
                ctx_get_device: symbol(lib, c"cuCtxGetDevice")?,
                device_get: symbol(lib, c"cuDeviceGet")?,
                primary_ctx_retain: symbol(lib, c"cuDevicePrimaryCtxRetain")?,
                error_name: symbol(lib, c"cuGetErrorName")?,
            })
        }
    }

    /// An error naming the driver's result `code` and what failed.
    fn error(&self, code: CuResult, what: &str) -> Error {
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static C string, or leaves it null for
        // an unknown code.
        let known = unsafe { (self.error_name)(code, &mut name) } == CUDA_SUCCESS;
        let name = if known && !name.is_null() {
            // SAFETY: a non-null name is a static, NUL-terminated string of the driver's.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        } else {
            format!("CUDA error {code}")
        };
        Error::invalid(format!("{what}: {name}"))
    }

    /// Runs `f` with GPU `device`'s context current on this thread, then puts the thread's
    /// own back.
    fn on_device<T>(&self, device: i32, f: impl FnOnce() -> T) -> Result<T> {
        let mut current: Handle = std::ptr::null_mut();
        // SAFETY: both calls write one value into the local they are given.
        unsafe {
            if (self.ctx_get_current)(&mut current) == CUDA_SUCCESS && !current.is_null() {
                let mut on = -1;
                if (self.ctx_get_device)(&mut on) == CUDA_SUCCESS && on == device {
                    return Ok(f());
                }
            }
        }
        let context = self.primary_context(device)?;
        // SAFETY: `context` is a primary context this process holds (retained, never
        // released); `current` is the thread's own context or null, valid to restore.
        let set = unsafe { (self.ctx_set_current)(context) };
        if set != CUDA_SUCCESS {
            return Err(self.error(set, &format!("making GPU {device}'s context current")));
        }
        let out = f();
        // SAFETY: as above.
        unsafe { (self.ctx_set_current)(current) };
        Ok(out)
    }

    /// GPU `device`'s primary context, retained once per process and kept.
    fn primary_context(&self, device: i32) -> Result<Handle> {
        static KEPT: Mutex<Option<HashMap<i32, usize>>> = Mutex::new(None);
        let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
        let map = kept.get_or_insert_with(HashMap::new);
        if let Some(&context) = map.get(&device) {
            return Ok(context as Handle);
        }
        let mut dev = 0;
        let mut context: Handle = std::ptr::null_mut();
        // SAFETY: each call writes one value into the local it is given.
        let code = unsafe { (self.device_get)(&mut dev, device) };
        if code != CUDA_SUCCESS {
            return Err(self.error(code, &format!("finding GPU {device}")));
        }
        // SAFETY: as above; `dev` is a device the driver just named.
        let code = unsafe { (self.primary_ctx_retain)(&mut context, dev) };
        if code != CUDA_SUCCESS {
            return Err(self.error(code, &format!("taking GPU {device}'s primary context")));
        }
        map.insert(device, context as usize);
        Ok(context)
    }
}

/// The loaded driver, or an error that says none is.
fn driver() -> Result<&'static Driver> {
    Driver::get().ok_or_else(|| {
        Error::invalid(
            "no CUDA driver is loaded in this process (libcuda.so.1): initialise CUDA \
             through torch first, or read the events through torch",
        )
    })
}

/// Whether the process has a CUDA driver loaded that the functions here can use.
pub fn available() -> bool {
    Driver::get().is_some()
}

/// A new event of GPU `device` that keeps its time (`timing`), or one only to order work by;
/// its handle, which lives as long as the process (events are pooled and reused by the
/// caller, never destroyed).
pub fn create(device: i32, timing: bool) -> Result<usize> {
    let d = driver()?;
    let mut event: Handle = std::ptr::null_mut();
    let flags = if timing {
        CU_EVENT_DEFAULT
    } else {
        CU_EVENT_DISABLE_TIMING
    };
    // SAFETY: cuEventCreate writes one handle into the local it is given.
    let code = d.on_device(device, || unsafe { (d.event_create)(&mut event, flags) })?;
    if code != CUDA_SUCCESS {
        return Err(d.error(code, &format!("creating an event on GPU {device}")));
    }
    Ok(event as usize)
}

/// Records `event` on `stream` (a raw `CUstream`; 0 is the legacy default stream) of GPU
/// `device`.
pub fn record(device: i32, event: usize, stream: usize) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller passes handles the driver gave out and that live as long as the
    // process: events from `create` or torch's (kept by their owners), and torch's streams.
    // These functions are the tracer's alone (`shardline._native` is private): a made-up
    // integer would be undefined behaviour, and none is ever passed.
    let code = d.on_device(device, || unsafe {
        (d.event_record)(event as Handle, stream as Handle)
    })?;
    if code != CUDA_SUCCESS {
        return Err(d.error(code, &format!("recording an event on GPU {device}")));
    }
    Ok(())
}

/// Whether GPU `device` is past `event` (as last recorded; one never recorded is passed).
pub fn query(device: i32, event: usize) -> Result<bool> {
    let d = driver()?;
    // SAFETY: as in `record`: a live event the driver gave out.
    let code = d.on_device(device, || unsafe { (d.event_query)(event as Handle) })?;
    match code {
        CUDA_SUCCESS => Ok(true),
        CUDA_ERROR_NOT_READY => Ok(false),
        _ => Err(d.error(code, &format!("asking about an event of GPU {device}"))),
    }
}

/// A new stream of GPU `device` that does not wait on the legacy default stream; its handle,
/// which lives as long as the process (one per traced group, never destroyed).
pub fn stream_create(device: i32) -> Result<usize> {
    let d = driver()?;
    let mut stream: Handle = std::ptr::null_mut();
    // SAFETY: cuStreamCreate writes one handle into the local it is given.
    let code = d.on_device(device, || unsafe {
        (d.stream_create)(&mut stream, CU_STREAM_NON_BLOCKING)
    })?;
    if code != CUDA_SUCCESS {
        return Err(d.error(code, &format!("creating a stream on GPU {device}")));
    }
    Ok(stream as usize)
}

/// Makes `stream` of GPU `device` wait, on the GPU, until `event` (as last recorded) is
/// reached; the host does not wait.
pub fn stream_wait(device: i32, stream: usize, event: usize) -> Result<()> {
    let d = driver()?;
    // SAFETY: as in `record`: live handles the driver gave out, `stream` from `stream_create`
    // or torch's, `event` from `create`.
    let code = d.on_device(device, || unsafe {
        (d.stream_wait_event)(stream as Handle, event as Handle, 0)
    })?;
    if code != CUDA_SUCCESS {
        return Err(d.error(code, &format!("making a stream of GPU {device} wait")));
    }
    Ok(())
}

/// Records `start` and then `sync` on `stream` of GPU `device`, and makes `side` wait, on the
/// GPU, until `sync` is reached: how a traced op moves from the caller's stream to its group's
/// own, in one call (`record`, `record` and `stream_wait`, with one check of the context).
/// Stops at the first call that fails.
pub fn fork(device: i32, stream: usize, side: usize, start: usize, sync: usize) -> Result<()> {
    let d = driver()?;
    let failed = d.on_device(device, || {
        // SAFETY: as in `record` and `stream_wait`: live handles the driver gave out.
        unsafe {
            let code = (d.event_record)(start as Handle, stream as Handle);
            if code != CUDA_SUCCESS {
                return Some((code, "recording an event"));
            }
            let code = (d.event_record)(sync as Handle, stream as Handle);
            if code != CUDA_SUCCESS {
                return Some((code, "recording an event"));
            }
            let code = (d.stream_wait_event)(side as Handle, sync as Handle, 0);
            (code != CUDA_SUCCESS).then_some((code, "making a stream wait"))
        }
    })?;
    match failed {
        Some((code, what)) => Err(d.error(code, &format!("{what} on GPU {device}"))),
        None => Ok(()),
    }
}

/// Records `first` and then `second` on `stream` of GPU `device`, in one call: a traced op's
/// end, and the event its handle waits on. Stops at the first call that fails.
pub fn record_pair(device: i32, stream: usize, first: usize, second: usize) -> Result<()> {
    let d = driver()?;
    let code = d.on_device(device, || {
        // SAFETY: as in `record`: live handles the driver gave out.
        unsafe {
            let code = (d.event_record)(first as Handle, stream as Handle);
            if code != CUDA_SUCCESS {
                return code;
            }
            (d.event_record)(second as Handle, stream as Handle)
        }
    })?;
    if code != CUDA_SUCCESS {
        return Err(d.error(code, &format!("recording an event on GPU {device}")));
    }
    Ok(())
}

/// For each pair of events of GPU `device`, the milliseconds from the first to the second;
/// NaN where the driver has no time for the pair: one the GPU has not reached yet (how a
/// caller learns that), or one never recorded.
pub fn elapsed(device: i32, firsts: &[usize], seconds: &[usize]) -> Result<Vec<f64>> {
    if firsts.len() != seconds.len() {
        return Err(Error::invalid(format!(
            "{} first events and {} second ones: pass one of each per pair",
            firsts.len(),
            seconds.len()
        )));
    }
    let d = driver()?;
    d.on_device(device, || {
        firsts
            .iter()
            .zip(seconds)
            .map(|(&a, &b)| {
                let mut ms = 0f32;
                // SAFETY: the handles are live events the driver gave out (see `record`);
                // cuEventElapsedTime writes one float into the local it is given.
                let code = unsafe { (d.event_elapsed)(&mut ms, a as Handle, b as Handle) };
                if code == CUDA_SUCCESS {
                    f64::from(ms)
                } else {
                    f64::NAN
                }
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_loaded_driver_every_call_says_so_and_nothing_is_loaded() {
        if available() {
            return; // a host whose process loaded CUDA: the GPU tests cover it
        }
        for err in [
            create(0, true).unwrap_err(),
            record(0, 1, 0).unwrap_err(),
            query(0, 1).unwrap_err(),
            stream_create(0).unwrap_err(),
            stream_wait(0, 1, 2).unwrap_err(),
            fork(0, 1, 2, 3, 4).unwrap_err(),
            record_pair(0, 1, 2, 3).unwrap_err(),
            elapsed(0, &[1], &[2]).unwrap_err(),
        ] {
            assert!(
                err.message.contains("no CUDA driver is loaded"),
                "{}",
                err.message
            );
        }
        // Looking did not load it.
        // SAFETY: RTLD_NOLOAD only asks whether the library is loaded.
        let lib = unsafe {
            libc::dlopen(
                c"libcuda.so.1".as_ptr(),
                libc::RTLD_NOLOAD | libc::RTLD_LAZY,
            )
        };
        assert!(lib.is_null());
    }

    #[test]
    fn pairs_of_unequal_length_are_refused_before_the_driver_is_asked() {
        let err = elapsed(0, &[1, 2], &[3]).unwrap_err();
        assert!(
            err.message.contains("2 first events and 1 second"),
            "{}",
            err.message
        );
    }
}
