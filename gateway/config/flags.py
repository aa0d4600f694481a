"""The command line of the config: flags generated from the settings' fields, and what each
setting accepts (read from its type), for `--help` and for error messages."""

from __future__ import annotations

import argparse
import typing
from typing import Annotated, Literal


def allowed(hints: dict, name: str) -> str:
    """What a setting accepts, read from its type: a choice set or a numeric range."""
    hint = hints[name]
    if typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    if typing.get_origin(hint) is Annotated:
        base = typing.get_args(hint)[0]
        bounds = {}
        for meta in hint.__metadata__:
            for bound in getattr(meta, "metadata", [meta]):
                for key in ("gt", "ge", "lt", "le"):
                    if getattr(bound, key, None) is not None:
                        bounds[key] = getattr(bound, key)
        if base is int:  # integers: exclusive bounds become inclusive ones
            if "gt" in bounds:
                bounds["ge"] = bounds.pop("gt") + 1
            if "lt" in bounds:
                bounds["le"] = bounds.pop("lt") - 1
        low = f"{bounds['ge']}" if "ge" in bounds else f"> {bounds['gt']}" if "gt" in bounds else ""
        high = f"{bounds['le']}" if "le" in bounds else f"< {bounds['lt']}" if "lt" in bounds else ""
        if low.startswith(">"):
            return f"{low} and <= {high}" if high else low
        return f"{low}..{high}"
    return ""


def build_parser(fields: list, hints: dict) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway", allow_abbrev=False,
        description="PD-disaggregation gateway for SGLang prefill and decode servers.",
    )
    parser.add_argument(
        "--prefill", nargs="+", action="append", default=[], metavar="URL [BOOTSTRAP_PORT]",
        help="prefill server URL(s), comma-separated or repeated, each optionally "
        "followed by its bootstrap port (read from /server_info when omitted)",
    )
    parser.add_argument(
        "--decode", nargs="+", action="append", default=[], metavar="URL",
        help="decode server URL(s), comma-separated or repeated",
    )
    parser.add_argument("--config", help="YAML or TOML file with the same settings")
    for f in fields:
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        accepts = allowed(hints, f.name)
        help_text = f.metadata["help"] + (f" [{accepts}]" if accepts else "")
        if f.type == "bool":
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        elif f.metadata.get("kind") == "list":  # repeated flags add up (--api-key a --api-key b)
            parser.add_argument(*flags, dest=f.name, action=_Joined, default=None,
                                help=help_text + " (may be repeated)")
        else:
            parser.add_argument(*flags, dest=f.name, default=None, help=help_text)
    return parser


class _Joined(argparse.Action):
    """A list setting given several times: the values are joined with commas, so a second
    `--api-key` adds a key instead of silently replacing the first."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if before is None else f"{before},{values}")


def describe_error(error: dict, hints: dict) -> str:
    """One pydantic error as 'setting X: what is allowed (got V)'."""
    loc = error.get("loc") or ("?",)
    name = str(loc[0])
    where = ".".join(str(part) for part in loc)  # a nested setting: tenants.team-a.priority
    message = error.get("msg", "invalid value")
    context = error.get("ctx") or {}
    if "expected" in context:
        message = f"must be one of {context['expected']}"
    got = error.get("input")
    accepts = allowed(hints, name) if name in hints else ""
    suffix = f"; allowed: {accepts}" if accepts and "one of" not in message else ""
    return f"setting {where!r}: {message} (got {got!r}){suffix}"


