"""The race's figures (bench/vs_trl.py): time to a target accuracy, accuracy at a budget, medians over seeds."""

from __future__ import annotations

import statistics


def time_to(curve: list, target: float) -> float | None:
    return next((t for _, t, a in curve if a >= target), None)


def acc_at(curve: list, seconds: float) -> float:
    """Accuracy of the newest evaluation at or before `seconds` of RL time."""
    return [a for _, t, a in curve if t <= seconds + 1e-9][-1]


def fmt_seconds(x: float | None) -> str:
    return "never" if x is None else f"{x:.0f}"


def summarize(rows: dict[int, dict[str, dict]], seeds: list[int]) -> dict:
    """Per arm over seeds: median time to target (unreached = never) and mean accuracy at the budget."""
    arms: dict[str, dict] = {}
    for arm in next(iter(rows.values())):
        runs = [rows[s][arm] for s in seeds]
        inf = float("inf")
        tts = [inf if r["time_to_target_s"] is None else r["time_to_target_s"] for r in runs]
        ltts = [inf if r["launch_to_target_s"] is None else r["launch_to_target_s"] for r in runs]
        arms[arm] = {"reached": sum(x < inf for x in tts), "median_tt": statistics.median(tts),
                     "median_launch_tt": statistics.median(ltts),
                     "mean_acc_at_budget": statistics.fmean(r["acc_at_budget"] for r in runs),
                     "mean_final_acc": statistics.fmean(r["final_acc"] for r in runs),
                     "mean_s_per_step": statistics.fmean(r["s_per_step"] for r in runs)}
    out: dict = {"arms": {k: {kk: (None if vv == float("inf") else vv) for kk, vv in v.items()}
                          for k, v in arms.items()}}
    if "swarm" in arms and "trl" in arms:
        a, b = arms["swarm"]["median_tt"], arms["trl"]["median_tt"]
        if 0 < a < float("inf") and b < float("inf"):
            out["speedup"] = b / a
            out["speedup_from_launch"] = arms["trl"]["median_launch_tt"] / arms["swarm"]["median_launch_tt"]
        elif a < float("inf"):
            out["trl_never_reached"] = True
    return out
