//! Collective operations over the ranks of a data-parallel group.
//!
//! A [`Collective`] is one rank's handle on its group: element-wise sums
//! (gradients, token counts, statistics that steer sampling), an
//! all-gather of byte strings (per-rank records in rank order), a
//! broadcast and a barrier. Two implementations live here:
//!
//! - [`Single`]: a group of one (every operation is the identity), what a
//!   one-device run uses;
//! - [`ThreadGroup`]: `world` ranks as threads of one process, exchanging
//!   through shared memory, for CPU tests of data-parallel code paths;
//! - [`TcpGroup`]: ranks as processes, on one machine or several, joined
//!   over TCP through rank 0 (`MASTER_ADDR:MASTER_PORT`, the torchrun
//!   convention; [`TcpGroup::from_env`]). Every byte goes through rank 0,
//!   so it suits CPU ranks and tests, not gradients of large models;
//! - `NcclGroup` (the `nccl` cargo feature): a [`TcpGroup`] for the
//!   host-side exchanges (records, counts, the NCCL id) and an NCCL
//!   communicator on each rank's GPU stream for the gradient sums
//!   ([`Collective::all_reduce_sum_tensors`]), which then never leave the
//!   GPUs.
//!
//! Every rank calls the same operations in the same order (as with NCCL
//! or MPI). Sums add the ranks' values in rank order, so every rank gets
//! the bit-identical result and a run does not depend on which rank
//! arrived first. A rank that is dropped while the others still use the
//! group (it failed) makes their pending and later operations fail with
//! [`DistError::RankGone`] naming it, instead of waiting forever; an
//! operation that waits longer than the group's timeout fails with
//! [`DistError::Timeout`].

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Every rank's `item` (any serde value: records, lists), in rank order,
/// on every rank. Items travel as CBOR: compact, and exact for every float,
/// NaN and infinities included.
pub(crate) fn all_gather_items<T: serde::Serialize + serde::de::DeserializeOwned>(
    group: &mut dyn Collective,
    item: &T,
) -> Result<Vec<T>, DistError> {
    let rank = group.rank();
    let mut mine = Vec::new();
    ciborium::into_writer(item, &mut mine).map_err(|e| DistError::Mismatch {
        rank,
        msg: format!("cannot encode a record for the other ranks: {e}"),
    })?;
    group
        .all_gather(&mine)?
        .iter()
        .enumerate()
        .map(|(r, part)| {
            ciborium::from_reader(part.as_slice()).map_err(|e| DistError::Mismatch {
                rank,
                msg: format!("rank {r} sent an unreadable record: {e}"),
            })
        })
        .collect()
}

/// Why a collective operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DistError {
    /// A rank left the group (it was dropped, typically after an error).
    #[error("rank {0} of the group stopped")]
    RankGone(usize),
    /// The other ranks did not arrive in time.
    #[error("rank {rank}: {op} waited more than {secs} s for the other ranks")]
    Timeout {
        rank: usize,
        op: &'static str,
        secs: u64,
    },
    /// Ranks disagree about an operation (different lengths or roots).
    #[error("rank {rank}: {msg}")]
    Mismatch { rank: usize, msg: String },
    /// A tensor could not be read or written, or the device collective
    /// library (NCCL) failed.
    #[error("rank {rank}: {msg}")]
    Device { rank: usize, msg: String },
}

/// One rank's handle on a data-parallel group.
pub trait Collective: Send {
    /// This rank, `0..world`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// Every rank's `bytes`, in rank order (the same list on every rank).
    fn all_gather(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError>;

    /// `buf[i] <- sum over ranks r of buf_r[i]`, added in rank order. Every
    /// rank must pass the same length.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), DistError> {
        let bytes: Vec<u8> = buf.iter().flat_map(|x| x.to_le_bytes()).collect();
        let parts = self.all_gather(&bytes)?;
        let rank = self.rank();
        sum_parts(&parts, buf, rank, f32::from_le_bytes)
    }

