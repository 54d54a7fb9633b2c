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
import ctypes
import mmap
from typing import Iterable, List, Optional

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20  # the arena grows by this (or by one tensor, if larger)
MIN_BYTES = 64 << 10  # smaller weights stay where they are (the loader's choice)
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


def trim_heap() -> None:
    """Give the malloc heap's free pages back to the system (glibc's malloc_trim; nothing
    elsewhere). A weight repacked at load is a temporary once copied into the arena, and glibc
    keeps freed blocks of that size in its heap: without this a 1.5B model's load leaves ~0.5 GB
    of free heap resident."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


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
