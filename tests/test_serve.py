"""`specdec serve` through the official `openai` client against servers started here (uvicorn in
a background thread, ephemeral port, eager engines): streamed == non-streamed text, greedy text
== `specdec generate`, 32 concurrent clients (greedy, sampled, opted out of speculation,
cancelled mid-stream) with every greedy answer equal to its solo answer and the KV pool
consistent and free afterwards, stop strings, 429 on a full queue, and bad requests answered
with OpenAI-style errors naming the parameter, each followed by a request that succeeds.

The text tests run the default SmolLM2 (its chat template and tokenizer matter); the load tests
run a tiny random Llama over SmolLM2's tokenizer (its answers are gibberish, but exact)."""
import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from specdec_inductor import cli  # noqa: E402
from specdec_inductor.loading import DTYPES, encode, load_checked, model_directory  # noqa: E402
from specdec_inductor.engine.engine import Engine  # noqa: E402
from specdec_inductor.sampler import SamplingParams  # noqa: E402
from specdec_inductor.serve.app import Deliveries, chat_ids  # noqa: E402
from specdec_inductor.serve.launch import build_service, start_in_thread  # noqa: E402
from specdec_inductor.proposers.ngram import NgramProposer  # noqa: E402
from specdec_inductor.serve.scheduler import (Delta, Scheduler, ServeRequest,  # noqa: E402
                                              prefill_sizes)
from specdec_inductor.serve.trace import PHASES, Trace  # noqa: E402
from specdec_inductor.testing import write_random_eagle3_checkpoint  # noqa: E402

MODEL = "smollm2-135m"
PROMPTS = ["Tell me about penguins.", "Write a haiku about jazz.",
           "Explain how wind turbines work, step by step, in detail.", "Hi",
           "What is the capital of France? Answer briefly.",
           "List three uses of bamboo and say why each one works.", "Cheese?",
           "Write a Python function that rotates a list by k positions."]


def _serve_args(*flags):
    return cli.make_parser().parse_args(["serve", "--eager", *flags])


