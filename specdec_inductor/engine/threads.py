"""Thread governor: the OpenMP thread count of the thread that runs the engine's steps, adapted
between steps to the CPU that other processes leave free (SPECDEC_THREADS=auto, the default),
or fixed (SPECDEC_THREADS=N).

Why: a compiled SmolLM2 decode step runs ~200 OpenMP parallel regions (our ops'
at::parallel_for plus Inductor's kernels), each ending in a barrier. When another process holds
one of the cores, a barrier waits up to a scheduler slice for a descheduled worker, so on 2 cores
with one busy co-tenant 2 threads decode ~10x slower than 1 thread (issue 39). Fewer threads than
free cores cost a little; more cost a collapse. So the governor measures, over windows of
`window_s`, the CPU time other processes took on the CPUs this process may run on (/proc/stat
busy time of those CPUs minus this process's own /proc/self/stat time) and keeps
threads <= the cores they leave free, with hysteresis (see next_thread_count).

omp_set_num_threads (torch.set_num_threads) is a per-thread setting: `tick` applies the count
in the thread that calls it, so the engine ticks at the start of each public step, in the
stepping thread. A tick is a clock read and two compares except once per window (a read of
/proc/stat and /proc/self/stat, ~tens of us). Compiled kernels follow the runtime count because
Inductor emits `#pragma omp parallel` without num_threads when it compiles at os.cpu_count()
threads; lowerings/compile.py compiles at the governor's maximum (`at_max`) and asks for
dynamic threads when that maximum is another number. Dynamo guards the thread count among its
global state: the engine's guard filter drops that guard (keeps_guard).
"""
import contextlib
import math
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

THREADS_ENV = "SPECDEC_THREADS"

# Hysteresis of next_thread_count, in cores: drop a thread when the free cores fall more than
# DOWN_SLACK below the thread count; add one only when they exceed it by 1 - UP_SLACK, for
# UP_WINDOWS windows in a row (a wrong drop costs a window at 1/2 speed, a wrong rise a window
# of collapse, so rising is the slower decision).
DOWN_SLACK = 0.5
UP_SLACK = 0.25
UP_WINDOWS = 2
WINDOW_S = 0.25


