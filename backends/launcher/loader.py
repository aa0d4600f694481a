"""Build a `Topology` from a YAML/TOML file or a dict, expanding a short spec into explicit servers.

A spec may give counts (`prefill: 1`, `decode: 2`) or lists of server tables. Missing ports are
picked (sequential from `base_port`, or free ports), missing GPU ids are packed per machine, and
`defaults` (`all`, `prefill`, `decode`, `plain`) are merged into every server: args are
concatenated (all, role, server), env and other keys are overridden in that order.
Several models: `models:` lists models, each with its `model_name`/`model_path` and its own
servers (counts or lists, as at the top level); a server's `model_*` keys override the
top level's, its model's override both.
Strings may use `${VAR}` or `${VAR:-default}`; `${TOPOLOGY_DIR}` is the file's directory.
Unknown keys and wrong types are errors naming the key; all are reported at once.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from backends.launcher.errors import TopologyError
from backends.launcher.ports import free_ports, is_local
from backends.launcher.topology import (
    BACKENDS,
    DEVICES,
    LOOPBACK,
    ROLES,
    Backend,
    RestartPolicy,
    Role,
    ServerSpec,
    Topology,
)

SERVER_KEYS = frozenset(
    {
        "host",
        "port",
        "bootstrap_port",
        "tp_size",
        "base_gpu_id",
        "ib_device",
        "transfer_backend",
        "args",
        "env",
        "model_path",
        "model_name",
        "enable_pd_role_switch",
    }
)
DEFAULT_KEYS = SERVER_KEYS - {"port", "bootstrap_port"}
# one entry of `models:`: a model and its servers (role counts or lists, as at the top level)
MODEL_KEYS = frozenset({"model_path", "model_name", *ROLES})
RESTART_KEYS = frozenset(f.name for f in dataclasses.fields(RestartPolicy))
SCALAR_KEYS = {  # top-level key -> type
    "backend": str,
    "model_path": str,
    "model_name": str,
    "python": str,
    "device": str,
    "log_dir": str,
    "cwd": str,
    "host": str,
    "base_port": int,
    "bootstrap_base_port": int,
    "readiness_timeout_s": float,
    "health_path": str,
    "health_interval_s": float,
    "stop_grace_s": float,
    "enable_pd_role_switch": bool,  # every prefill and decode server (a server's key wins)
}
TOP_KEYS = frozenset(SCALAR_KEYS) | {"restart", "defaults", "models", *ROLES}
_Merged = list[tuple[Role, int, dict[str, Any]]]
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def load_topology(path: str | Path, variables: Mapping[str, str] | None = None) -> Topology:
    """Read a `.yaml`/`.yml`/`.toml`/`.json` topology file and expand it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TopologyError([f"cannot read {path}: {exc}"]) from exc
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # every parser error is one clear problem
        raise TopologyError([f"cannot parse {path}: {exc}"]) from exc
    merged = dict(os.environ if variables is None else variables)
    merged.setdefault("TOPOLOGY_DIR", str(path.resolve().parent))
    return topology_from_dict(data, variables=merged)


def topology_from_dict(data: Any, variables: Mapping[str, str] | None = None) -> Topology:
    """Expand a spec (as parsed from YAML/TOML) into a `Topology`; TopologyError lists problems."""
    parser = _Parser(dict(os.environ) if variables is None else variables)
    topology = parser.parse(data)
    if parser.problems or topology is None:
        raise TopologyError(parser.problems or ["empty topology"])
    return topology


def default_topology(
    backend: str = "sim", prefill: int = 1, decode: int = 2, **top: Any
) -> Topology:
    """The no-GPU default: 1 prefill + 2 decode simulated servers on free loopback ports."""
    return topology_from_dict({"backend": backend, "prefill": prefill, "decode": decode, **top})