class Server:
    """A started service and its uvicorn thread; `client()` is an openai client for it."""

    def __init__(self, args, model, tokenizer):
        engine = cli.build_engine(args, model)
        proposer = cli.make_proposer(args, engine) if args.method != "none" else None
        self.service = build_service(args, engine, proposer, tokenizer)
        self.scheduler = self.service.scheduler
        self.http = start_in_thread(self.service)
        self.base_url = self.http.base_url

    def client(self, **kwargs):
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, **kwargs)

    def wait_idle(self, timeout=60.0):
        """Until nothing is queued or running; then the pools are checked (assert_idle)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.scheduler.inspect(self.scheduler.assert_idle).result(timeout)
            except AssertionError as exc:
                if "not idle" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def metrics(self) -> dict:
        """The /metrics page as {'name{labels}': value}."""
        text = urllib.request.urlopen(self.base_url[:-3] + "/metrics").read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def close(self):
        self.http.stop()
        self.scheduler.stop(30)


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(model_directory(None))


def _tiny_llama(vocab_size, layers=2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def tiny(tokenizer):
    server = Server(_serve_args("--method", "ngram", "--max-batch", "8", "--max-len", "320"),
                    _tiny_llama(len(tokenizer)), tokenizer)
    yield server
    server.close()


@pytest.fixture(scope="module")
def smol():
    model, tokenizer = load_checked(None, DTYPES["fp32"])
    server = Server(_serve_args("--method", "ngram", "--max-batch", "4"), model, tokenizer)
    server.tokenizer = tokenizer
    yield server
    server.close()


def _complete(client, prompt, chat, stream=False, **kwargs):
    """(text, finish_reason, completion tokens) of one request, streamed or not."""
    kwargs = {"model": MODEL, "temperature": 0.0, **kwargs}
    if chat:
        call = client.chat.completions.create
        kwargs["messages"] = [{"role": "user", "content": prompt}]
    else:
        call = client.completions.create
        kwargs["prompt"] = prompt
    if not stream:
        out = call(**kwargs)
        choice = out.choices[0]
        return (choice.message.content if chat else choice.text), choice.finish_reason, \
            out.usage.completion_tokens
    pieces, reason, used = [], None, None
    for chunk in call(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        for choice in chunk.choices:
            pieces.append((choice.delta.content if chat else choice.text) or "")
            reason = choice.finish_reason or reason
    return "".join(pieces), reason, used


@pytest.mark.parametrize("flags,message", [
    (["--port", "70000"], "argument --port: must lie in [0, 65535]"),
    (["--max-queue", "0"], "argument --max-queue: must be >= 1"),
    (["--method", "ngram", "--num-draft-tokens", "1"], "--num-draft-tokens"),
])
def test_serve_flags_are_checked_before_anything_loads(flags, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", *flags])
    assert message in capsys.readouterr().err


# -- the default model: chat template, text ---------------------------------------------------
def test_chat_template_ids_equal_the_cli_encoding(smol):
    message = [{"role": "user", "content": PROMPTS[0]}]
    assert chat_ids(smol.tokenizer, message) == encode(smol.tokenizer, PROMPTS[0], chat=True)


def test_greedy_chat_equals_specdec_generate(smol, capsys):
    prompt, n = PROMPTS[4], 24
    text, reason, used = _complete(smol.client(), prompt, chat=True, max_tokens=n)
    capsys.readouterr()
    assert cli.main(["generate", "--eager", "--prompt", prompt, "--max-new-tokens", str(n)]) == 0
    expected = capsys.readouterr().out
    assert expected.endswith("\n") and text == expected[:-1]
    assert reason == ("length" if used == n else "stop") and 0 < used <= n


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_streamed_text_equals_non_streamed(smol, chat):
    client = smol.client()
    prompt = PROMPTS[1] if chat else "Once upon a time, in a small village by the sea,"
    full = _complete(client, prompt, chat, max_tokens=16)
    streamed = _complete(client, prompt, chat, stream=True, max_tokens=16)
    assert streamed == full and len(full[0]) > 20


# -- the tiny model: load, stops, opt-out, errors ---------------------------------------------
def test_stop_strings_cut_the_text_streamed_and_not(tiny):
    client = tiny.client()
    text, reason, used = _complete(client, PROMPTS[2], chat=False, max_tokens=40)
    assert reason == "length" and used == 40
    stop = text[len(text) // 2:len(text) // 2 + 3]  # a piece from the middle
    expected = text[:text.index(stop)]
    for stream in (False, True):
        cut, reason, used = _complete(client, PROMPTS[2], chat=False, stream=stream,
                                      max_tokens=40, stop=["@@never@@", stop])
        assert (cut, reason) == (expected, "stop") and used < 40
    tiny.wait_idle()


def test_speculative_false_decodes_without_drafts_and_gives_the_same_tokens(tiny):
    client = tiny.client()
    steps = 'specdec_steps_total{method="none"}'
    before = tiny.metrics()[steps]
    plain = _complete(client, PROMPTS[5], chat=True, max_tokens=24,
                      extra_body={"speculative": False})
    assert tiny.metrics()[steps] > before  # it ran in the draft-less lane
    assert plain == _complete(client, PROMPTS[5], chat=True, max_tokens=24)


def test_the_batch_bucket_follows_the_running_requests(tiny):
    """One lane batch (capacity --max-batch 8); each step takes the smallest bucket that holds
    its requests: one stream decodes in bucket 1, three in bucket 4."""
    lane = tiny.scheduler.lanes[0]
    assert lane.capacity == 8 and lane.batch.capacity == 8

    def state():
        return tiny.scheduler.inspect(lambda: (lane.batch.bucket, len(lane.running))).result(30)

    streams = []
    for count, bucket in ((1, 1), (3, 4)):
        while len(streams) < count:
            streams.append(tiny.client().completions.create(
                model=MODEL, prompt=PROMPTS[len(streams)], max_tokens=250, temperature=0,
                stream=True))
            next(iter(streams[-1]))  # its first token: it stepped with the others
        assert state() == (bucket, count)
    for stream in streams:
        stream.close()
    tiny.wait_idle()


def _load_case(i):
    """Request i of the 32-client test: (prompt, chat, max_tokens, kind, extra kwargs)."""
    prompt, chat, n = PROMPTS[i % 8], i % 2 == 0, 8 + (i * 7) % 33
    kind = ("greedy", "greedy", "sampled", "cancelled")[i // 8]
    extra = {}
    if kind == "sampled":
        extra = {"temperature": 0.9, "top_p": 0.95, "seed": i, "extra_body": {"top_k": 50}}
    elif kind == "cancelled":
        n = 250  # still running when its client leaves
    if kind == "greedy" and i % 3 == 0:
        extra = {"extra_body": {"speculative": False}}
    return prompt, chat, n, kind, extra


def test_32_concurrent_clients(tiny):
    solo = {}
    client = tiny.client()
    for i in range(16):  # greedy answers, one client at a time
        prompt, chat, n, kind, _ = _load_case(i)
        solo[i] = _complete(client, prompt, chat, max_tokens=n)[0]
    cancelled_before = tiny.metrics().get('specdec_requests_total{outcome="cancelled"}', 0)
    results, errors = {}, []
    start = threading.Barrier(32)

    def run(i):
        prompt, chat, n, kind, extra = _load_case(i)
        try:
            start.wait()
            c = tiny.client()
            if kind != "cancelled":
                results[i] = _complete(c, prompt, chat, stream=i % 4 < 2, max_tokens=n, **extra)
                return
            kwargs = {"model": MODEL, "max_tokens": n, "temperature": 0.0, "stream": True}
            stream = (c.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                                **kwargs) if chat
                      else c.completions.create(prompt=prompt, **kwargs))
            for k, chunk in enumerate(stream):
                assert chunk.choices[0].finish_reason is None
                if k == 3:
                    break
            stream.close()  # mid-stream: the server cancels it
            results[i] = "closed"
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert len(results) == 32
    for i in range(16):
        assert results[i][0] == solo[i], i
    for i in range(16, 24):
        text, reason, used = results[i]
        assert reason in ("stop", "length") and 0 < used <= _load_case(i)[2]
    tiny.wait_idle()  # every KV slot is free and the pool consistent
    cancelled = tiny.metrics()['specdec_requests_total{outcome="cancelled"}'] - cancelled_before
    assert cancelled == 8


def _post(url, body, raw=False):
    """(status, parsed JSON) of a POST with a JSON (or raw) body."""
    data = body if raw else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _ok():
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


BAD = [  # (endpoint, body change or raw bytes, status, param)
    ("completions", b"{not json", 400, None),
    ("completions", {"model": "gpt-4o"}, 404, "model"),
    ("completions", {"max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"max_tokens": 10 ** 9}, 400, "max_tokens"),
    ("completions", {"max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": "word " * 400}, 400, "prompt"),
    ("chat/completions", {"prompt": None, "messages": [{"role": "user", "content": "x " * 400}]},
     400, "messages"),
    ("completions", {"temperature": 5}, 400, "temperature"),
    ("completions", {"temperature": "hot"}, 400, "temperature"),
    ("completions", {"top_p": 0}, 400, "top_p"),
    ("completions", {"top_k": -1}, 400, "top_k"),
    ("completions", {"seed": -3}, 400, "seed"),
    ("completions", {"n": 2}, 400, "n"),
    ("completions", {"logprobs": 2}, 400, "logprobs"),
    ("completions", {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {"prompt": [1, 10 ** 7]}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"frobnicate": True}, 400, "frobnicate"),
    ("completions", {"model": None}, 400, "model"),
    ("chat/completions", {"prompt": None}, 400, "messages"),
    ("chat/completions", {"prompt": None, "messages": []}, 400, "messages"),
    ("chat/completions", {"prompt": None, "messages": [{"role": "robot", "content": "x"}]},
     400, "messages.0.role"),
    ("chat/completions", {"prompt": None, "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function"}]}, 400, "tools"),
]


@pytest.mark.parametrize("endpoint,change,status,param", BAD,
                         ids=[f"{i}-{case[3]}" for i, case in enumerate(BAD)])
def test_bad_request_is_an_openai_error_and_the_next_request_succeeds(tiny, endpoint, change,
                                                                       status, param):
    url = f"{tiny.base_url}/{endpoint}"
    if isinstance(change, bytes):
        got, body = _post(url, change, raw=True)
    else:
        request = {**_ok(), **change}  # None: the field left out
        got, body = _post(url, {k: v for k, v in request.items() if v is not None})
    assert got == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    if param and "." not in param and error["code"] != "context_length_exceeded":
        assert param in error["message"], error
    status_ok, answer = _post(f"{tiny.base_url}/completions", _ok())
    assert status_ok == 200 and answer["usage"]["completion_tokens"] == 2


def test_openai_client_surfaces_the_errors(tiny):
    client = tiny.client()
    caught = []
    for kwargs in ({"model": "nope"}, {"max_tokens": 10 ** 9}):
        try:
            client.completions.create(**{"model": MODEL, "prompt": "x", **kwargs})
        except openai.APIStatusError as exc:
            caught.append((exc.status_code, exc.body["param"]))
    assert caught == [(404, "model"), (400, "max_tokens")]
    assert _complete(client, "Hello", chat=False, max_tokens=3)[2] == 3


def test_models_health_metrics_and_unknown_routes(tiny):
    client = tiny.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    base = tiny.base_url[:-3]
    assert json.loads(urllib.request.urlopen(base + "/health").read()) == {"status": "ok"}
    got, body = _post(base + "/v1/embeddings", {"model": MODEL, "input": "x"})
    assert got == 404 and body["error"]["type"] == "not_found_error"
    metrics = tiny.metrics()
    for name in ("specdec_generation_tokens_total", "specdec_time_to_first_token_seconds_count",
                 "specdec_inter_token_latency_seconds_count", "specdec_queue_depth",
                 'specdec_kv_pool_usage_ratio{pool="target"}',
                 'specdec_mean_accepted_length{method="ngram"}',
                 'specdec_acceptance_rate{method="ngram",position="0"}',
                 "specdec_generation_tokens_per_second"):
        assert name in metrics, name
    assert metrics["specdec_generation_tokens_total"] > 0
    assert metrics['specdec_http_errors_total{status="404"}'] >= 1


def test_a_whole_answer_whose_client_left_is_cancelled(tiny):
    """A non-streamed request's client disconnects while it decodes: the watcher sees it, the
    request leaves its batch at the next boundary and its slots are free."""
    lane, scheduler = tiny.scheduler.lanes[0], tiny.scheduler
    cancelled = 'specdec_requests_total{outcome="cancelled"}'
    before = tiny.metrics().get(cancelled, 0)
    body = json.dumps({**_ok(), "max_tokens": 250}).encode()
    host, port = tiny.base_url.split("//")[1].split("/")[0].split(":")
    conn = socket.create_connection((host, int(port)))
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 60
    while not scheduler.inspect(lambda: len(lane.running)).result(30):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    release = threading.Event()
    held = scheduler.inspect(lambda: release.wait(60))  # the scheduler waits between steps
    try:
        conn.close()
        while not all(r.cancelled for r in list(lane.running.values())):
            assert time.monotonic() < deadline, "the disconnect was not noticed"
            time.sleep(0.01)
    finally:
        release.set()
    held.result(30)
    tiny.wait_idle()
    assert tiny.metrics()[cancelled] == before + 1


def test_deliveries_hand_each_step_over_in_one_call_in_order():
    """The Deltas of a step reach the event loop in one call_soon_threadsafe, and each request's
    Deltas keep their order across steps."""
    calls = []

    class Loop:
        def call_soon_threadsafe(self, fn, *args):
            calls.append((fn, args))

    loop, deliveries = Loop(), Deliveries()
    queues = [asyncio.Queue() for _ in range(3)]
    for step in range(4):
        for i, queue in enumerate(queues):
            deliveries.put(loop, queue, Delta([10 * step + i]))
        deliveries.flush()
    deliveries.flush()  # nothing pending: no call
    assert len(calls) == 4
    for fn, args in calls:
        fn(*args)
    for i, queue in enumerate(queues):
        assert [queue.get_nowait().tokens for _ in range(4)] == [[10 * s + i] for s in range(4)]
        assert queue.empty()


def test_run_serves_in_the_calling_thread_until_stop(tokenizer):
    """Scheduler.run (what `specdec serve` calls in its main thread): every step and every
    on_delta runs in the calling thread, flush follows each step's Deltas, and stop() from
    another thread ends it with nothing failed."""
    engine = Engine(_tiny_llama(len(tokenizer)), max_batch=2, max_len=64, compile=False)
    events, threads, done = [], set(), threading.Event()

    def on_delta(delta):
        threads.add(threading.current_thread())
        events.append(delta)
        if delta.finish_reason is not None:
            done.set()

    scheduler = Scheduler(engine, None, method="none", max_batch=2, max_queue=4,
                          eos_token_id=None, flush=lambda: events.append("flush"))
    errors = []

    def client():
        try:
            assert scheduler.ready.wait(60)
            scheduler.submit(ServeRequest([1, 2, 3], 5, SamplingParams(), on_delta))
            assert done.wait(60)
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)
        finally:
            scheduler.stop()

    thread = threading.Thread(target=client)
    thread.start()
    scheduler.run()
    thread.join(60)
    assert not errors and scheduler.failed is None
    assert threads == {threading.current_thread()}
    deltas = [e for e in events if e != "flush"]
    assert sum(len(d.tokens) for d in deltas) == 5 and deltas[-1].finish_reason == "length"
    for k, event in enumerate(events):  # a flush after every step's Delta
        if event != "flush":
            assert "flush" in events[k + 1:k + 2], events


_TGKILL = {"x86_64": 234, "aarch64": 131}  # the tgkill syscall's number


def _signal_other_thread(pid: int, sig: int) -> None:
    """Send sig to one thread of process pid other than its main thread, as the kernel may
    when the process gets a signal: Python runs the handler in the main thread, which a
    blocking wait there does not notice."""
    import ctypes
    import platform
    number = _TGKILL.get(platform.machine())
    if number is None or not os.path.isdir(f"/proc/{pid}/task"):
        pytest.skip("thread-directed signals are sent with Linux's tgkill on x86_64 / aarch64")
    tid = min(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(number, pid, tid, sig) == 0, os.strerror(ctypes.get_errno())


@pytest.mark.parametrize("target", ["process", "another thread"])
def test_specdec_serve_stops_cleanly_on_sigterm(target):
    """The CLI server (scheduler in the main thread, uvicorn in a second one): answers, then
    SIGTERM ends it with status 0, whichever of its threads the signal lands on."""
    proc = subprocess.Popen([sys.executable, "-m", "specdec_inductor.cli", "serve", "--eager",
                             "--port", "0", "--max-batch", "1", "--max-len", "128"],
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        url = None
        for line in proc.stderr:  # "... at http://127.0.0.1:PORT/v1; loaded in ..."
            if " at http://" in line:
                url = line.split(" at ")[1].split(";")[0]
                break
        assert url is not None, "no serving line"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url[:-3] + "/health")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        status, answer = _post(url + "/completions", _ok())
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
        time.sleep(0.5)  # the scheduler is idle, waiting for work
        if target == "process":
            proc.send_signal(signal.SIGTERM)
        else:
            _signal_other_thread(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_full_queue_answers_429(tokenizer):
    server = Server(_serve_args("--max-batch", "1", "--max-queue", "1", "--max-len", "320"),
                    _tiny_llama(len(tokenizer)), tokenizer)
    try:
        client = server.client()
        running = client.completions.create(model=MODEL, prompt="a", max_tokens=250,
                                            temperature=0, stream=True)
        next(iter(running))  # admitted: it decodes now, the queue is empty
        queued = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                                messages=[{"role": "user", "content": "b"}],
                                                stream=True)
        got, body = _post(server.base_url + "/completions", _ok())
        assert got == 429 and body["error"]["code"] == "rate_limit_exceeded", body
        running.close()
        assert "".join(c.choices[0].delta.content or "" for c in queued if c.choices)
        server.wait_idle()
    finally:
        server.close()


def test_eagle3_server_answers_greedy_as_its_draftless_lane(tokenizer, tmp_path):
    """A draft-model method (its own draft Engine and KV pool, the target's hidden states):
    concurrent greedy answers equal the draft-less lane's, and both pools end free."""
    target = _tiny_llama(len(tokenizer), layers=4)
    write_random_eagle3_checkpoint(str(tmp_path), target.config, seed=3, layer_ids=[0, 1, 2])
    server = Server(_serve_args("--method", "eagle3", "--draft-model", str(tmp_path),
                                "--max-batch", "4", "--max-len", "256"), target, tokenizer)
    try:
        assert len(server.scheduler.kv_pools()) == 2  # the draft model's pool is checked too
        client = server.client()
        plain = [_complete(client, p, chat=True, max_tokens=12,
                           extra_body={"speculative": False}) for p in PROMPTS[:3]]
        got = [None] * 3

        def run(i):
            got[i] = _complete(server.client(), PROMPTS[i], chat=True, stream=i == 1,
                               max_tokens=12)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == plain
        assert server.metrics()['specdec_steps_total{method="eagle3"}'] > 0
        server.wait_idle()
    finally:
        server.close()


def test_the_trace_marks_each_phase_of_an_answer_in_order(tiny, tmp_path):
    """--trace: a streamed answer's line has every phase, in order, after the client's send
    and (all but `sent`) before its first text chunk (perf_counter is one clock for both); a
    whole answer's lacks `sent` only."""
    path = tmp_path / "trace.jsonl"
    tiny.service.trace = Trace(str(path))
    try:
        t0 = time.perf_counter()
        stream = tiny.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=6,
            temperature=0, stream=True)
        first, answer_id = None, None
        for chunk in stream:
            answer_id = chunk.id
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
        whole = tiny.client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3,
                                                 temperature=0)
        tiny.wait_idle()
    finally:
        tiny.service.trace = None
    lines = {line["id"]: line for line in map(json.loads, path.read_text().splitlines())}
    streamed = lines[answer_id]
    assert list(streamed["marks"]) == list(PHASES)
    times = list(streamed["marks"].values())
    # (`sent` is marked once the write returned: the client may have read it just before)
    assert t0 <= times[0] and times == sorted(times) and times[-2] <= first
    assert streamed["completion_tokens"] == 6 and streamed["prompt_tokens"] > 0
    # At most 6 steps made its 6 tokens (one when it prefilled), within its first step's start
    # and its last tokens.
    marks = streamed["marks"]
    assert marks["token"] <= streamed["last_token"] <= time.perf_counter()
    assert 1 <= streamed["steps"] <= 6
    assert 0 < streamed["step_s"] <= streamed["last_token"] - marks["stepped"]
    assert list(lines[whole.id]["marks"]) == [p for p in PHASES if p != "sent"]


