"""`specdec serve` under load: N concurrent clients (default 1, 4, 16) send the held-out prompts
(train/corpus.py) as streamed chat completions through the official `openai` client, to our
server with each --methods entry ("none": no speculation) and to llama.cpp's llama-server
(built from the vendored source by build_llamacpp.sh) on the same GGUF file, with the same
prompts, client and settings (greedy, --max-tokens, stop at eos).

Per server and concurrency: aggregate tokens/s (completion tokens of all requests / wall time
of the run), p50 / p99 time to first token (request sent -> first text chunk) and p50 / p99
inter-token latency (per request: (last chunk - first chunk) / (completion tokens - 1), so a
speculative step that sends several tokens in one chunk counts as several tokens), mean
completion tokens. Every server is started first and stays up; the runs then take turns
(repeat -> concurrency -> server) so a drift of the machine's speed hits them alike. tok/s is
the median over --repeats; latencies pool the repeats' requests. Ratios: vs llama-server at
the same concurrency, vs our no-speculation server at the same concurrency, and vs the same
server at concurrency 1 (the scaling). The clients run as threads of this process and every
server in a process of its own, so no server shares its interpreter (or GIL) with the load;
they do share the machine's cores, alike for every server. Each run line and the table's
header give the load average (other processes' load makes every tok/s here slower).

--trace: our servers also write their per-request phase times (`specdec serve --trace`,
serve/trace.py), and a second table splits each server's time to first token into the
median time between consecutive phases, from the client's send (perf_counter, the same
clock as the server's on Linux) to the client's first text chunk.

    bash benchmarks/build_llamacpp.sh      # once (llama-server)
    python benchmarks/bench_serve.py                                  # none, ngram, eagle3
    python benchmarks/bench_serve.py --eager --concurrency 1,4 --prompts 4 --max-tokens 16 \\
        --requests-per-client 1 --repeats 1                           # a quick smoke run
    python benchmarks/bench_serve.py --methods none,ngram --baseline ../other-checkout
                                      # same-run A/B of a change: also that checkout's servers
    python benchmarks/bench_serve.py --methods none --concurrency 1 --no-llamacpp --trace
                                      # where a request's time to first token goes
    python benchmarks/bench_serve.py --methods none --baseline ../other-checkout --cold-cache
                                      # startup from an empty compile cache, A/B
"""
import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_quant_e2e import LLAMACPP_ARGS_EXAMPLE, llamacpp_bin, model_file  # noqa: E402
from specdec_inductor.train.corpus import heldout_prompts  # noqa: E402

NAME = "bench"  # the model name both servers answer to


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on a free port; `up()` waits for GET /health to answer 200."""

    def __init__(self, label: str, cmd: List[str], log_dir: str,
                 env: Optional[Dict[str, str]] = None):
        self.label, self.port = label, free_port()
        self.log_path = os.path.join(log_dir, label.replace(" ", "_") + ".log")
        self.log = open(self.log_path, "w")
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.trace: Optional[str] = None  # our servers' --trace file (bench --trace)

    def up(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited (rc {self.proc.returncode}); see "
                                   f"{self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return time.monotonic() - t0
            except OSError:
                time.sleep(1.0)
        raise RuntimeError(f"{self.label} not healthy after {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def ours(method: str, args, log_dir: str, root: Optional[str] = None) -> ServerProcess:
    """Our server with `method`; root: run another checkout's package (--baseline)."""
    # The console script the package installs next to this interpreter.
    specdec = os.path.join(os.path.dirname(sys.executable), "specdec")
    label = f"{'baseline' if root else 'ours'} {method}"
    cmd = ["env", f"PYTHONPATH={root}"] if root else []
    cmd += [specdec, "serve", "--port", "{port}",
           "--method", method.removesuffix("+lookup"), "--max-batch", str(args.max_batch),
           "--max-len", str(args.max_len), "--max-queue", str(4 * max(args.concurrency)),
           "--served-model-name", NAME, "--max-new-tokens", str(args.max_tokens)]
    # METHOD: the method alone (`--no-lookup`: eagle3 drafts with prompt lookup first by
    # default); METHOD+lookup: with it. A checkout from before that default knows no
    # `--no-lookup` and runs the method alone without it.
    registry = os.path.join(root or ROOT, "specdec_inductor", "proposers", "registry.py")
    with open(registry) as f:
        knows_no_lookup = "LOOKUP_BY_DEFAULT" in f.read()
    if method.endswith("+lookup"):
        cmd += ["--lookup"]
    elif knows_no_lookup:
        cmd += ["--no-lookup"]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--eager"] if args.eager else []
    trace = os.path.join(log_dir, label.replace(" ", "_") + ".trace.jsonl")
    cmd += ["--trace", trace] if args.trace else []
    # --cold-cache: a compile cache of its own, empty, so every server's startup compiles
    # everything (later servers would otherwise load the graphs an earlier one compiled).
    env = ({"TORCHINDUCTOR_CACHE_DIR": os.path.join(log_dir, label.replace(" ", "_") + "-cache")}
           if args.cold_cache else None)
    server = ServerProcess(label, cmd, log_dir, env)
    server.trace = trace if args.trace else None
    return server