    /// [`all_reduce_sum`](Self::all_reduce_sum) in f64 (counts, losses,
    /// statistics).
    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), DistError> {
        let bytes: Vec<u8> = buf.iter().flat_map(|x| x.to_le_bytes()).collect();
        let parts = self.all_gather(&bytes)?;
        let rank = self.rank();
        sum_parts(&parts, buf, rank, f64::from_le_bytes)
    }

    /// `root`'s `bytes` on every rank (the others' input is replaced).
    fn broadcast(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), DistError> {
        if root >= self.world() {
            return Err(DistError::Mismatch {
                rank: self.rank(),
                msg: format!("broadcast root {root} outside a group of {}", self.world()),
            });
        }
        let mine = if self.rank() == root {
            bytes.clone()
        } else {
            Vec::new()
        };
        let mut parts = self.all_gather(&mine)?;
        *bytes = std::mem::take(&mut parts[root]);
        Ok(())
    }

    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<(), DistError> {
        self.all_gather(&[]).map(|_| ())
    }

    /// Every rank's `xs`, concatenated in rank order.
    fn all_gather_f64(&mut self, xs: &[f64]) -> Result<Vec<f64>, DistError> {
        let mine: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        Ok(self
            .all_gather(&mine)?
            .iter()
            .flat_map(|p| p.chunks_exact(8))
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect())
    }

    /// The device this rank computes on. A group that moves device buffers
    /// (NCCL) sets up its communicator on that device's stream here; the
    /// others need nothing.
    fn bind_device(&mut self, _device: &candle_core::Device) -> Result<(), DistError> {
        Ok(())
    }

    /// Each of `ts` (f32, any shapes, the same list on every rank) summed
    /// over the ranks, on its own device; every rank gets the same sums.
    /// The tensors' storage may be reused for the sums: pass tensors that
    /// nothing else reads. By default through host memory in one flat
    /// [`Collective::all_reduce_sum`] (rank order); NCCL sums each tensor
    /// in place on the GPU.
    fn all_reduce_sum_tensors(
        &mut self,
        ts: Vec<candle_core::Tensor>,
    ) -> Result<Vec<candle_core::Tensor>, DistError> {
        host_sum_tensors(self, ts)
    }
}

/// [`Collective::all_reduce_sum_tensors`] through host memory.
fn host_sum_tensors<C: Collective + ?Sized>(
    group: &mut C,
    ts: Vec<candle_core::Tensor>,
) -> Result<Vec<candle_core::Tensor>, DistError> {
    let rank = group.rank();
    let err = |e: candle_core::Error| DistError::Device {
        rank,
        msg: e.to_string(),
    };
    let mut flat = Vec::new();
    for t in &ts {
        flat.extend(
            t.to_dtype(candle_core::DType::F32)
                .and_then(|x| x.flatten_all())
                .and_then(|x| x.to_vec1::<f32>())
                .map_err(err)?,
        );
    }
    group.all_reduce_sum(&mut flat)?;
    let mut at = 0;
    ts.iter()
        .map(|t| {
            let n = t.elem_count();
            at += n;
            candle_core::Tensor::from_slice(&flat[at - n..at], t.shape(), t.device()).map_err(err)
        })
        .collect()
}

/// Sums the ranks' little-endian encodings of `T` into `out`, in rank
/// order.
fn sum_parts<T, const N: usize>(
    parts: &[Vec<u8>],
    out: &mut [T],
    rank: usize,
    decode: fn([u8; N]) -> T,
) -> Result<(), DistError>
where
    T: Copy + Default + std::ops::AddAssign,
{
    let want = out.len() * N;
    if let Some((r, p)) = parts.iter().enumerate().find(|(_, p)| p.len() != want) {
        return Err(DistError::Mismatch {
            rank,
            msg: format!(
                "all-reduce of {} values here, {} on rank {r}",
                out.len(),
                p.len() / N
            ),
        });
    }
    out.fill(T::default());
    for p in parts {
        for (o, c) in out.iter_mut().zip(p.chunks_exact(N)) {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            *o += decode(a);
        }
    }
    Ok(())
}

#[cfg(feature = "nccl")]
pub use nccl::NcclGroup;

