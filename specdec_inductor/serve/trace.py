"""`specdec serve --trace FILE`: one JSON line per ended request with the time (perf_counter,
seconds; on Linux CLOCK_MONOTONIC, so a client on the same machine can put its own
perf_counter times next to them) at which it first reached each phase, in order:

  received   the handler began (before the body was read and parsed)
  tokenized  its prompt is token ids (chat template applied)
  queued     submitted to the scheduler (Scheduler.submit)
  picked     the scheduler thread took it from its inbox (between two steps)
  admitted   its lane admitted it (KV slots taken; its prompt prefills in the next steps)
  stepped    the first step it took part in began
  token      its first tokens were handed out (the end of the step that made them)
  handed     the event loop took its first Delta
  sent       its first text went out (streamed: the write of its server-sent event returned,
             which may be just after the client read it)

A phase a request never reached (cancelled while queued, a whole answer has no `sent`) is
absent. Also: `steps` (the lane steps it took part in), `step_s` (their seconds: the step
API's call, prefill chunks included) and `last_token` (when its last tokens were handed
out), so that (last_token - token) / (steps - 1) against step_s / steps shows what the
scheduler adds to each step. bench_serve.py --trace reads the file and prints the medians."""
import json
import threading

RECEIVED, TOKENIZED, QUEUED, PICKED, ADMITTED, STEPPED, TOKEN, HANDED, SENT = PHASES = (
    "received", "tokenized", "queued", "picked", "admitted", "stepped", "token", "handed",
    "sent")


class Trace:
    """Appends each request's line to `path` (from the event loop's thread; locked anyway)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        open(path, "w").close()  # a new trace per server

    def write(self, answer_id: str, request, completion_tokens: int) -> None:
        line = json.dumps({"id": answer_id, "prompt_tokens": len(request.prompt),
                           "completion_tokens": completion_tokens,
                           "marks": {p: request.marks[p] for p in PHASES if p in request.marks},
                           "steps": request.steps, "step_s": request.step_s,
                           "last_token": request.last_token_at})
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")
