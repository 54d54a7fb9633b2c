"""Commit of a verified step as tensor ops: the accepted tokens, the accepted path's KV moved
to the front of the tree's positions, and each request's next root and seq_len; and the step of
a batch (target step, acceptance, commit) as one program: greedy acceptance (GreedyStep) or
tree rejection sampling with uniforms drawn on the host (SampledStep).

Verify writes node i's KV at row position seq_len + i. After acceptance the row's slots for
positions [seq_len, seq_len + N) are permuted so that the accepted path's slots come first, in
path order; the rejected nodes' slots follow and are overwritten by the next verify. Only
req_to_token entries move, never K/V rows. Everything here stays on tensors (no per-request
Python lists), so it traces into one graph: its in-place updates of req_to_token, seq_lens and
roots become the graph's input mutations (functionalized, written back when the graph
returns). The host reads the result once per step.
"""
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from specdec_inductor import ops
from specdec_inductor.sampler import Sampler, SamplingParams, sampling_probs


class Committed(NamedTuple):
    tokens: Tensor  # [B, S] int64 accepted drafts then the bonus, -1 past each path
    accept_num: Tensor  # [B] int64 accepted drafts (bonus excluded)
    path: Tensor  # [B, S] int64 accepted node indices within each tree (root first), -1 after


def accepted_path(predicts: Tensor, accept_index: Tensor, accept_num: Tensor,
                  size: int) -> Committed:
    """The accepted tokens and node indices of each request from an acceptance op's output
    (predicts [B*N] (a decode step: [B] with N = 1), accept_index [B, S] flat rows padded with
    -1, accept_num [B])."""
    bs = accept_index.shape[0]
    index = accept_index.long()  # [B, S]
    valid = index >= 0
    tokens = torch.where(valid, predicts.reshape(-1).long()[index.clamp(min=0)], -1)  # [B, S]
    base = (torch.arange(bs, dtype=torch.int64) * size).view(bs, 1)  # [B, 1] first flat row
    path = torch.where(valid, index - base, -1)  # [B, S]
    return Committed(tokens, accept_num.long(), path)


def compact_accepted_kv(req_to_token: Tensor, req_rows: Tensor, tree_start: Tensor,
                        path: Tensor, size: int) -> None:
    """Permute req_to_token[row, tree_start + i] for i < size so the accepted path's slots come
    first (path order), the other nodes' after them in node order. req_rows / tree_start [B];
    a padding row (every entry the sink) permutes to itself."""
    bs, steps = path.shape
    # Sort key per node: its place on the path, or steps + its index when off the path.
    key = torch.arange(steps, steps + size + 1, dtype=torch.int64).repeat(bs, 1)  # [B, N + 1]
    column = torch.where(path >= 0, path, size)  # [B, S]; -1 entries land on spare column N
    key = key.scatter(1, column, torch.arange(steps, dtype=torch.int64).expand(bs, steps))
    order = key[:, :size].argsort(dim=1)  # [B, N] node at each new position
    positions = tree_start.view(bs, 1) + torch.arange(size, dtype=torch.int64).view(1, size)
    rows = req_rows.view(bs, 1).expand(bs, size)  # [B, N]
    slots = req_to_token[rows, positions]  # [B, N]
    req_to_token[rows, positions] = slots.gather(1, order)