/// Gradient sums over NCCL; see the module docs.
#[cfg(feature = "nccl")]
mod nccl {
    use candle_core::cuda_backend::cudarc::nccl::safe::{
        group_end, group_start, Comm, Id, ReduceOp,
    };
    use candle_core::cuda_backend::{CudaDevice, CudaStorage};
    use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor};

    use super::{Collective, DistError, TcpGroup};

    /// An NCCL communicator that moves between threads with its group.
    struct SendComm(Comm);

    // SAFETY: an NCCL communicator may be used from any thread as long as
    // calls on it are not concurrent; the group owns this one and calls it
    // only through `&mut self`.
    #[allow(unsafe_code)]
    unsafe impl Send for SendComm {}

    /// [`TcpGroup`] for host exchanges, NCCL for device buffers.
    pub struct NcclGroup {
        host: TcpGroup,
        /// The communicator and the device whose stream it runs on, once
        /// bound ([`Collective::bind_device`]).
        comm: Option<(SendComm, CudaDevice)>,
    }

    impl NcclGroup {
        /// The group of `host`'s ranks; its NCCL communicator is created
        /// when the rank's device is bound (rank 0 makes the NCCL id and
        /// sends it to the others over `host`).
        pub fn new(host: TcpGroup) -> Self {
            NcclGroup { host, comm: None }
        }

        fn err(&self, msg: impl std::fmt::Display) -> DistError {
            DistError::Device {
                rank: self.host.rank(),
                msg: msg.to_string(),
            }
        }
    }

    impl Collective for NcclGroup {
        fn rank(&self) -> usize {
            self.host.rank()
        }
        fn world(&self) -> usize {
            self.host.world()
        }
        fn all_gather(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
            self.host.all_gather(bytes)
        }

        fn bind_device(&mut self, device: &Device) -> Result<(), DistError> {
            let Device::Cuda(dev) = device else {
                return Ok(());
            };
            let mut id = Vec::new();
            if self.rank() == 0 {
                let made = Id::new().map_err(|e| self.err(format!("ncclGetUniqueId: {e:?}")))?;
                id = made.internal().iter().map(|&c| c as u8).collect();
            }
            self.host.broadcast(&mut id, 0)?;
            let internal: [std::ffi::c_char; 128] =
                std::array::from_fn(|i| id.get(i).copied().unwrap_or(0) as std::ffi::c_char);
            if id.len() != internal.len() {
                return Err(self.err(format!("an NCCL id of {} bytes, not 128", id.len())));
            }
            let (rank, world) = (self.rank(), self.world());
            let comm = Comm::from_rank(dev.cuda_stream(), rank, world, Id::uninit(internal))
                .map_err(|e| self.err(format!("ncclCommInitRank: {e:?}")))?;
            self.comm = Some((SendComm(comm), dev.clone()));
            Ok(())
        }

        /// Each tensor summed in place on its GPU (one NCCL all-reduce per
        /// tensor, launched together as one NCCL group; no copy of the
        /// gradients), then the stream is waited for, so a failure
        /// surfaces here and the time is the sum's.
        fn all_reduce_sum_tensors(&mut self, ts: Vec<Tensor>) -> Result<Vec<Tensor>, DistError> {
            let on_gpu = ts.iter().all(|t| matches!(t.device(), Device::Cuda(_)));
            let Some((comm, dev)) = self.comm.as_ref().filter(|_| on_gpu) else {
                return super::host_sum_tensors(self, ts);
            };
            let rank = self.host.rank();
            let err = |msg: String| DistError::Device { rank, msg };
            // An f32 contiguous tensor is summed where it is; others go
            // through an f32 copy.
            let out = ts
                .into_iter()
                .map(|t| {
                    if t.dtype() == DType::F32 && t.is_contiguous() {
                        Ok(t)
                    } else {
                        t.to_dtype(DType::F32)
                            .and_then(|x| x.contiguous())
                            .and_then(|x| x.copy())
                            .map_err(|e| err(e.to_string()))
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            group_start().map_err(|e| err(format!("ncclGroupStart: {e:?}")))?;
            let summed = out
                .iter()
                .try_for_each(|t| t.inplace_op1(&NcclSum(&comm.0)))
                .map_err(|e| err(e.to_string()));
            // The group is closed even after a failed call.
            let ended = group_end().map_err(|e| err(format!("ncclGroupEnd: {e:?}")));
            summed?;
            ended?;
            dev.cuda_stream()
                .synchronize()
                .map_err(|e| err(format!("waiting for the NCCL sums: {e:?}")))?;
            Ok(out)
        }
    }

    /// The sum over the communicator's ranks, in place.
    struct NcclSum<'a>(&'a Comm);

    impl InplaceOp1 for NcclSum<'_> {
        fn name(&self) -> &'static str {
            "arbor-nccl-sum"
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
            candle_core::bail!("an NCCL sum needs a CUDA tensor")
        }

        fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
            let Some((a, b)) = l.contiguous_offsets() else {
                candle_core::bail!("an NCCL sum needs a contiguous tensor");
            };
            let slice = s.as_cuda_slice_mut::<f32>()?;
            let mut view = slice.slice_mut(a..b);
            self.0
                .all_reduce_in_place(&mut view, &ReduceOp::Sum)
                .map_err(|e| candle_core::Error::Msg(format!("ncclAllReduce: {e:?}")))?;
            Ok(())
        }
    }
}

