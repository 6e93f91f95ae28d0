"""The ``parallel`` section of a training config and the ``dp x pp x tp`` process grid."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from exitlm.config import ConfigError
from exitlm.schema import NonNegativeInt, PositiveFloat, PositiveInt, Range, check

Schedule = Literal["1f1b", "gpipe"]
ExitPlacement = Literal["next", "end"]
BubbleFill = Literal["none", "warmup", "cooldown", "both"]

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest ``parallel.timeout_s``: a week (thread joins and socket timeouts overflow on
values like ``1e30``; a wait longer than this is a hang, not a slow rank)."""


@dataclass(frozen=True)
class ParallelConfig:
    """Pipeline, tensor and data parallelism (EE-LLM Sec. 3, App. A.2 and C.2; TeraPipe
    Sec. 3).

    * ``pp``: pipeline stages; ``tp``: tensor-parallel shards of every stage
      (:mod:`exitlm.train.parallel.tensor`); ``dp``: data-parallel replicas (0 = world size /
      (pp x tp)).
    * ``sequence_parallel``: under ``tp > 1``, norms and the residual stream are sharded
      along the sequence (activation memory / tp, same communication volume).
    * ``schedule``: ``1f1b`` (PipeDream-Flush) or ``gpipe``. ``train.grad_accum`` is the
      number of microbatches per step and ``train.batch_size`` the rows of each.
    * ``boundaries``: explicit stage boundaries as 1-based layers after which a stage ends
      (``pp - 1`` increasing values); empty = even split.
    * ``exit_placement``: an exit after the last layer of a stage runs at the ``next``
      stage's beginning (EE-LLM App. A.2, Optimization 2) or at the ``end`` of its own.
    * ``deferred_exits``: compute early-exit heads in the backward step instead of the
      forward step (Optimization 1): exit logits live for one step, not for every in-flight
      microbatch.
    * ``bubble_fill``: partial forward/backward of extra microbatches in the warm-up
      (``warmup``, Part 1) and/or cool-down (``cooldown``, Part 2) bubbles (App. C.2), their
      number from ``backward_forward_ratio`` (b / f) unless ``fill_microbatches`` is set
      (at most ``pp - 1``).
    * ``token_slices``: TeraPipe token slicing of every microbatch along the sequence: ``1``
      (none), ``N`` (N equal slices), a list of slice lengths summing to ``data.seq_len``,
      or ``auto`` (the dynamic program of :mod:`exitlm.plan.terapipe` over a cost model of
      this machine).
    * ``timeout_s``: every collective and transfer between processes that does not complete
      within this many seconds ends the job with an error naming the rank that stopped (at
      most :data:`MAX_TIMEOUT_S`).
    """

    pp: PositiveInt = 1
    dp: NonNegativeInt = 0
    tp: PositiveInt = 1
    sequence_parallel: bool = False
    schedule: Schedule = "1f1b"
    boundaries: tuple[PositiveInt, ...] = ()
    exit_placement: ExitPlacement = "next"
    deferred_exits: bool = True
    bubble_fill: BubbleFill = "none"
    backward_forward_ratio: PositiveFloat = 2.0
    fill_microbatches: NonNegativeInt | None = None
    token_slices: PositiveInt | tuple[PositiveInt, ...] | Literal["auto"] = 1
    timeout_s: Annotated[float, Range(gt=0, le=MAX_TIMEOUT_S)] = 300.0

    def __post_init__(self) -> None:
        if self.token_slices is None:  # YAML null: no slicing
            object.__setattr__(self, "token_slices", 1)
        check(self, "parallel")
        if self.token_slices == ():
            raise ConfigError("parallel.token_slices: expected a number of slices, a list of "
                              "slice lengths or 'auto', got []")
        if self.fill_microbatches is not None and self.fill_microbatches > self.pp - 1:
            raise ConfigError(
                f"parallel.fill_microbatches={self.fill_microbatches}: the bubbles of "
                f"parallel.pp={self.pp} stages hold at most pp - 1 = {self.pp - 1} partial "
                "microbatches per part (EE-LLM App. C.2.1); leave it unset for the number "
                "backward_forward_ratio gives")
        if self.boundaries and len(self.boundaries) != self.pp - 1:
            raise ConfigError(f"parallel.boundaries needs pp - 1 = {self.pp - 1} values, got "
                              f"{list(self.boundaries)}")

    @property
    def pipelined(self) -> bool:
        return self.pp > 1 or self.token_slices not in (1, (1,))

    def slice_lengths(self, seq_len: int) -> tuple[int, ...]:
        """Token slice lengths for sequences of ``seq_len`` tokens (not for ``auto``)."""
        ts = self.token_slices
        if isinstance(ts, str):
            raise ConfigError("token_slices=auto is resolved by the planner (plan_token_slices)")
        if isinstance(ts, int):
            if ts > seq_len:
                raise ConfigError(f"parallel.token_slices={ts} exceeds data.seq_len={seq_len}")
            base, extra = divmod(seq_len, ts)
            return tuple(base + (1 if i < extra else 0) for i in range(ts))
        if sum(ts) != seq_len:
            raise ConfigError(f"parallel.token_slices {list(ts)} sum to {sum(ts)}, not "
                              f"data.seq_len={seq_len}")
        return ts


