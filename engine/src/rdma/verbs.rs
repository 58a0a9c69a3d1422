//! The part of RDMA that talks to a device (cargo feature `rdma`): open a device, register
//! memory, create RC QPs, take them through INIT → RTR → RTS with the negotiated route, post
//! chains of one-sided READ/WRITE work requests and poll their completions.
//!
//! Devices are listed with the `ibverbs` crate. Its safe layer stops short of what a transfer
//! engine needs (it registers only memory it allocates itself, posts only SENDs, and pins every
//! QP to port 1), so everything past the listing is written here on its FFI crate,
//! `ibverbs-sys`, with owned handles that close in the right order: QPs hold their PD and CQ,
//! PDs and CQs hold their device context, memory registrations hold the region they cover.

use std::ffi::CStr;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use ibverbs_sys as ffi;

use super::handshake::{QpInfo, QpParams, Route, random_psn};
use super::mtu::Mtu;
use super::retry::WcStatus;
use super::sysfs::{Gid, LinkLayer, PortState};
use crate::error::{Error, Result};
use crate::op::Opcode;
use crate::region::{Location, Region, RegionId};

fn errno_error(call: &'static str, device: &str, errno: i32) -> Error {
    Error::Verbs {
        call,
        device: device.into(),
        reason: std::io::Error::from_raw_os_error(errno).to_string(),
    }
}

fn last_error(call: &'static str, device: &str) -> Error {
    Error::Verbs {
        call,
        device: device.into(),
        reason: std::io::Error::last_os_error().to_string(),
    }
}

/// The RDMA devices libibverbs can open; empty (not an error) on a machine without RDMA.
pub fn device_names() -> Vec<String> {
    match ibverbs::devices() {
        Ok(list) => list
            .iter()
            .filter_map(|d| d.name().map(|n| n.to_string_lossy().into_owned()))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// An open device.
#[derive(Debug)]
pub struct Context {
    raw: NonNull<ffi::ibv_context>,
    name: String,
}

// SAFETY: libibverbs contexts may be used from any thread; the library locks what it shares.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device; every child object holds an Arc of this context,
        // so none outlives it.
        let r = unsafe { ffi::ibv_close_device(self.raw.as_ptr()) };
        if r != 0 {
            tracing::warn!(device = %self.name, errno = r, "ibv_close_device failed");
        }
    }
}

/// A port as verbs reports it (sysfs lacks the InfiniBand active MTU and the message limit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortAttr {
    pub state: PortState,
    pub active_mtu: Mtu,
    pub lid: u16,
    pub link_layer: LinkLayer,
    pub gid_table_len: u32,
    pub max_msg_sz: u32,
}

/// Device limits that bound what a QP may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_qp_wr: u32,
    pub max_cqe: u32,
    pub max_qp_rd_atom: u32,
    pub max_qp_init_rd_atom: u32,
    pub max_mr_size: u64,
}