def test_prompts_prefill_in_the_smallest_chunk_size_that_holds_them(tokenizer):
    assert prefill_sizes(64) == [16, 32, 48, 64]
    assert prefill_sizes(40) == [16, 32, 40] and prefill_sizes(16) == [16]
    assert prefill_sizes(8) == [8]
    engine = Engine(_tiny_llama(len(tokenizer)), max_batch=2, max_len=128, compile=False,
                    prefill_chunk=32)
    scheduler = Scheduler(engine, None, method="none", max_batch=2, max_queue=4,
                          eos_token_id=None)

    assert scheduler.prefill_sizes == [16, 32]
    assert scheduler.prefill_chunk_for(3) == 16
    assert scheduler.prefill_chunk_for(16) == 16
    assert scheduler.prefill_chunk_for(17) == 32
    assert scheduler.prefill_chunk_for(90) == 32  # three chunks


@contextlib.contextmanager
def _serve_compiling_nothing(scheduler, requests, tokens):
    """Start `scheduler` and wait for its warm-up; after the `with` body (which checks the
    warm-up), serve `requests` ((prompt, sampling, speculative); request i for tokens + 4 * i
    tokens, the later ones joining a running batch) under fail_on_recompile, stop, and check
    that every answer came whole, no step failed and nothing compiled while serving."""
    results, done = {}, threading.Event()

    def on_delta(i):
        def deliver(delta):
            results.setdefault(i, []).append(delta)
            if delta.finish_reason is not None and len(results) == len(requests) and all(
                    r[-1].finish_reason is not None for r in results.values()):
                done.set()
        return deliver

    scheduler.start()
    try:
        assert scheduler.ready.wait(600) and scheduler.failed is None
        yield scheduler
        with torch.compiler.set_stance("fail_on_recompile"):
            for i, (prompt, sampling, speculative) in enumerate(requests):
                scheduler.submit(ServeRequest(prompt, tokens + 4 * i, sampling, on_delta(i),
                                              speculative=speculative))
                if i in (1, 3):
                    time.sleep(0.2)  # the later ones join a running batch
            assert done.wait(300)
            scheduler.inspect(scheduler.assert_idle).result(60)
    finally:
        scheduler.stop(60)
    assert scheduler.failed is None and scheduler.serving_graphs == 0
    for i, deltas in results.items():
        assert deltas[-1].error is None, deltas[-1].error
        assert sum(len(d.tokens) for d in deltas) == tokens + 4 * i


