"""What a speculative run reports (SpeculativeStats, the metrics of algorithms.md) and the
step timings the policies' costs come from (step_times)."""
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch

from torch import Tensor

from specdec_inductor.speculative.tree import VerifyInputs


@dataclass
class SpeculativeStats:
    """The metrics of algorithms.md: tokens/s, mean accepted length, per-position acceptance,
    verify steps, draft / verify time shares, compiled graphs and recompiles."""
    new_tokens: int = 0
    verify_steps: int = 0  # speculative steps, decode fallbacks included
    decode_steps: int = 0  # steps that fell back to plain decode (no request had a draft)
    request_steps: int = 0  # verify steps summed over requests
    accepted_drafts: int = 0
    accepted_at_depth: List[int] = field(default_factory=list)  # [S-1] requests accepting >= k
    prefill_s: float = 0.0
    draft_s: float = 0.0  # proposing and planning (host, the draft model's graphs)
    verify_s: float = 0.0  # the target step, acceptance and commit (one program; the draft
    # too in the steps drafted_in_program counts)
    commit_s: float = 0.0  # handing out the accepted tokens, the proposer's commit
    decode_s: float = 0.0
    graphs: int = 0
    recompiles: int = 0
    steps_by_size: Dict[int, int] = field(default_factory=dict)  # tree size -> steps (1: decode)
    drafted_in_program: int = 0  # steps that drafted inside the step program (DraftedStep)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per request per verify step (accepted drafts + the bonus)."""
        return 1.0 + self.accepted_drafts / self.request_steps if self.request_steps else float("nan")

    @property
    def acceptance_by_position(self) -> List[float]:
        return [n / self.request_steps for n in self.accepted_at_depth] if self.request_steps else []

    def count_accepted(self, accepted: int) -> None:
        """One request's verify step that accepted `accepted` drafts."""
        self.request_steps += 1
        self.accepted_drafts += accepted
        for k in range(accepted):
            self.accepted_at_depth[k] += 1

    def summary(self) -> str:
        busy = self.draft_s + self.verify_s + self.commit_s
        share = (lambda s: 100.0 * s / busy) if busy > 0 else (lambda s: float("nan"))
        accept = " ".join(f"{a:.2f}" for a in self.acceptance_by_position)
        sizes = " ".join(f"{k}:{v}" for k, v in sorted(self.steps_by_size.items()))
        return (f"{self.new_tokens} tokens, {self.tokens_per_s:.1f} tok/s; {self.verify_steps} steps "
                f"({self.decode_steps} plain decode; by tree size {sizes}), mean accepted length {self.mean_accepted_length:.2f}; acceptance by position "
                f"[{accept}]; time: draft {share(self.draft_s):.0f}% verify {share(self.verify_s):.0f}% "
                f"commit {share(self.commit_s):.0f}%{self._in_program()}; graphs {self.graphs}, "
                f"recompiles {self.recompiles}")

    def _in_program(self) -> str:
        if not self.drafted_in_program:
            return ""
        return (f" (drafted inside the step program in {self.drafted_in_program} steps: their "
                "draft's model time is under verify)")


def dynamo_counts() -> Tuple[int, int]:
    """(graphs compiled, recompiles) so far in this process, from Dynamo's counters."""
    from torch._dynamo.utils import counters
    return graphs_compiled(), sum(counters["recompiles"].values())


def graphs_compiled() -> int:
    """Graphs Dynamo compiled so far in this process: a step during which it grew spent its
    time compiling, and its timing prices nothing (the policies' draft and step costs)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@torch.inference_mode()
def step_times(engine, sizes: Sequence[int], context: int = 0, rounds: int = 16,
               batch_size: int = 1, program=None) -> Dict[int, float]:
    """Median seconds of one step of each tree size (1: a plain decode step, else a verify of
    a star tree) over a `context`-token prefix, after one untimed call each (which compiles
    what has not been). The sizes take turns within every round, so a drift of the machine's
    speed hits them alike. Runs on a scratch request, admitted and released here (its slots
    are written, then freed); the other rows of batch_size's bucket are padding. With
    `program` (a commit.GreedyStep or SampledStep) the steps are its programs (target step,
    acceptance and commit, as the loop runs them) instead of the engine's bare decode /
    verify."""
    bucket = engine.bucket_for(batch_size)
    (scratch,) = engine.pool.admit([max(context, 1)], max(sizes))
    times: Dict[int, List[float]] = {z: [] for z in sizes}
    try:
        rows = torch.tensor([scratch.row] + [engine.pool.padding_row] * (bucket - 1))  # [B]
        seq_lens = torch.tensor([context] + [0] * (bucket - 1))  # [B]
        step = _scratch_step(engine, program, rows, seq_lens, sizes)
        for z in sizes:
            step(z)
        for _ in range(rounds):
            for z in sizes:
                t0 = time.perf_counter()
                step(z)
                times[z].append(time.perf_counter() - t0)
    finally:
        engine.pool.release(scratch)
    return {z: statistics.median(t) for z, t in times.items() if t}


def _scratch_step(engine, program, rows: Tensor, seq_lens: Tensor, sizes: Sequence[int]):
    """step(z): one step of size z over the scratch rows, leaving seq_lens as they are (a
    step program commits into copies of them)."""
    bucket = rows.shape[0]
    # tokens, positions, mask, *linkage of star trees (VerifyInputs' padding rows)
    trees = {z: VerifyInputs(bucket, z, seq_lens).buffers for z in sizes if z > 1}
    roots = torch.zeros(bucket, dtype=torch.int64)  # [B]

    def step(z):
        if program is not None:
            acceptance = program.scratch_acceptance(bucket, z)
            if z == 1:
                program.decode(roots.clone(), rows, seq_lens.clone(), *acceptance)
            else:
                tokens, positions, mask, *linkage = trees[z]
                program.verify(tokens, positions, rows, seq_lens.clone(), mask, *linkage,
                               roots.clone(), *acceptance)
        elif z == 1:
            engine.decode(roots, rows, seq_lens)
        else:
            tokens, positions, mask, *_ = trees[z]
            engine.verify(tokens, positions, rows, seq_lens, mask)
    return step
