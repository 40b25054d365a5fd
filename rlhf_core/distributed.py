"""Training in N processes (``accelerate launch`` or Ray Train; DDP or FSDP2) that ends where one process would.

Every rank holds the whole batch (experience or preference pairs: a few numbers per token, small next
to the models) and draws the same shuffle from the same generator, so the global minibatches are
those of one process. Each rank then computes on its share of every minibatch:

1. Shares are contiguous and differ by at most one row (:func:`rank_share`). A rank left without rows
   (a minibatch smaller than N) computes on the minibatch's first row with weight 0, so it still takes
   part in DDP's gradient all-reduce and adds nothing.
2. Losses are normalised by the *whole* minibatch's counts (tokens, sequences, pairs), so the ranks'
   losses add up to the one-process loss; DDP averages gradients over ranks, so each rank backpropagates
   ``N * weight`` times its loss and the averaged gradient is the one-process gradient. Gradient
   clipping then sees the same norm, and the optimizers step identically on every rank.
3. Statistics are all-reduced (:func:`global_sum`), so a decision taken from them (PPO's ``target_kl``
   early stop) is the same on every rank.
4. Only the main process saves (the callers check ``accelerator.is_main_process``).
5. Sharded (:func:`shard_model`, FSDP2 ``fully_shard``): each rank holds 1/N of every trained parameter, its
   gradient and its optimizer state. The forward and backward gather a layer's parameters when they need
   them, and the backward reduce-scatters gradients averaged over the ranks, as DDP's all-reduce averages
   them, so 1 to 4 hold unchanged. Saving the weights gathers them on the main process
   (:func:`full_state_dict`, collective); optimizer states are saved by every rank together, each its part
   (torch distributed checkpointing, outside the core). The precision is the unsharded one (:func:`prepare`): fp32
   parameters, autocast in the forward pass, so a sharded update computes what an unsharded one does.

With one process every function here is the identity, and the arithmetic is that of a plain loop.
"""

from __future__ import annotations

from types import MethodType

import torch
from accelerate import Accelerator
from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard

from rlhf_core.config import Sharding


def rank_share(rows: int, *, rank: int, world: int) -> tuple[torch.Tensor, float]:
    """This rank's rows of a minibatch of ``rows`` rows, and their weight (0 for a rank with no real rows).

    Naive equivalent: ``list(range(rows))[rank * rows // world : (rank + 1) * rows // world]`` up to which ranks
    take the extra rows (``torch.tensor_split``: the first ``rows % world``).

    Shapes:
        returns (b,) row indices.
    """
    share = torch.arange(rows).tensor_split(world)[rank]
    if len(share) == 0:
        return torch.zeros(1, dtype=torch.long), 0.0
    return share, 1.0


def global_sum(accelerator: Accelerator, values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over every process (all-reduce); ``values`` itself with one process.

    Shapes:
        values: (...); returns (...).
    """
    if accelerator.num_processes == 1:
        return values
    return accelerator.reduce(values.detach().clone(), reduction="sum")


def layer_classes_of(model: nn.Module, names: tuple[str, ...] = ()) -> tuple[type[nn.Module], ...]:
    """The classes of ``model``'s modules named ``names`` (or in any submodule's ``_no_split_modules``).

    Raises:
        ValueError: no module of ``model`` has such a class (nothing to shard layer by layer).
    """
    wanted = set(names)
    if not wanted:
        for module in model.modules():
            wanted.update(getattr(module, "_no_split_modules", None) or ())
    found = {type(module) for module in model.modules() if type(module).__name__ in wanted}
    if not found:
        what = f"no layer of class {', '.join(sorted(wanted))}" if wanted else "no `_no_split_modules`"
        raise ValueError(
            f"FSDP finds no transformer layer class to wrap in {type(model).__name__} ({what}): set "
            "`fsdp_transformer_layer_cls_to_wrap` in `execution.accelerate_config`"
        )
    return tuple(sorted(found, key=lambda kind: kind.__name__))


def shard_model(model: nn.Module, sharding: Sharding) -> nn.Module:
    """``model`` sharded in place over every process (FSDP2 ``fully_shard``): its layers, then the rest.

    Parameters become ``DTensor`` shards along their first dimension; the forward and backward gather a
    layer's parameters when they need them, and the backward reduce-scatters the gradients averaged over
    the processes (as DDP's all-reduce averages them, so :func:`rank_share`'s weights are unchanged).
    """
    classes = layer_classes_of(model, sharding.layer_classes)
    for module in list(model.modules()):
        if isinstance(module, classes):
            fully_shard(module, reshard_after_forward=sharding.reshard_after_forward)
    fully_shard(model, reshard_after_forward=sharding.reshard_after_forward)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by :func:`shard_model`."""
    return isinstance(model, FSDPModule)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole ``model``'s state on the CPU of the main process, gathered from every process's shards
    ({} on the other processes, which must all call this: it is collective); ``model.state_dict()`` for an
    unsharded model. A tied parameter (GPT-2's output layer is its input embedding) appears once, under its
    first name, as ``save_pretrained`` writes it: gathered copies would no longer share their storage."""
    if is_sharded(model):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = model.state_dict()
    seen: set[int] = set()
    tied = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            tied.add(name)
        seen.add(id(parameter))
    return {name: value for name, value in state.items() if name not in tied}


def prepare(
    accelerator: Accelerator, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """``accelerator.prepare`` the trained models and their optimizers, sharded (:func:`shard_model`) or not.

    Unsharded models are prepared as accelerate does (DDP with several processes). Sharded ones are left as
    they are, their forward only put under the precision's autocast (what accelerate's own preparation
    adds, so a sharded model computes what an unsharded one does), and their optimizers are prepared alone.
    """
    if not any(is_sharded(model) for model in models):
        prepared = accelerator.prepare(*models, *optimizers)
        prepared = list(prepared) if isinstance(prepared, tuple) else [prepared]
        return prepared[: len(models)], prepared[len(models) :]
    if accelerator.native_amp:
        context = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
        for model in models:
            model.forward = MethodType(convert_outputs_to_fp32(context(type(model).forward)), model)
    return models, [accelerator.prepare_optimizer(optimizer) for optimizer in optimizers]
