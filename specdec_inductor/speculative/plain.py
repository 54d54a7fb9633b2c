"""Plain greedy decoding (Engine.generate / generate_stream) as the speculative loop without a
proposer: one autoregressive path. Each step is the loop's decode step (commit.GreedyStep's
decode program: the target's decode pass and the commit of its token as one graph), so plain
decoding, the baseline every method is held token-identical to, and a speculative run's
decode fallbacks are the same compiled program. This file only adds Engine.generate's
streaming shape and its GenerationStats."""
import time
from typing import Iterator, List, Optional, Sequence

from specdec_inductor.engine.engine import GenerationStats
from specdec_inductor.speculative.loop import SpeculativeGenerator


def greedy_stream(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  eos_token_id: Optional[int] = None,
                  stats: Optional[GenerationStats] = None) -> Iterator[List[Optional[int]]]:
    """Greedy decoding of `prompts` on `engine`: yields, per step, each request's new token
    (None for a request that has stopped: after its eos, or at max_new_tokens); the first
    yield is the prefill's token of every request. Ends when every request has stopped.
    stats gets prefill / decode times, token counts and each decode step's seconds."""
    engine.check_request(prompts, max_new_tokens)
    if max_new_tokens <= 0:
        return
    stats = stats if stats is not None else GenerationStats()
    loop = SpeculativeGenerator(engine, None)
    with loop.batch(len(prompts)) as batch:
        t0 = time.perf_counter()
        requests = loop.admit(batch, prompts, max_new_tokens, eos_token_id=eos_token_id)
        stats.prefill_s += time.perf_counter() - t0
        stats.prompt_tokens += sum(len(p) for p in prompts)
        stats.new_tokens += len(requests)
        yield [r.tokens[0] for r in requests]
        t_decode = time.perf_counter()
        while batch.live:
            t_step = time.perf_counter()
            emitted = loop.step(batch)
            stats.step_times.append(time.perf_counter() - t_step)
            made = sum(len(tokens) for tokens in emitted.values())
            stats.decode_steps += 1
            stats.new_tokens += made
            stats.decode_tokens += made
            yield [emitted[r][0] if emitted.get(r) else None for r in requests]
        stats.decode_s += time.perf_counter() - t_decode
