"""Command line and settings of the simulated SGLang server.

One frozen `SimConfig` is built from the flags before any port is bound; the
fault knobs live apart in a mutable `Faults` because `POST /sim/faults`
changes them at run time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from backends.sim.timing import (
    H100_8B_ESTIMATE,
    KNOB_HELP,
    KNOBS,
    PROFILES,
    SIM_DEFAULT_PROFILE,
)

Mode = Literal["prefill", "decode", "null"]
MODES: tuple[str, ...] = ("prefill", "decode", "null")
SGLANG_VERSION = "0.5.23"
# model_runner's decode CUDA graph batch sizes as a GPU decode captures them (role switch)
DEFAULT_GRAPH_BS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32)
# arg_groups/fields/parallel.py: the --load-balance-method choices of 0.5.23.
LOAD_BALANCE_METHODS: tuple[str, ...] = (
    "auto", "round_robin", "follow_bootstrap_room", "total_requests", "total_tokens")

# The earlier H100 estimate by its knob names (backends/sim/timing.py holds the profiles).
H100_8B_TIMING: dict[str, float] = H100_8B_ESTIMATE.knobs()
_T = SIM_DEFAULT_PROFILE  # every timing default below (timing.py says why not the H200's)


@dataclass
class Faults:
    """Injected misbehaviour; mutable because /sim/faults edits it live."""

    error_rate: float = 0.0
    hang: bool = False
    crash_after: int = 0
    slow_start: float = 0.0
    health_fail: bool = False
    first_token_delay: float = 0.0
    fail_bootstrap_port: int = 0  # 500 for requests paired with this bootstrap port (0: off)
    truncate_rate: float = 0.0  # that fraction of 200 answers is cut off, then the socket closed
    stall_after: int = 0  # answers stop after N stream chunks, the socket left open (0: off)
    withhold_kv: bool = False  # prefill: take the room, never send the KV, never answer
    role_switch_fail: bool = False  # /pd_role_switch fails midway: instance unhealthy after
    gpu_free_gb: float = 80.0  # what get_available_gpu_memory reports (decode graph headroom)

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a JSON body of knob changes; unknown names raise ValueError."""
        known = {f.name: f for f in dataclasses.fields(self)}
        for raw_name, value in changes.items():
            name = raw_name.replace("-", "_")
            if name not in known:
                raise ValueError(f"unknown fault knob {raw_name!r}; known: {sorted(known)}")
            kind = type(getattr(self, name))
            if kind is bool:
                setattr(self, name, bool(value))
            else:
                number = kind(value)
                if number < 0:
                    raise ValueError(f"fault knob {raw_name!r} must be >= 0")
                setattr(self, name, number)
        if self.error_rate > 1 or self.truncate_rate > 1:
            raise ValueError("error_rate and truncate_rate must be within [0, 1]")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class KvEventsSettings:
    """The parsed `--kv-events-config` (SGLang's KVEventsConfig subset)."""

    raw: str
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    bind: bool | None = None

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq"

    @classmethod
    def parse(cls, raw: str) -> KvEventsSettings:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        allowed = {"publisher", "endpoint", "replay_endpoint", "topic", "buffer_steps", "hwm", "bind"}
        ignored = {"max_queue_size", "format"}
        unknown = set(data) - allowed - ignored
        if unknown:
            raise ValueError(f"unknown --kv-events-config keys: {sorted(unknown)}")
        kept = {k: v for k, v in data.items() if k in allowed}
        return cls(raw=raw, **kept)


