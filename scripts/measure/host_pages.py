"""A pinned H2D copy's cost beyond its bytes by how its host memory was allocated: cudaHostAlloc
(torch's pin_memory) against anonymous memory registered with cudaHostRegister, with and without
transparent huge pages; N copies of S bytes back to back on one stream against one copy of all.

Run on the GPU machine with torch: python scripts/measure/host_pages.py
"""
import mmap, ctypes, time, torch
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15
print(open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip())
print(open("/sys/kernel/mm/transparent_hugepage/defrag").read().strip())
dev = torch.device("cuda")
s = torch.cuda.Stream()
cudart = torch.cuda.cudart()
def anon(nbytes, huge):
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = (ctypes.c_char * nbytes).from_buffer(m)
    addr = ctypes.addressof(buf)
    rc = libc.madvise(addr, nbytes, MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(1)
    r = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    return t, (m, buf), rc, int(r)
def anon_huge_kb():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages"):
            return line.split()[1]
def bench(src, size, n, reps=5):
    dst = torch.empty(size * n, dtype=torch.uint8, device=dev)
    def go(chunks):
        best = 1e9
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(s):
                for i in range(chunks):
                    c = size * n // chunks
                    dst[i*c:(i+1)*c].copy_(src[i*c:(i+1)*c], non_blocking=True)
            s.synchronize()
            best = min(best, time.perf_counter() - t0)
        return size * n / best / 1e9
    each, whole = go(n), go(1)
    return each, whole, size / 1e3 * (1 / each - 1 / whole)
total = 146 << 25
for kind in ["pin_memory", "register, huge pages", "register, no huge pages", "pin_memory"]:
    keep = None
    if kind == "pin_memory":
        src = torch.empty(total, dtype=torch.uint8).pin_memory(); extra = ""
    else:
        src, keep, rc, r = anon(total, "no huge" not in kind)
        extra = f" (madvise {rc}, register {r}, pinned {src.is_pinned()}, AnonHugePages {anon_huge_kb()} kB)"
    print(kind + extra)
    for size, n in [(33554432, 146), (8388608, 584), (2097152, 2336)]:
        each, whole, us = bench(src, size, n)
        print(f"  {size>>20:3d} MiB x {n:4d}: one copy each {each:.2f} GB/s, one copy {whole:.2f} GB/s, {us:.2f} us a copy")
    if keep is not None:
        cudart.cudaHostUnregister(src.data_ptr())
    del src
