"""EAGLE heads (proposers/eagle.py): checkpoints in the published EAGLE-1/2 layout (config.json
+ one state dict: fc over [embed ; hidden], layers.0 without its input norm) load through the
real loader; wrong checkpoints (EAGLE-3 layout, missing keys, wrong width) are refused by name;
the proposer's drafts equal a from-scratch recomputation of the head over the committed tokens
and the target's hidden states (which pins draft extend and KV bookkeeping); greedy EAGLE output
equals the target's plain greedy output (batch 1, ragged batch, sampled with seeds, compiled);
both pools end fully free."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine  # noqa: E402
from specdec_inductor.proposers.eagle import (  # noqa: E402
    EagleCheckpointError, EagleProposer, load_eagle_head)
from specdec_inductor.sampler import SamplingParams  # noqa: E402
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats  # noqa: E402
from specdec_inductor.testing import write_random_eagle_checkpoint  # noqa: E402

VOCAB, HIDDEN = 96, 32


def tiny_target(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def write_eagle_checkpoint(path, seed=1, bias=True, fmt="bin", scale=0.3):
    return write_random_eagle_checkpoint(str(path), tiny_target().config, seed=seed, scale=scale,
                                         bias=bias, fmt=fmt)


def prompts(count, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4 + 5 * i,), generator=gen).tolist() for i in range(count)]


def _engines(target, head, batch, compiled=False):
    engine = Engine(target, max_batch=batch, max_len=128, compile=compiled, prefill_chunk=16,
                    capture_hidden=[-1])
    draft = Engine(head, max_batch=batch, max_len=128, compile=compiled, prefill_chunk=8,
                   capture_hidden=[-1])
    return engine, draft


def _free(*engines):
    for e in engines:
        e.pool.check_consistent()
        assert e.pool.num_free_slots == e.pool.num_slots and not e.pool.live_requests


def reference_chain(target, head, committed, k):
    """The head's greedy chain after `committed` tokens, recomputed from scratch with plain
    HF attention: pairs (x_{p+1}, h_p) for every committed position but the root's."""
    impl = head.config._attn_implementation
    head.config._attn_implementation = "sdpa"
    target.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad():
            h = target(torch.tensor([committed]), output_hidden_states=True).hidden_states[-1][0]
            ids, hid, chain = list(committed[1:]), h[:-1], []
            for _ in range(k):
                out = head(input_ids=torch.tensor([ids]),
                           position_ids=torch.arange(len(ids)).view(1, -1), aux_hidden=hid[None])
                d = int(out.logits[0, -1].argmax())
                chain.append(d)
                ids.append(d)
                hid = torch.cat([hid, out.hidden_states[0][0, -1:]])
        return chain
    finally:
        head.config._attn_implementation = impl
        target.config._attn_implementation = "specdec"


@pytest.mark.parametrize("fmt,bias", [("bin", True), ("safetensors", False)])
def test_drafts_equal_a_from_scratch_recomputation(tmp_path, fmt, bias):
    target = tiny_target()
    write_eagle_checkpoint(tmp_path, bias=bias, fmt=fmt)
    head = load_eagle_head(str(tmp_path), target)
    assert (head.fc.bias is not None) == bias
    engine, draft = _engines(target, head, 1)
    proposer = EagleProposer(draft, 5)
    seen = []
    propose = proposer.propose

    def recording(request_ids, seq_lens):
        tree = propose(request_ids, seq_lens)
        seen.append(tree.tokens[0].tolist())
        return tree

    proposer.propose = recording
    spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
    spec.draft_in_program = False  # record by propose (the step program drafts the same chains)
    p = prompts(1)[0]
    out = spec.generate([p], 20)[0]
    assert out == engine.generate([p], 20)[0]
    committed = list(p) + [out[0]]
    emitted = iter(out[1:])
    assert len(seen) >= 3  # the chains were recorded (drafted by propose)
    for tokens in seen:  # each step's root is the last committed token
        assert tokens[0] == committed[-1]
        assert tokens[1:] == reference_chain(target, head, committed, 4), len(committed)
        # advance by what the step emitted: accepted drafts then the bonus
        step = []
        for d in tokens[1:]:
            nxt = next(emitted, None)
            if nxt is None:
                break
            step.append(nxt)
            if nxt != d:
                break
        else:
            nxt = next(emitted, None)
            if nxt is not None:
                step.append(nxt)
        committed += step
    _free(engine, draft)


