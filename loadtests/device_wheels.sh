#!/usr/bin/env bash
# Wheels that loadtests.scaling needs on the 16-core device machine, which has Python 3.12
# (x86-64) with uvloop, aiohttp, httpx, prometheus-client, psutil, pyyaml, jinja2, anyio,
# click, h11 and msgpack, and reaches no package registry (docs/BENCHMARKS.md, "Scaling over
# cores"). Downloads, never installs:
#
#     bash loadtests/device_wheels.sh [DIR]        # DIR defaults to .whl
#
# Versions are the ones this project is developed and tested with (`pip show` on the
# development machine); fastapi stays at 0.140 for mini_lb because later releases import
# opentelemetry. fastapi 0.140 accepts any starlette >= 0.46, so the gateway's starlette
# serves both. The total is printed and must stay under 62 MB (what travels to the device).
set -euo pipefail

dest="${1:-.whl}"
limit_mb=62
packages=(
    # the gateway
    starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 orjson==3.13.0 pyzmq==27.3.0
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
    typing-extensions==4.16.0
    # the peers: sglang-router (Rust router and mini_lb) and what mini_lb imports
    sglang-router==0.3.2 setproctitle==1.3.8 fastapi==0.140.13 annotated-doc==0.0.7
    # overhead targets gateway-tokenizer (tokenizers, jinja2) and gateway-tracing
    # (OpenTelemetry SDK, OTLP/HTTP exporter; the rotel collector as the sink: 0.0.1a8 is the
    # last release whose agent binary does not link libpython3.11)
    tokenizers==0.23.3 jinja2==3.1.6 markupsafe==3.0.4
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
    opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
    opentelemetry-proto==1.45.2 opentelemetry-exporter-http-transport==0.66b2
    opentelemetry-exporter-otlp-common==0.66b2 googleapis-common-protos==1.76.0 protobuf==7.36.2
    requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1
    charset-normalizer==3.5.3 rotel==0.0.1a8
)

mkdir -p "$dest"
for spec in "${packages[@]}"; do
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$dest" "$spec"
done

ls -1 "$dest"
bytes=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
mb=$(( (bytes + 1048575) / 1048576 ))
echo "total: $(ls "$dest"/*.whl | wc -l) wheels, ${mb} MB in $dest"
if (( mb >= limit_mb )); then
    echo "over the ${limit_mb} MB budget" >&2
    exit 1
fi
