//! Peak heap of token logprobs by allocation accounting (exact, not timed):
//! the fused op's forward + backward at Qwen3's vocabulary stays under 1/10
//! of the naive path's forward alone (full logits -> log_softmax -> gather).
//! One test in this binary, so no other test's allocations interleave.
//! `arbor bench logprob-memory` measures the 8k-token case.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{Device, Tensor, Var, D};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

struct Counting;

// SAFETY: forwards to the system allocator; only counts bytes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            PEAK.fetch_max(
                LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size(),
                Ordering::Relaxed,
            );
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static A: Counting = Counting;

fn peak_of(f: impl FnOnce()) -> usize {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    f();
    PEAK.load(Ordering::Relaxed) - base
}

#[test]
fn fused_peak_is_under_a_tenth_of_naive_at_qwen3_vocab() {
    let (n, v, h) = (512, 151_936, 16);
    let dev = Device::Cpu;
    let hid = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, h), &dev).unwrap()).unwrap();
    let w = Var::from_tensor(&(Tensor::randn(0f32, 1.0, (v, h), &dev).unwrap() * 0.05).unwrap())
        .unwrap();
    let y: Vec<u32> = (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % v as u32)
        .collect();
    let y = Tensor::from_vec(y, n, &dev).unwrap();
    let fused = peak_of(|| {
        let o = arbor_ops::fused_logprobs(hid.as_tensor(), w.as_tensor(), &y, 1 << 22).unwrap();
        let g = o
            .narrow(1, 0, 1)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert!(g.get(w.as_tensor()).is_some());
    });
    let naive = peak_of(|| {
        let logits = hid
            .as_tensor()
            .detach()
            .matmul(&w.as_tensor().detach().t().unwrap())
            .unwrap();
        let lp = candle_nn_free_log_softmax(&logits);
        let _picked = lp.gather(&y.unsqueeze(1).unwrap(), 1).unwrap();
    });
    let logits_bytes = n * v * 4;
    eprintln!(
        "fused fwd+bwd peak {fused} B, naive fwd peak {naive} B (logits alone {logits_bytes} B)"
    );
    assert!(naive >= logits_bytes, "naive path must hold the logits");
    assert!(
        fused * 10 <= naive,
        "fused {fused} B is more than 1/10 of naive {naive} B"
    );
}

/// `log_softmax` composed from candle ops as a user would write it.
fn candle_nn_free_log_softmax(x: &Tensor) -> Tensor {
    let m = x.max_keepdim(D::Minus1).unwrap();
    let d = x.broadcast_sub(&m).unwrap();
    let lse = d
        .exp()
        .unwrap()
        .sum_keepdim(D::Minus1)
        .unwrap()
        .log()
        .unwrap();
    d.broadcast_sub(&lse).unwrap()
}