def test_greedy_ragged_batch_and_sampling(tmp_path):
    target = tiny_target(1)
    write_eagle_checkpoint(tmp_path, seed=4)
    head = load_eagle_head(str(tmp_path), target)
    engine, draft = _engines(target, head, 3)
    spec = SpeculativeGenerator(engine, EagleProposer(draft, 4), min_accepted=0.0)
    ps = prompts(3)
    stats = SpeculativeStats()
    assert spec.generate(ps, 24, stats=stats) == engine.generate(ps, 24)
    assert stats.verify_steps > stats.decode_steps
    params = [SamplingParams(0.8, seed=1), SamplingParams(), SamplingParams(1.2, top_p=0.9, seed=2)]
    first = spec.generate(ps, 16, sampling=params)
    assert first == spec.generate(ps, 16, sampling=params)
    assert first[1] == engine.generate(ps, 16)[1]
    for max_new in (1, 2, 3):
        assert spec.generate(ps, max_new, eos_token_id=7) == engine.generate(ps, max_new, eos_token_id=7)
    _free(engine, draft)


def test_compiled_eagle_is_exact_without_recompiles(tmp_path):
    target = tiny_target(2)
    write_eagle_checkpoint(tmp_path, seed=5)
    head = load_eagle_head(str(tmp_path), target)
    engine, draft = _engines(target, head, 2, compiled=True)
    spec = SpeculativeGenerator(engine, EagleProposer(draft, 4), min_accepted=0.0)
    ps = prompts(2)
    assert spec.generate(ps, 12) == engine.generate(ps, 12)
    with torch.compiler.set_stance("fail_on_recompile"):
        ps2 = prompts(2, seed=8)
        assert spec.generate(ps2, 14) == engine.generate(ps2, 14)
    _free(engine, draft)


def test_eagle3_checkpoint_is_refused(tmp_path):
    target = tiny_target()
    sd = write_eagle_checkpoint(tmp_path)
    sd = {k.replace("layers.0.", "midlayer."): v for k, v in sd.items()}
    sd["d2t"] = torch.zeros(16, dtype=torch.int64)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EagleCheckpointError, match="EAGLE-3 checkpoint"):
        load_eagle_head(str(tmp_path), target)


def test_bad_checkpoints_are_refused(tmp_path):
    target = tiny_target()
    with pytest.raises(EagleCheckpointError, match="no config.json"):
        load_eagle_head(str(tmp_path), target)
    sd = write_eagle_checkpoint(tmp_path)
    del sd["layers.0.mlp.up_proj.weight"]
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(EagleCheckpointError, match="missing.*up_proj"):
        load_eagle_head(str(tmp_path), target)
    sd = write_eagle_checkpoint(tmp_path)
    sd["fc.weight"] = torch.zeros(HIDDEN, 3 * HIDDEN)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(EagleCheckpointError, match="fc.weight has shape"):
        load_eagle_head(str(tmp_path), target)
    sd = write_eagle_checkpoint(tmp_path)
    sd["layers.1.mlp.up_proj.weight"] = torch.zeros(1)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(EagleCheckpointError, match="unexpected keys"):
        load_eagle_head(str(tmp_path), target)


def _recorded(spec, ps, max_new):
    """(output, the proposer's draft trees' tokens step by step) of spec.generate(ps), every
    tree drafted by propose (not inside the step program, which drafts the same trees:
    test_speculative's test_drafting_inside_the_step_program_keeps_trees_and_tokens)."""
    spec.draft_in_program = False
    proposer, trees = spec.proposer, []
    propose = proposer.propose

    def record(*args, **kwargs):
        tree = propose(*args, **kwargs)
        trees.append(tree.tokens.clone())
        return tree
    proposer.propose = record
    try:
        return spec.generate(ps, max_new), trees
    finally:
        proposer.propose = propose