def test_the_warm_up_compiles_each_graph_once_and_serving_none(tokenizer):
    """A compiled engine (dynamo with the eager backend: the same graphs and guards, without
    Inductor's compile time). The warm-up compiles, counted: per bucket the greedy and the
    sampled program of every tree size (decode and each verify size), shared by both lanes,
    and one one-row prefill graph per prefill size, whatever the bucket. After it, requests of
    every prefill size class (one chunk of 16, of 32, several chunks), alone and together, in
    buckets 1 and 2, greedy and sampled, in the speculative lane (drafts verified at the sizes
    the cost-aware policy picks, and steps where it decodes) and in the draft-less one, run
    under fail_on_recompile and compile nothing."""
    torch._dynamo.reset()
    engine = Engine(_tiny_llama(len(tokenizer)), max_batch=2, max_len=160, compile=True,
                    compile_backend="eager", prefill_chunk=32)
    proposer = NgramProposer(num_draft_tokens=4, breadth=(2, 1))
    scheduler = Scheduler(engine, proposer, method="ngram", max_batch=2, max_queue=8,
                          eos_token_id=None, warmup_prompt=[5, 6, 7, 8] * 3)
    lane = scheduler.lanes[0]
    assert lane.batch is None and lane.generator.cost_aware
    sampled = SamplingParams(temperature=0.8, seed=3)
    # (prompt, sampling, speculative): 6, 24, 60 (two chunks of 32), 12, 16 and 33 tokens
    requests = [([3, 4, 5] * 2, SamplingParams(), True),
                ([7, 8, 9, 10] * 6, SamplingParams(), True),
                ([3, 4] * 30, SamplingParams(), True), ([11, 12, 13] * 4, sampled, True),
                ([20, 21] * 8, SamplingParams(), False), ([22, 23, 24] * 11, sampled, False)]
    with _serve_compiling_nothing(scheduler, requests, 24):
        sizes = lane.generator.tree_sizes
        assert sizes == [1, 2, 4] and scheduler.prefill_sizes == [16, 32]
        assert scheduler.warmup_graphs == {"step programs": 2 * len(engine.buckets) * len(sizes),
                                           "prefill chunks": 2}
        # The cost-aware policy has each bucket's measured step costs to weigh.
        assert {(b, z) for b in engine.buckets for z in sizes} <= set(
            lane.generator.costs.step_s)
        # From here every size's step is priced alike (the costs, and each step's own time on a
        # scripted clock), so the policy verifies where drafts hit whatever the machine's load:
        # on this tiny model a busy moment during the warm-up could price every verify out.
        for key in lane.generator.costs.step_s:
            lane.generator.costs.step_s[key] = 1.0
        lane.generator.clock = itertools.count().__next__
    # The batch verified drafts at some step (repeating prompts) and decoded at others.
    steps = lane.stats.steps_by_size
    assert sum(n for z, n in steps.items() if z > 1) > 0 and steps.get(1, 0) > 0, steps
    assert scheduler.lanes[1].stats.verify_steps > 0  # the draft-less lane stepped too


