"""Thread governor (engine/threads.py): the policy, the governor over an injected CPU-usage
source and clock (no timing), /proc parsing, SPECDEC_THREADS, the engine's per-step hook, and
compile_graph compiling at the governor's maximum."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from specdec_inductor.engine import threads
from specdec_inductor.engine.threads import (CpuSample, ProcStatCpu, ThreadGovernor,
                                             next_thread_count, parse_threads_spec)


class FakeCpu:
    """Cumulative CPU seconds driven by the test: `advance(wall, others, own)` adds `wall`
    seconds of which other processes used `others` cores and this process `own` cores."""

    def __init__(self, clock):
        self.clock, self.busy, self.own, self.reads = clock, 0.0, 0.0, 0

    def advance(self, wall, others, own=1.0):
        self.clock.now += wall
        self.busy += (others + own) * wall
        self.own += own * wall

    def sample(self):
        self.reads += 1
        return CpuSample(self.busy, self.own)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FakeThreads:
    """A per-OS-thread count (as omp_set_num_threads'), starting at `initial` in every thread;
    `applied` lists every set."""

    def __init__(self, initial):
        self.initial, self.local, self.applied = initial, threading.local(), []

    def set(self, n):
        self.local.count = n
        self.applied.append(n)

    def get(self):
        return getattr(self.local, "count", self.initial)


def governor(max_threads=2, cores=2, initial=None):
    clock = FakeClock()
    cpu = FakeCpu(clock)
    counts = FakeThreads(initial)
    gov = ThreadGovernor(max_threads, source=cpu, cores=cores, clock=clock,
                         set_threads=counts.set, get_threads=counts.get, window_s=0.25)
    return gov, cpu, counts.applied


def run_windows(gov, cpu, others, n):
    """n windows with `others` cores busy, a tick after each; the counts in force after each."""
    counts = []
    for _ in range(n):
        cpu.advance(0.25, others)
        counts.append(gov.tick())
    return counts


# -- the policy -----------------------------------------------------------------------------

@pytest.mark.parametrize("current,free,streak,expected", [
    (2, 2.0, 0, (2, 0)),    # idle: stay
    (2, 1.6, 0, (2, 0)),    # less than half a core taken: stay
    (2, 1.4, 0, (1, 0)),    # more than half a core taken: down at once
    (2, 1.0, 0, (1, 0)),    # one busy co-tenant
    (2, 0.2, 0, (1, 0)),    # never below 1
    (1, 1.7, 0, (1, 0)),    # hysteresis band: not free enough to rise
    (1, 1.8, 0, (1, 1)),    # free enough: first window of the streak
    (1, 1.8, 1, (2, 0)),    # second window: up
    (1, 2.0, 3, (2, 0)),
    (8, 4.0, 0, (4, 0)),    # many cores: down to the free ones
    (4, 16.0, 1, (8, 0)),   # up to max_threads, not the free cores
])
def test_next_thread_count(current, free, streak, expected):
    assert next_thread_count(current, free, 8 if current > 2 else 2, streak) == expected


def test_parse_threads_spec():
    assert parse_threads_spec("auto") is None
    assert parse_threads_spec(" AUTO ") is None
    assert parse_threads_spec("3") == 3
    for bad in ("0", "-1", "two", "", "1.5"):
        with pytest.raises(ValueError, match="SPECDEC_THREADS"):
            parse_threads_spec(bad)


# -- the governor over a fake source --------------------------------------------------------

def test_governor_drops_under_a_cotenant_and_returns_when_free():
    gov, cpu, applied = governor()
    assert gov.tick() == 2  # first tick: baseline sample, max threads applied
    assert run_windows(gov, cpu, others=0.0, n=3) == [2, 2, 2]
    assert run_windows(gov, cpu, others=1.0, n=3) == [1, 1, 1]  # one busy process: down at once
    # Free again: up only after UP_WINDOWS windows that allow it.
    assert run_windows(gov, cpu, others=0.05, n=3) == [1, 2, 2]
    assert applied == [2, 1, 2]  # set only on a change
    assert gov.stats.switches == 2
    # Each window is booked to the count in force during it (a switch takes effect after it).
    assert gov.stats.seconds_at == pytest.approx({2: 1.25, 1: 1.0})


def test_governor_ignores_its_own_cpu_and_brief_blips():
    gov, cpu, _ = governor()
    gov.tick()
    cpu.advance(0.25, others=0.0, own=2.0)  # our own two busy threads are not a co-tenant
    assert gov.tick() == 2
    assert gov.stats.others_cores == pytest.approx(0.0)
    # A co-tenant that comes and goes every other window: down when it is there, never up
    # (no two free windows in a row).
    assert run_windows(gov, cpu, others=0.9, n=1) == [1]
    for _ in range(4):
        assert run_windows(gov, cpu, others=0.0, n=1) + run_windows(gov, cpu, others=0.9, n=1) == [1, 1]


def test_governor_reads_the_source_once_per_window():
    gov, cpu, applied = governor()
    gov.tick()
    for _ in range(100):  # steps within one window: no /proc reads, no set_num_threads
        cpu.clock.now += 0.001
        gov.tick()
    assert cpu.reads == 1 and applied == [2]
    cpu.clock.now += 0.25
    gov.tick()
    assert cpu.reads == 2


def test_governor_applies_the_count_in_every_stepping_thread():
    # omp_set_num_threads is per OS thread: a step run from another thread sets it there too.
    gov, cpu, applied = governor(initial=1)
    gov.tick()
    seen = []
    worker = threading.Thread(target=lambda: seen.append(gov.tick()))
    worker.start()
    worker.join()
    assert seen == [2] and applied == [2, 2]


def test_governor_reapplies_a_count_changed_behind_it():
    # Another governor (a benchmark's fixed runs) or the user changed the thread's count: the
    # next tick sets it back, even within a window.
    gov, cpu, applied = governor()
    gov.tick()
    gov.set_threads(1)
    gov.tick()
    assert applied == [2, 1, 2]


def test_fixed_governor_never_reads_and_keeps_its_count():
    cpu = FakeCpu(FakeClock())
    counts = FakeThreads(2)
    gov = ThreadGovernor(3, fixed=True, source=cpu, clock=cpu.clock, set_threads=counts.set,
                         get_threads=counts.get)
    for _ in range(5):
        cpu.advance(1.0, others=2.0)
        assert gov.tick() == 3
    assert cpu.reads == 0 and counts.applied == [3] and not gov.adaptive


def test_governor_without_a_source_warns_and_keeps_max():
    with pytest.warns(UserWarning, match="no CPU usage source"):
        gov = ThreadGovernor(2, source=None, set_threads=lambda n: None, get_threads=lambda: 1)
    assert not gov.adaptive and gov.tick() == 2


def test_bad_max_threads_is_named():
    with pytest.raises(ValueError, match="max_threads"):
        ThreadGovernor(0, fixed=True)


# -- /proc ----------------------------------------------------------------------------------

STAT = """cpu  900 0 900 9000 0 0 0 0 0 0
cpu0 100 10 200 5000 7 1 2 3 0 0
cpu1 800 0 700 4000 0 0 0 0 0 0
intr 12345 0 0
ctxt 999
"""


def test_proc_stat_parsing(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    self_stat = tmp_path / "self_stat"
    # The command name may hold spaces and ")": fields are counted after the last ")".
    self_stat.write_text("4242 (py thon) x) R 1 2 3 4 5 6 7 8 9 10 40 60 0 0 20 0 3 0\n")
    hz = os.sysconf("SC_CLK_TCK")
    only0 = ProcStatCpu(cpus={0}, stat_path=str(stat), self_stat_path=str(self_stat)).sample()
    assert only0.busy == pytest.approx((100 + 10 + 200 + 1 + 2 + 3) / hz)  # idle, iowait left out
    assert only0.own == pytest.approx((40 + 60) / hz)
    both = ProcStatCpu(cpus={0, 1}, stat_path=str(stat), self_stat_path=str(self_stat)).sample()
    assert both.busy == pytest.approx((316 + 1500) / hz)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc")
def test_real_source_sees_a_busy_process():
    source = ProcStatCpu()
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # let it start
        a = source.sample()
        time.sleep(1.0)
        b = source.sample()
    finally:
        child.kill()
        child.wait()
    assert b.own >= a.own >= 0
    # The spinner alone takes a share of a core (all of one on an idle machine).
    assert (b.busy - a.busy) - (b.own - a.own) > 0.3


def test_make_governor_from_env(monkeypatch):
    monkeypatch.setenv("SPECDEC_THREADS", "3")
    gov = threads.make_governor()
    assert (gov.max_threads, gov.adaptive) == (3, False)
    monkeypatch.setenv("SPECDEC_THREADS", "lots")
    with pytest.raises(ValueError, match="SPECDEC_THREADS='lots'"):
        threads.make_governor()
    monkeypatch.delenv("SPECDEC_THREADS")
    gov = threads.make_governor()
    assert gov.max_threads == min(torch.get_num_threads(), len(os.sched_getaffinity(0)))
    assert gov.adaptive == os.path.exists("/proc/stat")


@pytest.fixture
def restore_governor():
    before, count = threads._governor, torch.get_num_threads()
    yield
    threads._governor = before
    torch.set_num_threads(count)


# -- the engine hook ------------------------------------------------------------------------

class CountingGovernor(ThreadGovernor):
    def __init__(self, count):
        super().__init__(count, fixed=True)
        self.ticks = 0

    def tick(self):
        self.ticks += 1
        return super().tick()


def tiny_engine(compile):
    transformers = pytest.importorskip("transformers")
    from specdec_inductor.engine.engine import Engine
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return Engine(model, max_batch=1, max_len=64, compile=compile, prefill_chunk=8)


def test_engine_steps_tick_the_governor(restore_governor):
    engine = tiny_engine(compile=False)
    torch.set_num_threads(2)
    gov = threads.configure(CountingGovernor(1))
    engine.generate([[1, 2, 3]], max_new_tokens=5)  # one prefill chunk + 4 decode steps
    assert gov.ticks == 5
    assert torch.get_num_threads() == 1  # applied in the stepping thread
    seen = []

    def step_elsewhere():
        engine.generate([[4, 5]], max_new_tokens=2)
        seen.append(torch.get_num_threads())

    torch.set_num_threads(2)
    worker = threading.Thread(target=step_elsewhere)
    worker.start()
    worker.join()
    assert seen == [1]


def test_thread_count_changes_do_not_recompile(restore_governor):
    # Dynamo guards torch.get_num_threads() in its global state; the engine drops that guard,
    # so the governor's switches reuse the compiled steps.
    torch._dynamo.reset()
    engine = tiny_engine(compile=True)
    threads.configure(2)
    expected = engine.generate([[1, 2, 3]], max_new_tokens=4)
    threads.configure(1)
    with torch.compiler.set_stance("fail_on_recompile"):
        assert engine.generate([[1, 2, 3]], max_new_tokens=4) == expected
    assert torch.get_num_threads() == 1


# -- compile_graph at the governor's maximum -----------------------------------------------

def test_thread_patches_rule():
    from specdec_inductor.lowerings.compile import thread_patches
    cpus = os.cpu_count()
    fixed = ThreadGovernor(cpus + 1, fixed=True)
    auto_all = ThreadGovernor(cpus, source=FakeCpu(FakeClock()), set_threads=lambda n: None)
    auto_other = ThreadGovernor(cpus + 1, source=FakeCpu(FakeClock()), set_threads=lambda n: None)
    assert thread_patches({}, fixed) == {}  # the count never changes
    assert thread_patches({}, auto_all) == {}  # Inductor already emits run-time-count regions
    assert thread_patches({}, auto_other) == {"cpp.dynamic_threads": True}
    assert thread_patches({"cpp.dynamic_threads": False}, auto_other) == {}  # the caller's


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs")
def test_compile_runs_at_the_governors_maximum(restore_governor):
    # The machine was busy (the governor at 1 thread) when a graph compiled: it must still be
    # planned for the maximum, with regions that follow the run-time count.
    from specdec_inductor.backend import specdec_backend
    from specdec_inductor.lowerings.compile import run_and_get_code
    threads.configure(ThreadGovernor(os.cpu_count(), source=FakeCpu(FakeClock()),
                                     set_threads=torch.set_num_threads))
    torch.set_num_threads(1)
    torch._dynamo.reset()
    x = torch.randn(1 << 20)  # [N], large enough to be split across threads
    fn = torch.compile(lambda t: (t * 2 + 1).relu(), backend=specdec_backend, fullgraph=True)
    out, codes = run_and_get_code(fn, x)
    torch.testing.assert_close(out, (x * 2 + 1).relu())
    code = "\n".join(codes)
    assert "#pragma omp parallel" in code
    assert "num_threads(" not in code
    assert torch.get_num_threads() == 1  # the stepping thread's count is restored