def parse_threads_spec(value: str) -> Optional[int]:
    """SPECDEC_THREADS / --threads: "auto" -> None (adaptive), a positive int N -> N (fixed)."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"{THREADS_ENV}={value!r}: must be 'auto' or a thread count >= 1")


def next_thread_count(current: int, free_cores: float, max_threads: int,
                      up_streak: int) -> Tuple[int, int]:
    """(thread count for the next window, updated up_streak) given the cores other processes
    left free in the last window. Down at once to round(free) when free < current - DOWN_SLACK;
    up to floor(free + UP_SLACK) (at most max_threads) after UP_WINDOWS windows that all allow
    it; never below 1."""
    if free_cores < current - DOWN_SLACK:
        return max(1, min(max_threads, math.floor(free_cores + DOWN_SLACK))), 0
    allowed = min(max_threads, math.floor(free_cores + UP_SLACK))
    if allowed <= current:
        return current, 0
    if up_streak + 1 >= UP_WINDOWS:
        return allowed, 0
    return current, up_streak + 1


@dataclass
class CpuSample:
    """Cumulative CPU seconds: `busy` of the CPUs this process may run on (all processes), and
    `own` of this process (all its threads)."""
    busy: float
    own: float


class ProcStatCpu:
    """CpuSample from /proc/stat (the allowed CPUs' lines) and /proc/self/stat (utime + stime).
    Busy = user + nice + system + irq + softirq + steal: time the CPU was not ours to take."""

    def __init__(self, cpus: Optional[set] = None, stat_path: str = "/proc/stat",
                 self_stat_path: str = "/proc/self/stat"):
        self.cpus = set(os.sched_getaffinity(0)) if cpus is None else set(cpus)
        self.stat_path, self.self_stat_path = stat_path, self_stat_path
        self.tick_s = 1.0 / os.sysconf("SC_CLK_TCK")

    def sample(self) -> CpuSample:
        busy = 0
        with open(self.stat_path) as f:
            for line in f:
                if not line.startswith("cpu") or line[3] == " ":
                    continue  # the aggregate "cpu " line, and intr/ctxt/... lines
                name, *vals = line.split()
                if int(name[3:]) in self.cpus:
                    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, vals[:8])
                    busy += user + nice + system + irq + softirq + steal
        with open(self.self_stat_path) as f:
            # Fields after the ")" that ends the command name: utime and stime are the 12th
            # and 13th (fields 14 and 15 of proc(5)).
            rest = f.read().rsplit(")", 1)[1].split()
        own = int(rest[11]) + int(rest[12])
        return CpuSample(busy * self.tick_s, own * self.tick_s)


def default_cpu_source():
    """A ProcStatCpu, or None where /proc cannot be read (then `auto` keeps max_threads)."""
    try:
        source = ProcStatCpu()
        source.sample()
        return source
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@dataclass
class GovernorStats:
    """What the governor did: seconds spent at each thread count, switches, and the last
    window's measured load of other processes in cores (None before the first window)."""
    seconds_at: Dict[int, float] = field(default_factory=dict)
    switches: int = 0
    others_cores: Optional[float] = None
    windows: int = 0


class ThreadGovernor:
    """The thread count of the stepping thread(s): fixed (`fixed=True`: always max_threads) or
    adaptive over `source`'s CPU samples (see the module docstring).

    Args:
        max_threads: the most threads (adaptive) or the count (fixed).
        fixed: never adapt.
        source: object with sample() -> CpuSample; None in adaptive mode keeps max_threads
            (warned once, and `adaptive` is then False).
        cores: cores this process may use (default: its CPU affinity).
        clock: seconds, monotonic (tests pass a fake one).
        set_threads, get_threads: set / read the calling thread's count (default
            torch.set_num_threads / torch.get_num_threads).
    """

    def __init__(self, max_threads: int, *, fixed: bool = False, source=None,
                 cores: Optional[int] = None, clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 get_threads: Callable[[], int] = torch.get_num_threads,
                 window_s: float = WINDOW_S):
        if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
            raise ValueError(f"argument 'max_threads' must be an int >= 1, got {max_threads!r}")
        if not fixed and source is None:
            warnings.warn(f"{THREADS_ENV}=auto: no CPU usage source (/proc unreadable); "
                          f"keeping {max_threads} threads", stacklevel=2)
        self.max_threads = max_threads
        self.adaptive = not fixed and source is not None
        self.source = source
        self.cores = len(os.sched_getaffinity(0)) if cores is None else cores
        self.clock, self.window_s = clock, window_s
        self.set_threads, self.get_threads = set_threads, get_threads
        self.threads = max_threads
        self.stats = GovernorStats()
        self._up_streak = 0
        self._window_start: Optional[float] = None
        self._last: Optional[CpuSample] = None
        self._next_read = -math.inf

    def tick(self) -> int:
        """Called between steps by the stepping thread: updates the count once per window and
        applies it in this thread when the thread's count differs (read back every tick, not
        remembered: another governor, the user or a new OS thread may have another). Returns
        it."""
        if self.adaptive:
            now = self.clock()
            if now >= self._next_read:
                self._read_window(now)
        if self.get_threads() != self.threads:
            self.set_threads(self.threads)
        return self.threads

    def _read_window(self, now: float) -> None:
        sample = self.source.sample()
        if self._last is not None and now > self._window_start:
            wall = now - self._window_start
            others = max(0.0, (sample.busy - self._last.busy) - (sample.own - self._last.own))
            self.stats.others_cores = others / wall
            self.stats.windows += 1
            spent = self.stats.seconds_at
            spent[self.threads] = spent.get(self.threads, 0.0) + wall
            free = self.cores - self.stats.others_cores
            new, self._up_streak = next_thread_count(self.threads, free, self.max_threads,
                                                     self._up_streak)
            if new != self.threads:
                self.threads = new
                self.stats.switches += 1
        self._last, self._window_start = sample, now
        self._next_read = now + self.window_s

    @contextlib.contextmanager
    def at_max(self) -> Iterator[None]:
        """Run the body (a compile) at max_threads in this thread: Inductor specializes a
        kernel's parallel plan on the count at compile time, and a graph compiled while the
        machine was busy must not stay planned for fewer threads once it is free."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.max_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def keeps_guard(entry) -> bool:
    """Dynamo guard filter predicate for the engine's step graphs: False for the global-state
    guard. It snapshots torch.get_num_threads() with grad mode, autocast, the default dtype and
    the deterministic / reduced-precision flags, so every count the governor sets would re-trace
    every graph (and fail `fail_on_recompile`). The engine's public steps run under
    inference_mode, so grad mode is fixed; the other settings, changed after a graph is traced,
    are not seen by it (as the model's parameter layout is not: engine._skip_model_guards).
    Torch-function modes keep their own guard."""
    return entry.guard_type != "GLOBAL_STATE"


_governor: Optional[ThreadGovernor] = None
_lock = threading.Lock()


def make_governor(spec: Optional[str] = None) -> ThreadGovernor:
    """A governor for spec "auto" or "N" (default: SPECDEC_THREADS, else "auto"). auto's
    maximum is torch's thread count now (OMP_NUM_THREADS / torch.set_num_threads), at most the
    allowed CPUs."""
    value = os.environ.get(THREADS_ENV, "auto") if spec is None else spec
    count = parse_threads_spec(value)
    if count is not None:
        return ThreadGovernor(count, fixed=True)
    cores = len(os.sched_getaffinity(0))
    return ThreadGovernor(max(1, min(torch.get_num_threads(), cores)), source=default_cpu_source(),
                          cores=cores)


def governor() -> ThreadGovernor:
    """The process's governor (made from SPECDEC_THREADS on first use)."""
    global _governor
    if _governor is None:
        with _lock:
            if _governor is None:
                _governor = make_governor()
    return _governor


def configure(spec) -> ThreadGovernor:
    """Replace the process's governor: spec "auto", an int / "N", or a ThreadGovernor (the CLI's
    --threads, benchmarks and tests). Returns it."""
    global _governor
    new = spec if isinstance(spec, ThreadGovernor) else make_governor(str(spec))
    with _lock:
        _governor = new
    return new


def tick() -> int:
    """The engine's per-step hook: governor().tick()."""
    return governor().tick()
