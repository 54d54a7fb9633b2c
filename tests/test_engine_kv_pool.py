"""KV pool: slot allocation, request rows, failure atomicity, and that every slot comes back."""
import pytest
import torch

from specdec_inductor.engine.kv_pool import KVPool, PoolExhaustedError, RequestTooLongError


def make_pool(num_slots=32, max_reqs=3, max_len=16):
    return KVPool(num_layers=2, num_kv_heads=2, head_dim=4, num_slots=num_slots,
                  max_reqs=max_reqs, max_len=max_len)


def test_admit_ragged_batch_writes_req_to_token():
    pool = make_pool()
    reqs = pool.admit([3, 5, 1], max_new_tokens=4)
    assert [r.budget for r in reqs] == [7, 9, 5]
    seen = set()
    for r in reqs:
        row = pool.req_to_token[r.row, :r.budget].to(torch.int64)
        assert torch.equal(row, r.slots)
        assert (pool.req_to_token[r.row, r.budget:] == -1).all()
        seen.update(r.slots.tolist())
    assert len(seen) == 21 and pool.num_free_slots == 32 - 21
    pool.check_consistent()
    # The padding row maps every position to the padding sink, which is never handed out.
    assert (pool.req_to_token[pool.padding_row] == pool.padding_slot).all()
    assert pool.padding_slot not in seen and pool.k[0].shape == (33, 2, 4)


def test_exhaustion_raises_and_leaves_pool_unchanged():
    pool = make_pool(num_slots=20)
    first = pool.admit([4], max_new_tokens=8)  # 12 slots
    before = (pool.num_free_slots, pool.num_free_rows, pool.req_to_token.clone())
    with pytest.raises(PoolExhaustedError, match="exhausted"):
        pool.admit([4, 4], max_new_tokens=2)  # 12 > 8 free
    assert (pool.num_free_slots, pool.num_free_rows) == before[:2]
    assert torch.equal(pool.req_to_token, before[2])
    pool.check_consistent()
    pool.release(first[0])
    pool.admit([4, 4], max_new_tokens=2)  # fits now
    pool.check_consistent()


def test_too_long_and_no_rows_raise_cleanly():
    pool = make_pool(max_reqs=2, max_len=16)
    with pytest.raises(RequestTooLongError, match="max_len 16"):
        pool.admit([10], max_new_tokens=7)
    with pytest.raises(PoolExhaustedError, match="request rows"):
        pool.admit([1, 1, 1], max_new_tokens=1)
    with pytest.raises(ValueError, match="prompt_lens"):
        pool.admit([0], max_new_tokens=1)
    assert pool.num_free_slots == 32 and pool.num_free_rows == 2
    pool.check_consistent()


def test_all_slots_free_after_requests_finish():
    pool = make_pool(num_slots=40, max_reqs=3)
    gen = torch.Generator().manual_seed(0)
    live = []
    for _ in range(30):  # random admit / release interleaving
        if live and (torch.rand(1, generator=gen) < 0.5 or pool.num_free_rows == 0):
            pool.release(live.pop(int(torch.randint(len(live), (1,), generator=gen))))
        else:
            try:
                live += pool.admit([int(torch.randint(1, 8, (1,), generator=gen))], 4)
            except PoolExhaustedError:
                pass
        pool.check_consistent()
    for r in live:
        pool.release(r)
    assert pool.num_free_slots == 40 and pool.num_free_rows == 3
    assert (pool.req_to_token[:3] == -1).all()
    pool.check_consistent()


def test_double_free_and_foreign_release_raise():
    pool = make_pool()
    (req,) = pool.admit([2], 2)
    pool.release(req)
    with pytest.raises(ValueError, match="not a live request"):
        pool.release(req)
    with pytest.raises(ValueError, match="already free"):
        pool.free_slots(torch.tensor([0]))
    with pytest.raises(ValueError, match="not a slot"):
        pool.free_slots(torch.tensor([32]))
    pool.check_consistent()
