"""Forward only (inference) with RamTorch 1.11's OffloadModel on the weights benchmark's model
(examples/benches/weights.rs, the same model as shared/peer/ramtorch_bench.py), so the forward-only
figures of both tools come from one device command.

Model: 16 blocks, d=4096, bf16, 4096 tokens; one block is
    a = x @ wq^T @ wk^T @ wv^T @ wo^T;  x = x + a;  y = x + gelu_tanh(x @ up^T) @ down^T
(12 d x d matrices, 402.65 MB), the weights drawn as in the Rust benchmark's resident stack.

RamTorch streams whole chunks through `window` slots and pins `pin` chunks evenly spaced, so
room for four blocks of weights allows pin + window = 4 block chunks. It is run two ways:
  * block chunks: one chunk per block (pin 2 window 2, pin 0 window 4, pin 3 window 1);
  * d x d chunks: the benchmark's `d×d units`, each block as twelve chunks of one d x d matrix
    (the four projections, then the MLP a quarter of its hidden features at a time: the up
    projection's rows, then the down projection's columns, summed into the residual), the
    chunks passing tuples; room 4 = 48 chunks (pin 46 window 2, pin 44 window 4).

Each configuration: warm-up forwards, then timed forwards each between two device waits (best
and median), the same forwards each waited for by its output only (the compute stream, as
reading the result waits; best), then the same forwards queued back to back with one wait at
the end; chunk loads a
forward from OffloadModel.stats; peak allocated; the output checked against the resident model
(largest difference over the largest value, 5% allowed as in the Rust benchmark).

Floor: max(resident forward, weights beyond the room / pinned H2D bandwidth measured here),
the room being four blocks: 12 blocks' bytes, 4.832 GB.

Run on the GPU machine (scripts/gpu-check runs it after shared/peer/ramtorch_bench.py when
RamTorch's wheel is in .whl): PYTHONPATH=<ramtorch> python scripts/peer/ramtorch_forward.py
"""

import gc
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCKS = int(os.environ.get("SH_BLOCKS", 16))
D = int(os.environ.get("SH_D", 4096))
TOKENS = int(os.environ.get("SH_TOKENS", 4096))
STEPS = int(os.environ.get("RT_STEPS", 10))
WARM = int(os.environ.get("RT_WARM", 2))
ROOM = 4
DTYPE = torch.bfloat16
SLICES = 4
# RT_DEVICE=cpu runs it small on a machine without a GPU (a check of the script, not a figure).
dev = torch.device(os.environ.get("RT_DEVICE", "cuda:0"))
BLOCK_BYTES = 12 * D * D * torch.finfo(DTYPE).bits // 8


def shapes(d):
    return [(d, d), (d, d), (d, d), (d, d), (4 * d, d), (d, 4 * d)]


def block_fwd(w, x):
    a = F.linear(F.linear(F.linear(F.linear(x, w[0]), w[1]), w[2]), w[3])
    x = x + a
    m = F.gelu(F.linear(x, w[4]), approximate="tanh")
    return x + F.linear(m, w[5])


class Weights(nn.Module):
    """A chunk whose weights are buffers (frozen, streamed by OffloadModel)."""

    def __init__(self, **ws):
        super().__init__()
        for n, w in ws.items():
            self.register_buffer(n, w)


class Block(Weights):
    def __init__(self, ws):
        super().__init__(**{f"w{i}": w for i, w in enumerate(ws)})

    def forward(self, x):
        return block_fwd([getattr(self, f"w{i}") for i in range(6)], x)


class First(Weights):
    """wq: x -> (x, x @ wq^T)."""

    def forward(self, x):
        return x, F.linear(x, self.w)


class Chain(Weights):
    """wk, wv: (x, a) -> (x, a @ w^T)."""

    def forward(self, x, a):
        return x, F.linear(a, self.w)


class Out(Weights):
    """wo: (x, a) -> (x + a @ wo^T) twice: the MLP's input and the running output."""

    def forward(self, x, a):
        x = x + F.linear(a, self.w)
        return x, x


class Up(Weights):
    """A quarter of up's rows: (x, y) -> (x, y, gelu(x @ up_i^T))."""

    def forward(self, x, y):
        return x, y, F.gelu(F.linear(x, self.w), approximate="tanh")


class Down(Weights):
    """The same quarter of down's columns: (x, y, m) -> (x, y + m @ down_i^T); the last one
    returns y alone, the next block's input."""

    def __init__(self, w, last):
        super().__init__(w=w)
        self.last = last

    def forward(self, x, y, m):
        y = y + F.linear(m, self.w)
        return y if self.last else (x, y)


def matrix_chunks(ws):
    up, down = ws[4], ws[5]
    chunks = [First(w=ws[0]), Chain(w=ws[1]), Chain(w=ws[2]), Out(w=ws[3])]
    for i in range(SLICES):
        rows = slice(i * D, (i + 1) * D)
        # Copies with storages of their own: a chunk streams its tensors, not the whole matrix.
        chunks.append(Up(w=up[rows].clone()))
        chunks.append(Down(down[:, rows].contiguous().clone(), last=i == SLICES - 1))
    return chunks


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def gb(b):
    return b / 1e9


