"""FSDP2 over the ranks: which N a model can be sharded over, the sharding itself, and the full weights
gathered back onto rank 0 for publishing.

Each decoder layer is one FSDP unit (its weights are gathered just before it runs and freed after), the
root holds the rest: the embeddings, the final norm and the LM head, which is the embedding itself when
tied (one parameter, so one shard set). On GPUs the layers compute in bf16 with fp32 gradient reduction
(fp32 master weights and optimizer state stay sharded); on CPU everything is fp32.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from trainer.distributed import DistEnv


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (Llama, Qwen2, Mistral, ...: model.model.layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__} has no model.layers: the sharded trainer shards HF "
                         "decoder-only models by their decoder layers")
    return list(layers)


def check_world(model, world: int, prompts_per_step: int | None = None) -> None:
    """Refuse an N this model cannot be sharded over: every rank must hold a piece of every weight (FSDP2
    shards each along its first dimension), and every rank must get at least one group per step."""
    if world < 1:
        raise ValueError(f"{world} ranks: need at least 1")
    decoder_layers(model)
    for name, p in model.named_parameters():
        rows = p.shape[0]
        per_rank = -(-rows // world)  # torch.chunk's split along the first dimension
        if -(-rows // per_rank) < world:
            raise ValueError(f"cannot shard this model over {world} ranks: {name} has {rows} rows, in pieces "
                             f"of {per_rank}, so some ranks would hold nothing of it; use fewer ranks")
    if prompts_per_step is not None and prompts_per_step < world:
        raise ValueError(f"{world} ranks but train.prompts_per_step={prompts_per_step}: a step's groups are "
                         f"split whole across the ranks, so each needs one; use at most {prompts_per_step} "
                         "ranks or more prompts per step")


def make_mesh(env: DistEnv) -> DeviceMesh:
    return init_device_mesh(env.device.type, (env.world,))


def shard(model, mesh: DeviceMesh, bf16: bool):
    """fully_shard each decoder layer, then the root; gradients are summed over the ranks, not averaged
    (each rank's loss is already divided by the whole batch's token count)."""
    mp = MixedPrecisionPolicy()
    if bf16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for unit in [*decoder_layers(model), model]:  # each unit reduces its own gradients
        unit.set_gradient_divide_factor(1.0)
        if hasattr(unit, "set_force_sum_reduction_for_comms"):  # torch >= 2.9; gloo has no pre-scaled sum
            unit.set_force_sum_reduction_for_comms(True)
    return model


def gather_full_state(model, dtype: torch.dtype | None, keep: bool) -> dict[str, torch.Tensor]:
    """The whole model's weights as CPU tensors (floating-point ones cast to `dtype` when given), in the
    model's own state_dict order and with tied weights as one tensor: what trainer/policy.py's frozen_state
    returns for an unsharded model. Collective: every rank calls it; only where `keep` (rank 0) is the
    result kept, and an empty dict returned elsewhere. Gathered one tensor at a time and moved to the CPU
    at once, so no device holds more than one full tensor and rank 0 holds one copy of the weights."""
    out: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    for k, v in model.state_dict(keep_vars=True).items():
        ident = id(v)  # a tied weight is one parameter under two names
        if ident not in seen:
            seen.add(ident)
            full = v.full_tensor() if isinstance(v, DTensor) else v
            if keep:
                cast = dtype if dtype is not None and full.is_floating_point() else full.dtype
                copies[ident] = full.detach().to("cpu", dtype=cast, copy=True)
            del full
        if keep:
            out[k] = copies[ident]
    return out
