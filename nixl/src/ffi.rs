//! The C ABI the C++ shim (shim/plugin.cpp) calls: raw pointers and lengths in, NIXL status
//! codes out. No panic crosses it (each call is caught and answered NIXL_ERR_UNKNOWN), and an
//! error is written to stderr where NIXL would log its own.

use std::ffi::{c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use crate::backend::{Backend, Md};
use crate::request::{Desc, Request};
use crate::status::{Error, Status};

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KvfDesc {
    pub addr: u64,
    pub len: u64,
    pub dev: u64,
    pub md: *const c_void,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KvfStr {
    pub ptr: *const c_char,
    pub len: usize,
}

type PushNotif = unsafe extern "C" fn(*mut c_void, *const c_char, usize, *const c_char, usize);

/// The outcome of a call as NIXL reads it; errors said on stderr.
fn answer(context: &str, f: impl FnOnce() -> Result<Status, Error>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(status)) => status as c_int,
        Ok(Err(e)) => {
            eprintln!("kvfabric-nixl: {context}: {e}");
            e.status() as c_int
        }
        Err(_) => {
            eprintln!("kvfabric-nixl: {context}: internal error (panic)");
            Status::Unknown as c_int
        }
    }
}

/// # Safety
/// `ptr` is null with `len` 0, or points at `len` readable bytes that outlive the borrow.
unsafe fn bytes<'a>(ptr: *const c_char, len: usize) -> &'a [u8] {
    if ptr.is_null() || len == 0 {
        return &[];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(ptr.cast(), len) }
}

/// # Safety
/// As [`bytes`].
unsafe fn text<'a>(ptr: *const c_char, len: usize) -> Result<&'a str, Error> {
    // SAFETY: the caller's contract.
    std::str::from_utf8(unsafe { bytes(ptr, len) }).map_err(|_| Error::Invalid {
        field: "agent name",
        reason: "not UTF-8".into(),
    })
}

fn str_of(s: &str) -> KvfStr {
    KvfStr {
        ptr: s.as_ptr().cast(),
        len: s.len(),
    }
}

/// A new backend for NIXL agent `agent`, or null (said on stderr).
///
/// # Safety
/// The pointers are valid for their lengths.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_backend_new(
    agent: *const c_char,
    agent_len: usize,
    dir: *const c_char,
    dir_len: usize,
) -> *mut c_void {
    let made = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the caller's contract.
        let (agent, dir) = unsafe { (text(agent, agent_len)?, text(dir, dir_len)?) };
        Backend::new(agent, dir)
    }));
    match made {
        Ok(Ok(b)) => Box::into_raw(Box::new(b)).cast(),
        Ok(Err(e)) => {
            eprintln!("kvfabric-nixl: starting the KVFABRIC backend: {e}");
            std::ptr::null_mut()
        }
        Err(_) => std::ptr::null_mut(),
    }
}

/// # Safety
/// `backend` came from [`kvf_backend_new`] and is not used after.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_backend_free(backend: *mut c_void) {
    // SAFETY: the caller's contract.
    let b = unsafe { Box::from_raw(backend.cast::<Backend>()) };
    // A runtime may not be dropped inside another's context; NIXL calls from plain threads.
    let _ = catch_unwind(AssertUnwindSafe(move || drop(b)));
}

/// # Safety
/// `backend` is live; the answer lives as long as it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_conn_info(backend: *const c_void) -> KvfStr {
    // SAFETY: the caller's contract.
    str_of(unsafe { &*backend.cast::<Backend>() }.conn_info())
}

/// # Safety
/// `backend` is live, `out` writable; `[addr, addr + len)` is this process's memory that no
/// thread writes during the call and that stays mapped while transfers may touch it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_register(
    backend: *mut c_void,
    addr: u64,
    len: u64,
    dev: u64,
    mem: c_int,
    out: *mut *mut c_void,
) -> c_int {
    answer("registering memory", || {
        // SAFETY: the caller's contract.
        let b = unsafe { &*backend.cast::<Backend>() };
        // SAFETY: the caller's contract.
        let local = unsafe { b.register(addr, len, dev, mem) }?;
        let md = Box::new(Md::Local(Arc::new(local)));
        // SAFETY: the caller's contract.
        unsafe { *out = Box::into_raw(md).cast() };
        Ok(Status::Success)
    })
}