def _eagle3_scheduler(tokenizer, tmp_path, lookup=False):
    """(a Scheduler, its proposer) over a tiny target compiled by Dynamo with the eager backend
    (the same graphs and guards, without Inductor's compile time), max batch 2, drafting with a
    random EAGLE-3 tree head (N = 6, topk 2, depth 3), with prompt lookup in front where
    `lookup`."""
    from specdec_inductor.proposers.eagle3 import Eagle3Proposer, load_eagle3_head
    from specdec_inductor.proposers.lookup_first import LookupFirstProposer
    from specdec_inductor.proposers.ngram import NgramProposer
    torch._dynamo.reset()
    target = _tiny_llama(len(tokenizer), layers=4)
    write_random_eagle3_checkpoint(str(tmp_path), target.config, seed=3, layer_ids=[0, 1, 2])
    head = load_eagle3_head(str(tmp_path), target)
    draft = Engine(head, max_batch=2 * 3, max_len=160 + 6, compile=True,
                   compile_backend="eager", prefill_chunk=8, capture_hidden=[-1])
    model = Eagle3Proposer(draft, 6, topk=2, depth=3)
    proposer = LookupFirstProposer(model, NgramProposer(6)) if lookup else model
    engine = Engine(target, max_batch=2, max_len=160, compile=True, compile_backend="eager",
                    prefill_chunk=32, capture_hidden=model.target_hidden_layers)
    scheduler = Scheduler(engine, proposer, method="eagle3", max_batch=2, max_queue=8,
                          eos_token_id=None, warmup_prompt=[5, 6, 7, 8] * 3)
    return scheduler, proposer


