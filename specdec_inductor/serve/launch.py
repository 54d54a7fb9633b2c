"""`specdec serve`: a Scheduler over the Engine and proposer the CLI made (as `specdec generate`
makes them), and uvicorn serving the app.
`start_in_thread` runs the same app on an ephemeral port inside the caller's process (tests,
embedding)."""
import logging
import os
import socket
import sys
import threading
import time
from typing import Optional

import uvicorn

from specdec_inductor.loading import encode
from specdec_inductor.serve.app import Service, create_app
from specdec_inductor.serve.metrics import Metrics
from specdec_inductor.serve.scheduler import Scheduler

WARMUP_PROMPT = "Say hello."


def served_name(args) -> str:
    """--served-model-name, else the model argument's name (a path's file or directory)."""
    from specdec_inductor.models import DEFAULT_MODEL
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return DEFAULT_MODEL
    return os.path.splitext(os.path.basename(os.path.normpath(args.model)))[0]


def build_service(args, engine, proposer, tokenizer) -> Service:
    """The Service of the serve flags over `engine` and `proposer` (None: no drafts). The
    scheduler is made, not started."""
    metrics = Metrics()
    scheduler = Scheduler(engine, proposer, method=args.method, max_batch=args.max_batch,
                          max_queue=args.max_queue, eos_token_id=tokenizer.eos_token_id,
                          metrics=metrics,
                          warmup_prompt=encode(tokenizer, WARMUP_PROMPT, chat=True))
    return Service(scheduler, tokenizer, served_name(args), metrics, args.max_new_tokens)


def main(args, engine, proposer, tokenizer, t0: float) -> int:
    """Serve until interrupted; t0: when loading began (perf_counter)."""
    logging.basicConfig(level=logging.INFO, format="[specdec] %(message)s", stream=sys.stderr)
    service = build_service(args, engine, proposer, tokenizer)
    service.scheduler.start()
    log = logging.getLogger("specdec.serve")
    engine = service.scheduler.engine
    log.info(f"serving {service.model_name} ({args.dtype}, method {args.method}, "
             f"{'compiled' if engine.compiled else 'eager'}, max batch {args.max_batch}, "
             f"context {args.max_len}) at http://{args.host}:{args.port}/v1; loaded in "
             f"{time.perf_counter() - t0:.1f} s, warming up (GET /health says ok when done)")
    try:
        uvicorn.run(create_app(service), host=args.host, port=args.port, log_level="warning")
    finally:
        service.scheduler.stop(timeout=30)
    return 0


class ServerThread:
    """uvicorn serving `app` from a background thread on 127.0.0.1 and an ephemeral port."""

    def __init__(self, app, host: str = "127.0.0.1"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="specdec-uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def start_in_thread(service: Service, ready_timeout: Optional[float] = 600.0) -> ServerThread:
    """Start the service's scheduler and serve its app on an ephemeral port; waits until the
    scheduler has warmed up (RuntimeError if it failed)."""
    service.scheduler.start()
    if not service.scheduler.ready.wait(ready_timeout) or service.scheduler.failed:
        raise RuntimeError(f"the scheduler did not start: {service.scheduler.failed}")
    return ServerThread(create_app(service)).start()