/// # Safety
/// `md` came from [`kvf_register`] of this backend and is not used after.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_deregister(backend: *mut c_void, md: *mut c_void) -> c_int {
    answer("deregistering memory", || {
        // SAFETY: the caller's contract.
        let (b, md) = unsafe { (&*backend.cast::<Backend>(), Box::from_raw(md.cast::<Md>())) };
        match *md {
            Md::Local(local) => b.deregister(&local).map(|()| Status::Success),
            Md::Remote(_) => Ok(Status::Success),
        }
    })
}

/// # Safety
/// `md` is live; the answer lives as long as it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_public_data(md: *const c_void) -> KvfStr {
    // SAFETY: the caller's contract.
    match unsafe { &*md.cast::<Md>() } {
        Md::Local(l) => str_of(&l.public),
        Md::Remote(_) => str_of(""),
    }
}

/// # Safety
/// `backend` is live; the pointers are valid for their lengths.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_load_remote_conn(
    backend: *mut c_void,
    agent: *const c_char,
    agent_len: usize,
    info: *const c_char,
    info_len: usize,
) -> c_int {
    answer("loading a peer's connection info", || {
        // SAFETY: the caller's contract.
        let (b, agent, info) = unsafe {
            (
                &*backend.cast::<Backend>(),
                text(agent, agent_len)?,
                bytes(info, info_len),
            )
        };
        b.load_conn_info(agent, info).map(|()| Status::Success)
    })
}

/// # Safety
/// `backend` is live; the pointers are valid for their lengths.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_disconnect(
    backend: *mut c_void,
    agent: *const c_char,
    agent_len: usize,
) -> c_int {
    answer("forgetting a peer", || {
        // SAFETY: the caller's contract.
        let (b, agent) = unsafe { (&*backend.cast::<Backend>(), text(agent, agent_len)?) };
        b.forget(agent);
        Ok(Status::Success)
    })
}

/// # Safety
/// `backend` is live, `out` writable; the pointers are valid for their lengths.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvf_load_remote_md(
    backend: *mut c_void,
    addr: u64,
    len: u64,
    _dev: u64,
    meta: *const c_char,
    meta_len: usize,
    mem: c_int,
    agent: *const c_char,
    agent_len: usize,
    out: *mut *mut c_void,
) -> c_int {
    answer("loading a peer's memory", || {
        // SAFETY: the caller's contract.
        let (b, agent, meta) = unsafe {
            (
                &*backend.cast::<Backend>(),
                text(agent, agent_len)?,
                bytes(meta, meta_len),
            )
        };
        let remote = b.load_remote(agent, addr, len, mem, meta)?;
        let md = Box::new(Md::Remote(Arc::new(remote)));
        // SAFETY: the caller's contract.
        unsafe { *out = Box::into_raw(md).cast() };
        Ok(Status::Success)
    })
}

/// # Safety
/// `md` came from [`kvf_load_remote_md`] and is not used after.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_unload_md(md: *mut c_void) {
    // SAFETY: the caller's contract. Requests that use it keep their own reference.
    drop(unsafe { Box::from_raw(md.cast::<Md>()) });
}