impl Context {
    /// Opens the device called `name` (`mlx5_0`).
    pub fn open(name: &str) -> Result<Arc<Context>> {
        let mut n = 0;
        // SAFETY: a valid out-pointer; the list is freed below on every path.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(Error::NoRdmaDevice {
                reason: format!(
                    "cannot open {name:?}: ibv_get_device_list: {}",
                    std::io::Error::last_os_error()
                ),
            });
        }
        let mut found = None;
        let mut names = Vec::new();
        for i in 0..n.max(0) as usize {
            // SAFETY: the list has `n` entries.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a device of the list; the name is a NUL-terminated string it owns.
            let dev_name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) }
                .to_string_lossy()
                .into_owned();
            if dev_name == name {
                found = Some(dev);
            }
            names.push(dev_name);
        }
        // SAFETY: a device opened from the list stays valid after the list is freed.
        let ctx = found.map(|dev| unsafe { ffi::ibv_open_device(dev) });
        // SAFETY: the list came from ibv_get_device_list and is freed once.
        unsafe { ffi::ibv_free_device_list(list) };
        match ctx {
            None => Err(Error::NoRdmaDevice {
                reason: format!(
                    "no device {name:?} (libibverbs lists: {})",
                    if names.is_empty() {
                        "none".into()
                    } else {
                        names.join(", ")
                    }
                ),
            }),
            Some(raw) => match NonNull::new(raw) {
                Some(raw) => Ok(Arc::new(Context {
                    raw,
                    name: name.into(),
                })),
                None => Err(last_error("ibv_open_device", name)),
            },
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: the exported ibv_query_port fills the (smaller) compat prefix of
        // ibv_port_attr, which `attr` has room for.
        let r = unsafe {
            ffi::ibv_query_port(
                self.raw.as_ptr(),
                port,
                (&mut attr as *mut ffi::ibv_port_attr).cast(),
            )
        };
        if r != 0 {
            return Err(errno_error("ibv_query_port", &self.name, r));
        }
        let state = match attr.state {
            ffi::ibv_port_state::IBV_PORT_DOWN => PortState::Down,
            ffi::ibv_port_state::IBV_PORT_INIT => PortState::Init,
            ffi::ibv_port_state::IBV_PORT_ARMED => PortState::Armed,
            ffi::ibv_port_state::IBV_PORT_ACTIVE => PortState::Active,
            ffi::ibv_port_state::IBV_PORT_ACTIVE_DEFER => PortState::ActiveDefer,
            other => PortState::Other(format!("{other}")),
        };
        let link_layer = match u32::from(attr.link_layer) {
            ffi::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
            // UNSPECIFIED is how old providers say InfiniBand.
            ffi::IBV_LINK_LAYER_INFINIBAND | ffi::IBV_LINK_LAYER_UNSPECIFIED => {
                LinkLayer::InfiniBand
            }
            other => LinkLayer::Other(format!("link layer {other}")),
        };
        let active_mtu = Mtu::from_ibv(attr.active_mtu).ok_or_else(|| Error::RdmaPort {
            device: self.name.clone(),
            port: port.into(),
            reason: format!("active_mtu {} is not an IB MTU", attr.active_mtu),
        })?;
        Ok(PortAttr {
            state,
            active_mtu,
            lid: attr.lid,
            link_layer,
            gid_table_len: attr.gid_tbl_len.max(0) as u32,
            max_msg_sz: attr.max_msg_sz,
        })
    }

    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        let mut gid = ffi::ibv_gid::default();
        // SAFETY: a valid out-pointer.
        let r = unsafe { ffi::ibv_query_gid(self.raw.as_ptr(), port, index as i32, &mut gid) };
        if r != 0 {
            return Err(errno_error("ibv_query_gid", &self.name, r));
        }
        // SAFETY: every bit pattern of the union is a valid `raw` array.
        Ok(Gid(unsafe { gid.raw }))
    }

    pub fn limits(&self) -> Result<Limits> {
        let mut attr = ffi::ibv_device_attr::default();
        // SAFETY: a valid out-pointer of the type the function takes.
        let r = unsafe { ffi::ibv_query_device(self.raw.as_ptr(), &mut attr) };
        if r != 0 {
            return Err(errno_error("ibv_query_device", &self.name, r));
        }
        let u = |v: i32| v.max(0) as u32;
        Ok(Limits {
            max_qp_wr: u(attr.max_qp_wr),
            max_cqe: u(attr.max_cqe),
            max_qp_rd_atom: u(attr.max_qp_rd_atom),
            max_qp_init_rd_atom: u(attr.max_qp_init_rd_atom),
            max_mr_size: attr.max_mr_size,
        })
    }

    pub fn alloc_pd(self: &Arc<Self>) -> Result<Arc<Pd>> {
        // SAFETY: a live context.
        let raw = unsafe { ffi::ibv_alloc_pd(self.raw.as_ptr()) };
        NonNull::new(raw)
            .map(|raw| {
                Arc::new(Pd {
                    raw,
                    ctx: self.clone(),
                })
            })
            .ok_or_else(|| last_error("ibv_alloc_pd", &self.name))
    }

    /// A completion queue of at least `entries` entries.
    pub fn create_cq(self: &Arc<Self>, entries: u32) -> Result<Arc<Cq>> {
        // SAFETY: a live context; no channel, vector 0.
        let raw = unsafe {
            ffi::ibv_create_cq(
                self.raw.as_ptr(),
                entries.min(i32::MAX as u32) as i32,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        NonNull::new(raw)
            .map(|raw| {
                Arc::new(Cq {
                    raw,
                    ctx: self.clone(),
                })
            })
            .ok_or_else(|| last_error("ibv_create_cq", &self.name))
    }
}

/// A protection domain.
#[derive(Debug)]
pub struct Pd {
    raw: NonNull<ffi::ibv_pd>,
    ctx: Arc<Context>,
}

// SAFETY: see Context.
unsafe impl Send for Pd {}
// SAFETY: see Context.
unsafe impl Sync for Pd {}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd; MRs and QPs hold an Arc of this PD.
        let r = unsafe { ffi::ibv_dealloc_pd(self.raw.as_ptr()) };
        if r != 0 {
            tracing::warn!(device = %self.ctx.name, errno = r, "ibv_dealloc_pd failed");
        }
    }
}