/// A group of one: every operation returns its input.
#[derive(Debug, Clone, Copy, Default)]
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_gather(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        Ok(vec![bytes.to_vec()])
    }
    fn all_reduce_sum(&mut self, _buf: &mut [f32]) -> Result<(), DistError> {
        Ok(())
    }
    fn all_reduce_sum_f64(&mut self, _buf: &mut [f64]) -> Result<(), DistError> {
        Ok(())
    }
    fn broadcast(&mut self, _bytes: &mut Vec<u8>, root: usize) -> Result<(), DistError> {
        if root == 0 {
            Ok(())
        } else {
            Err(DistError::Mismatch {
                rank: 0,
                msg: format!("broadcast root {root} outside a group of 1"),
            })
        }
    }
    fn barrier(&mut self) -> Result<(), DistError> {
        Ok(())
    }
    fn all_reduce_sum_tensors(
        &mut self,
        ts: Vec<candle_core::Tensor>,
    ) -> Result<Vec<candle_core::Tensor>, DistError> {
        Ok(ts)
    }
}

/// The exchange of a [`ThreadGroup`]: the round in progress and the last
/// one completed.
struct Exchange {
    /// Completed rounds.
    round: u64,
    /// This round's deposits, by rank.
    deposits: Vec<Option<Vec<u8>>>,
    /// The result of round `round - 1`, read by every rank.
    last: Arc<Vec<Vec<u8>>>,
    /// The first rank that left, if any.
    gone: Option<usize>,
}

struct Shared {
    state: Mutex<Exchange>,
    changed: Condvar,
    timeout: Duration,
}

/// One rank of a group whose ranks are threads of this process.
pub struct ThreadGroup {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
}

