"""`GET /metrics` of `specdec serve` in the Prometheus text format (version 0.0.4): request and
token counters, tokens/s over a sliding window, time-to-first-token and inter-token-latency
histograms, and gauges read from the scheduler when scraped (queue depth, running requests,
KV pool use, mean accepted length and acceptance by position per method).

Counters and histograms are written by the scheduler thread only; a scrape reads them from
another thread (plain reads of numbers, so a scrape may see a step half counted, never a
broken value). Inter-token latency is per token: a step that hands a request k tokens after
a gap g counts k latencies of g / k (speculation emits several tokens per step).
"""
import bisect
import collections
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

PREFIX = "specdec"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                   20.48, 40.96)
RATE_WINDOW_S = 10.0


def _labels(labels: Dict[str, object]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return "{" + inner + "}"


def _family(name: str, kind: str, help_: str,
            samples: Iterable[Tuple[str, Dict[str, object], float]]) -> List[str]:
    lines = [f"# HELP {PREFIX}_{name} {help_}", f"# TYPE {PREFIX}_{name} {kind}"]
    lines += [f"{PREFIX}_{name}{suffix}{_labels(labels)} {_number(value)}"
              for suffix, labels, value in samples]
    return lines


def _number(value: float) -> str:
    if value != value:  # NaN
        return "NaN"
    return repr(float(value)) if isinstance(value, float) else str(value)


class Histogram:
    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS):
        self.buckets = list(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one: above every bucket
        self.sum, self.count = 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def samples(self):
        running = 0
        for bound, n in zip(self.buckets + [float("inf")], self.counts):
            running += n
            yield "_bucket", {"le": "+Inf" if bound == float("inf") else repr(bound)}, running
        yield "_sum", {}, self.sum
        yield "_count", {}, self.count


class Metrics:
    """What the scheduler and the HTTP layer count; render(scheduler) writes the page."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.outcomes: Dict[str, int] = collections.Counter()  # finish reasons
        self.http_errors: Dict[int, int] = collections.Counter()  # status -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self._recent: collections.deque = collections.deque()  # (time, tokens)

    # -- the scheduler thread --------------------------------------------------------------------
    def tokens_delivered(self, request, n: int, now: float) -> None:
        if request.first_token_at is None:
            self.ttft.observe(now - request.arrival)
            self.prompt_tokens += len(request.prompt)
            if n > 1:
                self.itl.observe(0.0, n - 1)  # tokens that came with the first one
        else:
            self.itl.observe((now - request.last_token_at) / n, n)
        self.generation_tokens += n
        self._recent.append((now, n))
        while self._recent[0][0] < now - RATE_WINDOW_S:  # pruned here only (one writer)
            self._recent.popleft()

    def request_ended(self, reason: str) -> None:
        self.outcomes[reason] += 1

    # -- the HTTP layer ------------------------------------------------------------------------
    def http_error(self, status: int) -> None:
        self.http_errors[status] += 1

    def tokens_per_s(self, now: Optional[float] = None) -> float:
        """Tokens handed out per second over the last RATE_WINDOW_S seconds."""
        now = self.clock() if now is None else now
        return sum(n for t, n in list(self._recent) if t >= now - RATE_WINDOW_S) / RATE_WINDOW_S

    def render(self, scheduler) -> str:
        lines: List[str] = []
        lines += _family("requests_total", "counter", "Requests ended, by finish reason "
                         "(stop, length, cancelled, error).",
                         [("", {"outcome": k}, v) for k, v in sorted(self.outcomes.items())])
        lines += _family("http_errors_total", "counter", "Requests refused, by HTTP status.",
                         [("", {"status": k}, v) for k, v in sorted(self.http_errors.items())])
        lines += _family("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
                         [("", {}, self.prompt_tokens)])
        lines += _family("generation_tokens_total", "counter", "Tokens handed out.",
                         [("", {}, self.generation_tokens)])
        lines += _family("generation_tokens_per_second", "gauge",
                         f"Tokens handed out per second over the last {RATE_WINDOW_S:g} s.",
                         [("", {}, self.tokens_per_s())])
        lines += _family("time_to_first_token_seconds", "histogram",
                         "Arrival to first token, per request.", self.ttft.samples())
        lines += _family("inter_token_latency_seconds", "histogram",
                         "Time between a request's tokens, per token.", self.itl.samples())
        lines += _scheduler_gauges(scheduler)
        return "\n".join(lines) + "\n"


def _scheduler_gauges(scheduler) -> List[str]:
    lines = _family("queue_depth", "gauge", "Requests waiting for admission.",
                    [("", {}, scheduler.queue_depth)])
    lines += _family("running_requests", "gauge", "Requests decoding, per method (lane).",
                     [("", {"method": l.method}, l.running_count) for l in scheduler.lanes])
    pools = list(zip(("target", "draft"), scheduler.kv_pools()))
    lines += _family("kv_slots_used", "gauge", "KV pool slots held by requests.",
                     [("", {"pool": n}, p.num_slots - p.num_free_slots) for n, p in pools])
    lines += _family("kv_slots_total", "gauge", "KV pool slots.",
                     [("", {"pool": n}, p.num_slots) for n, p in pools])
    lines += _family("kv_pool_usage_ratio", "gauge", "Fraction of the KV pool's slots in use.",
                     [("", {"pool": n}, 1.0 - p.num_free_slots / p.num_slots) for n, p in pools])
    stats = [(l.method, l.stats) for l in scheduler.lanes]
    lines += _family("mean_accepted_length", "gauge", "Tokens per request per step (accepted "
                     "drafts + the bonus), per method.",
                     [("", {"method": m}, s.mean_accepted_length) for m, s in stats])
    lines += _family("acceptance_rate", "gauge", "Fraction of request steps that accepted a "
                     "draft at this depth, per method.",
                     [("", {"method": m, "position": k}, a) for m, s in stats
                      for k, a in enumerate(s.acceptance_by_position)])
    lines += _family("steps_total", "counter", "Batch steps, per method (lane).",
                     [("", {"method": m}, s.verify_steps) for m, s in stats])
    return lines
