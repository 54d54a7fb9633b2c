"""engine/hugepages.py: the arena's copies (values, alignment, a storage each, mappings kept
alive) and that the kernel backs them with huge pages where THP is available (the GGUF loader's
use of it: tests/test_gguf_model.py)."""
import gc

import pytest
import torch

from specdec_inductor.engine import hugepages


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.int64])
def test_arena_copies(dtype):
    arena = hugepages.Arena(chunk_bytes=4 << 20)
    sources = [torch.arange(n, dtype=torch.float64).to(dtype).reshape(-1, 3)
               for n in (3, 300, 3 * 1000, 3 * 700_000)]  # the last one outgrows the chunk
    copies = [arena.copy(s) for s in sources]
    for src, out in zip(sources, copies):
        assert out.dtype == src.dtype and out.shape == src.shape and torch.equal(out, src)
        assert out.is_contiguous() and out.data_ptr() % hugepages.ALIGN == 0
    assert copies[0].data_ptr() % hugepages.HUGE_PAGE == 0  # a chunk starts on a huge page
    assert len({c.untyped_storage().data_ptr() for c in copies}) == len(copies)
    assert arena.placed_bytes == sum(s.numel() * s.element_size() for s in sources)
    del arena
    gc.collect()
    copies[1].add_(1)  # the mapping lives while a tensor does, and the copies are writable
    assert torch.equal(copies[1], sources[1] + 1)
    if hugepages.available():
        assert hugepages.backed_bytes([copies[3]]) > 0
