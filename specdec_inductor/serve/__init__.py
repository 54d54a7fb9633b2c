"""`specdec serve`: an OpenAI-compatible HTTP server with continuous batching over the
speculative step API. protocol.py: the wire format and errors; scheduler.py: the thread that
owns the engine and drives the steps; text.py: detokenization and stop strings; metrics.py:
the Prometheus page; app.py: the FastAPI routes; launch.py: the command and a test server."""
