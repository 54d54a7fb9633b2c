"""KV slot pool (page size 1) and request rows: per-layer K/V buffers, `req_to_token`, a slot
allocator and request admission/release. Host-side bookkeeping only; no model code here.

Invariants (tested): every slot is either free or owned by exactly one live request; a failed
admission (pool exhausted, request over its length limit, no free row) raises before any state
changes; after every request is released all slots and rows are free again.

Each request reserves its whole budget (prompt + max new tokens) at admission and writes the
slots into its `req_to_token` row once (`assign_req_to_token`), so a decode step needs no host
work: the compiled step reads its slot as `req_to_token[row, position]` from tensors.
"""
import contextlib
import itertools
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from specdec_inductor.ops import assign_req_to_token


class PoolExhaustedError(RuntimeError):
    """Not enough free slots (or request rows) for a new request."""


class RequestTooLongError(ValueError):
    """A request's prompt + new tokens exceed the pool's per-request length limit."""


@dataclass
class Request:
    """One admitted request: its row in `req_to_token` and the slots it owns."""
    row: int
    prompt_len: int
    budget: int  # positions reserved: prompt_len + max_new_tokens
    slots: Tensor  # [budget] int64, the slots written into req_to_token[row, :budget]
    generation: Optional[int] = None  # the KVPool.generation() it was admitted in, if any