/// How a region was registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MrKind {
    Host,
    /// GPU memory through a dma-buf of the CUDA driver (no kernel module needed).
    DmaBuf,
    /// GPU memory by its device address (needs the nvidia-peermem module).
    PeerMemory,
}

fn access_flags() -> i32 {
    (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
        | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
        | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ)
        .0 as i32
}

/// A registered region: local and remote keys, and the region itself, kept alive as long as
/// the device may touch it.
#[derive(Debug)]
pub struct MemoryRegion {
    raw: NonNull<ffi::ibv_mr>,
    pd: Arc<Pd>,
    region: Arc<Region>,
    /// The address WRs use for the region's first byte (its virtual address, or the IOVA of
    /// a dma-buf registration).
    addr: u64,
    kind: MrKind,
}

// SAFETY: see Context; the MR is immutable after registration.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr / ibv_reg_dmabuf_mr; deregistered once, before the
        // region (held here) can be freed.
        let r = unsafe { ffi::ibv_dereg_mr(self.raw.as_ptr()) };
        if r != 0 {
            tracing::warn!(device = %self.pd.ctx.name, errno = r, "ibv_dereg_mr failed");
        }
    }
}

impl MemoryRegion {
    pub fn lkey(&self) -> u32 {
        // SAFETY: a live MR.
        unsafe { self.raw.as_ref() }.lkey
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: a live MR.
        unsafe { self.raw.as_ref() }.rkey
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> u64 {
        self.region.len()
    }

    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
    }

    pub fn kind(&self) -> MrKind {
        self.kind
    }

    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// What a peer needs to reach this region through this NIC (published in the segment
    /// descriptor).
    pub fn key(&self) -> crate::segment::RdmaKey {
        crate::segment::RdmaKey {
            nic: self.pd.ctx.name.clone(),
            addr: self.addr,
            rkey: self.rkey(),
        }
    }
}

impl Pd {
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Registers `region` for local access and remote READ/WRITE. Host memory is registered
    /// by address; GPU memory through a dma-buf when the driver exports one, else by device
    /// address (peer memory). The registration keeps the region alive.
    pub fn register(self: &Arc<Self>, region: Arc<Region>) -> Result<MemoryRegion> {
        let len = usize::try_from(region.len()).map_err(|_| Error::InvalidConfig {
            field: "len",
            value: region.len().to_string(),
            reason: "does not fit the address space",
        })?;
        let (raw, addr, kind) = match region.location() {
            Location::Host { .. } => {
                let ptr = region.range(0, "len", 0, region.len())?.ptr;
                // SAFETY: the whole region is mapped host memory, kept alive by the Arc held in
                // the returned MemoryRegion until after deregistration.
                let raw =
                    unsafe { ffi::ibv_reg_mr(self.raw.as_ptr(), ptr.cast(), len, access_flags()) };
                (raw, ptr as u64, MrKind::Host)
            }
            Location::Cuda { device } => {
                let ptr = region.device_ptr().ok_or_else(|| Error::InvalidConfig {
                    field: "region",
                    value: region.id().to_string(),
                    reason: "a GPU region without a device pointer",
                })?;
                self.register_gpu(device, ptr, len)?
            }
        };
        let raw = NonNull::new(raw).ok_or_else(|| last_error("ibv_reg_mr", &self.ctx.name))?;
        Ok(MemoryRegion {
            raw,
            pd: self.clone(),
            region,
            addr,
            kind,
        })
    }

