"""A model's weights in memory backed by transparent huge pages.

Decode reads every weight once per token, streaming ~100 MB-1 GB from memory. In 4 KB pages the
hardware prefetchers stop at every page boundary and each page costs a TLB walk; in 2 MB pages a
weight streams on. torch's allocator gives ordinary pages (and a GGUF's file-layout tensors are
views of the file's mapping, page-cache pages), so `place_weights` copies a model's large
weights into anonymous memory advised for huge pages (madvise MADV_HUGEPAGE, Linux), packed
back to back in chunks so that the many small weights of a small model share huge pages too.
Values, dtypes, shapes and the sharing between tied parameters stay as they were.
`benchmarks/bench_hugepages.py` measures what it buys.
"""
import bisect
import mmap
from typing import Dict, Iterable, List, Optional, Set

import torch
from torch import Tensor, nn

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20  # the arena grows by this (or by one tensor, if larger)
MIN_BYTES = 64 << 10  # smaller tensors (norms, biases) stay where they are
ALIGN = 64  # each placed tensor starts on a cache line
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def available() -> bool:
    """Whether this system gives huge pages to memory that asks for them: Linux with
    transparent huge pages in 'always' or 'madvise' mode."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return False
    try:
        with open(_THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


class Arena:
    """Bump allocation of tensors in anonymous, huge-page-advised mappings. Each tensor gets a
    storage of its own over its bytes (torch.compile treats views of one storage as aliases),
    and each storage keeps its mapping alive (torch.frombuffer holds the buffer)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._chunk: Optional[memoryview] = None  # starts on a huge page
        self._used = 0
        self.placed_bytes = 0

    def _grow(self, nbytes: int) -> None:
        size = max(self.chunk_bytes, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        # One huge page more than asked: the mapping starts on a 4 KB page, the chunk on a
        # 2 MB one (the untouched head never becomes resident).
        mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults take huge pages
        view = memoryview(mapping)
        skip = (-torch.frombuffer(view[:1], dtype=torch.uint8).data_ptr()) % HUGE_PAGE
        self._chunk, self._used = view[skip:skip + size], 0

    def copy(self, t: Tensor) -> Tensor:
        """A contiguous copy of t placed in the arena."""
        nbytes = t.numel() * t.element_size()
        start = -(-self._used // ALIGN) * ALIGN
        if self._chunk is None or start + nbytes > len(self._chunk):
            self._grow(nbytes)
            start = 0
        out = torch.frombuffer(self._chunk[start:start + nbytes], dtype=t.dtype).view(t.shape)
        out.copy_(t)
        self._used = start + nbytes
        self.placed_bytes += nbytes
        return out


def place_weights(model: nn.Module, min_bytes: Optional[int] = None) -> Set[int]:
    """Move the model's parameters and buffers of at least min_bytes that need no gradient
    into huge-page memory (module by module, so the peak is one arena chunk above the model).
    Tensors shared by several modules stay shared. Returns the ids of the tensors replaced (the
    caller may release what backed them); nothing moves where huge pages are not available.
    `model.hugepage_bytes` records the bytes placed."""
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    moved: Dict[int, Tensor] = {}
    arena = Arena()
    if available():
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is None or t.requires_grad or t.is_meta or t.device.type != "cpu":
                        continue
                    if id(t) not in moved:
                        if t.numel() * t.element_size() < min_bytes:
                            continue
                        new = arena.copy(t)
                        moved[id(t)] = (nn.Parameter(new, requires_grad=False)
                                        if isinstance(t, nn.Parameter) else new)
                    table[name] = moved[id(t)]
    model.hugepage_bytes = arena.placed_bytes
    return set(moved)


def backed_bytes(tensors: Iterable[Tensor]) -> Optional[int]:
    """Bytes of huge pages (AnonHugePages in /proc/self/smaps) in the mappings that hold the
    tensors' first bytes, each mapping counted once; None where smaps is not readable. What
    the kernel actually gave (it may give fewer huge pages than were asked for)."""
    addresses = sorted(t.data_ptr() for t in tensors)
    try:
        with open("/proc/self/smaps") as f:
            lines: List[str] = f.read().splitlines()
    except OSError:
        return None
    total, inside = 0, False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            begin, end = (int(v, 16) for v in head.split("-"))
            k = bisect.bisect_left(addresses, begin)
            inside = k < len(addresses) and addresses[k] < end
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
