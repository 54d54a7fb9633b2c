"""The training loop of `specdec train-draft`: seeded batches of whole sequences, AdamW with
warmup + cosine decay, progress lines, a resumable trainer state every `save_every` steps, and
the final head written in its published checkpoint layout.

Objectives (as published): EAGLE -- feature regression (SmoothL1 of g_p against h_{p+1}) plus
0.1 x cross-entropy of the head's next-token distribution against the target's; EAGLE-3 --
cross-entropy against the target's distribution restricted to the draft vocabulary at every
unrolled step, weighted 0.8^s, positions whose target top-1 lies outside the draft vocabulary
masked out.
"""
import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec_inductor.train.data import DraftData
from specdec_inductor.train.heads import Eagle3Head, EagleHead, write_checkpoint

STATE_FILE = "trainer_state.pt"


@dataclass
class TrainConfig:
    method: str = "eagle"  # "eagle" | "eagle3"
    epochs: int = 4
    batch_size: int = 8  # sequences per step
    lr: float = 1e-3
    warmup: float = 0.05  # fraction of steps
    weight_decay: float = 0.0
    clip: float = 0.5
    seed: int = 0
    ttt_steps: int = 4  # EAGLE-3 unrolled draft steps
    noise: float = 0.2  # EAGLE: uniform feature noise amplitude (total width)
    save_every: int = 50
    # "bf16": the head's matmuls under CPU autocast (bf16 inputs, fp32 weights, optimizer
    # state and losses); "fp32": everything in fp32. command.py picks bf16 where the CPU has
    # bf16 matmul instructions (train_precision()).
    precision: str = "fp32"
    # Compile the soft cross-entropy with Inductor (one fused pass over the [B, T, V] logits
    # forward and one backward instead of a materialised fp32 log_softmax: +16% training
    # tokens/s for an EAGLE-3 head here, ~20 s of compiling). The CLI sets it unless --eager.
    compile_loss: bool = False
    # A head checkpoint to start from (a warm start; its own draft vocabulary and target
    # layers are kept) instead of a fresh head.
    init: Optional[str] = None

    def validate(self) -> None:
        if self.method not in ("eagle", "eagle3"):
            raise ValueError(f"argument 'method' must be 'eagle' or 'eagle3', got {self.method!r}")
        for name in ("epochs", "batch_size", "ttt_steps", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"argument '{name}' must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"argument 'lr' must be a finite number > 0, got {self.lr}")
        if self.precision not in ("bf16", "fp32"):
            raise ValueError(f"argument 'precision' must be 'bf16' or 'fp32', got {self.precision!r}")
        if self.init is not None and self.method != "eagle3":
            raise ValueError(f"argument 'init': a warm start needs method 'eagle3', got "
                             f"{self.method!r}")
        if self.init is not None and not os.path.isfile(os.path.join(self.init, "config.json")):
            raise ValueError(f"argument 'init': no config.json in {self.init!r}")


def train_precision(choice: str = "auto") -> str:
    """'auto' -> 'bf16' where oneDNN runs bf16 matmuls natively (avx512_bf16 or AMX), else
    'fp32' (emulated bf16 matmuls would be slower than fp32 ones)."""
    if choice != "auto":
        return choice
    return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"


def _pad(rows: List[Tensor], length: int) -> Tensor:
    out = rows[0].new_zeros((len(rows), length) + tuple(rows[0].shape[1:]))
    for b, r in enumerate(rows):
        out[b, :r.shape[0]] = r
    return out


# Batches per window of the batch order: a window's sequences are sorted by length before they
# are cut into batches, so a batch pads to a length close to its sequences' own.
LENGTH_WINDOW = 16


def _batch_order(lengths: List[int], batch_size: int, seed: int, epoch: int) -> List[List[int]]:
    """The epoch's batches of sequence indices: a seeded shuffle, cut into windows of
    LENGTH_WINDOW batches, each window sorted by length (stable) and cut into batches, and the
    batches shuffled again. Every sequence appears once per epoch."""
    gen = torch.Generator().manual_seed(seed * 1000 + epoch)
    n = len(lengths)
    perm = torch.randperm(n, generator=gen).tolist()
    window = LENGTH_WINDOW * batch_size
    batches = []
    for w in range(0, n, window):
        part = sorted(perm[w:w + window], key=lambda i: lengths[i])
        batches += [part[i:i + batch_size] for i in range(0, len(part), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]


def _soft_ce(logits: Tensor, ids: Tensor, probs: Tensor) -> Tensor:
    """-sum_k probs[..., k] * log_softmax(logits)[ids[..., k]] per row: logits [..., V],
    ids / probs [..., K] -> [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.gather(-1, ids) * probs).sum(-1)


_compiled_soft_ce = None


def soft_ce_fn(compiled: bool) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """_soft_ce, or its Inductor compilation (dynamic shapes: one graph for every batch)."""
    global _compiled_soft_ce
    if not compiled:
        return _soft_ce
    if _compiled_soft_ce is None:
        _compiled_soft_ce = torch.compile(_soft_ce, dynamic=True, fullgraph=True)
    return _compiled_soft_ce


@torch.no_grad()
def _top1_accuracy(logits: Tensor, want: Tensor, mask: Tensor) -> float:
    """How often logits' top-1 [..., V] is `want` [...] over the rows `mask` [...] selects."""
    return float((logits[mask].argmax(-1) == want[mask]).float().mean())


def eagle_loss(head: EagleHead, data: DraftData, idx: List[int], noise: float,
               gen: torch.Generator, with_acc: bool = True, soft_ce=_soft_ce
               ) -> Tuple[Tensor, Dict[str, float]]:
    lens = [int(data.tokens[i].numel()) - 1 for i in idx]  # pairs (x_{p+1}, h_p) per sequence
    t = max(lens)
    nxt = _pad([data.tokens[i][1:] for i in idx], t)  # [B, T]
    # Features may be stored in bf16 (DraftData.precision); the losses work in fp32.
    feats = _pad([data.final[i][:-1] for i in idx], t).float()  # [B, T, H]
    want = _pad([data.final[i][1:] for i in idx], t).float()  # [B, T, H]
    ids = _pad([data.label_ids[i][1:] for i in idx], t)  # [B, T, K]
    probs = _pad([data.label_probs[i][1:] for i in idx], t)  # [B, T, K]
    valid = torch.arange(t).view(1, t) < torch.tensor(lens).view(-1, 1)  # [B, T]
    scored = valid  # rows whose cross-entropy counts
    if head.draft_vocab is not None:
        ids, probs, label_ok = _draft_labels(head.target_to_draft, ids, probs)
        scored = valid & label_ok
    if noise:
        feats = feats + (torch.rand(feats.shape, generator=gen) - 0.5) * noise
    g = head(nxt, feats)  # [B, T, H]
    reg = F.smooth_l1_loss(g, want, reduction="none").mean(-1)  # [B, T]
    logits = head.logits(g)  # [B, T, Vd]
    ce = soft_ce(logits, ids, probs)  # [B, T]
    n = valid.sum()
    loss = (reg[valid].sum() + 0.1 * ce[scored].sum()) / n
    stats = {"reg": float(reg[valid].mean().detach()), "ce": float(ce[scored].mean().detach()),
             "tokens": int(n)}
    if with_acc:
        stats["acc"] = _top1_accuracy(logits, ids[..., 0], scored)
    return loss, stats


def _draft_labels(target_to_draft: Tensor, ids: Tensor, probs: Tensor
                  ) -> Tuple[Tensor, Tensor, Tensor]:
    """Soft labels over target ids (ids / probs [..., K]) as labels over a draft vocabulary:
    draft ids (0 where outside it), probs renormalized over the ids inside it, and whether the
    target's top-1 is inside it [...] (the rows a head restricted to the vocabulary can get
    right)."""
    ids_d = target_to_draft[ids]  # -1 outside the draft vocab
    inside = ids_d >= 0
    probs = probs * inside
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-9)
    return ids_d.clamp(min=0), probs, inside[..., 0]


def eagle3_loss(head: Eagle3Head, data: DraftData, idx: List[int], steps: int,
                with_acc: bool = True, soft_ce=_soft_ce) -> Tuple[Tensor, Dict[str, float]]:
    lens = [int(data.tokens[i].numel()) for i in idx]
    t = max(lens)
    tokens = _pad([data.tokens[i] for i in idx], t)  # [B, T]
    feats = _pad([data.feats[i] for i in idx], t).float()  # [B, T, 3H] (bf16 data: fp32 here)
    ids_t = _pad([data.label_ids[i] for i in idx], t)  # [B, T, K] target ids
    probs = _pad([data.label_probs[i] for i in idx], t)  # [B, T, K]
    ids_d, probs, label_ok = _draft_labels(head.target_to_draft, ids_t, probs)  # [B, T, K] / [B, T]
    lens_t = torch.tensor(lens).view(-1, 1)
    logits = head(tokens, feats, steps)
    loss, total_w, stats = 0.0, 0.0, {}
    for s, lg in enumerate(logits):
        # index i at step s predicts token i+s+2: the label row is i+s+1.
        rows = torch.arange(t) + s + 1  # [T]
        valid = rows.view(1, t) < lens_t  # [B, T]
        rows = rows.clamp(max=t - 1)
        lid, lp, ok = ids_d[:, rows], probs[:, rows], label_ok[:, rows]  # [B, T, K] / [B, T]
        mask = valid & ok
        ce = soft_ce(lg, lid, lp)  # [B, T]
        w = 0.8 ** s
        n = mask.sum().clamp(min=1)
        loss = loss + w * ce[mask].sum() / n
        total_w += w
        if with_acc:
            stats[f"acc{s}"] = _top1_accuracy(lg, lid[..., 0], mask)
        if s == 0:
            stats["tokens"] = int(mask.sum())
            stats["ce"] = float(ce[mask].mean().detach())
    return loss / total_w, stats


def draft_vocabulary(target, data: DraftData, draft_vocab_size: int) -> Tensor:
    """The draft_vocab_size most frequent target ids of the data, ascending [Vd]."""
    counts = data.token_counts(target.config.vocab_size)
    size = min(draft_vocab_size, target.config.vocab_size)
    return counts.topk(size).indices.sort().values


def make_head(target, data: DraftData, cfg: TrainConfig, draft_vocab_size: int):
    torch.manual_seed(cfg.seed)
    if cfg.init is not None:
        return warm_start_head(target, data, cfg)
    vocab = draft_vocabulary(target, data, draft_vocab_size)
    if cfg.method == "eagle":
        return EagleHead(target, vocab)
    return Eagle3Head(target, vocab, data.layers)


def warm_start_head(target, data: DraftData, cfg: TrainConfig) -> Eagle3Head:
    """The EAGLE-3 head in checkpoint cfg.init as a training module: its weights, its draft
    vocabulary (the target ids of its d2t) and the target layers it reads, which the data must
    carry."""
    from specdec_inductor.proposers.eagle import _read_state_dict
    from specdec_inductor.proposers.eagle3 import eagle3_target_layers
    cfg.validate()
    with open(os.path.join(cfg.init, "config.json")) as f:
        raw = json.load(f)
    layers = eagle3_target_layers(raw, target.config.num_hidden_layers, cfg.init)
    if list(data.layers) != layers:
        raise ValueError(f"argument 'init': the head reads target layers {layers}, the data "
                         f"carries {list(data.layers)}")
    sd = _read_state_dict(cfg.init)
    if "d2t" not in sd:
        raise ValueError(f"argument 'init': {cfg.init!r} is no EAGLE-3 head (no d2t)")
    d2t = sd["d2t"].long()
    head = Eagle3Head(target, torch.arange(d2t.numel()) + d2t, layers)
    own = head.published_state_dict()
    wrong = [k for k in own if k not in sd or sd[k].shape != own[k].shape]
    if wrong:
        raise ValueError(f"argument 'init': {cfg.init!r} does not fit this target's head "
                         f"({wrong[:3]} missing or shaped otherwise)")
    head.load_state_dict({k: sd[k].to(own[k].dtype) for k in own}, strict=False)
    return head


def train_head(target, data: DraftData, out_dir: str, cfg: TrainConfig, *,
               draft_vocab_size: int = 8192, resume: bool = False,
               progress: Callable[[str], None] = print, log_every: int = 10):
    """Train a head on `data` and write it to `out_dir` (published layout, bf16); returns it."""
    cfg.validate()
    for p in target.parameters():
        p.requires_grad_(False)
    head = make_head(target, data, cfg, draft_vocab_size)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(len(data) / cfg.batch_size)
    total = per_epoch * cfg.epochs
    warm = max(1, int(cfg.warmup * total))

    def lr_at(step: int) -> float:
        if step < warm:
            return cfg.lr * (step + 1) / warm
        frac = (step - warm) / max(1, total - warm)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    step, noise_gen = 0, torch.Generator().manual_seed(cfg.seed + 1)
    state_path = os.path.join(out_dir, STATE_FILE)
    if resume and os.path.exists(state_path):
        st = torch.load(state_path, weights_only=False)
        # How the loss is computed (compiled or not) does not change the training run.
        same = {k: v for k, v in st["config"].items() if k != "compile_loss"}
        if same != {k: v for k, v in asdict(cfg).items() if k != "compile_loss"}:
            raise ValueError(f"argument 'resume': {state_path} was written with another training "
                             f"configuration ({st['config']}); use a fresh --out directory")
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["optimizer"])
        noise_gen.set_state(st["noise_rng"])
        step = st["step"]
        progress(f"[train] resumed at step {step}/{total}")
    os.makedirs(out_dir, exist_ok=True)

    def save_state():
        tmp = state_path + ".tmp"
        torch.save({"config": asdict(cfg), "head": head.state_dict(), "optimizer": opt.state_dict(),
                    "noise_rng": noise_gen.get_state(), "step": step}, tmp)
        os.replace(tmp, state_path)

    head.train()
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if cfg.precision == "bf16"
                else contextlib.nullcontext())
    ce = soft_ce_fn(cfg.compile_loss)
    lengths = [int(t.numel()) for t in data.tokens]
    order = None  # (epoch, its batches)
    t0, tokens_seen, start_step = time.perf_counter(), 0, step
    while step < total:
        epoch, k = divmod(step, per_epoch)
        if order is None or order[0] != epoch:
            order = (epoch, _batch_order(lengths, cfg.batch_size, cfg.seed, epoch))
        idx = order[1][k]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        # Top-1 accuracies only for the progress lines (an argmax over the logits costs ~8% of
        # a step).
        log = (step + 1) % log_every == 0 or step + 1 == total
        with autocast:
            if cfg.method == "eagle":
                loss, stats = eagle_loss(head, data, idx, cfg.noise, noise_gen, with_acc=log,
                                         soft_ce=ce)
            else:
                loss, stats = eagle3_loss(head, data, idx, cfg.ttt_steps, with_acc=log, soft_ce=ce)
        if not torch.isfinite(loss.detach()):
            raise FloatingPointError(f"training diverged at step {step}: the loss is "
                                     f"{loss.item()}; lower --lr (now {cfg.lr})")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        if not torch.isfinite(norm):
            raise FloatingPointError(f"training diverged at step {step}: the gradient norm is "
                                     f"{norm.item()}; lower --lr (now {cfg.lr})")
        opt.step()
        step += 1
        tokens_seen += stats["tokens"]
        if log:
            el = time.perf_counter() - t0
            eta = el / (step - start_step) * (total - step)
            accs = " ".join(f"{k}={v:.3f}" for k, v in stats.items() if k.startswith(("acc", "reg", "ce")))
            progress(f"[train] epoch {epoch + 1}/{cfg.epochs} step {step}/{total} "
                     f"loss={loss.item():.4f} {accs} {tokens_seen / el:.0f} tok/s eta {eta:.0f} s")
        if step % cfg.save_every == 0 or step == total:
            save_state()
    head.eval()
    bad = [name for name, p in head.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:  # never write a head that cannot draft
        raise FloatingPointError(f"training produced non-finite weights ({', '.join(bad[:3])}); "
                                 f"lower --lr (now {cfg.lr})")
    write_checkpoint(head, out_dir)
    if cfg.method == "eagle":
        # The head's draft vocabulary (proposers/eagle.py): the data's most frequent ids, as an
        # EAGLE-3 head's; the published layout itself stays the full-vocabulary one.
        from specdec_inductor.proposers.eagle import write_draft_vocab
        write_draft_vocab(out_dir, head.draft_vocab)
    return head
