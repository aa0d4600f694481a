"""Command-line entry: build the config, then serve it with uvicorn (uvloop, httptools)."""

from __future__ import annotations

import logging
import sys

import uvicorn

from gateway.app import build_app
from gateway.config import EXIT_CONFIG_ERROR, EXIT_STARTUP_FAILURE, ConfigError, load_config


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
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host.strip("[]"), port=config.port, loop="uvloop", http="httptools",
        lifespan="on", log_level=config.log_level, access_log=False, proxy_headers=False,
        timeout_graceful_shutdown=config.shutdown_grace, backlog=2048))
    server.run()
    if not server.started:
        print("gateway: startup failed (see the error above)", file=sys.stderr)
        return EXIT_STARTUP_FAILURE
    return 0