def test_a_draft_model_server_compiles_nothing_while_serving(tokenizer, tmp_path):
    """With a draft model (an EAGLE-3 tree, whose drafted steps draft inside the step
    program, greedy or sampled: SpeculativeGenerator.draft_in_program), the warm-up compiles
    every graph serving needs: greedy and sampled requests, alone and together, speculative
    and not, run under fail_on_recompile and compile nothing, and the speculative lane's
    drafted steps ran as the programs that draft inside them."""
    scheduler, _ = _eagle3_scheduler(tokenizer, tmp_path)
    lane = scheduler.lanes[0]
    lane.generator.min_accepted = 0.0  # a random head: drafting every step all the same
    sampled = SamplingParams(temperature=0.8, seed=3)
    requests = [([3, 4, 5] * 2, SamplingParams(), True), ([7, 8, 9, 10] * 6, sampled, True),
                ([3, 4] * 20, SamplingParams(), True), ([11, 12, 13] * 4, sampled, True),
                ([20, 21] * 8, SamplingParams(), False)]
    with _serve_compiling_nothing(scheduler, requests, 16):
        assert scheduler.warmup_graphs["draft model, sampled"] > 0
        assert lane.stats.drafted_in_program == 0
    assert lane.stats.drafted_in_program > 0
    assert lane.stats.drafted_in_program == lane.stats.verify_steps - lane.stats.decode_steps


