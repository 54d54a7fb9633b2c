"""The model's steps over the KV pool: chunked prefill (ragged prompts, right-padded), decode
and verify steps, each one compiled graph per (batch bucket, step kind). Generation is the
speculative loop's (speculative/): Engine.generate is plain greedy decoding through it.

Every length, position and slot a step needs is a tensor input (or derived in the graph from
`req_to_token`), never a Python int, so a bucket's graph is compiled once and reused for any
prompt lengths and any number of steps (tested under `set_stance("fail_on_recompile")`).
Step kinds: EXTEND with T = `prefill_chunk` (prefill; prompts longer than one chunk take
several chunks over their growing prefix), EXTEND with T = N and a tree mask (verify(N)),
DECODE (one token per request). Callers compose a step function with their own tensor work
into one graph with compile_program (the speculative loop's greedy step: verify, acceptance and
commit), and run a prompt chunk by chunk between other steps with prefill_chunk_step.

Eager mode (`compile=False` or SPECDEC_EAGER=1) runs the same step functions uncompiled.
"""
import functools
import inspect
import operator
import os
import types
import warnings
from dataclasses import dataclass, field
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from specdec_inductor.engine import attention_backend as ab
from specdec_inductor.engine import threads
from specdec_inductor.engine.hf import StepBatch, StepKind, model_shape, use_specdec_attention
from specdec_inductor.engine.hf import compile_layers_once as hf_compile_layers_once
from specdec_inductor.engine.kv_pool import KVPool

EAGER_ENV = "SPECDEC_EAGER"


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def eager_requested() -> bool:
    """SPECDEC_EAGER as a boolean: 1/true/yes/on or 0/false/no/off (any case; unset = 0);
    anything else raises rather than silently meaning one of them."""
    value = os.environ.get(EAGER_ENV, "0").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{EAGER_ENV}={os.environ[EAGER_ENV]!r}: must be 1/true/yes/on or "
                     "0/false/no/off")


def _own_code(method):
    """The bound method `method` over a private copy of its code object. Dynamo keeps compiled
    graphs and their guards per code object, so each engine's steps get their own cache: the
    graphs of one engine's model are never tried (or guarded against) for another's."""
    f = method.__func__
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__,
                           f.__closure__)
    return types.MethodType(g, method.__self__)


def _skip_model_guards(guard_entries) -> List[bool]:
    """Dynamo guard filter: keep every guard except those on the engine's model and KV pool
    (thousands of parameter, hook-dict, module-class and attribute checks, ~1 ms per step on
    SmolLM2). Safe because each engine has its own code objects (`_own_code`) and the engine
    owns its model and pool: the model's modules, their classes, parameters and config, and the
    pool's buffers must not be replaced after the Engine is made (values may be updated in
    place; parameters and pool buffers are graph inputs read on every call). Also drops the
    global-state guard, which holds the thread count the governor varies (threads.keeps_guard)."""
    return [not _engine_owned(e.name) and threads.keeps_guard(e) for e in guard_entries]


_OWNED_ROOTS = tuple(f"self.{owner}{part}" for owner in ("", "engine.", "step.engine.",
                                                          "drafter.engine.",
                                                          "drafter.inner.engine.")
                     for part in ("model", "pool"))


def _engine_owned(name: str) -> bool:
    """A guard source on an engine's model (its attributes, parameters, and the class dicts of
    its modules: `dict(type(self.model.model.layers[0]))...`) or its KV pool, which the engine
    creates and never replaces; reached as `self.engine....` from a compile_program owner, and
    as `self.step.engine....` / `self.drafter.engine....` from a program that runs another
    program's step and a draft Engine's (commit.DraftedStep), `self.drafter.inner.engine....`
    where a drafter wraps the draft Engine's (lookup_first.MixedDrafter)."""
    for root in _OWNED_ROOTS:
        at = name.find(root)
        while at >= 0:
            end = at + len(root)
            if end == len(name) or name[end] in ".[)":
                return True
            at = name.find(root, end)
    return False