def commit_step(req_to_token: Tensor, req_rows: Tensor, seq_lens: Tensor, roots: Tensor,
                padding_row: int, predicts: Tensor, accept_index: Tensor, accept_num: Tensor,
                size: int) -> Committed:
    """Commit one step of the batch's first B requests in place: compact the accepted KV, then
    advance each live request's seq_len past the root and its accepted drafts (their KV is
    cached now) and make its bonus token the next root. req_rows / seq_lens / roots are the
    bucket-sized batch state; a request whose row is the padding row (finished) is left as it
    is. Requests that finish with this step are committed too: they leave right after."""
    bs = accept_index.shape[0]
    done = accepted_path(predicts, accept_index, accept_num, size)
    rows = req_rows[:bs]
    live = rows != padding_row  # [B]
    if size > 1:
        compact_accepted_kv(req_to_token, rows, torch.where(live, seq_lens[:bs], 0), done.path,
                            size)
    bonus = done.tokens.gather(1, done.accept_num.view(bs, 1)).view(bs)  # [B]
    seq_lens[:bs] += torch.where(live, done.accept_num + 1, 0)
    roots[:bs] = torch.where(live, bonus, roots[:bs])
    return done


class StepResult(NamedTuple):
    """What a greedy step program gives back: the one tensor the host reads, and the target
    hidden rows of each accepted path for proposers that draft from them."""
    host: Tensor  # [B, 1 + S] int64: accepted drafts, then Committed.tokens
    path_hidden: Optional[Tensor]  # [B, S, k*H] hidden row of each path node, or None
    drafted: Tuple[Tensor, ...] = ()  # a DraftedStep drafter's own outputs (DraftProgram.read)


def path_rows(hidden: Tensor, path: Tensor) -> Tensor:
    """hidden [B, N, k*H] rows at each request's accepted path (path [B, S], -1 after it:
    row 0 there) -> [B, S, k*H]."""
    bs, steps = path.shape
    index = path.clamp(min=0).unsqueeze(-1).expand(bs, steps, hidden.shape[-1])  # [B, S, k*H]
    return hidden.gather(1, index)


def step_result(done: Committed, hidden: Optional[Tensor]) -> StepResult:
    host = torch.cat([done.accept_num.view(-1, 1), done.tokens], dim=1)  # [B, 1 + S]
    return StepResult(host, None if hidden is None else path_rows(hidden, done.path))