@pytest.mark.parametrize("topk,depth,n", [(1, None, 5), (2, 3, 6)])
def test_draft_vocabulary_narrows_the_lm_head_and_stays_exact(tmp_path, topk, depth, n):
    """A draft_vocab.safetensors beside the checkpoint gives the head an LM head over those
    target rows only: its logits are the full head's logits at those columns, an Engine over it
    reports the narrow vocabulary, and its chains and trees, mapped back to target ids, are
    exactly those of the full head with every other id masked out (which a column / id mix-up
    would break); greedy output equals plain decoding; full_vocab=True ignores the file."""
    from specdec_inductor.engine.hf import model_shape
    from specdec_inductor.proposers.eagle import write_draft_vocab
    target = tiny_target(1)
    write_eagle_checkpoint(tmp_path, seed=4)
    vocab = torch.tensor([i for i in range(VOCAB) if i % 3 != 1])
    write_draft_vocab(str(tmp_path), vocab)
    head = load_eagle_head(str(tmp_path), target)
    assert torch.equal(head.draft_to_target, vocab) and head.lm_head.weight.shape[0] == vocab.numel()
    assert model_shape(head).vocab_size == vocab.numel()
    masked = load_eagle_head(str(tmp_path), target, full_vocab=True)
    assert masked.draft_to_target is None
    x, pos, aux = torch.tensor([prompts(1)[0][1:4]]), torch.arange(3).view(1, -1), torch.randn(1, 3, HIDDEN)
    with torch.no_grad():
        narrow = head(input_ids=x, position_ids=pos, aux_hidden=aux).logits
        wide = masked(input_ids=x, position_ids=pos, aux_hidden=aux).logits
    torch.testing.assert_close(narrow, wide[..., vocab])
    # The full head with the ids outside the vocabulary pushed to -1e4: the same drafts.
    lm = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
    with torch.no_grad():
        lm.weight.copy_(target.lm_head.weight)
        lm.bias.fill_(-1e4)
        lm.bias[vocab] = 0.0
    masked.lm_head = lm
    runs = []
    for h in (head, masked):
        engine = Engine(target, max_batch=2, max_len=128, compile=False, prefill_chunk=16,
                        capture_hidden=[-1])
        draft = Engine(h, max_batch=2 * (1 + topk), max_len=128 + topk * (depth or 0),
                       compile=False, prefill_chunk=8, capture_hidden=[-1])
        spec = SpeculativeGenerator(engine, EagleProposer(draft, n, topk=topk, depth=depth),
                                    min_accepted=0.0)
        ps = prompts(2)
        out, trees = _recorded(spec, ps, 20)
        assert out == engine.generate(ps, 20)
        runs.append(trees)
        _free(engine, draft)
    assert len(runs[0]) == len(runs[1]) > 3
    for a, b in zip(*runs):
        assert torch.equal(a, b)
        assert bool(torch.isin(a[:, 1:], vocab).all())  # drafts are target ids of the vocabulary


@pytest.mark.parametrize("narrow", [True, False])
def test_bf16_head_keeps_the_target_in_fp32_drafts_close_and_stays_exact(tmp_path, narrow):
    """load_eagle_head(dtype=bf16): the head's own weights (fc, its layer, a narrowed LM head)
    in bf16 and first among its parameters (the Engine takes its dtype from there), the shared
    target embedding and full LM head left in fp32; its logits are the fp32 head's within bf16
    error; drafting with it keeps greedy output exact (eager; compiled with the narrowed head)
    and the pools free."""
    from specdec_inductor.proposers.eagle import write_draft_vocab
    target = tiny_target(1)
    write_eagle_checkpoint(tmp_path, seed=4)
    vocab = torch.tensor([i for i in range(VOCAB) if i % 3 != 1])
    if narrow:
        write_draft_vocab(str(tmp_path), vocab)
    head = load_eagle_head(str(tmp_path), target, dtype=torch.bfloat16)
    ref = load_eagle_head(str(tmp_path), target)
    assert next(head.parameters()).dtype == torch.bfloat16
    assert head.fc.weight.dtype == head.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert target.model.embed_tokens.weight.dtype == target.lm_head.weight.dtype == torch.float32
    assert head.lm_head.weight.dtype == (torch.bfloat16 if narrow else torch.float32)
    assert (head.lm_head is target.lm_head) == (not narrow)
    x, pos, aux = torch.tensor([prompts(1)[0][1:4]]), torch.arange(3).view(1, -1), torch.randn(1, 3, HIDDEN)
    with torch.no_grad():
        low = head(input_ids=x, position_ids=pos, aux_hidden=aux).logits
        high = ref(input_ids=x, position_ids=pos, aux_hidden=aux).logits
    torch.testing.assert_close(low.float(), high, atol=5e-2, rtol=5e-2)
    for compiled in (False, True) if narrow else (False,):  # one compile keeps CI short
        engine = Engine(target, max_batch=2, max_len=128, compile=compiled, prefill_chunk=16,
                        capture_hidden=[-1])
        draft = Engine(head, max_batch=2 * 3, max_len=128 + 2 * 3, compile=compiled,
                       prefill_chunk=8, capture_hidden=[-1])
        assert draft.dtype == torch.bfloat16
        spec = SpeculativeGenerator(engine, EagleProposer(draft, 6, topk=2, depth=3),
                                    min_accepted=0.0)
        stats = SpeculativeStats()
        ps = prompts(2)
        assert spec.generate(ps, 20, None, stats) == engine.generate(ps, 20)
        assert stats.accepted_drafts > 0
        _free(engine, draft)
    with pytest.raises(ValueError, match="'dtype'"):
        load_eagle_head(str(tmp_path), target, dtype=torch.float16)


