"""What the events around a copy cost the PCIe link: 146 d x d units (33.5 MB, bf16) streamed
through two device slots with a matmul per unit, as the weights benchmark's forward-only `d×d
units` variant does, by the events around each copy: none timed; timed on the compute stream
only; a timed done event on the copy stream; timed start and done events on the copy stream (the
runtime before copies were timed by sample); and the copies timed on a third "clock" stream that
waits for untimed markers. Prints each variant's step, one wait at its end, and five steps queued
back to back, against one copy of all the bytes.

Run on the GPU machine with torch: python scripts/measure/copy_events.py
"""
import torch, time
dev = torch.device("cuda")
D, T, N = 4096, 4096, 146
cs = torch.cuda.current_stream()
ls = torch.cuda.Stream()
host = [torch.randn(D, D).to(torch.bfloat16).pin_memory() for _ in range(8)]
slots = [torch.empty(D, D, dtype=torch.bfloat16, device=dev) for _ in range(2)]
x = torch.randn(T, D, device=dev).to(torch.bfloat16) * 0.01
clock = torch.cuda.Stream()
durations = []
def step(copy_timing, start_events, compute_timing, clocked=False):
    last_use = [None, None]
    done = []
    stamps = []
    def load(n):
        s = n % 2
        with torch.cuda.stream(ls):
            if last_use[s] is not None:
                ls.wait_event(last_use[s])
            if start_events:
                torch.cuda.Event(enable_timing=True).record(ls)
            if clocked:
                m = torch.cuda.Event(); m.record(ls)
            slots[s].copy_(host[n % 8], non_blocking=True)
            e = torch.cuda.Event(enable_timing=copy_timing); e.record(ls)
        if clocked:
            clock.wait_event(m); t0 = torch.cuda.Event(enable_timing=True); t0.record(clock)
            clock.wait_event(e); t1 = torch.cuda.Event(enable_timing=True); t1.record(clock)
            stamps.append((t0, t1))
        done.append(e)
    load(0); load(1)
    y = x
    for n in range(N):
        if compute_timing:
            torch.cuda.Event(enable_timing=True).record(cs)
        cs.wait_event(done[n])
        y = torch.nn.functional.linear(x, slots[n % 2])
        e = torch.cuda.Event(enable_timing=compute_timing); e.record(cs)
        last_use[n % 2] = e
        if n + 2 < N:
            load(n + 2)
    if clocked:
        durations.append(stamps)
    return y
def bw():
    h = torch.empty(N * D * D * 2, dtype=torch.uint8).pin_memory()
    d = torch.empty_like(h, device=dev)
    d.copy_(h, non_blocking=True); torch.cuda.synchronize()
    t0 = time.perf_counter(); d.copy_(h, non_blocking=True); torch.cuda.synchronize()
    return h.numel() / (time.perf_counter() - t0)
b = bw()
floor = N * D * D * 2 / b
print(f"one copy of all: {b/1e9:.2f} GB/s, {floor*1e3:.2f} ms")
for r in range(2):
    for name, args in [("all untimed", (False, False, False)),
                       ("compute stream timed (before each wait, last use), copies untimed", (False, False, True)),
                       ("copy stream: timed done, compute untimed", (True, False, False)),
                       ("copy stream: timed start + done, compute untimed", (True, True, False)),
                       ("all timed (the runtime today)", (True, True, True)),
                       ("copies untimed, timed on a clock stream waiting for untimed markers", (False, False, True, True))]:
        step(*args); torch.cuda.synchronize()
        best = 1e9; b2b = 0
        for _ in range(5):
            t0 = time.perf_counter(); step(*args); torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(5):
            step(*args)
        torch.cuda.synchronize(); b2b = (time.perf_counter() - t0) / 5
        print(f"{name}: best {best*1e3:.2f} ms ({(best-floor)/N*1e6:.1f} us a copy beyond the bytes), back to back {b2b*1e3:.2f} ms ({(b2b-floor)/N*1e6:.1f} us a copy)")
torch.cuda.synchronize()
last = durations[-1]
ms = [a.elapsed_time(b) for a, b in last]
print(f"clock-stream durations of the last step: {len(ms)} copies, mean {sum(ms)/len(ms)*1e3:.1f} us, min {min(ms)*1e3:.1f}, max {max(ms)*1e3:.1f}; sum {sum(ms):.2f} ms; bytes at one copy's rate {D*D*2*len(ms)/b*1e3:.2f} ms")