class GreedyStep:
    """A greedy step of a whole batch bucket as one program per (bucket, N): the target's
    decode (N = 1) or verify(N) pass, greedy acceptance (verify_tree_greedy) and the commit
    (commit_step: accepted-path KV compaction in req_to_token, seq_lens and roots advanced in
    place). On a compiled Engine each is one graph (Engine.compile_program: fullgraph, static
    shapes, so a bucket's graph serves any requests joining and leaving); in eager the same
    functions run op by op. Every row of the bucket takes part: a padding row (req_rows = the
    pool's padding row) verifies a root-only tree and commits nothing. Subclasses change the
    acceptance (accept_roots / accept_tree) and may take more inputs after the tree's
    (`acceptance`, passed on to them)."""

    def __init__(self, engine, num_spec_steps: int):
        self.engine, self.num_spec_steps = engine, num_spec_steps
        self.compiled_runs = 0  # steps run as a compiled program (tests assert the path)
        self.padding_row = engine.pool.padding_row
        compiled = engine.compile_program if engine.compiled else (lambda method: method)
        self._decode, self._verify = compiled(self.decode_program), compiled(self.verify_program)

    @classmethod
    def of(cls, engine, num_spec_steps: int, *key) -> "GreedyStep":
        """The engine's program of this class for num_spec_steps (and a subclass's `key`,
        its constructor's further arguments), made once (Engine.programs): every generator of
        the engine shares its compiled programs, and the decode program, which does not
        depend on num_spec_steps, is that of num_spec_steps 1 for all (plain decoding and a
        speculative batch's draft-less steps run the same compiled graph)."""
        name = (cls.__name__, num_spec_steps, *key)
        if name not in engine.programs:
            step = cls(engine, num_spec_steps, *key)
            if num_spec_steps != 1:
                step._decode = cls.of(engine, 1, *key)._decode
            engine.programs[name] = step
        return engine.programs[name]

    def decode(self, roots: Tensor, req_rows: Tensor, seq_lens: Tensor,
               *acceptance: Tensor) -> StepResult:
        """A plain decode step of the roots, committed (roots [B] take the next tokens)."""
        return self._run(self._decode, roots, req_rows, seq_lens, *acceptance)

    def verify(self, tokens: Tensor, positions: Tensor, req_rows: Tensor, seq_lens: Tensor,
               tree_mask: Tensor, retrieve_index: Tensor, retrieve_next_token: Tensor,
               retrieve_next_sibling: Tensor, roots: Tensor, *acceptance: Tensor) -> StepResult:
        """Verify the trees (tokens / positions [B, N], tree_mask [B*N*N], linkage [B, N]
        int64, flat retrieve_index), accept and commit."""
        return self._run(self._verify, tokens, positions, req_rows, seq_lens, tree_mask,
                         retrieve_index, retrieve_next_token, retrieve_next_sibling, roots,
                         *acceptance)

    def _run(self, program, *args) -> StepResult:
        self.compiled_runs += int(self.engine.compiled)
        return self.engine.run_program(program, *args)

    def scratch_acceptance(self, bucket: int, size: int) -> Tuple[Tensor, ...]:
        """`acceptance` inputs for a step of `size` in `bucket` on scratch rows (warm-up and
        timing, stats.step_times): none for greedy acceptance."""
        return ()

    def accept_roots(self, out, *acceptance: Tensor):
        """(predicts [B], accept_index [B, 1], accept_num [B]) of a decode step's output."""
        bs = out.argmax.shape[0]
        accept_index = torch.arange(bs, dtype=torch.int32).view(bs, 1)  # [B, 1] root-only trees
        return out.argmax, accept_index, torch.zeros(bs, dtype=torch.int32)

    def accept_tree(self, out, tokens: Tensor, linkage: Tuple[Tensor, Tensor, Tensor],
                    steps: int, *acceptance: Tensor):
        """(predicts [B*N], accept_index [B, S], accept_num [B]) of a verify step's output."""
        return ops.verify_tree_greedy(tokens, *linkage, out.argmax, steps)

    def decode_program(self, roots, req_rows, seq_lens, *acceptance) -> StepResult:
        out = self.engine.decode_step(roots, req_rows, seq_lens)
        done = commit_step(self.engine.pool.req_to_token, req_rows, seq_lens, roots,
                           self.padding_row, *self.accept_roots(out, *acceptance), 1)
        return step_result(done, None if out.hidden is None else out.hidden.unsqueeze(1))

    def verify_program(self, tokens, positions, req_rows, seq_lens, tree_mask, retrieve_index,
                       retrieve_next_token, retrieve_next_sibling, roots,
                       *acceptance) -> StepResult:
        out = self.engine.verify_step(tokens, positions, req_rows, seq_lens, tree_mask)
        size = tokens.shape[1]
        linkage = (retrieve_index, retrieve_next_token, retrieve_next_sibling)
        accepted = self.accept_tree(out, tokens, linkage, min(self.num_spec_steps, size),
                                    *acceptance)
        done = commit_step(self.engine.pool.req_to_token, req_rows, seq_lens, roots,
                           self.padding_row, *accepted, size)
        return step_result(done, out.hidden)


def sampling_inputs(sampler, size: int) -> Tuple[Tensor, ...]:
    """A SampledStep's `acceptance` inputs for a step of tree size `size` (1: decode): the
    batch's sampling parameters (bucket-sized) and this step's uniforms, drawn now from each
    request's own generator, as many as the eager rejection sampling draws (Sampler.sample,
    Sampler.verify), so compiled and eager runs of the same seeds emit the same tokens."""
    u, u_final = sampler.uniforms(size)  # [B, size], [B]
    return sampler.temperature, sampler.top_k, sampler.top_p, sampler.greedy, u, u_final