    #[cfg(feature = "cuda")]
    fn register_gpu(
        &self,
        device: u32,
        ptr: u64,
        len: usize,
    ) -> Result<(*mut ffi::ibv_mr, u64, MrKind)> {
        use std::os::fd::AsRawFd;
        match crate::cuda::dmabuf(device, ptr, len as u64) {
            Ok((fd, offset)) => {
                // SAFETY: a dma-buf fd of the driver covering [ptr - offset, ...); the IOVA we
                // choose is the device address, so WR addresses are device addresses.
                let raw = unsafe {
                    ffi::ibv_reg_dmabuf_mr(
                        self.raw.as_ptr(),
                        offset,
                        len,
                        ptr,
                        fd.as_raw_fd(),
                        access_flags(),
                    )
                };
                if !raw.is_null() {
                    return Ok((raw, ptr, MrKind::DmaBuf));
                }
                tracing::debug!(
                    device = %self.ctx.name,
                    error = %std::io::Error::last_os_error(),
                    "ibv_reg_dmabuf_mr refused; trying peer memory"
                );
            }
            Err(e) => tracing::debug!(%e, "no dma-buf for GPU memory; trying peer memory"),
        }
        // SAFETY: a device address; with nvidia-peermem the kernel pins it, without it the call
        // fails (EFAULT) and nothing is touched.
        let raw = unsafe {
            ffi::ibv_reg_mr(
                self.raw.as_ptr(),
                ptr as *mut std::ffi::c_void,
                len,
                access_flags(),
            )
        };
        if raw.is_null() {
            return Err(Error::Verbs {
                call: "ibv_reg_mr",
                device: self.ctx.name.clone(),
                reason: format!(
                    "GPU memory cuda:{device} could not be registered: no dma-buf support and \
                     peer memory failed ({}); is nvidia-peermem loaded?",
                    std::io::Error::last_os_error()
                ),
            });
        }
        Ok((raw, ptr, MrKind::PeerMemory))
    }

    #[cfg(not(feature = "cuda"))]
    fn register_gpu(
        &self,
        _device: u32,
        _ptr: u64,
        _len: usize,
    ) -> Result<(*mut ffi::ibv_mr, u64, MrKind)> {
        Err(Error::NoCudaDriver {
            reason: "this build has no CUDA support (cargo feature `cuda` is off)".into(),
        })
    }
}

/// A completion queue.
#[derive(Debug)]
pub struct Cq {
    raw: NonNull<ffi::ibv_cq>,
    ctx: Arc<Context>,
}

// SAFETY: see Context; polling one CQ from several threads is allowed (the provider locks).
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_cq; QPs using it hold an Arc of it.
        let r = unsafe { ffi::ibv_destroy_cq(self.raw.as_ptr()) };
        if r != 0 {
            tracing::warn!(device = %self.ctx.name, errno = r, "ibv_destroy_cq failed");
        }
    }
}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub vendor_err: u32,
    pub qp_num: u32,
    pub byte_len: u32,
}

impl Cq {
    /// Appends up to `max` completions to `out`; returns how many.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let mut wc = [ffi::ibv_wc::default(); 32];
        let want = max.min(wc.len());
        // SAFETY: the context's provider table is filled by ibv_open_device.
        let poll = unsafe { (*self.ctx.raw.as_ptr()).ops.poll_cq }.ok_or_else(|| Error::Verbs {
            call: "ibv_poll_cq",
            device: self.ctx.name.clone(),
            reason: "the provider has no poll_cq".into(),
        })?;
        // SAFETY: a live CQ and a buffer of at least `want` entries.
        let n = unsafe { poll(self.raw.as_ptr(), want as i32, wc.as_mut_ptr()) };
        if n < 0 {
            return Err(errno_error("ibv_poll_cq", &self.ctx.name, -n));
        }
        for w in &wc[..n as usize] {
            let (status, vendor_err) = match w.error() {
                None => (WcStatus::Success, 0),
                Some((s, v)) => (WcStatus::from_code(s), v),
            };
            out.push(Completion {
                wr_id: w.wr_id(),
                status,
                vendor_err,
                qp_num: w.qp_num,
                byte_len: w.len() as u32,
            });
        }
        Ok(n as usize)
    }
}