# Inductor options of the engine's step graphs, under any compile_options the caller passes:
# - size_asserts off: the wrapper would assert the sizes and strides of every input and extern
#   kernel output on every call (~1100 asserts per SmolLM2 decode step, each layer region
#   asserting its inputs again). Same-process A/B on SmolLM2 decode (a throwaway script, 6-8
#   interleaved runs of 128 tokens): 1.16x bf16, 1.05-1.08x fp32 (two A/Bs), same tokens;
#   `benchmarks/bench_e2e.py --inductor-option size_asserts=1` times them back on. Dynamo's guards
#   still check the step inputs; the model's parameters, whose guards the engine skips
#   (_skip_model_guards), are checked against the compiled layout once per prefill instead.
ENGINE_INDUCTOR_OPTIONS = {"size_asserts": False}


def batch_invariant_options(hidden_size: int) -> dict:
    """Inductor options that keep every row's reductions serial in the step graphs, so a verify
    row reproduces the decode step's row bit for bit (greedy speculation == plain greedy).
    Inductor parallelizes a loop nest over its outer ranges while each thread keeps at least
    cpp.min_chunk_size elements: a one-row decode graph has no row range to split, so its
    RMSNorm sum over the hidden size gets split across threads (partial sums added at the
    end), while a verify graph splits rows and sums each one serially, another summation
    order. A minimum chunk above the hidden size never splits a reduction over it (1.5B
    Qwen2.5-Coder, hidden 1536, at 2 threads: the decode graph's norms were split at the default
    512, and INT8 activations turned those last bits into different tokens); graphs of several
    rows still split their rows."""
    return {"cpp.min_chunk_size": max(4096, hidden_size + 1)}


def _param_layout(model) -> List[Tuple[str, torch.Size, Tuple[int, ...], torch.dtype]]:
    """(name, shape, strides, dtype) of every parameter: what the compiled steps assume."""
    return [(name, p.shape, p.stride(), p.dtype) for name, p in model.named_parameters()]


def _capture_layer_input(index: int):
    """Forward pre-hook of decoder layer `index`: when the step's StepBatch asks for this layer
    (its `captured` dict has the key), store the layer's input hidden [B, T, H] there. A no-op
    for any other call (plain engines on the same model, stock HF calls without a StepBatch),
    so it traces to nothing in their graphs."""
    def hook(module, args, kwargs):
        batch = kwargs.get("specdec_batch")
        if batch is not None and batch.captured is not None and index in batch.captured:
            batch.captured[index] = args[0] if args else kwargs["hidden_states"]
    return hook


def _install_capture_hooks(layers) -> None:
    """The capture pre-hooks on every decoder layer (once per model; idempotent)."""
    for i, layer in enumerate(layers):
        if getattr(layer, "_specdec_capture_hook", None) is None:
            layer._specdec_capture_hook = layer.register_forward_pre_hook(
                _capture_layer_input(i), with_kwargs=True)


def batch_buckets(max_batch: int) -> List[int]:
    """Powers of two up to max_batch, plus max_batch itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def _inference(t: Optional[Tensor]) -> Optional[Tensor]:
    """t as an inference tensor (a copy when it is not one). Dynamo guards an input's dispatch
    keys, so a graph traced on inference tensors recompiles for normal ones: the public steps
    hand their graphs inference tensors only, and every caller -- generate, the speculative
    loop, a test's own tensors -- shares one graph per shape."""
    return t if not isinstance(t, Tensor) or t.is_inference() else t.clone()


class StepOutput(NamedTuple):
    """What every step returns, whatever the engine captures: fields are fixed, so callers
    read them by name (or unpack three) and never guess an arity."""
    argmax: Optional[Tensor]  # decode [B], verify [B, N], prefill [B]; None for extend
    logits: Tensor  # decode / prefill [B, V], verify / extend [B, T, V] (last_only: [B, 1, V])
    hidden: Optional[Tensor]  # captured rows [.., k*H] (prefill: [B, P, k*H]); None: no capture


@dataclass
class GenerationStats:
    """What Engine.generate / generate_stream report (summed over calls)."""
    prompt_tokens: int = 0
    new_tokens: int = 0  # all generated tokens, the prefill's first one included
    decode_tokens: int = 0  # tokens made by decode steps (new_tokens less one per request)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # from the first decode step to the last (the caller's work between)
    decode_steps: int = 0
    step_times: List[float] = field(default_factory=list)  # seconds of each decode step

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


