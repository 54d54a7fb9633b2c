"""Lossless sampling ops: top_k_top_p_renorm, tree_speculative_sampling,
chain_speculative_sampling. Semantics: shared/spec/kernels.md section 7.

Glossary: *target* probabilities are the target model's sampling distribution after
temperature, top-k and top-p; a *draft* is a proposed token; *accepted* drafts are emitted; the
*bonus* token is drawn after the last accepted draft, from the *residual* (the target
distribution with the mass of rejected drafts removed, renormalized). Uniforms are inputs in
[0, 1), so a step is reproducible and traceable; a draft is accepted when u < its acceptance
probability. Temperature 0 rows are handled by passing one-hot target probabilities (the walk
then accepts exactly the greedy tokens)."""
from typing import Tuple

import torch
from torch import Tensor

import specdec_inductor._library  # noqa: F401  (loads the schemas before register_fake)


def top_k_top_p_renorm(probs: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Restricts each row of probs [R, V] (float32) to its top_k[r] largest probabilities
    (top_k <= 0 or >= V: no limit), then to the fewest largest ones whose mass reaches
    top_p[r] (in (0, 1]; 1: no limit) of what is left, and renormalizes. Ties at a threshold
    are kept. Returns a new [R, V] float32 tensor."""
    return torch.ops.specdec.top_k_top_p_renorm.default(probs, top_k, top_p)


@torch.library.register_fake("specdec::top_k_top_p_renorm")
def _(probs, top_k, top_p):
    return probs.new_empty(probs.shape)


def tree_speculative_sampling(candidates: Tensor, retrieve_index: Tensor, retrieve_next_token: Tensor,
                              retrieve_next_sibling: Tensor, uniform_samples: Tensor,
                              uniform_final: Tensor, target_probs: Tensor,
                              num_spec_steps: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Tree rejection sampling with deterministic (top-k chosen) candidates.

    At the current node with target distribution p, the children are visited in sibling order;
    child c is accepted when uniform_samples[b, c] < residual(c) / remaining mass. A rejected
    child's mass leaves the residual before the next sibling. After the walk the bonus token is
    drawn with uniform_final[b] from the residual at the last accepted node.

    Args: linkage [B, N] as from build_tree; uniform_samples [B, N] and uniform_final [B]
    float32 in [0, 1); target_probs [B, N, V] float32 (node i's next-token distribution).
    Returns (predicts [B*N] int32, accept_index [B, S] int32, accept_token_num [B] int32) as
    verify_tree_greedy does.
    """
    return torch.ops.specdec.tree_speculative_sampling.default(
        candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, uniform_samples,
        uniform_final, target_probs, num_spec_steps)


@torch.library.register_fake("specdec::tree_speculative_sampling")
def _(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, uniform_samples,
      uniform_final, target_probs, num_spec_steps):
    bs, n = candidates.shape
    return (candidates.new_empty((bs * n,), dtype=torch.int32),
            candidates.new_empty((bs, num_spec_steps), dtype=torch.int32),
            candidates.new_empty((bs,), dtype=torch.int32))


def chain_speculative_sampling(draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor,
                               uniform_samples: Tensor, uniform_final: Tensor) -> Tuple[Tensor, Tensor]:
    """Standard speculative sampling of a sampled draft chain: draft x_i (drawn from q_i) is
    accepted when uniform_samples[b, i] * q_i(x_i) < p_i(x_i); at the first rejection a token is
    drawn from max(p_i - q_i, 0) renormalized, else the bonus from p_K, with uniform_final[b].

    Args: draft_tokens [B, K]; draft_probs [B, K, V]; target_probs [B, K+1, V] float32.
    Returns (tokens [B, K+1] int64: accepted drafts then the recovered/bonus token, -1 after;
    accept_token_num [B] int32)."""
    return torch.ops.specdec.chain_speculative_sampling.default(
        draft_tokens, draft_probs, target_probs, uniform_samples, uniform_final)


@torch.library.register_fake("specdec::chain_speculative_sampling")
def _(draft_tokens, draft_probs, target_probs, uniform_samples, uniform_final):
    bs, k = draft_tokens.shape
    return (draft_tokens.new_empty((bs, k + 1), dtype=torch.int64),
            draft_tokens.new_empty((bs,), dtype=torch.int32))