/// # Safety
/// `local`/`remote` point at that many descriptors whose `md` is null or a live MD of this
/// backend; `out` is writable.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvf_prep(
    _backend: *const c_void,
    op: c_int,
    local: *const KvfDesc,
    local_len: usize,
    remote: *const KvfDesc,
    remote_len: usize,
    agent: *const c_char,
    agent_len: usize,
    out: *mut *mut c_void,
) -> c_int {
    answer("preparing a transfer", || {
        let read = match op {
            0 => true,
            1 => false,
            other => {
                return Err(Error::Invalid {
                    field: "operation",
                    reason: format!("{other} is neither NIXL_READ nor NIXL_WRITE"),
                });
            }
        };
        // SAFETY: the caller's contract.
        let (local, remote, agent) = unsafe {
            (
                descs(local, local_len),
                descs(remote, remote_len),
                text(agent, agent_len)?,
            )
        };
        let request = Request::prepare(read, &local, &remote, agent)?;
        // SAFETY: the caller's contract.
        unsafe { *out = Box::into_raw(Box::new(request)).cast() };
        Ok(Status::Success)
    })
}

/// # Safety
/// As [`kvf_prep`]'s descriptors.
unsafe fn descs<'a>(ptr: *const KvfDesc, len: usize) -> Vec<Desc<'a>> {
    if ptr.is_null() || len == 0 {
        return Vec::new();
    }
    // SAFETY: the caller's contract.
    let raw = unsafe { std::slice::from_raw_parts(ptr, len) };
    raw.iter()
        .map(|d| Desc {
            addr: d.addr,
            len: d.len,
            // SAFETY: null or a live MD (the caller's contract).
            md: unsafe { d.md.cast::<Md>().as_ref() },
        })
        .collect()
}

/// # Safety
/// `backend` and `req` are live; `notif` is valid for `notif_len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_post(
    backend: *const c_void,
    req: *mut c_void,
    notif: *const c_char,
    notif_len: usize,
    has_notif: c_int,
) -> c_int {
    answer("posting a transfer", || {
        // SAFETY: the caller's contract.
        let (b, r) = unsafe { (&*backend.cast::<Backend>(), &*req.cast::<Request>()) };
        // SAFETY: the caller's contract.
        let notification = (has_notif != 0).then(|| unsafe { bytes(notif, notif_len) }.to_vec());
        r.post(b, notification)
    })
}

/// # Safety
/// `req` is live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_check(req: *mut c_void) -> c_int {
    answer("checking a transfer", || {
        // SAFETY: the caller's contract.
        Ok(unsafe { &*req.cast::<Request>() }.check())
    })
}

/// Frees a request unless its batches are still running (then NIXL_ERR_REPOST_ACTIVE, and
/// the request stays).
///
/// # Safety
/// `req` is live; after a success it is not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_release(req: *mut c_void) -> c_int {
    answer("releasing a transfer", || {
        // SAFETY: the caller's contract.
        if unsafe { &*req.cast::<Request>() }.running() {
            return Err(Error::Running);
        }
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(req.cast::<Request>()) });
        Ok(Status::Success)
    })
}

/// Hands every notification that arrived to `push`.
///
/// # Safety
/// `backend` is live; `push(ctx, …)` may be called with borrowed bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_take_notifs(
    backend: *mut c_void,
    ctx: *mut c_void,
    push: PushNotif,
) -> c_int {
    answer("taking notifications", || {
        // SAFETY: the caller's contract.
        let b = unsafe { &*backend.cast::<Backend>() };
        for n in b.take_notifications() {
            // SAFETY: the caller's contract; the bytes live through the call.
            unsafe {
                push(
                    ctx,
                    n.sender.as_ptr().cast(),
                    n.sender.len(),
                    n.message.as_ptr().cast(),
                    n.message.len(),
                )
            };
        }
        Ok(Status::Success)
    })
}

/// # Safety
/// `backend` is live; the pointers are valid for their lengths.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvf_gen_notif(
    backend: *const c_void,
    agent: *const c_char,
    agent_len: usize,
    msg: *const c_char,
    msg_len: usize,
) -> c_int {
    answer("sending a notification", || {
        // SAFETY: the caller's contract.
        let (b, agent, msg) = unsafe {
            (
                &*backend.cast::<Backend>(),
                text(agent, agent_len)?,
                bytes(msg, msg_len),
            )
        };
        b.notify(agent, msg).map(|()| Status::Success)
    })
}