/// Where one WR's bytes are on the other side: from a peer's `RdmaKey` plus the region length
/// its descriptor publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteMemory {
    /// The remote region (for errors).
    pub region: RegionId,
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
}

/// One READ or WRITE: `len` bytes at `local_offset` of a local registration and
/// `remote_offset` of a remote one. Bounds are checked on both sides before posting.
#[derive(Debug, Clone, Copy)]
pub struct WorkRequest<'a> {
    pub wr_id: u64,
    pub opcode: Opcode,
    pub local: &'a MemoryRegion,
    pub local_offset: u64,
    pub remote: RemoteMemory,
    pub remote_offset: u64,
    pub len: u32,
    pub signaled: bool,
}

/// A reliable-connection queue pair.
#[derive(Debug)]
pub struct Qp {
    raw: NonNull<ffi::ibv_qp>,
    pd: Arc<Pd>,
    _cq: Arc<Cq>,
    port: u8,
    params: QpParams,
    psn: u32,
}

// SAFETY: see Context; posting is serialized by `&mut self`.
unsafe impl Send for Qp {}
// SAFETY: `&self` methods only read immutable fields.
unsafe impl Sync for Qp {}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_qp; destroyed once.
        let r = unsafe { ffi::ibv_destroy_qp(self.raw.as_ptr()) };
        if r != 0 {
            tracing::warn!(device = %self.pd.ctx.name, errno = r, "ibv_destroy_qp failed");
        }
    }
}