class _Parser:
    """Collects problems while converting, so one error lists everything wrong."""

    def __init__(self, variables: Mapping[str, str]) -> None:
        self.variables = variables
        self.problems: list[str] = []

    def parse(self, data: Any) -> Topology | None:
        if not isinstance(data, Mapping):
            self.problems.append("the topology must be a mapping of keys to values")
            return None
        self._unknown("topology", data, TOP_KEYS)
        top = {
            key: self._scalar(key, data[key], kind)
            for key, kind in SCALAR_KEYS.items()
            if data.get(key) is not None
        }
        backend = top.get("backend")
        if backend not in BACKENDS:
            self.problems.append(f"backend: must be one of {', '.join(BACKENDS)} (got {backend!r})")
        device = top.get("device", "cuda")
        if device not in DEVICES:
            self.problems.append(f"device: must be one of {', '.join(DEVICES)} (got {device!r})")
        restart = self._restart(data.get("restart") or {})
        servers = self._servers(data, top, gpu_packing=backend != "sim" and device != "cpu")
        if self.problems:
            return None
        optional = {
            key: top[key]
            for key in (
                "model_path",
                "model_name",
                "readiness_timeout_s",
                "health_path",
                "health_interval_s",
                "stop_grace_s",
            )
            if key in top
        }
        return Topology(
            backend=cast(Backend, backend),
            servers=servers,
            python=top.get("python", sys.executable),
            device=device,
            log_dir=Path(top.get("log_dir", "logs/launcher")),
            cwd=Path(top["cwd"]) if "cwd" in top else None,
            restart=restart,
            **optional,
        )

    def _unknown(self, where: str, table: Mapping[str, Any], allowed: frozenset[str]) -> None:
        for key in table:
            if key not in allowed:
                self.problems.append(
                    f"{where}: unknown key {key!r} (allowed: {', '.join(sorted(allowed))})"
                )

    def _expand(self, where: str, value: str) -> str:
        def replace(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in self.variables and self.variables[name] != "":
                return self.variables[name]
            if default is not None:
                return default
            self.problems.append(f"{where}: variable ${{{name}}} is not set")
            return ""

        return _VAR.sub(replace, value)

    def _scalar(self, where: str, value: Any, kind: type) -> Any:
        if kind is str and isinstance(value, str):
            return self._expand(where, value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is bool and isinstance(value, bool):
            return value
        self.problems.append(f"{where}: expected {kind.__name__}, got {value!r}")
        return None

    def _restart(self, raw: Any) -> RestartPolicy:
        if not isinstance(raw, Mapping):
            self.problems.append("restart: expected a table")
            return RestartPolicy()
        self._unknown("restart", raw, RESTART_KEYS)
        values = {
            key: self._scalar(f"restart.{key}", raw[key], int if key == "max_restarts" else float)
            for key in RESTART_KEYS & raw.keys()
        }
        return RestartPolicy(**{k: v for k, v in values.items() if v is not None})

    def _args(self, where: str, raw: Any) -> list[str]:
        if isinstance(raw, str):
            return [self._expand(where, arg) for arg in shlex.split(raw)]
        if isinstance(raw, list) and all(isinstance(a, (str, int, float)) for a in raw):
            return [self._expand(where, str(arg)) for arg in raw]
        self.problems.append(f"{where}: expected a list of strings or one string")
        return []

    def _env(self, where: str, raw: Any) -> dict[str, str]:
        if not isinstance(raw, Mapping):
            self.problems.append(f"{where}: expected a table of NAME: value")
            return {}
        env = {}
        for name, value in raw.items():
            if isinstance(value, bool):
                value = "1" if value else "0"
            env[str(name)] = self._expand(f"{where}.{name}", str(value))
        return env

    def _merge(self, where: str, layers: list[Mapping[str, Any]]) -> dict[str, Any]:
        """Merge defaults and the server table: args concatenate, env and scalars override."""
        merged: dict[str, Any] = {"args": [], "env": {}}
        for layer_where, layer in zip(
            ("defaults.all", "defaults.role", where), layers, strict=True
        ):
            for key, value in layer.items():
                if key == "args":
                    merged["args"] += self._args(f"{layer_where}.args", value)
                elif key == "env":
                    merged["env"].update(self._env(f"{layer_where}.env", value))
                elif key in ("tp_size", "base_gpu_id", "port", "bootstrap_port"):
                    merged[key] = self._scalar(f"{layer_where}.{key}", value, int)
                elif key == "enable_pd_role_switch":
                    merged[key] = self._scalar(f"{layer_where}.{key}", value, bool)
                elif value is not None:
                    merged[key] = self._scalar(f"{layer_where}.{key}", value, str)
        return {key: value for key, value in merged.items() if value is not None}

    def _entries(self, role: str, raw: Any) -> list[Mapping[str, Any]]:
        if raw is None:
            return []
        if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
            return [{} for _ in range(raw)]
        if isinstance(raw, list) and all(isinstance(item, Mapping) for item in raw):
            for index, item in enumerate(raw):
                self._unknown(f"{role}[{index}]", item, SERVER_KEYS)
            return raw
        self.problems.append(f"{role}: expected a count or a list of server tables")
        return []

    def _servers(
        self, data: Mapping[str, Any], top: Mapping[str, Any], gpu_packing: bool
    ) -> tuple[ServerSpec, ...]:
        defaults = data.get("defaults") or {}
        if not isinstance(defaults, Mapping):
            self.problems.append("defaults: expected a table")
            defaults = {}
        self._unknown("defaults", defaults, frozenset({"all", *ROLES}))
        for name, table in defaults.items():
            if isinstance(table, Mapping):
                self._unknown(f"defaults.{name}", table, DEFAULT_KEYS)
            else:
                self.problems.append(f"defaults.{name}: expected a table")
        table_of = {name: t for name, t in defaults.items() if isinstance(t, Mapping)}
        merged: _Merged = []
        for role in ROLES:
            for index, (where, entry) in enumerate(self._role_entries(data, role)):
                server = self._merge(
                    where, [table_of.get("all", {}), table_of.get(role, {}), entry]
                )
                server.setdefault("host", top.get("host", LOOPBACK))
                switches = server.setdefault(
                    "enable_pd_role_switch", bool(top.get("enable_pd_role_switch")))
                if role == "plain":  # no PD role to switch
                    server["enable_pd_role_switch"] = switches = False
                if role != "prefill" and not switches and server.get("bootstrap_port") is not None:
                    self.problems.append(f"{where}: bootstrap_port applies to prefill servers "
                                         "only (and to servers with enable_pd_role_switch)")
                merged.append((role, index, server))
        self._assign_ports(merged, "port", top.get("base_port"), lambda role, s: True)
        self._assign_ports(
            merged, "bootstrap_port", top.get("bootstrap_base_port"),
            lambda role, s: role == "prefill" or s["enable_pd_role_switch"],
        )
        self._assign_gpus(merged, gpu_packing)
        return tuple(
            ServerSpec(
                role=role,
                index=index,
                host=s["host"],
                port=s["port"],
                bootstrap_port=s.get("bootstrap_port"),
                tp_size=s.get("tp_size", 1),
                base_gpu_id=s["base_gpu_id"],
                ib_device=s.get("ib_device"),
                transfer_backend=s.get("transfer_backend", "mooncake"),
                args=tuple(s["args"]),
                env=tuple(s["env"].items()),
                model_path=s.get("model_path"),
                model_name=s.get("model_name"),
                pd_role_switch=s["enable_pd_role_switch"],
            )
            for role, index, s in merged
        )

    def _role_entries(self, data: Mapping[str, Any], role: Role) -> list[tuple[str, Mapping]]:
        """The server tables of `role`: the top level's, then each model's of `models:`
        with that model's `model_path` and `model_name` (indices run on across models)."""
        found = [(f"{role}[{i}]", e) for i, e in enumerate(self._entries(role, data.get(role)))]
        groups = data.get("models") or []
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
            if role == ROLES[0]:
                self.problems.append("models: expected a list of model tables")
            return found
        for number, group in enumerate(groups):
            where = f"models[{number}]"
            if role == ROLES[0]:
                self._unknown(where, group, MODEL_KEYS)
                if not group.get("model_name") and not group.get("model_path"):
                    self.problems.append(f"{where}: needs model_name or model_path")
            own = {k: group[k] for k in ("model_path", "model_name") if group.get(k)}
            entries = self._entries(f"{where}.{role}", group.get(role))
            found += [(f"{where}.{role}[{i}]", {**own, **e}) for i, e in enumerate(entries)]
        return found

    def _assign_ports(
        self, merged: _Merged, key: str, base: int | None,
        wants: Callable[[Role, dict[str, Any]], bool],
    ) -> None:
        """Fill missing ports: sequential from `base`, else free ports of the server's host."""
        taken: dict[str, set[int]] = {}
        for _, _, s in merged:
            for port_key in ("port", "bootstrap_port"):
                if s.get(port_key) is not None:
                    taken.setdefault(s["host"], set()).add(s[port_key])
        next_port = base
        for role, index, s in merged:
            if not wants(role, s) or s.get(key) is not None:
                continue
            host_taken = taken.setdefault(s["host"], set())
            if next_port is not None:
                while next_port in host_taken:
                    next_port += 1
                s[key], next_port = next_port, next_port + 1
            elif is_local(s["host"]):
                s[key] = free_ports(s["host"], 1, avoid=host_taken)[0]
            else:
                self.problems.append(
                    f"{role}[{index}]: {key} is required: host {s['host']!r} "
                    "is not an address of this machine"
                )
                s[key] = 0
            host_taken.add(s[key])

    def _assign_gpus(self, merged: _Merged, packing: bool) -> None:
        """Give servers without base_gpu_id the next GPUs no explicit server uses (or 0)."""
        used = {
            gpu
            for _, _, s in merged
            if s.get("base_gpu_id") is not None
            for gpu in range(s["base_gpu_id"], s["base_gpu_id"] + s.get("tp_size", 1))
        }
        cursor = 0
        for _, _, s in merged:
            if s.get("base_gpu_id") is not None:
                continue
            if not packing:
                s["base_gpu_id"] = 0
                continue
            width = max(s.get("tp_size") or 1, 1)
            while used & set(range(cursor, cursor + width)):
                cursor += 1
            s["base_gpu_id"] = cursor
            used |= set(range(cursor, cursor + width))
            cursor += width