def print_warm_up(server: ServerProcess) -> None:
    """The warm-up's log lines of one of our servers (graphs compiled per phase, seconds)."""
    with open(server.log_path) as f:
        for line in f:
            if "warm-up:" in line:
                print(f"#   {line.strip()}", flush=True)


def llama_server(bindir: str, args, log_dir: str) -> ServerProcess:
    threads = args.threads or os.cpu_count()
    cmd = [os.path.join(bindir, "llama-server"), "-m", model_file(args.model), "--port", "{port}",
           "--host", "127.0.0.1", "-a", NAME, "-t", str(threads), "-np", str(args.max_batch),
           "-c", str(args.max_len * args.max_batch), "-cb", "--no-webui"]
    cmd += shlex.split(args.llamacpp_args)
    return ServerProcess("llama-server", cmd, log_dir)


def one_request(base_url: str, prompt: str, max_tokens: int) -> dict:
    """Stream one chat completion; the client-side timings of its chunks."""
    import openai
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    first = last = answer_id = None
    chunks, used = 0, None
    for chunk in client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0.0, stream=True, stream_options={"include_usage": True}):
        answer_id = chunk.id
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = now if first is None else first
            last, chunks = now, chunks + 1
    tokens = used if used is not None else chunks
    return {"ttft": (first if first is not None else time.perf_counter()) - t0,
            "itl": (last - first) / (tokens - 1) if first is not None and tokens > 1 else None,
            "tokens": tokens, "id": answer_id, "sent_at": t0, "first_at": first}


def run_load(server: ServerProcess, prompts: List[str], clients: int, per_client: int,
             max_tokens: int) -> dict:
    """`clients` threads, each sending `per_client` requests one after the other."""
    results, errors = [], []

    def client(c):
        for j in range(per_client):
            try:
                results.append(one_request(server.base_url,
                                           prompts[(c * per_client + j) % len(prompts)],
                                           max_tokens))
            except Exception as exc:  # noqa: BLE001 -- counted and shown
                errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{server.label}: {len(errors)} failed requests, e.g. {errors[0]}")
    return {"tok_s": sum(r["tokens"] for r in results) / wall, "requests": results}


def percentile(values: List[float], q: float) -> float:
    values = sorted(v for v in values if v is not None)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(runs: List[dict]) -> dict:
    requests = [r for run in runs for r in run["requests"]]
    ttft, itl = [r["ttft"] for r in requests], [r["itl"] for r in requests]
    return {"tok_s": statistics.median(run["tok_s"] for run in runs),
            "ttft50": percentile(ttft, 50), "ttft99": percentile(ttft, 99),
            "itl50": percentile(itl, 50), "itl99": percentile(itl, 99),
            "tokens": statistics.mean(r["tokens"] for r in requests)}


def ratio(a: Optional[dict], b: Optional[dict]) -> str:
    return f"{a['tok_s'] / b['tok_s']:.2f}x" if a and b else "-"


def print_table(table: Dict[str, Dict[int, dict]], concurrency: List[int]) -> None:
    print("| server | clients | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | tokens/request | "
          "vs llama-server | vs ours none | vs its 1 client |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in concurrency:
        for label, rows in table.items():
            r = rows[c]
            print(f"| {label} | {c} | {r['tok_s']:.1f} | {r['ttft50'] * 1e3:.0f} / "
                  f"{r['ttft99'] * 1e3:.0f} | {r['itl50'] * 1e3:.1f} / {r['itl99'] * 1e3:.1f} | "
                  f"{r['tokens']:.1f} | {ratio(r, table.get('llama-server', {}).get(c))} | "
                  f"{ratio(r, table.get('ours none', {}).get(c))} | "
                  f"{ratio(r, rows.get(concurrency[0]))} |")


def trace_phases(trace_path: str, requests: List[dict]) -> Dict[str, float]:
    """Median seconds between consecutive phases of the requests' time to first token (the
    client's send, the server's trace marks (serve/trace.py), the client's first chunk), and
    per step after the one of the first token: the step API's call, the scheduler's
    step-to-step time (the first to the last token handed out) and the client's inter-token
    latency (per token: below a step's time where steps emit several)."""
    with open(trace_path) as f:
        lines = {line["id"]: line for line in map(json.loads, f)}
    gaps: Dict[str, List[float]] = {}
    for r in requests:
        line = lines.get(r["id"])
        if line is None or r["first_at"] is None:
            continue
        times = [("client", r["sent_at"])] + list(line["marks"].items())
        times.append(("client first chunk", r["first_at"]))
        for (a, ta), (b, tb) in zip(times, times[1:]):
            gaps.setdefault(f"{a} -> {b}", []).append(tb - ta)
        if line["steps"] > 1 and r["itl"] is not None:
            marks, later = line["marks"], line["steps"] - 1  # the steps after the first token's
            first_step = marks["token"] - marks["stepped"]
            per_step = {"step (the step API's call)": (line["step_s"] - first_step) / later,
                        "step to step (server)": (line["last_token"] - marks["token"]) / later,
                        "client ITL": r["itl"]}
            for k, v in per_step.items():
                gaps.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in gaps.items()}