impl Qp {
    /// An RC QP on `port` whose send completions go to `cq`, in the RESET state. The send
    /// queue depth and the READ depths are clamped to the device's limits.
    pub fn create(pd: &Arc<Pd>, cq: &Arc<Cq>, port: u8, params: &QpParams) -> Result<Qp> {
        params.validate()?;
        let mut params = *params;
        let limits = pd.ctx.limits()?;
        params.sq_depth = params.sq_depth.min(limits.max_qp_wr.max(1));
        params.max_rd_atomic = params
            .max_rd_atomic
            .min(limits.max_qp_init_rd_atom.clamp(1, 255) as u8);
        params.max_dest_rd_atomic = params
            .max_dest_rd_atomic
            .min(limits.max_qp_rd_atom.clamp(1, 255) as u8);
        let mut init = ffi::ibv_qp_init_attr {
            send_cq: cq.raw.as_ptr(),
            recv_cq: cq.raw.as_ptr(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: params.sq_depth,
                // One-sided ops consume no receive WRs; some providers refuse 0.
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: a live PD and CQ; `init` is fully initialised.
        let raw = unsafe { ffi::ibv_create_qp(pd.raw.as_ptr(), &mut init) };
        let raw = NonNull::new(raw).ok_or_else(|| last_error("ibv_create_qp", &pd.ctx.name))?;
        // The device may round the depth up; credits must use what it granted at most.
        params.sq_depth = params.sq_depth.min(init.cap.max_send_wr.max(1));
        Ok(Qp {
            raw,
            pd: pd.clone(),
            _cq: cq.clone(),
            port,
            params,
            psn: random_psn(),
        })
    }

    pub fn qpn(&self) -> u32 {
        // SAFETY: a live QP.
        unsafe { self.raw.as_ref() }.qp_num
    }

    /// The parameters in force (after clamping to the device).
    pub fn params(&self) -> &QpParams {
        &self.params
    }

    /// A name for errors and logs: `mlx5_0 qp 0x1a2b`.
    pub fn name(&self) -> String {
        format!("{} qp {:#x}", self.pd.ctx.name, self.qpn())
    }

    /// This end of the connection, to send to the peer; `gid` is the GID this QP sends from.
    pub fn info(&self, gid: Gid) -> Result<QpInfo> {
        let port = self.pd.ctx.query_port(self.port)?;
        Ok(QpInfo {
            nic: self.pd.ctx.name.clone(),
            port: self.port,
            link_layer: port.link_layer,
            lid: port.lid,
            gid,
            mtu: port.active_mtu,
            qpn: self.qpn(),
            psn: self.psn,
        })
    }

    fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        call: &'static str,
    ) -> Result<()> {
        // SAFETY: a live QP and an attribute struct valid for the mask.
        let r = unsafe { ffi::ibv_modify_qp(self.raw.as_ptr(), attr, mask.0 as i32) };
        if r != 0 {
            return Err(Error::Verbs {
                call,
                device: self.name(),
                reason: std::io::Error::from_raw_os_error(r).to_string(),
            });
        }
        Ok(())
    }

    /// INIT → RTR → RTS towards the peer QP of `route`, sending from GID `sgid_index`. Works
    /// from RESET (a new QP, or one `reset` after an error).
    pub fn connect(&mut self, route: &Route, sgid_index: u32) -> Result<()> {
        use ffi::ibv_qp_attr_mask as M;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: self.port,
            qp_access_flags: access_flags() as u32,
            ..Default::default()
        };
        self.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(INIT)",
        )?;

        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: route.mtu.ibv(),
            dest_qp_num: route.remote_qpn,
            rq_psn: route.remote_psn,
            max_dest_rd_atomic: self.params.max_dest_rd_atomic,
            min_rnr_timer: self.params.min_rnr_timer,
            ah_attr: ffi::ibv_ah_attr {
                dlid: route.dlid,
                sl: 0,
                src_path_bits: 0,
                port_num: self.port,
                ..Default::default()
            },
            ..Default::default()
        };
        if let Some(dgid) = route.dgid {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = dgid.0;
            a.ah_attr.grh.sgid_index = u8::try_from(sgid_index).map_err(|_| Error::RdmaPort {
                device: self.pd.ctx.name.clone(),
                port: self.port.into(),
                reason: format!("GID index {sgid_index} does not fit the address vector (max 255)"),
            })?;
            a.ah_attr.grh.hop_limit = 64;
        }
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp(RTR)",
        )?;

        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: route.local_psn,
            timeout: self.params.timeout,
            retry_cnt: self.params.retry_cnt,
            rnr_retry: self.params.rnr_retry,
            max_rd_atomic: self.params.max_rd_atomic,
            ..Default::default()
        };
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp(RTS)",
        )
    }

    /// Back to RESET after an error (every outstanding WR is dropped), with a fresh PSN for
    /// the next handshake.
    pub fn reset(&mut self) -> Result<()> {
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RESET,
            ..Default::default()
        };
        self.modify(
            &mut a,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE,
            "ibv_modify_qp(RESET)",
        )?;
        self.psn = random_psn();
        Ok(())
    }

    /// Posts `chain` as one linked list of WRs (one doorbell). Every WR is bounds-checked
    /// against its local registration and remote extent first; nothing is posted if one fails.
    /// The caller accounts credits (`SendQueue::post`) before calling.
    pub fn post(&mut self, chain: &[WorkRequest<'_>]) -> Result<()> {
        if chain.is_empty() {
            return Ok(());
        }
        let name = self.name();
        let mut sges = Vec::with_capacity(chain.len());
        let mut remote_addrs = Vec::with_capacity(chain.len());
        for (i, w) in chain.iter().enumerate() {
            let check = |field: &'static str, region: RegionId, offset: u64, region_len: u64| {
                if w.len == 0 {
                    return Err(Error::ZeroLength { op: i });
                }
                match offset.checked_add(w.len.into()) {
                    Some(end) if end <= region_len => Ok(()),
                    _ => Err(Error::OutOfBounds {
                        op: i,
                        field,
                        region,
                        offset,
                        len: w.len.into(),
                        region_len,
                    }),
                }
            };
            check(
                "local_offset",
                w.local.region.id(),
                w.local_offset,
                w.local.len(),
            )?;
            check(
                "remote_offset",
                w.remote.region,
                w.remote_offset,
                w.remote.len,
            )?;
            if !Arc::ptr_eq(&w.local.pd, &self.pd) {
                return Err(Error::Verbs {
                    call: "ibv_post_send",
                    device: name,
                    reason: format!(
                        "WR {i}: the local memory is registered on another device or PD"
                    ),
                });
            }
            // The remote base comes from the peer's descriptor: its sum with an offset inside
            // the region may still pass 2^64.
            let remote_addr = w
                .remote
                .addr
                .checked_add(w.remote_offset)
                .filter(|a| a.checked_add(w.len.into()).is_some())
                .ok_or(Error::RangeOverflow {
                    op: i,
                    field: "remote rdma addr",
                    offset: w.remote.addr,
                    len: w.remote_offset.saturating_add(w.len.into()),
                })?;
            remote_addrs.push(remote_addr);
            sges.push(ffi::ibv_sge {
                // Inside our own registration (checked above).
                addr: w.local.addr + w.local_offset,
                length: w.len,
                lkey: w.local.lkey(),
            });
        }
        let mut wrs: Vec<ffi::ibv_send_wr> = chain
            .iter()
            .zip(sges.iter_mut())
            .zip(remote_addrs)
            .map(|((w, sge), remote_addr)| {
                let mut wr = ffi::ibv_send_wr {
                    wr_id: w.wr_id,
                    next: std::ptr::null_mut(),
                    sg_list: sge,
                    num_sge: 1,
                    opcode: match w.opcode {
                        Opcode::Read => ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
                        Opcode::Write => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                    },
                    send_flags: if w.signaled {
                        ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
                    } else {
                        0
                    },
                    ..Default::default()
                };
                wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                    remote_addr,
                    rkey: w.remote.rkey,
                };
                wr
            })
            .collect();
        for i in 1..wrs.len() {
            let next: *mut ffi::ibv_send_wr = &mut wrs[i];
            wrs[i - 1].next = next;
        }
        // SAFETY: the context's provider table is filled by ibv_open_device.
        let post =
            unsafe { (*self.pd.ctx.raw.as_ptr()).ops.post_send }.ok_or_else(|| Error::Verbs {
                call: "ibv_post_send",
                device: name.clone(),
                reason: "the provider has no post_send".into(),
            })?;
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: a live QP; the WR list and its SGEs live until the call returns (the provider
        // copies them into the send queue); the memory they name is registered and bounds-checked.
        let r = unsafe { post(self.raw.as_ptr(), wrs.as_mut_ptr(), &mut bad) };
        if r != 0 {
            let at = if bad.is_null() {
                "?".to_string()
            } else {
                // SAFETY: `bad` points into `wrs`.
                unsafe { bad.offset_from(wrs.as_ptr()) }.to_string()
            };
            return Err(Error::Verbs {
                call: "ibv_post_send",
                device: name,
                reason: format!(
                    "{} (at WR {at} of {})",
                    std::io::Error::from_raw_os_error(r),
                    wrs.len()
                ),
            });
        }
        Ok(())
    }
}

