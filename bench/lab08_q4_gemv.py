"""Lab 08: q4_gemv's tile configurations at the Llama-3.1-8B MLP shape, over a working set larger than L2 (GPU).

    python bench/lab08_q4_gemv.py            # prints GB/s per (BLOCK_N, BLOCKS, num_warps) beside copy and torch.mv BF16

Each configuration runs the up (14336 x 4096) and down (4096 x 14336) projections of LAYERS layers in rotation from a
CUDA graph; bandwidth = Q4_0 bytes read / time. The lab's kernel is exported from solutions/08 (utils.solutions.load).
"""
import itertools
import json
import sys
import types

import torch

sys.path.insert(0, ".")
from utils import blocks  # noqa: E402

# the lab's kernel cell, as solutions/08 has it (read as JSON: the GPU machine needs no nbformat)
cells = json.load(open("solutions/08_quantized_inference.ipynb"))["cells"]
lab = types.ModuleType("lab08")
code = next("".join(c["source"]) for c in cells if "q4_gemv_kernel" in "".join(c["source"]) and "export" in
            c.get("metadata", {}).get("tags", []))
path = "build/lab08_kernel.py"
import os  # noqa: E402
os.makedirs("build", exist_ok=True)
open(path, "w").write(code)
exec(compile(code, path, "exec"), lab.__dict__)   # Triton reads the kernel's source from the file
N, K = 14336, 4096
dev = "cuda"
l2 = torch.cuda.get_device_properties(0).L2_cache_size
layer = blocks.Q4_0.row_bytes(K) * N + blocks.Q4_0.row_bytes(N) * K
LAYERS = max(2, -(-4 * l2 // layer))
up = [torch.from_numpy(blocks.random_blocks("Q4_0", N * K // 32, seed=i)).reshape(N, -1).to(dev) for i in range(LAYERS)]
down = [torch.from_numpy(blocks.random_blocks("Q4_0", N * K // 32, seed=99 + i)).reshape(K, -1).to(dev) for i in range(LAYERS)]
x, h, y = torch.randn(K, device=dev), torch.empty(N, device=dev), torch.empty(K, device=dev)


def timed(fn, calls=LAYERS, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / calls)
    return sorted(ts)[len(ts) // 2]


src = torch.ones(1 << 28, device=dev)
dst = torch.empty_like(src)
copy_ms = timed(lambda: dst.copy_(src), calls=4)
copy = 2 * src.numel() * 4 / copy_ms / 1e6
print(f"{torch.cuda.get_device_name()}: L2 {l2 >> 20} MiB, {LAYERS} layers ({LAYERS * layer >> 20} MiB Q4); copy {copy:,.0f} GB/s")
w16 = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
d16 = [torch.randn(K, N, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
x16, h16 = x.bfloat16(), torch.empty(N, device=dev, dtype=torch.bfloat16)
t16 = itertools.count()
ms = timed(lambda: (lambda i: (torch.mv(w16[i], x16, out=h16), torch.mv(d16[i], h16)))(next(t16) % LAYERS))
print(f"torch.mv bf16: {4 * N * K / ms / 1e6:,.0f} GB/s = {4 * N * K / ms / 1e6 / copy:.2f} of copy")
del w16, d16
best = None
for bn, bs, nw in itertools.product((1, 2, 4, 8, 16), (4, 8, 16, 32), (2, 4, 8)):
    turn = itertools.count()

    def mlp():
        i = next(turn) % LAYERS
        for w, a, o in ((up[i], x, h), (down[i], h, y)):
            n, k = w.shape[0], a.shape[0]
            lab.q4_gemv_kernel[(triton_cdiv(n, bn),)](w, a, o, n, k, w.shape[1], HAS_MIN=False, BLOCK_N=bn,
                                                     BLOCKS=bs, num_warps=nw)
    triton_cdiv = lambda a, b: (a + b - 1) // b
    try:
        ms = timed(mlp)
    except Exception as err:  # a configuration that does not compile or fit
        print(bn, bs, nw, "failed:", str(err).splitlines()[0][:80])
        continue
    gbps = layer / ms / 1e6
    best = max(best or (0,), (gbps, bn, bs, nw))
    print(f"BLOCK_N={bn:<3} BLOCKS={bs:<3} warps={nw}: {gbps:8,.0f} GB/s = {gbps / copy:.2f} of copy", flush=True)
print("best:", best, f"= {best[0] / copy:.2f} of copy")
got = lab.q4_gemv(up[0], x).double().cpu()
w = blocks.decode(up[0].cpu().numpy(), "Q4_0")
want = torch.from_numpy(w).double() @ x.double().cpu()
print("check: max relative error", ((got - want).abs().max() / want.abs().max()).item())
