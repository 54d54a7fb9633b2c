"""Per-request sampling for the speculative loop: temperature, top-k, top-p and a seed per
request, greedy (temperature 0) and sampled requests mixed in one batch.

Losslessness comes from the ops (kernels.md section 7): the target's sampling distribution p
(softmax of logits / T, then top-k / top-p renormalised) goes to `tree_speculative_sampling`,
which accepts a draft with probability min(1, residual / remaining mass) and draws the bonus
from the residual, so every emitted token is distributed exactly as plain sampling from p.
Greedy rows get a one-hot p at the argmax, which makes the same walk accept exactly the greedy
tokens. Uniforms come from one torch.Generator per request, so a seeded run repeats exactly.
"""
import random
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from specdec_inductor import ops


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = no limit; top_p 1 = no limit; seed None = random."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or not (t >= 0.0) or t == float("inf"):
            raise ValueError(f"argument 'temperature' must be a finite number >= 0, got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"argument 'top_k' must be an int >= 0 (0: no limit), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"argument 'top_p' must lie in (0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 64):
            raise ValueError(f"argument 'seed' must be an int in [0, 2**64) or None, got "
                             f"{self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def request_params(sampling: Union[None, SamplingParams, Sequence[SamplingParams]],
                   batch: int) -> List[SamplingParams]:
    """One SamplingParams per request from None (all greedy), one for all, or one each."""
    if sampling is None:
        return [SamplingParams()] * batch
    params = [sampling] * batch if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != batch:
        raise ValueError(f"argument 'sampling' has {len(params)} entries for {batch} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"argument 'sampling' [{i}] must be a SamplingParams, got {type(p)}")
    return params


def request_generator(params: SamplingParams) -> Optional[torch.Generator]:
    """A request's own uniform stream (None when greedy): its draws do not depend on which
    other requests share its batch."""
    if params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
    return g


def sampling_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                   greedy: Tensor) -> Tensor:
    """logits [B, N, V] -> the per-request sampling distributions [B, N, V] float32:
    softmax(logits / temperature), top-k / top-p renormalised; a one-hot at the argmax for
    greedy rows. temperature [B] (any value > 0 for greedy rows), top_k [B] int64, top_p [B]
    float32, greedy [B] bool. Tensor ops only, so it traces into a step program."""
    bs, n, v = logits.shape
    logits = logits.float()
    probs = torch.softmax(logits / temperature.view(bs, 1, 1), dim=-1)  # [B, N, V]
    probs = ops.top_k_top_p_renorm(probs.view(bs * n, v), top_k.repeat_interleave(n),
                                   top_p.repeat_interleave(n)).view(bs, n, v)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy.view(bs, 1, 1), one_hot, probs)


class Sampler:
    """Target distributions and uniforms for a batch of `len(params)` requests; generators:
    each request's stream (request_generator), made here when not given."""

    def __init__(self, params: Sequence[SamplingParams],
                 generators: Optional[Sequence[Optional[torch.Generator]]] = None):
        self.params = list(params)
        self.greedy = torch.tensor([p.greedy for p in self.params])  # [B]
        self.generators: List[Optional[torch.Generator]] = (
            list(generators) if generators is not None
            else [request_generator(p) for p in self.params])
        self.temperature = torch.tensor([p.temperature if not p.greedy else 1.0
                                         for p in self.params])  # [B]
        self.top_k = torch.tensor([p.top_k for p in self.params], dtype=torch.int64)  # [B]
        self.top_p = torch.tensor([p.top_p for p in self.params], dtype=torch.float32)  # [B]

    @staticmethod
    def for_batch(sampling: Union[None, SamplingParams, Sequence[SamplingParams]],
                  batch: int) -> Optional["Sampler"]:
        """None when every request is greedy (the loop then verifies with plain argmax)."""
        params = request_params(sampling, batch)
        return None if all(p.greedy for p in params) else Sampler(params)

    @staticmethod
    def for_requests(params: Sequence[SamplingParams],
                     generators: Sequence[Optional[torch.Generator]]) -> Optional["Sampler"]:
        """for_batch of requests that carry their own generators."""
        return None if all(p.greedy for p in params) else Sampler(params, generators)

    def target_probs(self, logits: Tensor) -> Tensor:
        """logits [B, N, V] -> the per-request sampling distributions [B, N, V] float32."""
        return sampling_probs(logits, self.temperature, self.top_k, self.top_p, self.greedy)

    def uniforms(self, n: int):
        """(uniform_samples [B, n], uniform_final [B]) in [0, 1); zeros for greedy rows (their
        one-hot targets make the walk independent of the uniforms)."""
        u = torch.zeros(len(self.params), n + 1)  # [B, n + 1]
        for b, g in enumerate(self.generators):
            if g is not None:
                u[b] = torch.rand(n + 1, generator=g)
        return u[:, :n].contiguous(), u[:, n].contiguous()

    def sample(self, logits: Tensor) -> Tensor:
        """One token per request from logits [B, V] (the prefill's token, a decode step): a
        root-only tree, so the bonus is drawn from p itself."""
        bs = logits.shape[0]
        probs = self.target_probs(logits.view(bs, 1, -1))  # [B, 1, V]
        none = torch.full((bs, 1), -1, dtype=torch.int64)  # [B, 1]
        u, u_final = self.uniforms(1)
        predicts, _, _ = ops.tree_speculative_sampling(
            torch.zeros(bs, 1, dtype=torch.int64), torch.arange(bs).view(bs, 1), none, none,
            u, u_final, probs, 1)
        return predicts.long()  # [B]

    def verify(self, tokens: Tensor, linkage: Sequence[Tensor], logits: Tensor,
               num_spec_steps: int, tree_sampling=ops.tree_speculative_sampling):
        """Tree rejection sampling of draft `tokens` [B, N] against the target `logits`
        [B, N, V]; returns (predicts, accept_index, accept_num) as verify_tree_greedy does."""
        probs = self.target_probs(logits)
        u, u_final = self.uniforms(tokens.shape[1])
        return tree_sampling(tokens, *linkage, u, u_final, probs, num_spec_steps)
