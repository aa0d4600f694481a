"""Stand-in sim server for launcher tests: GET /health -> 200, plus switches to misbehave."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Health(BaseHTTPRequestHandler):
    """200 on /health once `ready_at` has passed, 503 before; 404 elsewhere."""

    ready_at = 0.0

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path != "/health":
            self.send_error(404)
            return
        ok = time.monotonic() >= self.ready_at
        self.send_response(200 if ok else 503)
        self.end_headers()
        self.wfile.write(b"ok" if ok else b"starting")

    def log_message(self, format: str, *args: object) -> None:
        sys.stdout.write(f"standin: {format % args}\n")
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=["prefill", "decode", "null"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bootstrap-port", type=int)
    parser.add_argument("--model-path")
    parser.add_argument("--served-model-name", "--model-name")
    parser.add_argument("--ready-after", type=float, default=0.0, help="503 until then")
    parser.add_argument("--exit-after", type=float, help="exit with code 3 after N seconds")
    parser.add_argument("--spawn-child", action="store_true", help="fork a sleeping child")
    parser.add_argument("--ignore-sigterm", action="store_true")
    args = parser.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        print(f"standin child pid {child.pid}", flush=True)
    if args.exit_after is not None:
        threading.Timer(args.exit_after, lambda: os._exit(3)).start()
    Health.ready_at = time.monotonic() + args.ready_after
    server = ThreadingHTTPServer((args.host, args.port), Health)
    print(f"standin {args.mode} on {args.host}:{args.port} pid {os.getpid()}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
