"""Which SDPA backend a prefill picks, and what a new shape costs the first time, per backend set."""
import time, torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from torch.nn.attention.bias import causal_lower_right
dev = "cuda"
Hq, Hkv, D = 4, 2, 64
def run(n, L, dtype, style, backends):
    q = torch.randn(1, Hq, n, D, device=dev, dtype=dtype)
    k = torch.randn(1, Hkv, L + n, D, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    kw = dict(scale=D ** -0.5, enable_gqa=True)
    if style == "mask":
        m = None if L == 0 else torch.ones(n, L + n, dtype=torch.bool, device=dev).tril(diagonal=L)
        kw.update(attn_mask=m, is_causal=L == 0)
    else:
        kw.update(attn_mask=causal_lower_right(n, L + n))
    torch.cuda.synchronize(); t0 = time.perf_counter()
    with sdpa_kernel(backends) if backends else torch.no_grad():
        o = F.scaled_dot_product_attention(q, k, v, **kw)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, o
ALL = None
NOCUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
print("fused choice bf16 L=0:", torch._fused_sdp_choice(torch.randn(1,Hq,9,D,device=dev,dtype=torch.bfloat16), torch.randn(1,Hkv,9,D,device=dev,dtype=torch.bfloat16), torch.randn(1,Hkv,9,D,device=dev,dtype=torch.bfloat16), is_causal=True, enable_gqa=True))
print("SDPBackend values:", {b.name: int(b.value) for b in SDPBackend if hasattr(b, 'value')} if hasattr(SDPBackend, '__iter__') else SDPBackend.__members__)
base = 7
for dtype in (torch.bfloat16, torch.float32):
    for style in ("mask", "lower_right"):
        for name, b in (("default", ALL), ("no-cudnn", NOCUDNN)):
            firsts, seconds = [], []
            for n, L in ((base, 0), (base + 10, 30), (base + 31, 0), (base + 2, 101), (base + 64, 57)):
                try:
                    t1, o1 = run(n, L, dtype, style, b); t2, o2 = run(n, L, dtype, style, b)
                    firsts.append(round(t1, 1)); seconds.append(round(t2, 2))
                except Exception as e:
                    firsts.append(type(e).__name__); seconds.append(str(e)[:80])
            base += 100
            print(f"{str(dtype):15} {style:11} {name:8} first {firsts} second {seconds}", flush=True)
# same outputs? compare mask vs lower_right at one shape
n, L = 23, 45
q = torch.randn(1, Hq, n, D, device=dev, dtype=torch.float32); k = torch.randn(1, Hkv, L+n, D, device=dev); v = torch.randn_like(k)
m = torch.ones(n, L + n, dtype=torch.bool, device=dev).tril(diagonal=L)
a = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
with sdpa_kernel(NOCUDNN):
    b2 = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, L+n), enable_gqa=True)
print("mask vs lower_right max diff fp32:", (a - b2).abs().max().item())