@dataclass(frozen=True)
class SimConfig:
    """Every resolved setting of one simulated server."""

    mode: str = "null"
    host: str = "127.0.0.1"
    port: int = 30000
    bootstrap_port: int = 8998
    model_path: str = "sim-model"  # what it reports as model_path and tokenizer_path
    model_name: str = "sim-model"  # served_model_name: the model's name in the API
    page_size: int = 1
    max_running_requests: int = 256
    max_total_tokens: int = 400_000
    cache_capacity_tokens: int = 400_000
    chunked_prefill_size: int = 8192
    context_length: int = 131_072
    default_max_new_tokens: int = 16
    timing: str = SIM_DEFAULT_PROFILE.name  # the --timing profile the knobs below start from
    prefill_overhead_ms: float = _T.prefill_overhead_ms
    prefill_ms_per_token: float = _T.prefill_ms_per_token
    prefill_ms_per_mpair_new: float = _T.prefill_ms_per_mpair_new
    prefill_ms_per_mpair_cached: float = _T.prefill_ms_per_mpair_cached
    prefill_floor_ms: float = _T.prefill_floor_ms
    prefill_floor_ms_per_cached_token: float = _T.prefill_floor_ms_per_cached_token
    decode_step_ms: float = _T.decode_step_ms
    decode_ms_per_req: float = _T.decode_ms_per_req
    decode_ms_per_kv_token: float = _T.decode_ms_per_kv_token
    transfer_overhead_ms: float = _T.transfer_overhead_ms
    transfer_ms_per_token: float = _T.transfer_ms_per_token
    token_delay: float | None = None
    bootstrap_timeout: float = 30.0
    waiting_timeout: float = 30.0
    bootstrap_retries: int = 15
    bootstrap_retry_interval: float = 1.0
    transfer_backend: str = "mooncake"
    enable_cache_report: bool = True
    kv_events: KvEventsSettings | None = None
    kv_events_encoding: str = "map"
    seed: int = 0
    log_level: str = "warning"
    num_dp_ranks: int = 1  # schedulers (DP ranks) in this server
    attn_dp: bool = False  # the ranks are attention-DP groups (--enable-dp-attention)
    load_balance_method: str = "round_robin"  # resolved: never "auto"
    enable_trace: bool = False  # record received trace headers (/sim/stats); no spans
    # priority scheduling flags (arg_groups/fields/schedule.py): reported in /server_info;
    # received priorities are counted in /sim/stats (the queue itself stays FIFO)
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    abort_on_priority_when_disabled: bool = False
    enable_pd_role_switch: bool = False  # POST /pd_role_switch allowed (role_switch.py)
    disable_cuda_graph: bool = False  # no decode graphs captured at launch
    faults: Faults = field(default_factory=Faults, compare=False)

    @property
    def engine_type(self) -> str:
        """The `engine_type` metric label SGLang derives from the mode."""
        return {"prefill": "prefill", "decode": "decode"}.get(self.mode, "unified")

    @property
    def max_req_input_len(self) -> int:
        """Prompts must be shorter: mirrors TpModelWorker's (managers/tp_worker.py), the
        context or the KV pool less 1, less 5; reported in /server_info."""
        return min(self.context_length - 1, self.max_total_tokens - 1) - 5

    @property
    def dp_size(self) -> int:
        """`dp_size` as /server_info reports it: replicas, 1 under attention DP.

        mirrors parallel_hook._handle_deprecated_dp_attention (arg_groups/parallel_hook.py):
        `--dp-size N --enable-dp-attention` resolves to attn_dp_size=N, dp_size=1.
        """
        return 1 if self.attn_dp else self.num_dp_ranks

    @property
    def attn_dp_size(self) -> int:
        return self.num_dp_ranks if self.attn_dp else 1

    @property
    def follow_bootstrap_room(self) -> bool:
        return self.load_balance_method == "follow_bootstrap_room"


