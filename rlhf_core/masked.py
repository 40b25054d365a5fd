"""Masked reductions: the one vocabulary every token-level reduction in the project uses.

Choices:
1. The variance is the unbiased (Bessel-corrected) estimate over valid elements, as in TRL's
   ``masked_var`` and the design's whitening convention.
2. Fewer valid elements than a reduction needs is an error, never a silent NaN.
3. Masked positions are selected away (``torch.where``), not multiplied by 0, so whatever sits
   there, even ``inf`` or ``nan``, never reaches a result or a gradient.
"""

from __future__ import annotations

import torch


def _valid_count(mask: torch.Tensor, dim: int | None) -> torch.Tensor:
    return mask.sum() if dim is None else mask.sum(dim=dim)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` over the positions where ``mask`` is True (0 when it selects none).

    Naive equivalent: ``values[mask].sum()`` (for ``dim=None``).

    Args:
        values: any float tensor.
        mask: bool (or 0/1) tensor of the same shape.
        dim: reduce along this dimension only; ``None`` reduces everything.

    Shapes:
        values, mask: (...); returns () or (...) without ``dim``.
    """
    valid = torch.where(mask.bool(), values, torch.zeros_like(values))
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is True.

    Naive equivalent: ``values[mask].mean()`` (for ``dim=None``).

    Args:
        values: any float tensor.
        mask: bool (or 0/1) tensor of the same shape.
        dim: reduce along this dimension only; ``None`` reduces everything.

    Returns:
        The masked mean; a scalar for ``dim=None``. Rows with no valid element give 0 when
        ``dim`` is set (their mean is undefined and must not poison a later average).

    Shapes:
        values, mask: (...); returns () or (...) without ``dim``.
    """
    valid = torch.where(mask.bool(), values, torch.zeros_like(values))
    total = valid.sum() if dim is None else valid.sum(dim=dim)
    count = _valid_count(mask.to(values.dtype), dim)
    if dim is None:
        if count.item() == 0:
            raise ValueError("`mask` selects no element: the masked mean is undefined")
        return total / count
    return total / count.clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the positions where ``mask`` is True.

    Naive equivalent: ``values[mask].var(unbiased=unbiased)``.

    Shapes:
        values, mask: (...); returns ().
    """
    count = mask.sum().item()
    needed = 2 if unbiased else 1
    if count < needed:
        raise ValueError(f"`mask` selects {int(count)} element(s); the masked variance needs at least {needed}")
    mean = masked_mean(values, mask)
    squared_deviation = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        squared_deviation = squared_deviation * count / (count - 1)
    return squared_deviation


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``values`` to mean 0 and (unbiased) variance 1 over the valid positions.

    Positions outside the mask are set to 0 so that nothing downstream can read them by accident.

    Args:
        values: float tensor.
        mask: bool tensor of the same shape.
        shift_mean: if False, only scale (keep the mean), as some PPO variants do for advantages.
        eps: added to the variance before the square root.

    Shapes:
        values, mask: (...); returns (...).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