def h2d_bandwidth(nbytes, reps=5):
    cuda = dev.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    host.fill_(1)
    t = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    t.copy_(host, non_blocking=True)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        t.copy_(host, non_blocking=True)
    sync()
    return nbytes * reps / (time.perf_counter() - t0)


def output_ready():
    """Waits for the forward's output only: the current (compute) stream, as reading the result
    does; copies the offloader queued on its own streams may still run."""
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def timed(run):
    """Best and median of forwards each between two device waits, the best of the same number
    each waited for by its output only, then the mean of the same number queued back to back
    (after the warm-up forwards, run first by the caller)."""
    ts = []
    for _ in range(STEPS):
        sync()
        t0 = time.perf_counter()
        out = run()
        sync()
        ts.append(time.perf_counter() - t0)
    ready = float("inf")
    for _ in range(STEPS):
        t0 = time.perf_counter()
        out = run()
        output_ready()
        ready = min(ready, time.perf_counter() - t0)
    sync()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        out = run()
    sync()
    return min(ts), statistics.median(ts), ready, (time.perf_counter() - t0) / STEPS, out


def main():
    import ramtorch
    from ramtorch import OffloadModel

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device: {name} torch {torch.__version__} ramtorch {ramtorch.__version__}")
    print(f"model: {BLOCKS} blocks, d={D}, bf16, {gb(BLOCKS * BLOCK_BYTES):.2f} GB of weights, {TOKENS} tokens, forward only")
    bw = h2d_bandwidth(BLOCK_BYTES)
    print(f"pinned H2D bandwidth ({BLOCK_BYTES} B copies): {bw / 1e9:.2f} GB/s")

    torch.manual_seed(0)
    gpu_w = []
    for _ in range(BLOCKS):
        gpu_w.append([(torch.randn(s, dtype=torch.float32, device=dev) * (1.0 / s[1] ** 0.5)).to(DTYPE) for s in shapes(D)])
    x0 = (torch.randn(TOKENS, D, dtype=torch.float32, device=dev) * 0.1).to(DTYPE)

    def resident():
        with torch.no_grad():
            h = x0
            for w in gpu_w:
                h = block_fwd(w, h)
            return h

    for _ in range(WARM):
        resident()
    best, median, _, b2b, ref = timed(resident)
    ref = ref.float()
    scale = ref.abs().max().item()
    print(f"resident forward: best {best:.4f} s, median {median:.4f} s, back to back {b2b:.4f} s")
    beyond = (BLOCKS - ROOM) * BLOCK_BYTES
    floor = max(best, beyond / bw)
    print(f"floor: max(resident {best:.4f}, weights beyond the room {gb(beyond):.3f} GB / {bw / 1e9:.2f} GB/s "
          f"{beyond / bw:.4f}) = {floor:.4f} s")

    host_w = [[w.cpu().pin_memory() if dev.type == "cuda" else w.clone() for w in ws] for ws in gpu_w]
    del gpu_w
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    sync()

    per_block = 12
    configs = [("block chunks", 1, 2, 2), ("block chunks", 1, 0, 4), ("block chunks", 1, 3, 1),
               ("d×d chunks", per_block, ROOM * per_block - 2, 2), ("d×d chunks", per_block, ROOM * per_block - 4, 4)]
    for kind, per, pin, window in configs:
        label = f"[ramtorch forward, {kind}, pin {pin} window {window}]"
        chunks = []
        for ws in host_w:
            chunks.extend([Block(ws)] if per == 1 else matrix_chunks(ws))
        chunk_bytes = BLOCK_BYTES // per
        try:
            model = OffloadModel(chunks, device=dev, window=window, pin=pin)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            for _ in range(WARM):
                model(x0)
            loads0 = model.stats["loads"]
            best, median, ready, b2b, out = timed(lambda: model(x0))
            loads = (model.stats["loads"] - loads0) / (3 * STEPS)
        except Exception as e:  # noqa: BLE001
            print(f"{label} failed: {e!r}")
            continue
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
        err = (out.float() - ref).abs().max().item() / scale
        status = "ok" if err <= 0.05 else "MISMATCH"
        print(f"{label} best {best:.4f} s, median {median:.4f} s, output ready {ready:.4f} s, back to back {b2b:.4f} s; "
              f"ratio {best / floor:.3f} (output ready {ready / floor:.3f}, back to back {b2b / floor:.3f}); {loads:.1f} chunk loads a forward = "
              f"{gb(loads * chunk_bytes):.3f} GB ({loads * chunk_bytes / beyond:.3f}x the weights beyond the room); "
              f"peak allocated {gb(peak):.2f} GB; output vs resident {err:.2e} of its largest value ({status})")
        model.close()
        del model, chunks
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        sync()


if __name__ == "__main__":
    main()