@dataclass(frozen=True)
class ParallelDims:
    """Where this process sits in the ``dp x pp x tp`` grid (torchtitan's ``ParallelDims``).

    Global rank ``r = (replica * pp + stage) * tp + tp_rank``: the ranks of one
    tensor-parallel group are consecutive (on one node when possible: they exchange the
    most), then the stages of one pipeline, then the data-parallel replicas.
    :func:`exitlm.train.parallel.groups.ProcessGroups.create` builds the process groups and the
    device mesh of these dimensions.
    """

    world_size: int
    pp: int
    dp: int
    tp: int
    rank: int

    @classmethod
    def build(cls, world_size: int, rank: int, pp: int = 1, dp: int = 0,
              tp: int = 1) -> ParallelDims:
        """Validate the dimensions against the number of processes; ``dp = 0`` takes the
        processes left over by ``pp x tp``. Errors name the setting to change."""
        for key, v in (("parallel.pp", pp), ("parallel.tp", tp)):
            if v < 1:
                raise ConfigError(f"{key} must be >= 1, got {v}")
        model = pp * tp
        if dp == 0:
            if world_size % model:
                raise ConfigError(
                    f"{world_size} process(es) cannot hold parallel.pp={pp} stages x "
                    f"parallel.tp={tp} shards; launch a multiple of pp x tp = {model} "
                    f"processes, e.g. torchrun --nproc-per-node {model} -m exitlm train ...")
            dp = world_size // model
        if pp * dp * tp != world_size:
            raise ConfigError(f"parallel.pp x parallel.dp x parallel.tp = {pp} x {dp} x {tp} = "
                              f"{pp * dp * tp} but {world_size} processes were launched "
                              "(torchrun --nproc-per-node); make them equal")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside a world of {world_size} processes")
        return cls(world_size, pp, dp, tp, rank)

    @property
    def stage(self) -> int:
        return (self.rank // self.tp) % self.pp

    @property
    def replica(self) -> int:
        return self.rank // (self.tp * self.pp)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def rank_of(self, stage: int | None = None, replica: int | None = None,
                tp_rank: int | None = None) -> int:
        """Global rank of (``stage``, ``replica``, ``tp_rank``); each defaults to this
        process's own."""
        s = self.stage if stage is None else stage
        r = self.replica if replica is None else replica
        t = self.tp_rank if tp_rank is None else tp_rank
        return (r * self.pp + s) * self.tp + t

    def pipeline_ranks(self, replica: int | None = None, tp_rank: int | None = None) -> list[int]:
        """The stages of one pipeline (one replica, one tensor-parallel shard)."""
        return [self.rank_of(s, replica, tp_rank) for s in range(self.pp)]

    def dp_ranks(self, stage: int | None = None, tp_rank: int | None = None) -> list[int]:
        """The replicas of one stage's shard: they average gradients."""
        return [self.rank_of(stage, r, tp_rank) for r in range(self.dp)]

    def tp_ranks(self, stage: int | None = None, replica: int | None = None) -> list[int]:
        """The shards of one stage of one replica: one tensor-parallel group."""
        return [self.rank_of(stage, replica, t) for t in range(self.tp)]