def _flag_table() -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every flag (with SGLang-spelled aliases) and its help; defaults come from the dataclasses."""
    d = SimConfig()
    f = Faults()
    return [
        (("--mode", "--disaggregation-mode"),
         {"choices": MODES, "default": d.mode, "help": "prefill, decode, or null (plain server)"}),
        (("--host",), {"default": d.host, "help": "address of the HTTP and bootstrap servers"}),
        (("--port",), {"type": int, "default": d.port, "help": "HTTP port"}),
        (("--bootstrap-port", "--disaggregation-bootstrap-port"),
         {"type": int, "default": d.bootstrap_port, "help": "bootstrap server port (prefill)"}),
        (("--model-path",), {"default": d.model_path, "help": "model path it reports"}),
        (("--served-model-name", "--model-name"),
         {"dest": "model_name", "default": None,
          "help": "the model's name in the API (default: the model path, as SGLang)"}),
        (("--page-size",), {"type": int, "default": d.page_size, "help": "KV page size in tokens"}),
        (("--dp-size", "--data-parallel-size"),
         {"type": int, "default": 1, "help": "DP ranks: schedulers, each with its own cache"}),
        (("--attn-dp-size", "--attention-data-parallel-size"),
         {"type": int, "default": 1, "help": "attention-DP ranks (as --dp-size N --enable-dp-attention)"}),
        (("--enable-dp-attention",), {"action": "store_true",
                                      "help": "the --dp-size ranks are attention-DP groups"}),
        (("--load-balance-method",), {"choices": LOAD_BALANCE_METHODS, "default": "auto",
                                      "help": "how requests pick a DP rank"}),
        (("--max-running-requests",),
         {"type": int, "default": d.max_running_requests, "help": "running batch limit"}),
        (("--max-total-tokens",), {"type": int, "default": d.max_total_tokens,
                                   "help": "KV pool size in tokens (token_usage denominator)"}),
        (("--cache-capacity-tokens",), {"type": int, "default": None,
                                        "help": "prefix cache capacity; default: max-total-tokens"}),
        (("--chunked-prefill-size",),
         {"type": int, "default": d.chunked_prefill_size, "help": "prefill tokens per batch"}),
        (("--context-length",), {"type": int, "default": d.context_length,
                                 "help": "longest prompt + output"}),
        (("--default-max-new-tokens",), {"type": int, "default": d.default_max_new_tokens,
                                         "help": "max_new_tokens when a request gives none"}),
        (("--timing",), {"choices": tuple(PROFILES), "default": d.timing,
                         "help": "timing profile (docs/SIMULATOR.md); the knobs below override"}),
        *(((f"--{k.replace('_', '-')}",), {"type": float, "default": argparse.SUPPRESS,
                                          "help": f"{KNOB_HELP[k]}, ms (default: --timing's)"})
          for k in KNOBS),
        (("--token-delay",), {"type": float, "default": None,
                              "help": "fixed seconds per decode step, overriding the model"}),
        (("--fast",), {"action": "store_true", "help": "zero every timing-model delay (tests)"}),
        (("--bootstrap-timeout",), {"type": float, "default": d.bootstrap_timeout,
                                    "help": "seconds a prefill waits for its decode"}),
        (("--waiting-timeout",), {"type": float, "default": d.waiting_timeout,
                                  "help": "seconds a decode waits for the KV"}),
        (("--bootstrap-retries",), {"type": int, "default": d.bootstrap_retries,
                                    "help": "decode attempts to reach a bootstrap server"}),
        (("--bootstrap-retry-interval",), {"type": float, "default": d.bootstrap_retry_interval,
                                           "help": "seconds between those attempts"}),
        (("--transfer-backend", "--disaggregation-transfer-backend"),
         {"default": d.transfer_backend, "help": "reported in /server_info only"}),
        (("--enable-cache-report",), {"action": argparse.BooleanOptionalAction,
                                      "default": d.enable_cache_report,
                                      "help": "usage.prompt_tokens_details.cached_tokens"}),
        (("--enable-trace",), {"action": "store_true",
                               "help": "record the traceparent/tracestate headers of generation "
                                       "requests in /sim/stats (emits no spans)"}),
        (("--enable-metrics",), {"action": "store_true",
                                 "help": "accepted for SGLang compatibility; /metrics is always on"}),
        (("--kv-events-config",), {"default": None, "help": "SGLang KVEventsConfig JSON"}),
        (("--kv-events-encoding",), {"choices": ("map", "array"), "default": d.kv_events_encoding,
                                     "help": "event encoding: tagged maps (0.5.x) or arrays"}),
        (("--seed",), {"type": int, "default": d.seed, "help": "seed of the --error-rate draw"}),
        (("--log-level",), {"default": d.log_level, "help": "uvicorn and sim log level"}),
        (("--error-rate",), {"type": float, "default": f.error_rate,
                             "help": "fraction of generation requests answered 500"}),
        (("--enable-priority-scheduling",), {"action": "store_true",
                                             "help": "report priority scheduling as on"}),
        (("--schedule-low-priority-values-first",), {"action": "store_true",
                                                     "help": "report lower values first"}),
        (("--abort-on-priority-when-disabled",), {"action": "store_true", "help": (
            "answer 503 to requests with a priority while priority scheduling is off")}),
        (("--enable-pd-role-switch",), {"action": "store_true", "help": (
            "allow POST /pd_role_switch (prefill <-> decode at runtime; bootstrap server on "
            "every PD instance)")}),
        (("--disable-cuda-graph",), {"action": "store_true",
                                     "help": "no decode CUDA graphs at launch (role switch)"}),
        (("--hang",), {"action": "store_true", "help": "never answer generation requests"}),
        (("--crash-after",), {"type": int, "default": f.crash_after,
                              "help": "exit hard when request N+1 arrives (0: never)"}),
        (("--slow-start",), {"type": float, "default": f.slow_start,
                             "help": "health answers 503 for this many seconds"}),
        (("--health-fail",), {"action": "store_true", "help": "health answers 503"}),
        (("--first-token-delay",), {"type": float, "default": f.first_token_delay,
                                    "help": "extra seconds before each item's first token"}),
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m backends.sim",
        description="Simulated SGLang 0.5.23 server (prefill, decode or plain).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for names, options in _flag_table():
        parser.add_argument(*names, **options)
    return parser


def config_from_args(argv: list[str] | None = None) -> SimConfig:
    """Parse and validate flags; raises SystemExit(2) on bad input."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return _resolve(ns)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _resolve(ns: argparse.Namespace) -> SimConfig:
    profile = PROFILES[ns.timing].knobs()
    timing = {k: getattr(ns, k, profile[k]) for k in KNOBS}  # a given flag beats the profile
    if ns.fast:
        timing = {k: 0.0 for k in timing}
    token_delay = 0.0 if ns.fast and ns.token_delay is None else ns.token_delay
    faults = Faults()
    faults.update({
        "error_rate": ns.error_rate, "hang": ns.hang, "crash_after": ns.crash_after,
        "slow_start": ns.slow_start, "health_fail": ns.health_fail,
        "first_token_delay": ns.first_token_delay,
    })
    kv_events = KvEventsSettings.parse(ns.kv_events_config) if ns.kv_events_config else None
    for name in ("page_size", "max_running_requests", "max_total_tokens", "chunked_prefill_size",
                 "context_length", "default_max_new_tokens"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if any(v < 0 for v in timing.values()) or (token_delay or 0) < 0:
        raise ValueError("timing figures must be >= 0")
    if ns.bootstrap_retries < 1:
        raise ValueError("--bootstrap-retries must be >= 1")
    num_dp_ranks, attn_dp = _dp_layout(ns)
    if kv_events is not None and num_dp_ranks > 1 and not kv_events.endpoint.startswith(
            ("tcp", "inproc")):
        # mirrors ZmqEventPublisher.offset_endpoint_port (disaggregation/kv_events.py)
        raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")
    capacity = ns.cache_capacity_tokens
    return SimConfig(
        mode=ns.mode, host=ns.host, port=ns.port, bootstrap_port=ns.bootstrap_port,
        model_path=ns.model_path, model_name=ns.model_name or ns.model_path,
        page_size=ns.page_size,
        max_running_requests=ns.max_running_requests, max_total_tokens=ns.max_total_tokens,
        cache_capacity_tokens=ns.max_total_tokens if capacity is None else max(0, capacity),
        chunked_prefill_size=ns.chunked_prefill_size, context_length=ns.context_length,
        default_max_new_tokens=ns.default_max_new_tokens, token_delay=token_delay,
        bootstrap_timeout=ns.bootstrap_timeout, waiting_timeout=ns.waiting_timeout,
        bootstrap_retries=ns.bootstrap_retries,
        bootstrap_retry_interval=ns.bootstrap_retry_interval,
        transfer_backend=ns.transfer_backend, enable_cache_report=ns.enable_cache_report,
        kv_events=kv_events, kv_events_encoding=ns.kv_events_encoding, seed=ns.seed,
        log_level=ns.log_level, num_dp_ranks=num_dp_ranks, attn_dp=attn_dp,
        load_balance_method=resolve_load_balance_method(ns.load_balance_method, ns.mode),
        enable_trace=ns.enable_trace,
        enable_priority_scheduling=ns.enable_priority_scheduling,
        schedule_low_priority_values_first=ns.schedule_low_priority_values_first,
        abort_on_priority_when_disabled=ns.abort_on_priority_when_disabled,
        enable_pd_role_switch=ns.enable_pd_role_switch, disable_cuda_graph=ns.disable_cuda_graph,
        faults=faults, timing=ns.timing, **timing,
    )


def _dp_layout(ns: argparse.Namespace) -> tuple[int, bool]:
    """(DP ranks, attention DP?) from --dp-size, --attn-dp-size, --enable-dp-attention.

    mirrors parallel_hook._handle_deprecated_dp_attention (arg_groups/parallel_hook.py) and
    num_dp_ranks_of (runtime_context.py): ranks = dp_size * attn_dp_size, one of them 1.
    """
    if ns.dp_size < 1 or ns.attn_dp_size < 1:
        raise ValueError("--dp-size and --attn-dp-size must be >= 1")
    dp, attn = ns.dp_size, ns.attn_dp_size
    if ns.enable_dp_attention and attn == 1:
        dp, attn = 1, dp
    if dp > 1 and attn > 1:
        # mirrors context_parallel_attn_dp_size's assert (arg_groups/model_override_base.py)
        raise ValueError(f"--dp-size {dp} with --attn-dp-size {attn}: use one of them")
    return dp * attn, attn > 1


def resolve_load_balance_method(method: str, mode: str) -> str:
    """auto -> follow_bootstrap_room on a PD prefill, round_robin otherwise.

    mirrors handle_load_balance_method (arg_groups/serving_hook.py).
    """
    if method != "auto":
        return method
    return "follow_bootstrap_room" if mode == "prefill" else "round_robin"
