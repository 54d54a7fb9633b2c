"""Training data for draft heads, built offline through the Engine (EAGLE recommends the
target's own outputs): prompts -> the target's greedy continuations -> one prefill over
prompt + continuation capturing the hidden states the head needs -> soft labels (the target's
next-token distribution at every position, truncated to its top LABEL_TOP_K entries).

A `DraftData` holds, per sequence: tokens [T], feats [T, k*H] (the captured layers, in the
Engine's capture_hidden order), final [T, H] (the final normed hidden state: EAGLE's input
and regression target, and what the labels are computed from), label_ids / label_probs
[T, LABEL_TOP_K] (row t = the target's distribution of token t+1).

The data pass may run the target in bf16 (`precision`, `data_precision()`): on a CPU with AMX
tiles oneDNN's bf16 GEMMs make it several times faster than fp32 (README: Training draft
heads), and feats / final are then stored in bf16. The head still drafts from the fp32 target's
features at inference; bf16 rounding (~3 significant digits) is far below the feature noise
EAGLE trains with on purpose.
"""
import copy
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch import Tensor

LABEL_TOP_K = 32  # keeps the labels small (80 MB for 100k tokens) and loses <1% of mass here


@dataclass
class DraftData:
    tokens: List[Tensor]  # [T] int64 each
    feats: List[Tensor]  # [T, k*H] float32 (captured layers; empty [T, 0] for EAGLE)
    final: List[Tensor]  # [T, H] float32
    label_ids: List[Tensor]  # [T, K] int64
    label_probs: List[Tensor]  # [T, K] float32
    layers: List[int]  # the captured HF hidden_states indices behind feats
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    precision: str = "fp32"  # the target's dtype in the data pass (feats / final are stored in it)

    def __len__(self) -> int:
        return len(self.tokens)

    def num_tokens(self) -> int:
        return sum(int(t.numel()) for t in self.tokens)

    def save(self, path: str) -> None:
        torch.save(self.__dict__, path)

    @classmethod
    def load(cls, path: str) -> "DraftData":
        return cls(**torch.load(path, weights_only=True))

    def token_counts(self, vocab_size: int) -> Tensor:
        """How often each target token id appears (prompts and continuations) [V]."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for t in self.tokens:
            counts += torch.bincount(t, minlength=vocab_size)
        return counts


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def data_precision(choice: str = "auto") -> str:
    """'auto' -> 'bf16' where the CPU has AMX tiles (the data pass's GEMMs run on oneDNN's AMX
    kernels), else 'fp32' (without AMX a bf16 pass gains too little to change the data)."""
    if choice == "auto":
        from specdec_inductor import detected_isa
        return "bf16" if detected_isa() == "amx" else "fp32"
    if choice not in PRECISIONS:
        raise ValueError(f"argument 'precision' must be 'auto', 'fp32' or 'bf16', got {choice!r}")
    return choice


def data_engine_options(precision: str) -> dict:
    """Backend options of the data pass's Engine. In bf16 on AMX its decode steps (16-64 rows) and
    prefill chunks run faster through oneDNN's AMX GEMMs than through the packed GEMV, whose bf16
    path is vdpbf16ps (SmolLM2, 64 rows, 2-core AMX Xeon: 51.5 against 103.9 ms a decode step),
    so the skinny_linear pass and the packed copies are off there."""
    from specdec_inductor import detected_isa
    if precision == "bf16" and detected_isa() == "amx":
        return {"specdec.skinny_linear": False, "specdec.pack_weights": False}
    return {}


def _topk_probs(logits: Tensor, top_k: int):
    """(ids [R, K] int64, probs [R, K] float32): the top_k of softmax(logits [R, V]), renormalised."""
    p = torch.softmax(logits.float(), dim=-1)
    top = p.topk(top_k, dim=-1)
    return top.indices, top.values / top.values.sum(-1, keepdim=True)


@torch.inference_mode()
def soft_labels(lm_head: torch.nn.Module, final: Tensor, top_k: int = LABEL_TOP_K,
                chunk: int = 512):
    """The target's next-token distribution at every row of final [T, H] (top_k entries)."""
    ids, probs = [], []
    # A GGUF-quantized LM head holds uint8 blocks and takes the activations' dtype.
    weight_dtype = next((p.dtype for p in lm_head.parameters() if p.is_floating_point()),
                        final.dtype)
    for part in final.split(chunk):
        i, p = _topk_probs(lm_head(part.to(weight_dtype)), top_k)
        ids.append(i)
        probs.append(p)
    return torch.cat(ids), torch.cat(probs)


