"""One fix to an HF config.json that both the trainer (transformers) and the nodes (vLLM) depend on."""

from __future__ import annotations

import json
from pathlib import Path

from swarm_common.atomic import write_atomic


def hoist_rope_theta(model_dir: str | Path, default: float | None = None) -> float | None:
    """vLLM reads `rope_theta` at the top level of config.json; transformers 5 nests it under
    `rope_parameters` when it saves. Write it at the top level too (from the nested value, else the top
    level's, else `default`) and return it; leave the file alone when none is known."""
    path = Path(model_dir) / "config.json"
    data = json.loads(path.read_text())
    rope = data.get("rope_parameters") or {}
    theta = rope.get("rope_theta", data.get("rope_theta", default))
    if theta is None:
        return None
    data["rope_theta"] = float(theta)
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True))
    return float(theta)