impl ThreadGroup {
    /// The `world` ranks of a new group (hand one to each thread); an
    /// operation waits at most `timeout` for the others.
    pub fn new(world: usize, timeout: Duration) -> Vec<ThreadGroup> {
        let shared = Arc::new(Shared {
            state: Mutex::new(Exchange {
                round: 0,
                deposits: vec![None; world],
                last: Arc::new(Vec::new()),
                gone: None,
            }),
            changed: Condvar::new(),
            timeout,
        });
        (0..world)
            .map(|rank| ThreadGroup {
                rank,
                world,
                shared: shared.clone(),
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Exchange> {
        // A rank that panicked while holding the lock leaves the state
        // consistent (deposits are whole): keep using it.
        self.shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Collective for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        let mut st = self.lock();
        if let Some(r) = st.gone {
            return Err(DistError::RankGone(r));
        }
        let round = st.round;
        st.deposits[self.rank] = Some(bytes.to_vec());
        if st.deposits.iter().all(Option::is_some) {
            // The last to arrive completes the round for everyone.
            let parts: Vec<Vec<u8>> = st.deposits.iter_mut().filter_map(Option::take).collect();
            st.last = Arc::new(parts);
            st.round += 1;
            self.shared.changed.notify_all();
            return Ok(st.last.as_ref().clone());
        }
        let start = Instant::now();
        loop {
            let left = self.shared.timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                // Take the deposit back: a later round must not see it.
                st.deposits[self.rank] = None;
                return Err(DistError::Timeout {
                    rank: self.rank,
                    op: "all-gather",
                    secs: self.shared.timeout.as_secs(),
                });
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
            if st.round > round {
                // No later round can complete before this rank deposits
                // again, so `last` is still this round's.
                return Ok(st.last.as_ref().clone());
            }
            if let Some(r) = st.gone {
                return Err(DistError::RankGone(r));
            }
        }
    }
}

impl Drop for ThreadGroup {
    /// Leaving the group: the others' operations fail instead of waiting
    /// for this rank.
    fn drop(&mut self) {
        let mut st = self.lock();
        if st.gone.is_none() {
            st.gone = Some(self.rank);
        }
        st.deposits[self.rank] = None;
        self.shared.changed.notify_all();
    }
}

/// A frame's length word that announces a failed rank instead of data.
const ABORT: u64 = u64::MAX;

/// One rank of a group of processes joined over TCP through rank 0.
///
/// Rank 0 listens on `addr` and accepts the other ranks, which say who they
/// are on connecting; an all-gather sends each rank's frame (length, bytes)
/// to rank 0, which answers every rank with all frames in rank order. When
/// rank 0 loses a rank it tells the others which one (an abort frame)
/// before closing, so every rank's error names the rank that stopped.
pub struct TcpGroup {
    rank: usize,
    world: usize,
    /// Rank 0: a stream to each other rank (index `r - 1`); others: the
    /// stream to rank 0.
    peers: Vec<std::net::TcpStream>,
    /// The first rank known to have stopped.
    gone: Option<usize>,
    timeout: Duration,
}

impl TcpGroup {
    /// Joins the group: rank 0 listens on `addr` and waits for the others;
    /// the others connect to it, retrying for up to `timeout` (rank 0 may
    /// start later). Operations wait at most `timeout` for data.
    pub fn join(
        rank: usize,
        world: usize,
        addr: &str,
        timeout: Duration,
    ) -> Result<TcpGroup, DistError> {
        use std::io::{Read, Write};
        let io = |what: &str, e: std::io::Error| DistError::Mismatch {
            rank,
            msg: format!("{what} {addr}: {e}"),
        };
        if rank >= world {
            return Err(DistError::Mismatch {
                rank,
                msg: format!("rank {rank} outside a group of {world}"),
            });
        }
        let start = Instant::now();
        let mut peers = Vec::new();
        if rank == 0 {
            let listener =
                std::net::TcpListener::bind(addr).map_err(|e| io("cannot listen on", e))?;
            listener
                .set_nonblocking(true)
                .map_err(|e| io("cannot listen on", e))?;
            let mut by_rank: Vec<Option<std::net::TcpStream>> = (1..world).map(|_| None).collect();
            while by_rank.iter().any(Option::is_none) {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        s.set_nonblocking(false)
                            .map_err(|e| io("accepting on", e))?;
                        s.set_read_timeout(Some(timeout))
                            .map_err(|e| io("accepting on", e))?;
                        s.set_write_timeout(Some(timeout))
                            .map_err(|e| io("accepting on", e))?;
                        let mut b = [0u8; 8];
                        s.read_exact(&mut b).map_err(|e| io("handshake on", e))?;
                        let r = u64::from_le_bytes(b) as usize;
                        if r == 0 || r >= world || by_rank[r - 1].is_some() {
                            return Err(DistError::Mismatch {
                                rank,
                                msg: format!("a peer claims rank {r} in a group of {world}"),
                            });
                        }
                        by_rank[r - 1] = Some(s);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if start.elapsed() > timeout {
                            let missing: Vec<usize> =
                                (1..world).filter(|r| by_rank[r - 1].is_none()).collect();
                            return Err(DistError::Timeout {
                                rank,
                                op: if missing.is_empty() {
                                    "join"
                                } else {
                                    "join (ranks missing)"
                                },
                                secs: timeout.as_secs(),
                            });
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(io("accepting on", e)),
                }
            }
            peers = by_rank.into_iter().flatten().collect();
        } else {
            let mut s = loop {
                match std::net::TcpStream::connect(addr) {
                    Ok(s) => break s,
                    Err(_) if start.elapsed() < timeout => {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    Err(e) => return Err(io("cannot reach rank 0 at", e)),
                }
            };
            s.set_read_timeout(Some(timeout))
                .map_err(|e| io("connected to", e))?;
            s.set_write_timeout(Some(timeout))
                .map_err(|e| io("connected to", e))?;
            s.write_all(&(rank as u64).to_le_bytes())
                .map_err(|e| io("handshake with", e))?;
            peers.push(s);
        }
        for p in &peers {
            let _ = p.set_nodelay(true);
        }
        Ok(TcpGroup {
            rank,
            world,
            peers,
            gone: None,
            timeout,
        })
    }

    /// Joins the group the environment describes, as torchrun and cluster
    /// launchers set it: `RANK`, `WORLD_SIZE`, `MASTER_ADDR` (default
    /// `127.0.0.1`), `MASTER_PORT`. `None` when `WORLD_SIZE` is unset.
    pub fn from_env(timeout: Duration) -> Option<Result<TcpGroup, DistError>> {
        let var = |k: &str| std::env::var(k).ok();
        let world = var("WORLD_SIZE")?;
        let bad = |msg: String| DistError::Mismatch { rank: 0, msg };
        let parse = |k: &str, v: Option<String>| -> Result<usize, DistError> {
            v.ok_or_else(|| bad(format!("WORLD_SIZE is set but {k} is not")))?
                .parse()
                .map_err(|_| bad(format!("{k} is not a number")))
        };
        Some((|| {
            let world = parse("WORLD_SIZE", Some(world))?;
            let rank = parse("RANK", var("RANK"))?;
            let port = parse("MASTER_PORT", var("MASTER_PORT"))?;
            let host = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
            TcpGroup::join(rank, world, &format!("{host}:{port}"), timeout)
        })())
    }

    /// Rank 0: tell every rank but `r` that rank `r` stopped (best effort:
    /// a rank that cannot be told learns it from the closed connection).
    fn abort_others(&mut self, r: usize) {
        let mut f = ABORT.to_le_bytes().to_vec();
        f.extend((r as u64).to_le_bytes());
        for (k, p) in self.peers.iter_mut().enumerate() {
            if k + 1 != r {
                let _ = std::io::Write::write_all(p, &f);
            }
        }
    }

    fn lost(&mut self, peer: usize, e: &std::io::Error) -> DistError {
        let r = self.gone.unwrap_or(peer);
        self.gone = Some(r);
        if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut {
            return DistError::Timeout {
                rank: self.rank,
                op: "all-gather",
                secs: self.timeout.as_secs(),
            };
        }
        DistError::RankGone(r)
    }
}

fn write_frame(s: &mut std::net::TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    s.write_all(&(bytes.len() as u64).to_le_bytes())?;
    s.write_all(bytes)
}

/// A frame: its bytes, or `Err(rank)` for an abort frame naming a rank.
fn read_frame(s: &mut std::net::TcpStream) -> std::io::Result<Result<Vec<u8>, usize>> {
    use std::io::Read;
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    let n = u64::from_le_bytes(b);
    if n == ABORT {
        s.read_exact(&mut b)?;
        return Ok(Err(u64::from_le_bytes(b) as usize));
    }
    // Grown as bytes arrive: a corrupt length cannot allocate at once.
    let mut v = Vec::new();
    (&mut *s).take(n).read_to_end(&mut v)?;
    if v.len() as u64 != n {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "connection closed inside a frame",
        ));
    }
    Ok(Ok(v))
}

impl Collective for TcpGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        if let Some(r) = self.gone {
            return Err(DistError::RankGone(r));
        }
        if self.rank != 0 {
            if let Err(e) = write_frame(&mut self.peers[0], bytes) {
                return Err(self.lost(0, &e));
            }
            let mut out = Vec::with_capacity(self.world);
            for _ in 0..self.world {
                match read_frame(&mut self.peers[0]) {
                    Ok(Ok(v)) => out.push(v),
                    Ok(Err(r)) => {
                        self.gone = Some(r);
                        return Err(DistError::RankGone(r));
                    }
                    Err(e) => return Err(self.lost(0, &e)),
                }
            }
            return Ok(out);
        }
        let mut out = vec![bytes.to_vec()];
        for r in 1..self.world {
            let e = match read_frame(&mut self.peers[r - 1]) {
                Ok(Ok(v)) => {
                    out.push(v);
                    continue;
                }
                // Only rank 0 sends abort frames.
                Ok(Err(_)) => std::io::Error::other("a rank sent an abort frame"),
                Err(e) => e,
            };
            let err = self.lost(r, &e);
            self.abort_others(r);
            return Err(err);
        }
        for r in 1..self.world {
            for part in &out {
                if let Err(e) = write_frame(&mut self.peers[r - 1], part) {
                    let err = self.lost(r, &e);
                    self.abort_others(r);
                    return Err(err);
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on every rank of a thread group of `world`, returning the
    /// ranks' results in rank order.
    fn on_ranks<T: Send>(world: usize, f: impl Fn(&mut ThreadGroup) -> T + Sync) -> Vec<T> {
        let ranks = ThreadGroup::new(world, Duration::from_secs(20));
        std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .into_iter()
                .map(|mut g| {
                    let f = &f;
                    s.spawn(move || f(&mut g))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn sums_are_the_rank_ordered_sum_on_every_rank() {
        for world in [1, 2, 3, 5] {
            let got = on_ranks(world, |g| {
                let r = g.rank() as f32;
                // Values whose sum depends on the order of addition.
                let mut a = vec![1e8 * (r - 1.0), 1.0 + r, 0.1 * r];
                g.all_reduce_sum(&mut a).unwrap();
                let mut b = vec![r as f64, 2.0];
                g.all_reduce_sum_f64(&mut b).unwrap();
                (a, b)
            });
            let mut want = vec![0.0f32; 3];
            for r in 0..world {
                let r = r as f32;
                for (w, x) in want.iter_mut().zip([1e8 * (r - 1.0), 1.0 + r, 0.1 * r]) {
                    *w += x;
                }
            }
            let n = world as f64;
            for (a, b) in &got {
                assert_eq!(a, &want, "world {world}");
                assert_eq!(b, &vec![n * (n - 1.0) / 2.0, 2.0 * n]);
            }
        }
    }

    /// Tensor sums through host memory keep each tensor's shape and device
    /// and add in rank order, as the flat sums do.
    #[test]
    fn tensor_sums_keep_shapes_and_rank_order() {
        use candle_core::{Device, Tensor};
        let got = on_ranks(3, |g| {
            let r = g.rank() as f32;
            let a = Tensor::new(
                &[[1e8 * (r - 1.0), 1.0 + r, 0.5], [r, 2.0, 3.0]],
                &Device::Cpu,
            )
            .unwrap();
            let b = Tensor::new(&[0.1 * r], &Device::Cpu).unwrap();
            let out = g.all_reduce_sum_tensors(vec![a, b]).unwrap();
            let dims: Vec<Vec<usize>> = out.iter().map(|t| t.dims().to_vec()).collect();
            let a: Vec<Vec<f32>> = out[0].to_vec2().unwrap();
            let b: Vec<f32> = out[1].to_vec1().unwrap();
            (dims, a, b)
        });
        let mut want = [0.0f32; 3];
        let mut tenth = 0.0f32;
        for r in 0..3 {
            let r = r as f32;
            for (w, x) in want.iter_mut().zip([1e8 * (r - 1.0), 1.0 + r, 0.5]) {
                *w += x;
            }
            tenth += 0.1 * r;
        }
        for (dims, a, b) in got {
            assert_eq!(dims, vec![vec![2, 3], vec![1]]);
            assert_eq!(a, vec![want.to_vec(), vec![3.0, 6.0, 9.0]]);
            assert_eq!(b, vec![tenth]);
        }
        // A group of one returns its input.
        let t = Tensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
        let same = Single.all_reduce_sum_tensors(vec![t.clone()]).unwrap();
        assert_eq!(same[0].to_vec1::<f32>().unwrap(), vec![1.0, 2.0]);
    }

    #[test]
    fn gather_broadcast_and_many_rounds_keep_rank_order() {
        let got = on_ranks(3, |g| {
            let mut out = Vec::new();
            for round in 0..50u8 {
                let parts = g.all_gather(&[g.rank() as u8, round]).unwrap();
                out.push(parts);
                let mut b = if g.rank() == 1 {
                    vec![round; 3]
                } else {
                    vec![]
                };
                g.broadcast(&mut b, 1).unwrap();
                assert_eq!(b, vec![round; 3]);
                g.barrier().unwrap();
            }
            out
        });
        for rank_view in &got {
            for (round, parts) in rank_view.iter().enumerate() {
                let want: Vec<Vec<u8>> = (0..3).map(|r| vec![r, round as u8]).collect();
                assert_eq!(parts, &want);
            }
        }
        let mut single = Single;
        let mut v = vec![1.5f32];
        single.all_reduce_sum(&mut v).unwrap();
        assert_eq!(v, vec![1.5]);
        assert!(single.broadcast(&mut Vec::new(), 1).is_err());
    }

    #[test]
    fn a_rank_that_stops_fails_the_others_instead_of_hanging() {
        let t0 = Instant::now();
        let got = on_ranks(3, |g| {
            g.barrier().unwrap();
            if g.rank() == 2 {
                // Rank 2 fails: its handle is dropped with the thread.
                return Err(DistError::RankGone(2));
            }
            let mut a = [1.0f32];
            g.all_reduce_sum(&mut a)
        });
        for r in &got {
            assert_eq!(r, &Err(DistError::RankGone(2)));
        }
        assert!(t0.elapsed() < Duration::from_secs(10));
    }

    /// A free local port (bound, then released).
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Runs `f` on every rank of a TCP group of `world` (threads standing in
    /// for processes).
    fn on_tcp_ranks<T: Send>(world: usize, f: impl Fn(&mut TcpGroup) -> T + Sync) -> Vec<T> {
        let addr = format!("127.0.0.1:{}", free_port());
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    let (f, addr) = (&f, addr.clone());
                    s.spawn(move || {
                        let mut g =
                            TcpGroup::join(rank, world, &addr, Duration::from_secs(20)).unwrap();
                        f(&mut g)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn tcp_ranks_agree_with_thread_ranks() {
        let work = |g: &mut dyn Collective| {
            let r = g.rank() as f32;
            let mut a = vec![1e8 * (r - 1.0), 1.0 + r, 0.1 * r];
            g.all_reduce_sum(&mut a).unwrap();
            let parts = g.all_gather(&[g.rank() as u8; 3]).unwrap();
            let mut b = if g.rank() == 2 { vec![7u8; 5] } else { vec![] };
            g.broadcast(&mut b, 2).unwrap();
            g.barrier().unwrap();
            (a, parts, b)
        };
        let tcp = on_tcp_ranks(3, |g| work(g));
        let threads = on_ranks(3, |g| work(g));
        assert_eq!(tcp, threads);
        assert_eq!(tcp[1].2, vec![7u8; 5]);
    }

    #[test]
    fn a_tcp_rank_that_stops_is_named_to_the_others() {
        let got = on_tcp_ranks(3, |g| {
            g.barrier().unwrap();
            if g.rank() == 2 {
                return Err(DistError::RankGone(2));
            }
            let mut a = [1.0f32];
            g.all_reduce_sum(&mut a)
        });
        assert_eq!(got[0], Err(DistError::RankGone(2)));
        assert_eq!(got[1], Err(DistError::RankGone(2)));
        // A rank that cannot reach rank 0 gives up after the timeout.
        let addr = format!("127.0.0.1:{}", free_port());
        let e = TcpGroup::join(1, 2, &addr, Duration::from_millis(200))
            .err()
            .unwrap();
        assert!(e.to_string().contains("cannot reach rank 0"), "{e}");
    }

    #[test]
    fn mismatched_lengths_and_timeouts_are_errors() {
        let got = on_ranks(2, |g| {
            let mut a = vec![1.0f32; 1 + g.rank()];
            g.all_reduce_sum(&mut a)
        });
        for r in got {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("all-reduce of") && e.contains("on rank"), "{e}");
        }
        let mut ranks = ThreadGroup::new(2, Duration::from_millis(50));
        let e = ranks[0].barrier().unwrap_err();
        assert!(matches!(e, DistError::Timeout { rank: 0, .. }), "{e}");
    }
}