@torch.inference_mode()
def generate_with_hidden(engine, prompts: List[List[int]], new_tokens: int,
                         eos_token_id: Optional[int]):
    """Greedy continuation of up to engine.max_batch prompts, recording what training needs
    in the same pass: per sequence (tokens [T], captured hidden [T, k*H], next-token labels
    (ids, probs) [T, K]) for the prompt and every generated token that was fed back (eos and
    the token after the last step are not: they have no hidden state)."""
    bs = len(prompts)
    bucket = engine.bucket_for(bs)
    lens = [len(p) for p in prompts]
    requests = engine.pool.admit(lens, new_tokens)
    lm_head = engine.model.get_output_embeddings()
    try:
        rows = [r.row for r in requests] + [engine.pool.padding_row] * (bucket - bs)
        req_rows = torch.tensor(rows, dtype=torch.int64)  # [B]
        _, last, hidden = engine.prefill_with_hidden(prompts, req_rows)  # [B, V], [B, P, k*H]
        width = hidden.shape[-1] // len(engine.capture_hidden)
        toks = [list(p) for p in prompts]
        hids = [[hidden[b, :lens[b]]] for b in range(bs)]
        labels = []
        for b in range(bs):
            ids, probs = soft_labels(lm_head, hidden[b, :lens[b] - 1, -width:])
            li, lp = _topk_probs(last[b:b + 1], LABEL_TOP_K)
            labels.append(([ids, li], [probs, lp]))
        tokens = last.argmax(-1)  # [B]
        seq_lens = torch.tensor(lens + [1] * (bucket - bs), dtype=torch.int64)  # [B]
        # Per step, the whole batch's fed token, hidden and labels; a row stops at its eos, so
        # its steps are a prefix of the list (steps[b]). Split per row after the loop.
        fed, step_hid, step_ids, step_probs = [], [], [], []
        steps = [0] * bs
        done = [False] * bs
        for _ in range(new_tokens - 1):
            for b in range(bs):
                done[b] = done[b] or (eos_token_id is not None and int(tokens[b]) == eos_token_id)
            if all(done):
                break
            nxt, logits, hid = engine.decode(tokens, req_rows, seq_lens)  # [B], [B, V], [B, k*H]
            li, lp = _topk_probs(logits[:bs], LABEL_TOP_K)
            fed.append(tokens[:bs])
            step_hid.append(hid[:bs])
            step_ids.append(li)
            step_probs.append(lp)
            for b in range(bs):
                steps[b] += not done[b]
            tokens, seq_lens = nxt, seq_lens + 1
    finally:
        for r in requests:
            engine.pool.release(r)
    if fed:
        fed_t, hid_t = torch.stack(fed, 1), torch.stack(step_hid, 1)  # [bs, S], [bs, S, k*H]
        ids_t, probs_t = torch.stack(step_ids, 1), torch.stack(step_probs, 1)  # [bs, S, K]
    out = []
    for b in range(bs):
        n = steps[b]
        tok = torch.tensor(toks[b], dtype=torch.int64)
        h, ids, probs = hids[b][0], labels[b][0], labels[b][1]
        if n:
            tok = torch.cat([tok, fed_t[b, :n]])
            h = torch.cat([h, hid_t[b, :n]])
            ids, probs = ids + [ids_t[b, :n]], probs + [probs_t[b, :n]]
        out.append((tok, h[:, :-width].clone(), h[:, -width:].clone(), torch.cat(ids),
                    torch.cat(probs)))
    return out


def build_draft_data(target, prompts: List[List[int]], layers: List[int], *, new_tokens: int,
                     eos_token_id: Optional[int], max_batch: int = 8, compile: Optional[bool] = None,
                     precision: str = "fp32",
                     progress: Callable[[str], None] = lambda s: None) -> DraftData:
    """Greedy continuations of `prompts` (token ids) by `target` (a HF causal LM) through one
    Engine that captures `layers` (HF hidden_states indices, may be empty) and the final
    hidden in the same pass. precision 'bf16' runs a bf16 copy of the target (`target` itself
    is left as it is)."""
    from specdec_inductor.engine.engine import Engine
    precision = data_precision(precision)
    dtype = PRECISIONS[precision]
    model = target
    if next(target.parameters()).dtype != dtype:
        model = copy.deepcopy(target).to(dtype)
    longest = max(len(p) for p in prompts) + new_tokens
    engine = Engine(model, max_batch=max_batch, max_len=longest + 1, compile=compile,
                    capture_hidden=list(layers) + [-1],
                    compile_options=data_engine_options(precision))
    data = DraftData([], [], [], [], [], list(layers), precision=precision)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), max_batch):
        batch = prompts[i:i + max_batch]
        # A short last batch is padded with copies so every batch runs the same graphs.
        padded = batch + [batch[0]] * (max_batch - len(batch))
        for tokens, feats, final, ids, probs in generate_with_hidden(
                engine, padded, new_tokens, eos_token_id)[:len(batch)]:
            data.tokens.append(tokens)
            data.feats.append(feats)
            data.final.append(final)
            data.label_ids.append(ids)
            data.label_probs.append(probs)
        data.num_prompt_tokens += sum(len(p) for p in batch)
        data.num_generated_tokens = data.num_tokens() - data.num_prompt_tokens
        progress(f"[data] {len(data)}/{len(prompts)} sequences, {data.num_tokens()} tokens, "
                 f"{data.num_generated_tokens / (time.perf_counter() - t0):.0f} generated tok/s")
    engine.pool.check_consistent()
    return data
