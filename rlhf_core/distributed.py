"""Training in N processes (``accelerate launch``, DDP) that ends where one process would.

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

With one process every function here is the identity, and the arithmetic is that of a plain loop.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator


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
