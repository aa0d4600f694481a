"""Command-line entry: build the config, then serve it with uvicorn (uvloop, httptools)."""

from __future__ import annotations

import gc
import logging
import sys

import uvicorn

from gateway.app import build_app
from gateway.config import EXIT_CONFIG_ERROR, EXIT_STARTUP_FAILURE, ConfigError, load_config


def tune_gc() -> None:
    """Fewer cyclic-GC passes: the hot path allocates many short-lived objects that reference
    counting frees, and the collector was ~10% of a small request's CPU (docs/BENCHMARKS.md).
    Objects alive after startup are frozen out of the collector's generations."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"gateway: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except ValueError as exc:  # bad policy options
        print(f"gateway: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_app(config)
    except ValueError as exc:
        print(f"gateway: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    tune_gc()
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host.strip("[]"), port=config.port, loop="uvloop", http="httptools",
        lifespan="on", log_level=config.log_level, access_log=False, proxy_headers=False,
        timeout_graceful_shutdown=config.shutdown_grace, backlog=2048))
    server.run()
    if not server.started:
        print("gateway: startup failed (see the error above)", file=sys.stderr)
        return EXIT_STARTUP_FAILURE
    return 0
