"""engine/hugepages.py: the arena's copies (values, alignment, a storage each, mappings kept
alive), place_weights' choices (sizes, gradients, shared tensors, no THP) and that the kernel
backs the copies with huge pages where THP is available."""
import gc

import pytest
import torch
from torch import nn

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


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(512, 256, bias=False).requires_grad_(False)
        self.tied = nn.Linear(512, 256, bias=False).requires_grad_(False)
        self.tied.weight = self.big.weight
        self.small = nn.Linear(4, 4).requires_grad_(False)
        self.trained = nn.Linear(512, 256)  # requires grad: an optimizer may hold it
        self.register_buffer("table", torch.randint(0, 255, (1024, 256), dtype=torch.uint8))


def test_place_weights():
    model = _Model()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    big, trained, small, table = (model.big.weight, model.trained.weight, model.small.weight,
                                  model.table)
    moved = hugepages.place_weights(model, min_bytes=64 << 10)
    if not hugepages.available():
        assert not moved and model.hugepage_bytes == 0 and model.big.weight is big
        return
    assert moved == {id(big), id(table)}
    assert model.big.weight is not big and model.tied.weight is model.big.weight
    assert isinstance(model.big.weight, nn.Parameter) and not model.big.weight.requires_grad
    assert model.trained.weight is trained and model.small.weight is small
    assert model.hugepage_bytes == 512 * 256 * 4 + 1024 * 256
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
    assert hugepages.backed_bytes([model.big.weight, model.table]) > 0


def test_nothing_moves_without_huge_pages(monkeypatch):
    monkeypatch.setattr(hugepages, "available", lambda: False)
    model = _Model()
    weight = model.big.weight
    assert hugepages.place_weights(model, min_bytes=1) == set()
    assert model.big.weight is weight and model.hugepage_bytes == 0
