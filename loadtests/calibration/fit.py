"""Fit the simulator's timing profile (backends/sim/timing.py) to a gpu_calibrate.py table.

    python -m loadtests.calibration.fit loadtests/calibration/h200_llama3_8b.json

Least squares on relative error, in plain Python (no numpy on the simulator's path):
- decode: step ms = step + per_req * batch + per_kv * batch * ctx, one linear fit;
- prefill: ms = max(floor + floor_per_cached * cached, compute) with compute linear in
  (1, new, new^2/2e6, new*cached/1e6): each point is given to the branch that predicts more,
  both branches are refitted on their points, until the split stops changing.
Prints the coefficients as TimingProfile arguments and the largest relative error of each part.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

Row = Sequence[float]


def lstsq_relative(rows: list[Row], ys: list[float]) -> list[float]:
    """Coefficients minimising sum(((row . beta) / y - 1)^2): normal equations, pivoting."""
    k = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    a = [[0.0] * (k + 1) for _ in range(k)]
    for row, y in zip(rows, ys, strict=True):
        x = [row[j] / scale[j] / y for j in range(k)]
        for i in range(k):
            for j in range(k):
                a[i][j] += x[i] * x[j]
            a[i][k] += x[i]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-300:
            raise ValueError("singular fit: too few distinct points")
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * p for v, p in zip(a[r], a[col], strict=True)]
    return [a[i][k] / a[i][i] / scale[i] for i in range(k)]


def _compute_row(new: float, cached: float) -> Row:
    return (1.0, new, new * new / 2e6, new * cached / 1e6)


def _floor_row(new: float, cached: float) -> Row:
    return (1.0, cached)


def _dot(beta: Sequence[float], row: Row) -> float:
    return sum(b * x for b, x in zip(beta, row, strict=True))


def fit_prefill(points: list[tuple[int, int, float]]) -> tuple[dict[str, float], float]:
    """(coefficients, max relative error) of the two-branch prefill model."""
    in_floor = [new <= 512 for new, _, _ in points]
    for _ in range(50):
        comp = [p for p, f in zip(points, in_floor, strict=True) if not f]
        flo = [p for p, f in zip(points, in_floor, strict=True) if f]
        c = lstsq_relative([_compute_row(n, k) for n, k, _ in comp], [y for *_, y in comp])
        f = lstsq_relative([_floor_row(n, k) for n, k, _ in flo], [y for *_, y in flo])
        again = [_dot(f, _floor_row(n, k)) > _dot(c, _compute_row(n, k)) for n, k, _ in points]
        if again == in_floor or sum(again) < 2 or len(again) - sum(again) < 4:
            break  # settled, or a branch would keep fewer points than it has coefficients
        in_floor = again
    coeffs = {
        "prefill_overhead_ms": c[0], "prefill_ms_per_token": c[1],
        "prefill_ms_per_mpair_new": c[2], "prefill_ms_per_mpair_cached": c[3],
        "prefill_floor_ms": f[0], "prefill_floor_ms_per_cached_token": f[1],
    }

    def predict(n: int, k: int) -> float:
        return max(_dot(f, _floor_row(n, k)), _dot(c, _compute_row(n, k)))

    return coeffs, max_error(points, predict)


def fit_decode(points: list[tuple[int, int, float]]) -> tuple[dict[str, float], float]:
    """(coefficients, max relative error) of the linear decode-step model."""
    beta = lstsq_relative([(1.0, b, b * t) for b, t, _ in points], [y for *_, y in points])
    coeffs = {"decode_step_ms": beta[0], "decode_ms_per_req": beta[1],
              "decode_ms_per_kv_token": beta[2]}
    return coeffs, max_error(points, lambda b, t: _dot(beta, (1.0, b, b * t)))


def max_error(points: list[tuple[int, int, float]], predict: Callable[[int, int], float]) -> float:
    return max(abs(predict(a, b) / y - 1) for a, b, y in points)


def fit_table(table: dict, model: str | None = None) -> dict[str, dict]:
    """Fit every model of a gpu_calibrate.py JSON (or the one named)."""
    out = {}
    for name, data in table["models"].items():
        if model is not None and name != model:
            continue
        prefill, p_err = fit_prefill([(r["new"], r["cached"], r["ms"]) for r in data["prefill"]])
        decode, d_err = fit_decode([(r["batch"], r["ctx"], r["ms"]) for r in data["decode"]])
        gbps = table.get("d2h_copy_gbps")
        transfer = data["kv_bytes_per_token"] / (gbps * 1e9) * 1e3 if gbps else None
        out[name] = {"prefill": prefill, "prefill_max_rel_error": p_err, "decode": decode,
                     "decode_max_rel_error": d_err, "transfer_ms_per_token": transfer,
                     "kv_bytes_per_token": data["kv_bytes_per_token"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tables", nargs="+", help="gpu_calibrate.py JSON files")
    args = parser.parse_args(argv)
    for path in args.tables:
        with open(path) as fh:
            fits = fit_table(json.load(fh))
        for name, fit in fits.items():
            print(f"# {path} [{name}]: prefill max rel error {fit['prefill_max_rel_error']:.3f}, "
                  f"decode {fit['decode_max_rel_error']:.3f}")
            for key, value in {**fit["prefill"], **fit["decode"]}.items():
                print(f"    {key}={value:.5g},")
            if fit["transfer_ms_per_token"] is not None:
                print(f"    transfer_ms_per_token={fit['transfer_ms_per_token']:.5g},")
    return 0


if __name__ == "__main__":
    sys.exit(main())
