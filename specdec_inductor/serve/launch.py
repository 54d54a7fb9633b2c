"""`specdec serve`: a Scheduler over the Engine and proposer the CLI made (as `specdec generate`
makes them), and uvicorn serving the app.
`start_in_thread` runs the same app on an ephemeral port inside the caller's process (tests,
embedding)."""
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

import uvicorn

from specdec_inductor.loading import encode
from specdec_inductor.serve.app import Deliveries, Service, create_app
from specdec_inductor.serve.metrics import Metrics
from specdec_inductor.serve.scheduler import Scheduler
from specdec_inductor.serve.trace import Trace

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
    metrics, deliveries = Metrics(), Deliveries()
    scheduler = Scheduler(engine, proposer, method=args.method, max_batch=args.max_batch,
                          max_queue=args.max_queue, eos_token_id=tokenizer.eos_token_id,
                          metrics=metrics, flush=deliveries.flush,
                          warmup_prompt=encode(tokenizer, WARMUP_PROMPT, chat=True))
    trace = Trace(args.trace) if args.trace else None
    return Service(scheduler, tokenizer, served_name(args), metrics, args.max_new_tokens,
                   deliveries, trace)


def main(args, engine, proposer, tokenizer, t0: float) -> int:
    """Serve until interrupted (SIGINT / SIGTERM); t0: when loading began (perf_counter).
    The scheduler steps in this (the main) thread (Scheduler.run says why), uvicorn serves
    from a second one."""
    logging.basicConfig(level=logging.INFO, format="[specdec] %(message)s", stream=sys.stderr)
    service = build_service(args, engine, proposer, tokenizer)
    scheduler = service.scheduler
    log = logging.getLogger("specdec.serve")
    try:
        http = ServerThread(create_app(service), args.host, args.port,
                            on_exit=scheduler.stop).start()
    except OSError as exc:
        raise SystemExit(f"specdec: cannot serve at {args.host}:{args.port}: {exc}") from None
    log.info(f"serving {service.model_name} ({args.dtype}, method {args.method}, "
             f"{'compiled' if engine.compiled else 'eager'}, max batch {args.max_batch}, "
             f"context {args.max_len}) at http://{args.host}:{http.port}/v1; loaded in "
             f"{time.perf_counter() - t0:.1f} s, warming up (GET /health says ok when done)")
    previous = {sig: signal.signal(sig, _stop_handler(scheduler))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        scheduler.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        http.stop()
    if isinstance(scheduler.failed, KeyboardInterrupt):
        return 130
    if scheduler.failed is not None:
        log.error(f"the scheduler failed: {scheduler.failed}")
        return 1
    return 0


def _stop_handler(scheduler: Scheduler):
    """SIGINT / SIGTERM while serving: stop at the next step boundary (open requests end with
    an error); while warming up (compiling for minutes): interrupt at once."""
    def handler(signum, frame):
        if not scheduler.ready.is_set():
            raise KeyboardInterrupt
        scheduler.stop()
    return handler


class ServerThread:
    """uvicorn serving `app` from a background thread on host:port (0: an ephemeral port, as
    tests use). on_exit: called when uvicorn's thread ends (it stopped, or failed to start)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 on_exit: Optional[Callable[[], object]] = None):
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                  socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError:
            self.sock.close()
            raise
        self.host, self.port = host, self.sock.getsockname()[1]
        self.on_exit = on_exit
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self._serve, name="specdec-uvicorn", daemon=True)

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        finally:
            if self.on_exit is not None:
                self.on_exit()

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
