"""Summarise a py-spy profile in collapsed-stack form (`py-spy record --format raw`).

Each line of the file is `frame;frame;...;frame COUNT`, outermost frame first, each frame
`function (file:line)`. Self time goes to the last frame; inclusive time to every distinct
frame of the stack. `python -m loadtests.profile FILE` prints the top functions.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_SITE = re.compile(r".*/(site-packages|lib/python3\.\d+)/")


def _short(frame: str) -> str:
    return _SITE.sub("", frame.replace(str(Path.cwd()) + "/", ""))


def read(path: Path) -> tuple[Counter, Counter, int]:
    own: Counter = Counter()
    inclusive: Counter = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_short(f) for f in stack.split(";") if f]
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    return own, inclusive, total


def summary(path: Path, top: int = 20) -> str:
    own, inclusive, total = read(path)
    if not total:
        return f"{path}: no samples"
    lines = [f"{path}: {total} samples (non-idle)", "", f"top {top} by self time:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    lines += ["", f"top {top} by inclusive time:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in inclusive.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    for path in args.files:
        print(summary(path, args.top))
        print()


if __name__ == "__main__":
    main()