class KVPool:
    """K/V buffers `[num_slots + 1, H_kv, D]` per layer and `req_to_token [max_reqs, max_len]`.

    Slot `num_slots` (the last one) is a padding sink that is never handed out: pure-torch
    attention backends write padded tokens there instead of branching on slot -1. Likewise
    row `max_reqs` of req_to_token is the padding row: every position maps to the sink, so a
    batch bucket is filled up with padding requests that need no special case in the graph.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int,
                 max_reqs: int, max_len: int, dtype: torch.dtype = torch.float32):
        if num_slots <= 0 or max_reqs <= 0 or max_len <= 0:
            raise ValueError("num_slots, max_reqs and max_len must be positive")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_slots, self.max_reqs, self.max_len, self.dtype = num_slots, max_reqs, max_len, dtype
        self.padding_slot = num_slots
        shape = (num_slots + 1, num_kv_heads, head_dim)  # [S + 1, H_kv, D]
        self.k: List[Tensor] = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v: List[Tensor] = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.padding_row = max_reqs
        self.req_to_token = torch.full((max_reqs + 1, max_len), -1, dtype=torch.int32)  # [R + 1, L]
        self.req_to_token[self.padding_row] = self.padding_slot
        # Free lists as Python lists: allocation is per request, never per token.
        # Popped from the end, so the lowest slots / rows are handed out first.
        self._free_slots: List[int] = list(range(num_slots - 1, -1, -1))
        self._free_rows: List[int] = list(range(max_reqs - 1, -1, -1))
        self._live: dict = {}  # row -> Request
        self._bare: dict = {}  # row -> generation, rows handed out by take_rows (no slots)
        # Generation scopes (generation()): the open ones, innermost last, and the ended ones
        # (a row still held by an ended generation leaked: its cleanup failed).
        self._open: List[int] = []
        self._ended: set = set()
        self._ids = itertools.count()

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def live_requests(self) -> List[Request]:
        return list(self._live.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @contextlib.contextmanager
    def generation(self):
        """Scope of one generation call: the requests and bare rows taken inside belong to it.
        Every one must be given back before the scope ends; one that is not leaked (the
        caller's cleanup failed) and check_consistent reports it."""
        gen = next(self._ids)
        self._open.append(gen)
        try:
            yield gen
        finally:
            self._open.remove(gen)
            self._ended.add(gen)
            held = {r.generation for r in self._live.values()} | set(self._bare.values())
            self._ended &= held  # remember only generations that still hold rows

    def _current(self) -> Optional[int]:
        return self._open[-1] if self._open else None

    # -- slots -------------------------------------------------------------------------------
    def alloc_slots(self, n: int) -> Tensor:
        """`n` free slots as int64 [n]; raises PoolExhaustedError (taking nothing) if short."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._free_slots):
            raise PoolExhaustedError(
                f"KV pool exhausted: {n} slots requested, {len(self._free_slots)} of "
                f"{self.num_slots} free")
        taken = self._free_slots[len(self._free_slots) - n:][::-1]
        del self._free_slots[len(self._free_slots) - n:]
        return torch.tensor(taken, dtype=torch.int64)  # [n]

    def free_slots(self, slots: Tensor) -> None:
        """Return slots to the pool; a slot that is out of range or already free raises."""
        values = slots.reshape(-1).tolist()
        free = set(self._free_slots)
        for s in values:
            if not 0 <= s < self.num_slots:
                raise ValueError(f"slots: {s} is not a slot of this pool (0..{self.num_slots - 1})")
            if s in free:
                raise ValueError(f"slots: slot {s} is already free (double free)")
            free.add(s)
        self._free_slots.extend(reversed(values))

    # -- requests ----------------------------------------------------------------------------
    def admit(self, prompt_lens: Sequence[int], max_new_tokens: int) -> List[Request]:
        """Admit a batch: one row and prompt_len + max_new_tokens slots per request.

        All-or-nothing: every check happens before the first allocation."""
        budgets = [int(p) + int(max_new_tokens) for p in prompt_lens]
        for i, (p, b) in enumerate(zip(prompt_lens, budgets)):
            if p <= 0:
                raise ValueError(f"prompt_lens[{i}] must be positive, got {p}")
            if b > self.max_len:
                raise RequestTooLongError(
                    f"request {i}: prompt ({p}) + max_new_tokens ({max_new_tokens}) = {b} "
                    f"exceeds max_len {self.max_len}")
        if len(budgets) > len(self._free_rows):
            raise PoolExhaustedError(
                f"no free request rows: {len(budgets)} needed, {len(self._free_rows)} free")
        if sum(budgets) > len(self._free_slots):
            raise PoolExhaustedError(
                f"KV pool exhausted: {sum(budgets)} slots needed, {len(self._free_slots)} of "
                f"{self.num_slots} free")
        rows = [self._free_rows.pop() for _ in budgets]
        slots = self.alloc_slots(sum(budgets))  # [sum budgets]
        rows_t = torch.tensor(rows, dtype=torch.int64)  # [B]
        start = torch.zeros(len(rows), dtype=torch.int64)  # [B]
        end = torch.tensor(budgets, dtype=torch.int64)  # [B]
        assign_req_to_token(self.req_to_token, rows_t, start, end, slots)
        requests, offset = [], 0
        for row, p, b in zip(rows, prompt_lens, budgets):
            req = Request(row=row, prompt_len=int(p), budget=b, slots=slots[offset:offset + b],
                          generation=self._current())
            self._live[row] = req
            requests.append(req)
            offset += b
        return requests

    def release(self, request: Request) -> None:
        """Free a request's slots and row and clear its req_to_token row."""
        if self._live.get(request.row) is not request:
            raise ValueError(f"request: row {request.row} is not a live request of this pool")
        self.free_slots(request.slots)
        self.req_to_token[request.row].fill_(-1)
        del self._live[request.row]
        self._free_rows.append(request.row)

    # -- bare rows ---------------------------------------------------------------------------
    def take_rows(self, n: int) -> List[int]:
        """`n` request rows that own no slots, for slot tables the caller fills itself (e.g.
        one virtual row per draft-tree branch: a request's prefix slots, then the branch's
        draft slots). All-or-nothing; give them back with return_rows."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._free_rows):
            raise PoolExhaustedError(f"no free request rows: {n} needed, {len(self._free_rows)} free")
        rows = [self._free_rows.pop() for _ in range(n)]
        self._bare.update((r, self._current()) for r in rows)
        return rows

    def return_rows(self, rows: Sequence[int]) -> None:
        """Give back rows from take_rows (their req_to_token rows are cleared)."""
        for r in rows:
            if r not in self._bare:
                raise ValueError(f"rows: {r} is not a row taken with take_rows")
        for r in rows:
            self.req_to_token[r].fill_(-1)
            del self._bare[r]
            self._free_rows.append(r)

    def release_all(self) -> None:
        for req in list(self._live.values()):
            self.release(req)

    def check_consistent(self) -> None:
        """Raise AssertionError unless free + owned slots partition the pool exactly and no
        request or bare row is held by a generation that has ended (a leak)."""
        leaked = sorted([r.row for r in self._live.values() if r.generation in self._ended] +
                        [row for row, g in self._bare.items() if g in self._ended])
        assert not leaked, (f"request rows {leaked} are held by no live generation (leaked: "
                            "their generation ended without releasing them)")
        owned = [s for r in self._live.values() for s in r.slots.tolist()]
        everything = owned + self._free_slots
        assert sorted(everything) == list(range(self.num_slots)), "slots leaked or double-owned"
        rows = list(self._live) + list(self._bare) + self._free_rows
        assert sorted(rows) == list(range(self.max_reqs)), "request rows leaked or double-owned"
        for r in self._live.values():
            table = self.req_to_token[r.row, :r.budget].to(torch.int64)
            assert torch.equal(table, r.slots), f"req_to_token row {r.row} disagrees with its slots"
