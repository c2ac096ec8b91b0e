"""Task lookup by name, with keyword parameters from the run's config."""

from __future__ import annotations

from rewards.arithmetic import ArithmeticTask
from rewards.base import Task

TASKS = {"arithmetic": ArithmeticTask}


def make_task(name: str, **params) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    return TASKS[name](**params)
