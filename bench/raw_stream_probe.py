"""Does ct.launch take a raw stream handle (int), and what does each way of getting
the current stream cost on the host?  Usage: python bench/raw_stream_probe.py"""

import timeit
import torch
import cuda.tile as ct


@ct.kernel
def add_one(X, TILE: ct.Constant[int]):
    i = ct.bid(0)
    t = ct.load(X, index=(i,), shape=(TILE,))
    ct.store(X, index=(i,), tile=t + 1.0)


x = torch.zeros(1024, device="cuda")
dev = x.device
s = torch.cuda.Stream()
ok = {}
for label, stream in (
    ("torch stream", torch.cuda.current_stream(dev)),
    ("raw int", torch._C._cuda_getCurrentRawStream(dev.index)),
    ("side stream raw", s.cuda_stream),
):
    try:
        ct.launch(stream, (8, 1, 1), add_one, (x, 128))
        torch.cuda.synchronize()
        ok[label] = True
    except Exception as e:  # noqa: BLE001
        ok[label] = f"{type(e).__name__}: {e}"
print("accepted:", ok, "x[0] =", x[0].item())
n = 20000
for label, fn in (
    ("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev)),
    ("torch.cuda.current_stream()", lambda: torch.cuda.current_stream()),
    (
        "_cuda_getCurrentRawStream(idx)",
        lambda: torch._C._cuda_getCurrentRawStream(dev.index),
    ),
    ("empty 1k f32", lambda: torch.empty(1024, device=dev)),
    ("zeros 1k f32", lambda: torch.zeros(1024, device=dev)),
    (
        "launch torch stream",
        lambda: ct.launch(torch.cuda.current_stream(dev), (8, 1, 1), add_one, (x, 128)),
    ),
    (
        "launch raw",
        lambda: ct.launch(
            torch._C._cuda_getCurrentRawStream(dev.index), (8, 1, 1), add_one, (x, 128)
        ),
    ),
):
    t = min(timeit.repeat(fn, number=n // 10, repeat=5)) / (n // 10) * 1e6
    torch.cuda.synchronize()
    print(f"{label:36s} {t:7.2f} us")
