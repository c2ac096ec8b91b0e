"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards of the
model and optimizer; rank 0 writes the run's state beside them (state.json, the TrainerState of
trainer/checkpoint.py, its RNG, and the model's signature). Any number of ranks, or an unsharded model in
one process, can load one: DCP reshards on load. The directory is made whole or not at all by the caller
(swarm_common.atomic.building_dir), as today's checkpoints are.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from trainer.checkpoint import TrainerState


class IncompatibleCheckpoint(ValueError):
    pass


class ModelSignature(msgspec.Struct):
    model_type: str
    shapes: dict[str, list[int]]  # every state_dict entry's full shape


def model_signature(model) -> ModelSignature:
    return ModelSignature(model.config.model_type, {k: list(v.shape) for k, v in model.state_dict().items()})


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / ".metadata").exists()


def check_compatible(path: Path, model) -> None:
    """Refuse, before any rank reads a shard, a checkpoint written for another model."""
    try:
        theirs = msgspec.json.decode((path / "model.json").read_bytes(), type=ModelSignature)
    except (OSError, msgspec.DecodeError) as e:
        raise IncompatibleCheckpoint(f"{path}: no readable model.json, not a sharded trainer checkpoint ({e})"
                                     ) from None
    ours = model_signature(model)
    if theirs == ours:
        return
    problems = []
    if theirs.model_type != ours.model_type:
        problems.append(f"model type {theirs.model_type} here {ours.model_type}")
    problems += [f"{k} missing" for k in ours.shapes if k not in theirs.shapes]
    problems += [f"{k} unexpected" for k in theirs.shapes if k not in ours.shapes]
    problems += [f"{k} {theirs.shapes[k]} here {s}" for k, s in ours.shapes.items()
                 if k in theirs.shapes and theirs.shapes[k] != s]
    raise IncompatibleCheckpoint(f"checkpoint {path} was written for another model ({len(problems)} "
                                 f"differences: {'; '.join(problems[:5])})")


def _states(model, optimizer) -> dict:
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


@contextmanager
def _one_process_quietly() -> Iterator[None]:
    """DCP warns on every use without a process group, which is how one process loads on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_shards(path: Path, model, optimizer, group=None) -> None:
    """Collective: every rank writes its shards of the model and optimizer into `path`."""
    with _one_process_quietly():
        dcp.save(_states(model, optimizer), checkpoint_id=str(path), process_group=group,
                 no_dist=not dist.is_initialized())


def load_shards(path: Path, model, optimizer, group=None) -> None:
    """Collective: every rank reads its shards (whatever the number of ranks that wrote them)."""
    states = _states(model, optimizer)
    with _one_process_quietly():
        dcp.load(states, checkpoint_id=str(path), process_group=group, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=states["model"], optim_state_dict=states["optim"])


def write_state(path: Path, model, state: TrainerState) -> None:
    """Rank 0: what makes the shards a checkpoint of this run."""
    (path / "model.json").write_bytes(msgspec.json.encode(model_signature(model)))
    torch.save({"torch_rng": torch.get_rng_state()}, path / "rng.pt")
    (path / "state.json").write_bytes(msgspec.json.encode(state))


def read_state(path: Path) -> TrainerState:
    torch.set_rng_state(torch.load(path / "rng.pt", weights_only=True)["torch_rng"])
    return msgspec.json.decode((path / "state.json").read_bytes(), type=TrainerState)


def load_sharded_checkpoint(path: Path, model, optimizer) -> TrainerState:
    """An unsharded model and its optimizer, in one process, from a sharded checkpoint."""
    check_compatible(path, model)
    load_shards(path, model, optimizer)
    return read_state(path)


def check_unsharded_compatible(path: Path, model) -> None:
    """Refuse an unsharded checkpoint (trainer/checkpoint.py's) of another model, from its files' headers."""
    from safetensors import safe_open

    theirs: dict[str, list[int]] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            theirs.update({k: list(st.get_slice(k).get_shape()) for k in st.keys()})  # noqa: SIM118
    ours = model_signature(model).shapes
    tied = set()
    if getattr(model.config, "tie_word_embeddings", False):
        tied = {k for k in ours if "lm_head" in k}
    problems = [f"{k} missing" for k in ours if k not in theirs and k not in tied]
    problems += [f"{k} unexpected" for k in theirs if k not in ours]
    problems += [f"{k} {s} here {ours[k]}" for k, s in theirs.items() if k in ours and ours[k] != s]
    if not theirs or problems or not (path / "optimizer.pt").exists():
        what = "; ".join(problems[:5]) or "no weights or no optimizer.pt"
        raise IncompatibleCheckpoint(f"checkpoint {path} is not one of this model's ({len(problems)} "
                                     f"differences: {what})")


def load_unsharded(path: Path, model, optimizer) -> None:
    """An unsharded run's checkpoint into a sharded model (collective): every rank reads the whole files
    and keeps its shards. The unsharded optimizer numbers its parameters in model.parameters() order."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(load_file(f))
    names = [n for n, _ in model.named_parameters()]
    osd = torch.load(path / "optimizer.pt", weights_only=False)["optimizer"]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]
    by_name = {"state": {names[i]: s for i, s in osd["state"].items()}, "param_groups": groups}
    # strict=False: a tied LM head is saved once, under the embedding's name.
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=by_name,
                   options=StateDictOptions(full_state_dict=True, strict=False))


def read_unsharded_state(path: Path) -> TrainerState:
    torch.set_rng_state(torch.load(path / "optimizer.pt", weights_only=False)["torch_rng"])
    return msgspec.json.decode((path / "state.json").read_bytes(), type=TrainerState)