class Engine:
    """The steps of a stock HF causal LM through the `specdec` attention and KV pool, and
    plain greedy decoding over them (generate: the speculative loop without a proposer).

    Args:
        model: an `AutoModelForCausalLM` (switched to the "specdec" attention in place).
        max_batch: largest batch; batches are padded up to a bucket (powers of two).
        max_len: positions per request (prompt + new tokens).
        num_slots: KV pool size; default max_batch * max_len.
        compile: torch.compile the step functions (default: not SPECDEC_EAGER).
        attention: "ops", "torch" or "reference" (default: see attention_backend.resolve_backend).
        compile_backend: torch.compile backend name ("specdec" = Inductor + our passes).
        compile_options: Inductor config patches on top of the specdec backend's own and
            ENGINE_INDUCTOR_OPTIONS (which they override).
        compile_layers_once: when compiled (on torch >= hf.MIN_TORCH_FOR_REGIONS), mark the
            decoder layers as one nested compile region (hf.compile_layers_once; the number
            marked is `layer_regions`): a step's graph then lowers and compiles one layer
            instead of every layer (SmolLM2 cold compile 46 s instead of 74 s, fp32 tokens
            the same; benchmarks/bench_e2e.py --per-layer-graphs). The marking stays on the
            model.
        prefill_chunk: new tokens per prefill step (the EXTEND graph's T).
        capture_hidden: indices into the model's `hidden_states` output whose rows every step
            also returns, concatenated on the last dim in the order given ([B, T, k*H]);
            EAGLE-style proposers draft from them. Every step's StepOutput then carries them
            as `hidden`, and prefill_with_hidden works. Convention (that of HF
            `output_hidden_states`, for a model with L decoder layers): index i in [0, L) is the
            input of decoder layer i (= the output of layer i - 1; 0 = the embeddings); L and -1
            are the final, normed hidden state; other negative indices count from L + 1. On a
            stock HF model layer inputs are taken by forward pre-hooks on its decoder layers,
            installed only when such an index is asked for (they do nothing for other engines'
            steps), so any indices trace under torch.compile(fullgraph=True). A model without
            decoder layers (a draft head) must return them itself as `hidden_states`.
        The model may take an auxiliary per-token input (`aux_hidden` [B, T, A], e.g. an EAGLE
        head's target features): pass it as `aux` to extend / verify / decode / prefill.
    """

    def __init__(self, model, *, max_batch: int = 4, max_len: int = 512,
                 num_slots: Optional[int] = None, compile: Optional[bool] = None,
                 attention: Optional[str] = None, compile_backend: str = "specdec",
                 compile_options: Optional[dict] = None, prefill_chunk: int = 64,
                 capture_hidden: Optional[Sequence[int]] = None,
                 compile_layers_once: bool = True):
        for name, value in (("max_batch", max_batch), ("max_len", max_len),
                            ("prefill_chunk", prefill_chunk), ("num_slots", num_slots)):
            if value is None and name == "num_slots":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"argument '{name}' must be an int >= 1, got {value!r}")
        self.model = model
        self.capture_hidden = list(capture_hidden) if capture_hidden is not None else None
        # Per capture_hidden entry: the decoder layer whose input it is, None for the final
        # normed hidden; None overall when the model has no decoder layers to hook.
        self._capture_layers: Optional[List[Optional[int]]] = None
        if self.capture_hidden is not None:
            self._capture_layers = self._plan_capture(model, self.capture_hidden)
        # Prefill chunks (and a draft tree's extend) need the logits of each request's last row
        # only: gathered before the LM head when the engine runs the decoder itself (hidden
        # capture) or the model takes HF's `logits_to_keep` (an EAGLE-3 head does); otherwise
        # (the EAGLE head) every row's.
        self.keeps_last_rows = (self._capture_layers is not None or
                                "logits_to_keep" in inspect.signature(model.forward).parameters)
        self.compiled = (not eager_requested()) if compile is None else compile
        self.attention_backend = ab.resolve_backend(attention)
        if self.compiled and not self.attention_backend.traceable:
            raise ValueError(f"attention backend {self.attention_backend.value!r} is eager-only; "
                             "pass compile=False (or SPECDEC_EAGER=1)")
        use_specdec_attention(model)
        self.layer_regions = (hf_compile_layers_once(model)
                              if self.compiled and compile_layers_once else 0)
        shape = model_shape(model)
        self.vocab_size = shape.vocab_size
        self.dtype = next(model.parameters()).dtype
        self.max_batch, self.max_len, self.prefill_chunk = max_batch, max_len, prefill_chunk
        self.buckets = batch_buckets(max_batch)
        self.pool = KVPool(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                           max_batch * max_len if num_slots is None else num_slots, max_batch, max_len, self.dtype)
        self.compile_backend = compile_backend
        # Step programs callers build over this engine (compile_program), by the caller's key:
        # every user of the same program shares its compiled graphs.
        self.programs: dict = {}
        if self.compiled:
            # Each engine adds graphs to the same step code objects; a hit of the recompile
            # limit must fail loudly, never fall back to eager.
            import torch._dynamo
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, 1024)
            torch._dynamo.config.fail_on_recompile_limit_hit = True
            backend = compile_backend
            if backend == "specdec":
                from specdec_inductor.backend import specdec_backend
                backend = functools.partial(specdec_backend, options={
                    **ENGINE_INDUCTOR_OPTIONS, **batch_invariant_options(shape.hidden_size),
                    **(compile_options or {})})
            self._layout = _param_layout(model)
            guard_options = ({"guard_filter_fn": _skip_model_guards}
                             if os.environ.get("SPECDEC_MODEL_GUARDS", "0") in ("", "0") else {})
            self._backend, self._guard_options = backend, guard_options
            self._extend_fn = torch.compile(_own_code(self._extend_step), fullgraph=True,
                                            dynamic=False, backend=backend,
                                            options=dict(guard_options))
            self._decode_fn = torch.compile(_own_code(self._decode_step), fullgraph=True,
                                            dynamic=False, backend=backend,
                                            options=dict(guard_options))
            self._verify_fn = torch.compile(_own_code(self._verify_step), fullgraph=True,
                                            dynamic=False, backend=backend,
                                            options=dict(guard_options))
        else:
            self._extend_fn, self._decode_fn = self._extend_step, self._decode_step
            self._verify_fn = self._verify_step

    @staticmethod
    def _plan_capture(model, capture_hidden: List[int]) -> Optional[List[Optional[int]]]:
        """Map capture_hidden to decoder layer indices (None = final normed hidden) and hook the
        layers whose inputs are asked for; None when `model` has no decoder layers."""
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        layers = getattr(decoder, "layers", None)
        if layers is None:
            # No layers to hook: the final hidden still comes from the decoder's output.
            return [None] if decoder is not None and capture_hidden == [-1] else None
        n = len(layers)
        plan: List[Optional[int]] = []
        for i in capture_hidden:
            if not isinstance(i, int) or not -(n + 1) <= i <= n:
                raise ValueError(f"argument 'capture_hidden': index {i!r} is outside [{-(n + 1)}, "
                                 f"{n}] (hidden_states of a model with {n} decoder layers)")
            j = i % (n + 1)
            plan.append(None if j == n else j)
        if any(j is not None for j in plan):
            _install_capture_hooks(layers)
        return plan

    # -- step functions (traced) ---------------------------------------------------------------
    def _capture_slots(self) -> Optional[dict]:
        """A fresh StepBatch.captured dict: the hooked layers this engine reads, or None."""
        if self._capture_layers is None or all(j is None for j in self._capture_layers):
            return None
        return {j: None for j in self._capture_layers if j is not None}

    def _forward(self, input_ids: Tensor, positions: Tensor, batch: StepBatch,
                 aux: Optional[Tensor], last: Optional[Tensor] = None):
        """The model over one step; (logits [B, T, V], captured hidden or None). With `last`
        [B] (row indices), the logits are those of row last[b] only: [B, 1, V]."""
        extra = {} if aux is None else {"aux_hidden": aux}
        bs = input_ids.shape[0]
        if self._capture_layers is not None:
            # A stock HF model: run its decoder and LM head ourselves (output_hidden_states
            # records through a lock Dynamo cannot trace); layer inputs land in batch.captured
            # through the pre-hooks while the decoder runs.
            hidden = self.model.get_decoder()(
                input_ids=input_ids, position_ids=positions, use_cache=False,
                specdec_batch=batch, **extra).last_hidden_state  # [B, T, H]
            rows = [hidden if j is None else batch.captured[j] for j in self._capture_layers]
            if any(r is None for r in rows):
                raise RuntimeError("capture_hidden: a decoder layer ran without its capture hook "
                                   "seeing specdec_batch (the model does not pass its forward "
                                   "kwargs on to its layers)")
            captured = rows[0] if len(rows) == 1 else torch.cat(rows, dim=-1)  # [B, T, k*H]
            if last is not None:
                hidden = hidden.gather(1, last.view(bs, 1, 1).expand(bs, 1, hidden.shape[-1]))
            return self.model.get_output_embeddings()(hidden), captured
        if self.capture_hidden is not None:
            extra["output_hidden_states"] = True
        if last is not None:
            extra["logits_to_keep"] = last  # rows last[0..B) of every request: [B, B, V]
        out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                         specdec_batch=batch, **extra)
        logits = out.logits
        if last is not None:  # request b's own row: the diagonal
            logits = logits.gather(1, torch.arange(bs).view(bs, 1, 1).expand(bs, 1, logits.shape[-1]))
        if self.capture_hidden is None:
            return logits, None
        hidden = torch.cat([out.hidden_states[i] for i in self.capture_hidden], dim=-1)
        return logits, hidden  # [B, T or 1, V], [B, T, k*H]

    def _extend_step(self, input_ids: Tensor, positions: Tensor, req_rows: Tensor,
                     prefix_lens: Tensor, extend_lens: Tensor,
                     tree_mask: Optional[Tensor], aux: Optional[Tensor] = None,
                     last_only: bool = False):
        """T new tokens per request at `positions` [B, T] (sequence positions; for a tree, the
        node depths); their KV goes to positions prefix_lens + t of the request's row.
        Returns StepOutput(None, logits [B, T, V] (rows t >= extend_lens[b] are padding),
        hidden); with last_only (a prefill chunk; its own graph) the logits of row
        extend_lens[b] - 1 only, [B, 1, V], where that saves LM-head rows."""
        bs, t_max = input_ids.shape
        t = torch.arange(t_max).view(1, t_max)
        # Padding requests (the pool's padding row) store nothing: store_kv rejects a slot
        # named twice, and every padding request would name the padding sink.
        real = (req_rows != self.pool.padding_row).view(bs, 1)  # [B, 1]
        valid = (t < extend_lens.view(bs, 1)) & real  # [B, T]
        table = self.pool.req_to_token[req_rows]  # [B, L]
        store_pos = (prefix_lens.view(bs, 1) + t).clamp(max=self.max_len - 1)  # [B, T]
        slots = torch.where(valid, torch.gather(table, 1, store_pos), -1)  # [B, T]
        batch = StepBatch(StepKind.EXTEND, self.attention_backend, self.pool, req_rows,
                          prefix_lens, extend_lens, slots, tree_mask, self._capture_slots())
        # logits_to_keep keeps B rows of every request (B * B in all): only worth it below T.
        if last_only and (self._capture_layers is not None or bs < t_max):
            last = (extend_lens - 1).clamp(min=0)  # [B]
        else:
            last = None
        logits, hidden = self._forward(input_ids, positions, batch, aux, last)
        return StepOutput(None, logits, hidden)  # [B, T or 1, V], [B, T, k*H] or None

    def _decode_step(self, tokens: Tensor, req_rows: Tensor, seq_lens: Tensor,
                     aux: Optional[Tensor] = None):
        """One token per request at position seq_lens[b]; returns StepOutput(argmax [B],
        logits [B, V], hidden [B, k*H] or None)."""
        bs = tokens.shape[0]
        slots = self.pool.req_to_token[req_rows, seq_lens].view(bs, 1)  # [B, 1]
        slots = torch.where((req_rows != self.pool.padding_row).view(bs, 1), slots, -1)
        batch = StepBatch(StepKind.DECODE, self.attention_backend, self.pool, req_rows,
                          seq_lens, torch.ones_like(seq_lens), slots, None, self._capture_slots())
        logits, hidden = self._forward(tokens.view(bs, 1), seq_lens.view(bs, 1), batch,
                                       None if aux is None else aux.view(bs, 1, -1))
        logits = logits[:, 0]  # [B, V]
        return StepOutput(logits.argmax(-1), logits, None if hidden is None else hidden[:, 0])

    def _verify_step(self, tokens: Tensor, positions: Tensor, req_rows: Tensor,
                     seq_lens: Tensor, tree_mask: Tensor, aux: Optional[Tensor] = None):
        """A verify pass: _extend_step over the tree, plus every node's argmax [B, N] in the
        same graph (its reduction there, parallel and fused, costs a fraction of an eager
        one over [B, N, V] after the step)."""
        extend_lens = torch.full_like(seq_lens, tokens.shape[1])  # [B]
        out = self._extend_step(tokens, positions, req_rows, seq_lens, extend_lens, tree_mask,
                                aux)
        return StepOutput(out.logits.argmax(-1), out.logits, out.hidden)

    def decode_step(self, tokens: Tensor, req_rows: Tensor, seq_lens: Tensor,
                    aux: Optional[Tensor] = None):
        """decode's step function itself, not compiled on its own: for a program that runs
        several steps and the work between them as one graph (compile_program). Callers that
        run one step use decode."""
        return self._decode_step(tokens, req_rows, seq_lens, aux)

    def verify_step(self, tokens: Tensor, positions: Tensor, req_rows: Tensor,
                    seq_lens: Tensor, tree_mask: Tensor, aux: Optional[Tensor] = None):
        """verify's step function itself, for a compile_program program (as decode_step)."""
        return self._verify_step(tokens, positions, req_rows, seq_lens, tree_mask, aux)

    def extend_step(self, input_ids: Tensor, positions: Tensor, req_rows: Tensor,
                    prefix_lens: Tensor, extend_lens: Tensor, tree_mask: Optional[Tensor] = None,
                    aux: Optional[Tensor] = None, last_only: bool = False):
        """extend's step function itself, for a compile_program program (as decode_step).
        last_only: the logits of each request's last row only, [B, 1, V], where the model can
        keep rows (`keeps_last_rows`); otherwise every row's, as without it."""
        return self._extend_step(input_ids, positions, req_rows, prefix_lens, extend_lens,
                                 tree_mask, aux, last_only and self.keeps_last_rows)

    def compile_program(self, method):
        """`method` (a bound method of an object that holds this Engine as `.engine` and calls
        its decode_step / extend_step) compiled as one graph like the steps: this engine's backend and
        options, fullgraph, static shapes, a private code object (one cache per program), and
        the guards on the engine's model and pool skipped (_skip_model_guards). Its tensor
        arguments must be inference tensors (_inference). Needs a compiled Engine."""
        if not self.compiled:
            raise ValueError("compile_program needs a compiled Engine (compile=True)")
        return torch.compile(_own_code(method), fullgraph=True, dynamic=False,
                             backend=self._backend, options=dict(self._guard_options))

    @torch.inference_mode()
    def run_program(self, program, *args):
        """Call a step program (compile_program's result, or its method uncompiled in eager)
        as the public steps call their graphs: the thread governor ticked, the tensor
        arguments as inference tensors (_inference)."""
        threads.tick()
        return program(*map(_inference, args))

    # -- public steps --------------------------------------------------------------------------
    def bucket_for(self, batch_size: int) -> int:
        for b in self.buckets:
            if b >= batch_size:
                return b
        raise ValueError(f"batch of {batch_size} exceeds max_batch {self.max_batch}")

    @torch.inference_mode()
    def extend(self, input_ids: Tensor, positions: Tensor, req_rows: Tensor, prefix_lens: Tensor,
               extend_lens: Tensor, tree_mask: Optional[Tensor] = None,
               aux: Optional[Tensor] = None):
        """One EXTEND step (a prefill chunk or a verify(N) pass); StepOutput(None, logits
        [B, T, V], hidden [B, T, k*H] or None)."""
        threads.tick()
        return self._extend_fn(*map(_inference, (input_ids, positions, req_rows, prefix_lens,
                                                 extend_lens, tree_mask, aux)))

    @torch.inference_mode()
    def verify(self, tokens: Tensor, positions: Tensor, req_rows: Tensor, seq_lens: Tensor,
               tree_mask: Tensor, aux: Optional[Tensor] = None):
        """Target pass over N draft-tree tokens per request (node 0 = the root), tokens and
        positions [B, N]; tree_mask QLEN_ONLY [B*N*N] bool or bit-packed [B*N]. The nodes' KV
        lands at positions [seq_len, seq_len + N) of each row and the prefix is exactly
        seq_len (kernels.md section 6). Returns StepOutput(argmax [B, N], logits [B, N, V],
        hidden [B, N, k*H] or None), as decode; the argmax is the decode step's own
        (torch's first index on ties). Its own graph per (bucket, N)."""
        threads.tick()
        return self._verify_fn(*map(_inference, (tokens, positions, req_rows, seq_lens,
                                                 tree_mask, aux)))

    @torch.inference_mode()
    def decode(self, tokens: Tensor, req_rows: Tensor, seq_lens: Tensor,
               aux: Optional[Tensor] = None):
        """One DECODE step; StepOutput(next tokens [B], logits [B, V], hidden [B, k*H] or
        None); aux [B, A] is the model's auxiliary input, if it takes one."""
        threads.tick()
        return self._decode_fn(*map(_inference, (tokens, req_rows, seq_lens, aux)))

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], req_rows: Tensor,
                aux: Optional[Tensor] = None) -> StepOutput:
        """Chunked prefill of right-padded ragged prompts: StepOutput(argmax [B], logits of
        each prompt's last token [B, V], captured hidden of every prompt position [B, P, k*H]
        (right-padded) or None). Row b of the (bucket-sized) batch holds prompts[b] or a
        padding request. aux [B, P, A] (P >= the longest prompt): the model's auxiliary input
        per position."""
        return self._prefill(prompts, req_rows, aux)

    @torch.inference_mode()
    def prefill_with_hidden(self, prompts: Sequence[Sequence[int]], req_rows: Tensor,
                            aux: Optional[Tensor] = None) -> StepOutput:
        """prefill of an engine that must capture hidden states (its `hidden` is never None)."""
        if self.capture_hidden is None:
            raise ValueError("prefill_with_hidden needs an Engine made with capture_hidden")
        return self._prefill(prompts, req_rows, aux)

    def _check_layout(self) -> None:
        """The compiled steps read the parameters without checking their shapes (model guards
        skipped, size_asserts off): refuse a model whose parameters changed layout since."""
        if not self.compiled:
            return
        now = _param_layout(self.model)
        if now != self._layout:
            changed = sorted({entry[0] for entry in set(now) ^ set(self._layout)})
            raise RuntimeError(f"the model's parameters changed shape, strides or dtype since this "
                               f"Engine compiled its steps ({', '.join(changed[:3])}): make a new "
                               "Engine")

    @torch.inference_mode()
    def prefill_chunk_step(self, input_ids: Tensor, positions: Tensor, req_rows: Tensor,
                           prefix_lens: Tensor, extend_lens: Tensor,
                           aux: Optional[Tensor] = None) -> StepOutput:
        """One prefill chunk (an EXTEND without a tree; the graph prefill runs for T =
        prefill_chunk): T tokens per request [B, T] after its cached prefix_lens, extend_lens
        [B] of them real (0: the row takes no part). Returns StepOutput(None, the logits of
        each request's last real row [B, V], hidden [B, T, k*H] or None)."""
        self._check_layout()  # every prefill path (chunked admission too) runs through here
        threads.tick()
        out = self._extend_fn(*map(_inference, (input_ids, positions, req_rows, prefix_lens,
                                                 extend_lens, None, aux)),
                              last_only=self.keeps_last_rows)
        logits = out.logits
        if logits.shape[1] > 1:  # every row's logits [B, T, V] -> row extend_len - 1
            bs = logits.shape[0]
            idx = (extend_lens - 1).clamp(min=0).view(bs, 1, 1)
            logits = logits.gather(1, idx.expand(bs, 1, logits.shape[-1]))
        return StepOutput(None, logits[:, 0], out.hidden)

    def _prefill(self, prompts, req_rows, aux):
        bs = req_rows.shape[0]
        lens = [len(p) for p in prompts] + [1] * (bs - len(prompts))
        chunk = self.prefill_chunk
        n_chunks = -(-max(lens) // chunk)
        ids = torch.zeros(bs, n_chunks * chunk, dtype=torch.int64)  # [B, chunks*C]
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = torch.as_tensor(p, dtype=torch.int64)
        if aux is not None:  # [B, chunks*C, A], zero-padded
            padded = aux.new_zeros(bs, n_chunks * chunk, aux.shape[-1])
            padded[:aux.shape[0], :min(aux.shape[1], n_chunks * chunk)] = aux[:, :n_chunks * chunk]
            aux = padded
        prompt_lens = torch.tensor(lens, dtype=torch.int64)  # [B]
        last = torch.zeros(bs, self.vocab_size, dtype=self.dtype)  # [B, V]
        hiddens = []
        t = torch.arange(chunk)
        for c in range(n_chunks):
            start = c * chunk
            prefix = prompt_lens.clamp(max=start)  # [B]
            ext = (prompt_lens - start).clamp(0, chunk)  # [B]
            positions = prefix.view(bs, 1) + t.view(1, chunk)  # [B, C]
            chunk_ids = ids[:, start:start + chunk].contiguous()  # [B, C]; strides are guarded
            chunk_aux = None if aux is None else aux[:, start:start + chunk].contiguous()
            _, logits, hidden = self.prefill_chunk_step(chunk_ids, positions, req_rows, prefix,
                                                        ext, chunk_aux)
            ends_here = (ext > 0) & (prefix + ext == prompt_lens)  # [B]
            last = torch.where(ends_here.view(bs, 1), logits.to(last.dtype), last)
            if hidden is not None:
                hiddens.append(hidden)
        return StepOutput(last.argmax(-1), last, torch.cat(hiddens, dim=1) if hiddens else None)

    def check_request(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """Refuse what would otherwise be silently misread: a max_new_tokens that is not an
        int, token ids that are not ints (a float id would be truncated) or lie outside the
        vocabulary; warn when a request runs past the model's max_position_embeddings
        (positions it was not trained on: the output degrades)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"argument 'max_new_tokens' must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 0:
            raise ValueError(f"argument 'max_new_tokens' must be >= 0, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if isinstance(p, torch.Tensor):
                if p.is_floating_point() or p.is_complex() or p.dtype == torch.bool:
                    raise ValueError(f"argument 'prompts': prompt {i} has dtype {p.dtype}, token "
                                     "ids must be integers")
                p = p.tolist()
            for t in p:
                if isinstance(t, bool) or not isinstance(t, int):
                    try:
                        t = operator.index(t)  # numpy ints and 0-d int tensors are fine
                    except TypeError:
                        raise ValueError(f"argument 'prompts': prompt {i} holds {t!r}, token ids "
                                         "must be ints") from None
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"argument 'prompts': token id {t} of prompt {i} lies "
                                     f"outside the vocabulary [0, {self.vocab_size})")
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and prompts:
            longest = max(len(p) for p in prompts)
            if longest + max(max_new_tokens, 0) > limit:
                warnings.warn(f"a request of {longest} prompt tokens + {max_new_tokens} new "
                              f"tokens runs past the model's max_position_embeddings ({limit}): "
                              "positions it was not trained on, expect degraded output",
                              stacklevel=3)

    def generate_stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                        eos_token_id: Optional[int] = None,
                        stats: Optional[GenerationStats] = None
                        ) -> Iterator[List[Optional[int]]]:
        """Greedy decoding; yields each request's next token per step ([len(prompts)], None
        for a request that has stopped: after its eos or at max_new_tokens) until every
        request has stopped. Runs the speculative loop without a proposer
        (speculative/plain.py), the one autoregressive path: each step is its decode program."""
        # Imported here: the speculative loop builds on this module.
        from specdec_inductor.speculative.plain import greedy_stream
        return greedy_stream(self, prompts, max_new_tokens, eos_token_id, stats)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 eos_token_id: Optional[int] = None,
                 stats: Optional[GenerationStats] = None) -> List[List[int]]:
        """Greedy new tokens per prompt; a request stops after (and including) eos."""
        out: List[List[int]] = [[] for _ in prompts]
        for step in self.generate_stream(prompts, max_new_tokens, eos_token_id, stats):
            for tokens, tok in zip(out, step):
                if tok is not None:
                    tokens.append(tok)
        return out