def test_a_lookup_first_server_compiles_its_mixed_program_in_the_warm_up(tokenizer, tmp_path):
    """Lookup first in front of an EAGLE-3 tree: a batch whose requests draft from different
    sources (the lookup, the model, both, none) takes a step program of its own
    (lookup_first.MixedDrafter); the warm-up compiles it at every bucket (its own phase), so
    greedy requests that repeat their prompts and others that do not, joining a running
    batch, compile nothing while serving and take that program."""
    scheduler, proposer = _eagle3_scheduler(tokenizer, tmp_path, lookup=True)
    # From bucket 2 on the loop's gate judges lookup first's drafts by the bucket's price; a
    # threshold of 0 (set by hand) keeps every bucket drafting, so that mixed steps run.
    scheduler.lanes[0].generator.min_accepted = 0.0
    greedy = SamplingParams()
    requests = [([3, 4, 5] * 6, greedy, True), ([7, 30, 9, 41, 2, 17], greedy, True),
                ([3, 4] * 20, greedy, True), ([11, 52, 13, 8, 60], greedy, True)]
    with _serve_compiling_nothing(scheduler, requests, 16):
        assert scheduler.warmup_graphs["draft program 1"] > 0
        warm = proposer.mixed_in_program_steps + proposer.grafts_in_program
    assert proposer.mixed_in_program_steps + proposer.grafts_in_program > warm


