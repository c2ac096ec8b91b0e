"""Task lookup by name, with keyword parameters from the run's config."""

from __future__ import annotations

from rewards.arithmetic import ArithmeticTask
from rewards.base import Task
from rewards.calculator import CalculatorEnv
from rewards.guess import GuessEnv

TASKS = {"arithmetic": ArithmeticTask, "calculator": CalculatorEnv, "guess": GuessEnv}


def make_task(name: str, **params) -> Task:
    # reasoning-gym tasks: "gym" with params.dataset, or "gym:DATASET" (a dataset or a rewards.gym preset).
    # Imported here so the core install does not need reasoning-gym.
    if name == "gym" or name.startswith("gym:"):
        from rewards.gym import GymTask

        if name != "gym":
            params = {**params, "dataset": name[4:]}
        return GymTask(**params)
    if name == "python":  # the code tool: its sandbox is only looked for when it is used
        from rewards.python_tool import PythonEnv

        return PythonEnv(**params)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}, python, gym:DATASET")
    return TASKS[name](**params)