class SampledStep(GreedyStep):
    """A step of a batch with sampled requests as one program per (bucket, N): the target's
    decode or verify pass, the requests' sampling distributions (sampler.sampling_probs;
    greedy rows a one-hot at the argmax, which makes the walk accept exactly the greedy
    tokens), tree rejection sampling (the `tree_sampling` rule, default
    ops.tree_speculative_sampling) and the commit. The uniforms are inputs (sampling_inputs):
    drawn on the host from each request's generator, so a seeded run repeats and the tokens
    stay exactly distributed as plain sampling from the target."""

    def __init__(self, engine, num_spec_steps: int, tree_sampling=ops.tree_speculative_sampling):
        self.tree_sampling = tree_sampling
        super().__init__(engine, num_spec_steps)

    def scratch_acceptance(self, bucket: int, size: int) -> Tuple[Tensor, ...]:
        return sampling_inputs(Sampler([SamplingParams()] * bucket), size)

    def accept_roots(self, out, temperature, top_k, top_p, greedy, u, u_final):
        """A root-only tree: the bonus token is drawn from the target distribution itself."""
        bs = out.logits.shape[0]
        probs = sampling_probs(out.logits.unsqueeze(1), temperature, top_k, top_p, greedy)
        none = torch.full((bs, 1), -1, dtype=torch.int64)  # [B, 1]
        return self.tree_sampling(torch.zeros(bs, 1, dtype=torch.int64),
                                  torch.arange(bs).view(bs, 1), none, none, u, u_final, probs, 1)

    def accept_tree(self, out, tokens, linkage, steps, temperature, top_k, top_p, greedy, u,
                    u_final):
        probs = sampling_probs(out.logits, temperature, top_k, top_p, greedy)  # [B, N, V]
        return self.tree_sampling(tokens, *linkage, u, u_final, probs, steps)


class DraftedStep:
    """The whole speculative step of a batch bucket as one program: the proposer's draft trees
    (a DraftProgram's tree_program: the draft's catch-up extend over what the last step
    committed, every draft decode, the top-k work and build_tree; or a chain's decodes), then
    `step`'s verify program (the target's verify(N) pass, greedy acceptance or tree rejection
    sampling, the commit). One compiled graph per bucket on a compiled target Engine
    (compile_program; the draft Engine's steps trace into it with the target's backend
    options, which may only change the draft's last bits, never a verified token); op by op
    in eager. The host prepares
    the draft's inputs and reads the step's one result, as for the other programs."""

    def __init__(self, step: GreedyStep, drafter):
        self.engine, self.step, self.drafter = step.engine, step, drafter
        self.compiled_runs = 0  # steps run as the compiled program (tests assert the path)
        compiled = self.engine.compile_program if self.engine.compiled else (lambda m: m)
        self._program = compiled(self.program)

    def run(self, draft_inputs, req_rows: Tensor, seq_lens: Tensor, roots: Tensor,
            *acceptance: Tensor) -> StepResult:
        """Draft, verify, accept and commit the bucket (draft_inputs: the DraftProgram's;
        req_rows / seq_lens / roots: the batch's state, updated in place as by step.verify)."""
        self.compiled_runs += int(self.engine.compiled)
        return self.engine.run_program(self._program, len(draft_inputs), *draft_inputs,
                                       req_rows, seq_lens, roots, *acceptance)

    def program(self, count: int, *args) -> StepResult:
        """args: the `count` draft inputs, then req_rows, seq_lens, roots and the acceptance."""
        draft_inputs, (req_rows, seq_lens, roots, *acceptance) = args[:count], args[count:]
        # The draft reads the roots and lengths before the commit advances them in place.
        tokens, mask, positions, ridx, nxt, sib, *own = self.drafter.tree_program(
            roots, seq_lens, *draft_inputs)
        bs, n = tokens.shape
        result = self.step.verify_program(tokens, positions.view(bs, n), req_rows, seq_lens,
                                          mask, ridx, nxt, sib, roots, *acceptance)
        return result._replace(drafted=tuple(own)) if own else result