def test_a_compile_while_serving_is_counted_and_logged(tokenizer, caplog):
    """A shape the warm-up did not compile (here: a prefill size added after it) compiles in
    the step that meets it, and the scheduler says so: a warning naming the lane and bucket,
    and serving_graphs counts it."""
    torch._dynamo.reset()
    engine = Engine(_tiny_llama(len(tokenizer)), max_batch=2, max_len=160, compile=True,
                    compile_backend="eager", prefill_chunk=32)
    scheduler = Scheduler(engine, None, method="none", max_batch=2, max_queue=8,
                          eos_token_id=None, warmup_prompt=[5, 6, 7, 8] * 3)
    done = threading.Event()
    scheduler.start()
    try:
        assert scheduler.ready.wait(600) and scheduler.failed is None
        assert scheduler.warmup_graphs == {"step programs": 2 * len(engine.buckets),
                                           "prefill chunks": 2}
        scheduler.prefill_sizes = [8] + scheduler.prefill_sizes  # a size nothing compiled
        with caplog.at_level("WARNING", logger="specdec.serve"):
            scheduler.submit(ServeRequest([3, 4, 5] * 2, 4, SamplingParams(),
                                          lambda d: d.finish_reason and done.set()))
            assert done.wait(300)
            scheduler.inspect(scheduler.assert_idle).result(60)
    finally:
        scheduler.stop(60)
    assert scheduler.serving_graphs == 1
    assert "compiled 1 graphs while serving (lane none, bucket 1)" in caplog.text
