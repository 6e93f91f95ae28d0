"""Per-sample layer dropout (LayerSkip Sec. 4.1.1, Eq. 1-4).

``x_{l+1} = x_l + M(p_{l,t}) f_l(x_l)`` with ``M(p)`` a Bernoulli that is 0 with probability
``p``, drawn separately for every sample of the batch. The dropped samples are *removed* from
the layer's batch (``EarlyExitLM.run_layers(active=...)``), so a dropped layer costs nothing.

The random numbers come from a generator seeded by ``(seed, step, micro-step)`` only, so every
data-parallel rank draws the same pattern (LayerSkip: "we seed the random number generator for
each GPU with the same seed") and a resumed run draws exactly what the uninterrupted run drew.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from exitlm.schema import Seed, UnitFloat, check
from exitlm.train.schedules import dropout_rates


@dataclass(frozen=True)
class LayerDropout:
    """LayerSkip layer dropout: ``p_max``, the time curriculum ``S`` and the seed."""

    p_max: UnitFloat = 0.0
    curriculum: Literal["none", "exp"] = "none"
    seed: Seed = 0

    def __post_init__(self) -> None:
        check(self, "dropout")

    @property
    def enabled(self) -> bool:
        return self.p_max > 0.0

    def rates(self, num_layers: int, step: int, total_steps: int) -> list[float]:
        """``p_{l,t}`` for ``l = 0..L-1`` (LayerSkip Eq. 2)."""
        return dropout_rates(num_layers, self.p_max, step, total_steps, self.curriculum)

    def sample(
        self,
        batch_size: int,
        num_layers: int,
        step: int,
        total_steps: int,
        micro: int = 0,
        device: torch.device | str = "cpu",
    ) -> list[torch.Tensor | None] | None:
        """The rows that *run* each layer (``None`` = all rows), or ``None`` when no layer
        drops anything. Pass the result as ``run_layers(active=...)``."""
        if not self.enabled:
            return None
        rates = self.rates(num_layers, step, total_steps)
        return sample_active(batch_size, rates, self.generator(step, micro), device)

    def generator(self, step: int, micro: int = 0) -> torch.Generator:
        """A CPU generator that depends only on ``(seed, step, micro)``."""
        g = torch.Generator()
        g.manual_seed((self.seed * 1_000_003 + step) * 1009 + micro)
        return g


def sample_active(
    batch_size: int,
    rates: Sequence[float],
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor | None] | None:
    """Draw ``M(p_l)`` per sample and layer (LayerSkip Eq. 1); return the kept rows per layer.

    A layer whose rate is 0 keeps every row (``None``). Returns ``None`` if nothing is dropped.
    """
    u = torch.rand(len(rates), batch_size, generator=generator)  # (L, B)
    active: list[torch.Tensor | None] = []
    dropped_any = False
    for l, p in enumerate(rates):
        if p <= 0.0:
            active.append(None)
            continue
        keep = u[l] >= p
        if bool(keep.all()):
            active.append(None)
            continue
        dropped_any = True
        active.append(keep.nonzero().flatten().to(device))
    return active if dropped_any else None