def print_phases(runs: Dict[str, Dict[int, List[dict]]], servers: List[ServerProcess],
                 concurrency: List[int]) -> None:
    print("\n| server | clients | TTFT phase, or per step | median ms |\n|---|---|---|---|")
    for server in servers:
        if server.trace is None:
            continue
        for c in concurrency:
            requests = [r for run in runs[server.label][c] for r in run["requests"]]
            for phase, seconds in trace_phases(server.trace, requests).items():
                print(f"| {server.label} | {c} | {phase} | {seconds * 1e3:.1f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="model name or .gguf (default: the SmolLM2-135M Q4_1 file, kept quantized "
                        "as llama-server runs it)")
    p.add_argument("--methods", default="none,ngram,eagle3",
                   help="our servers, one per method (none: no speculation; METHOD+lookup: "
                        "with --lookup, prompt lookup in front of a draft model)")
    p.add_argument("--concurrency", default="1,4,16", help="clients at once, comma list")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompts", type=int, default=len(heldout_prompts()),
                   help="the first K held-out prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=16, help="both servers' parallel requests")
    p.add_argument("--max-len", type=int, default=512, help="context per request")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="our servers uncompiled (smoke runs)")
    p.add_argument("--threads", type=int, default=None, help="llama-server -t (default: cores)")
    p.add_argument("--llamacpp-bin", default=None, help="llama.cpp bin dir (default: build it)")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--llamacpp-args", default="",
                   help=f"more llama-server arguments, {LLAMACPP_ARGS_EXAMPLE}")
    p.add_argument("--baseline", default=None, metavar="CHECKOUT",
                   help="also serve each method from this checkout of the repository (a "
                        "same-run A/B of a change: its rows are 'baseline METHOD')")
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--cold-cache", action="store_true",
                   help="each of our servers compiles into an empty Inductor cache of its own "
                        "(its startup from cold; default: the environment's shared cache)")
    p.add_argument("--trace", action="store_true",
                   help="split our servers' time to first token into phases (serve/trace.py)")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    for name, value in (("--repeats", args.repeats), ("--prompts", args.prompts),
                        ("--requests-per-client", args.requests_per_client),
                        ("--max-tokens", args.max_tokens), ("--concurrency",
                                                            min(args.concurrency))):
        if value < 1:
            raise SystemExit(f"bench_serve: {name} must be >= 1")
    prompts = heldout_prompts()[:args.prompts]
    log_dir = tempfile.mkdtemp(prefix="bench_serve_")
    bindir = None if args.no_llamacpp else llamacpp_bin(args.llamacpp_bin)
    servers = []
    try:
        roots = [None] + ([os.path.abspath(args.baseline)] if args.baseline else [])
        for root in roots:
            for method in methods:  # one at a time: each compiles (or warms up) on all cores
                servers.append(ours(method, args, log_dir, root))
                print(f"# {servers[-1].label}: up in {servers[-1].up(args.startup_timeout):.0f} s",
                      flush=True)
                print_warm_up(servers[-1])
        if bindir is not None:
            servers.append(llama_server(bindir, args, log_dir))
            print(f"# llama-server: up in {servers[-1].up(args.startup_timeout):.0f} s", flush=True)
        for server in servers:  # untimed: first-request costs
            one_request(server.base_url, prompts[0], 4)
        load0 = os.getloadavg()[0]
        runs: Dict[str, Dict[int, List[dict]]] = {s.label: {c: [] for c in args.concurrency}
                                                  for s in servers}
        for _ in range(args.repeats):
            for c in args.concurrency:
                for server in servers:
                    run = run_load(server, prompts, c, args.requests_per_client, args.max_tokens)
                    runs[server.label][c].append(run)
                    print(f"# {server.label}, {c} clients: {run['tok_s']:.1f} tok/s (load "
                          f"average {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for server in servers:
            server.stop()
    import torch
    print(f"# {args.model or 'smollm2-135m'} ({os.path.basename(model_file(args.model))}), "
          f"{os.cpu_count()} cores, torch {torch.__version__}; ours "
          f"{'eager' if args.eager else 'compiled'}; {len(prompts)} held-out prompts, "
          f"{args.requests_per_client} requests per client, max_tokens {args.max_tokens}, greedy, "
          f"stop at eos; max batch {args.max_batch}; tok/s medians of {args.repeats}; load "
          f"average {load0:.1f} before the runs, {os.getloadavg()[0]:.1f} after; server logs "
          f"in {log_dir}" + (f"; llama-server with {args.llamacpp_args}" if args.llamacpp_args
                             else ""))
    print_table({label: {c: summarize(r) for c, r in rows.items()}
                 for label, rows in runs.items()}, args.concurrency)
    if args.trace:
        print_phases(runs, servers, args.concurrency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
