"""Which parts of the mask_mod run scan Inductor compiles on this GPU, and how fast."""
import time, traceback, torch
from flexmask.masks import intervals as iv

import os; dev = torch.device(os.environ.get("DEV", "cuda"))
S, W, K = 16384, 128, 9
def natten(b, h, q, kv):
    height = S // W
    r0 = (q // W - K // 2).clamp(0, height - K); c0 = (q % W - K // 2).clamp(0, W - K)
    kr, kc = kv // W, kv % W
    return (kr >= r0) & (kr < r0 + K) & (kc >= c0) & (kc < c0 + K)

rows, cols, n = 1024, 4096, 1
b = h = torch.tensor(0, device=dev)
q = torch.arange(rows, device=dev).view(-1, 1); kv = torch.arange(cols, device=dev).view(1, -1)
above = torch.zeros((n, cols), dtype=torch.bool, device=dev); opened = torch.zeros((n, cols), dtype=torch.int32, device=dev)

def pred(fn, b, h, q, kv):
    return fn(b, h, q, kv).view(1, q.shape[0], kv.shape[1])
def pred_change(fn, b, h, q, kv, above):
    m = ~fn(b, h, q, kv)
    prev = ~fn(b, h, (q - 1).clamp(min=0), kv) & (q > 0) | (above.view(1, -1) & (q == 0))
    return m != prev
def change_cumsum(fn, b, h, q, kv, above, opened):
    m = (~fn(b, h, q, kv)).view(1, q.shape[0], kv.shape[1])
    change = m != torch.cat([above[:, None], m[:, :-1]], 1)
    return torch.cumsum(m & change, 1, dtype=torch.int32) + opened[:, None]
def change_cumsum_i64(fn, b, h, q, kv, above, opened):
    m = (~fn(b, h, q, kv)).view(1, q.shape[0], kv.shape[1])
    change = m != torch.cat([above[:, None], m[:, :-1]], 1)
    return torch.cumsum((m & change).long(), 1) + opened[:, None]
def block_counts(fn, b, h, q, kv, above):
    ch = pred_change(fn, b, h, q, kv, above)
    return ch.view(-1, 128, ch.shape[-1]).sum(1, dtype=torch.int32)
full = lambda *a: iv._scan_events(*a)

cases = [("pred", pred, (natten, b, h, q, kv)), ("pred_change", pred_change, (natten, b, h, q, kv, above)),
         ("block_counts", block_counts, (natten, b, h, q, kv, above)),
         ("change_cumsum", change_cumsum, (natten, b, h, q, kv, above, opened)),
         ("change_cumsum_i64", change_cumsum_i64, (natten, b, h, q, kv, above, opened)),
         ("scan_events", full, (natten, b, h, q, kv, above, opened, 9, S, dev))]
for name, f, args in cases:
    for mode in ("eager", "compiled"):
        g = torch.compile(f, fullgraph=True, dynamic=False) if mode == "compiled" else f
        try:
            t0 = time.perf_counter(); out = g(*args); (torch.cuda.synchronize() if dev.type == "cuda" else None); first = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(20): out = g(*args)
            (torch.cuda.synchronize() if dev.type == "cuda" else None); per = (time.perf_counter() - t0) / 20
            print(f"{name:18s} {mode:8s} ok  first {first*1e3:9.1f} ms  per block {per*1e6:9.1f} us", flush=True)
        except Exception as e:
            tb = traceback.format_exc().strip().splitlines()
            print(f"{name:18s} {mode:8s} FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            print("   ", "\n    ".join(l for l in tb if "File" in l)[-1500:], flush=True)