/// Pins the calling thread to `cpus` (the NIC's NUMA node); a no-op for an empty list.
pub fn pin_current_thread(cpus: &[usize]) -> Result<()> {
    if cpus.is_empty() {
        return Ok(());
    }
    let mut set = rustix::thread::CpuSet::new();
    for &c in cpus
        .iter()
        .filter(|&&c| c < rustix::thread::CpuSet::MAX_CPU)
    {
        set.set(c);
    }
    rustix::thread::sched_setaffinity(None, &set)
        .map_err(|e| Error::io("sched_setaffinity", e.into()))
}

/// A thread that polls `cq` until `stop` is set, handing every completion to `on`. It pins
/// itself to `cpus` first (failing that, it logs and runs unpinned).
pub fn spawn_poller(
    cq: Arc<Cq>,
    cpus: Vec<usize>,
    stop: Arc<AtomicBool>,
    mut on: impl FnMut(Completion) + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    let name = format!("kvf-rdma-cq-{}", cq.ctx.name);
    std::thread::Builder::new().name(name).spawn(move || {
        if let Err(e) = pin_current_thread(&cpus) {
            tracing::warn!(device = %cq.ctx.name, %e, "completion poller not pinned");
        }
        let mut out = Vec::with_capacity(32);
        let mut idle = 0u32;
        while !stop.load(Ordering::Acquire) {
            out.clear();
            match cq.poll(&mut out, 32) {
                Ok(0) => {
                    // Busy-poll briefly, then back off so an idle NIC costs no core.
                    idle = idle.saturating_add(1);
                    if idle > 1024 {
                        std::thread::sleep(std::time::Duration::from_micros(50));
                    } else {
                        std::hint::spin_loop();
                    }
                }
                Ok(_) => {
                    idle = 0;
                    out.drain(..).for_each(&mut on);
                }
                Err(e) => {
                    tracing::error!(device = %cq.ctx.name, %e, "completion queue failed; poller stops");
                    return;
                }
            }
        }
    })
}