def test_bad_draft_vocabularies_are_refused(tmp_path):
    from safetensors.torch import save_file
    from specdec_inductor.proposers.eagle import DRAFT_VOCAB_FILE
    target = tiny_target()
    write_eagle_checkpoint(tmp_path)
    for bad in [{"draft_to_target": torch.tensor([3, 1, 2])},  # not ascending
                {"draft_to_target": torch.tensor([1, 1, 2])},  # repeated
                {"draft_to_target": torch.tensor([0, VOCAB])},  # out of range
                {"draft_to_target": torch.tensor([0.0, 1.0])},  # not ids
                {"draft_to_target": torch.zeros(0, dtype=torch.int64)},  # empty
                {"d2t": torch.tensor([0, 1])}]:  # wrong name
        save_file(bad, str(tmp_path / DRAFT_VOCAB_FILE))
        with pytest.raises(EagleCheckpointError, match="draft_to_target"):
            load_eagle_head(str(tmp_path), target)


def test_loop_refuses_a_target_without_hidden_capture(tmp_path):
    target = tiny_target()
    write_eagle_checkpoint(tmp_path)
    head = load_eagle_head(str(tmp_path), target)
    _, draft = _engines(target, head, 1)
    plain = Engine(target, max_batch=1, max_len=64, compile=False)
    spec = SpeculativeGenerator(plain, EagleProposer(draft, 4))
    with pytest.raises(ValueError, match="capture_hidden"):
        spec.generate(prompts(1), 4)
    with pytest.raises(ValueError, match="draft_engine"):
        EagleProposer(plain, 4)


def _target_hidden(target, tokens):
    """Final normed hidden of every position of `tokens` (plain HF attention)."""
    impl = target.config._attn_implementation
    target.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad():
            return target(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    finally:
        target.config._attn_implementation = impl


@pytest.mark.parametrize("accepted", [[2, 4, 0, 3], [4, 4, 1], [0, 0, 2]])
def test_commits_with_accepted_paths_keep_the_draft_in_step(tmp_path, accepted):
    """Drive the proposer directly through steps that accept `accepted[i]` drafts (a random
    head is rarely right, so the loop alone seldom commits multi-token paths): after each
    commit the next chain must equal the from-scratch recomputation."""
    target = tiny_target()
    write_eagle_checkpoint(tmp_path)
    head = load_eagle_head(str(tmp_path), target)
    _, draft = _engines(target, head, 1)
    k = 4
    proposer = EagleProposer(draft, k + 1)
    prompt = prompts(1)[0]
    committed = list(prompt) + [17]
    h = _target_hidden(target, committed)
    proposer.start([0], [committed], [h[:len(prompt)]])
    bonus = 40
    for a in accepted:
        tree = proposer.propose([0], torch.tensor([len(committed) - 1]))
        chain = tree.tokens[0, 1:].tolist()
        assert tree.tokens[0, 0] == committed[-1]
        assert chain == reference_chain(target, head, committed, k), (a, len(committed))
        emitted = chain[:a] + [bonus + a]  # a accepted drafts, then a bonus
        root_pos = len(committed) - 1
        h = _target_hidden(target, committed + chain[:a])
        proposer.commit([0], [emitted], [h[root_pos:root_pos + a + 1]])
        committed += emitted
    tree = proposer.propose([0], torch.tensor([len(committed) - 1]))
    assert tree.tokens[0, 1:].tolist() == reference_chain(target, head, committed, k)
    proposer.finish([0])
    _free(draft)
