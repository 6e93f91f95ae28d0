"""The later stages of pipeline-based early-exit inference (EE-LLM Sec. 4) and the messages
between stages; stage 0 is :mod:`exitlm.infer.executors.pipeline`, whose docstring describes
the method.

Messages (all point-to-point, every receive waited on with a timeout; through shared memory
between the stages of one machine, :class:`~exitlm.comm.shm_p2p.ChannelP2P`, else
gloo, :class:`~exitlm.comm.p2p.P2P`), stage ``s`` -> ``s+1``:

* a command header, float64 ``[command, rows n, prompt length T, number of checks]``;
  ``STOP`` ends here (each stage passes it on and returns);
* the rows table, float64 ``(n, 5 [+ D])``: ``[slot id, position (prefill: prompt length),
  decided, forced, threshold]`` per row, followed on a ``STEP`` by the row's hidden state
  ``(D,)`` (exact in float64 for every model dtype);
* on a ``PREFILL`` only: the checked exits (long ``(checks,)``) and the prompts' hidden states
  ``(n, T, D)`` in the model's dtype (right-padded like the engine's prefill).

Stage ``s >= 1`` -> stage 0, once per step, only when stage ``s`` *can* decide something: some
row arrived undecided and either ``s`` is the last stage or it has a checked exit and one of
those rows may exit (threshold ``< 1``, not forced). Both ends know all this from the rows
table, so stage 0 reads replies from stages 1, 2, ... in order, never from "any source":

* float32 ``(u, 2)``: ``[decided, layer]`` for each of the ``u`` rows that arrived undecided,
  in row order, sent as soon as all of them are decided or after the stage's last checked
  exit (the last stage: after its final layer);
* when ``k > 0`` of them were decided here, their logits float32 ``(k, V)`` in row order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from exitlm.comm.launch import DEFAULT_TIMEOUT_S
from exitlm.comm.p2p import P2P
from exitlm.comm.shm import shm_channels
from exitlm.comm.shm_p2p import ChannelP2P
from exitlm.config import ConfigError
from exitlm.infer.decoder import last_positions
from exitlm.model.kv_cache import KVCache
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime.runner import Runner

STOP, PREFILL, STEP = 0, 1, 2
_HDR, _ROWS, _CHECKS, _HIDDEN, _REPLY, _LOGITS = 11, 12, 13, 14, 15, 16
_HEADER = 4  # command, rows, prompt length, number of checks
_ROW = 5  # slot id, position or prompt length, decided, forced, threshold


def stage_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Layer ranges ``[a, b)`` (0-based) of ``stages`` pipeline stages, as even as possible
    (earlier stages take the extra layers). Raises a :class:`ConfigError` naming ``--stages``
    when the model cannot be split that way."""
    if not 2 <= stages <= num_layers:
        raise ConfigError(f"--stages {stages}: expected 2 to {num_layers} pipeline stages "
                          f"(one process each, at least one of the model's {num_layers} "
                          "layers per stage)")
    base, extra = divmod(num_layers, stages)
    sizes = [base + (i < extra) for i in range(stages)]
    ends = list(itertools.accumulate(sizes))
    return [(e - n, e) for e, n in zip(ends, sizes, strict=True)]


def stage_checks(checks: tuple[int, ...], a: int, b: int, num_layers: int) -> tuple[int, ...]:
    """The checked exits (1-based) after a layer of ``[a, b)``: ``a < e <= b``, ``e < L``."""
    return tuple(e for e in checks if a < e <= b and e < num_layers)


@dataclass
class Rows:
    """The rows table of one command (see the module docstring): per row, the sequence's slot
    id, the new token's position (a prefill: the prompt length), whether its token is already
    decided, whether it must go the full depth (``max_pending`` reached; every prompt) and its
    threshold."""

    slots: list[int]
    pos: list[int]
    decided: list[bool]
    force: list[bool]
    threshold: list[float]

    def __len__(self) -> int:
        return len(self.slots)

    def may_exit(self, i: int) -> bool:
        """Whether row ``i`` may leave at an early exit (EE-LLM Sec. 5.2 confidence)."""
        return not self.force[i] and self.threshold[i] < 1.0

    def to_tensor(self) -> torch.Tensor:
        cols = (self.slots, self.pos, self.decided, self.force, self.threshold)
        return torch.tensor(list(zip(*cols, strict=True)), dtype=torch.float64).reshape(-1, _ROW)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Rows:
        slots, pos, decided, force, thr = t[:, :_ROW].T.tolist()
        return cls([int(x) for x in slots], [int(x) for x in pos], [bool(x) for x in decided],
                   [bool(x) for x in force], thr)


def owes_reply(has_checks: bool, last: bool, rows: Rows, undecided: list[int]) -> bool:
    """Whether a stage answers stage 0 this step: some row arrived ``undecided`` and the stage
    can decide one (the last stage decides all; another needs a checked exit and a row that
    may exit). Stage 0 and the stage evaluate this alike."""
    if not undecided:
        return False
    return last or (has_checks and any(rows.may_exit(i) for i in undecided))


class Links:
    """The transfers of one stage (the messages of the module docstring). Every stage builds
    its links at the same point (a collective): stages of one machine talk through
    shared-memory channels (:mod:`exitlm.comm.shm_p2p`), others - or with
    ``EXITLM_SHM=0`` - through gloo."""

    def __init__(self, rank: int, world: int, timeout_s: float, model: EarlyExitLM) -> None:
        self.rank, self.world = rank, world
        ends = shm_channels(rank, world)
        self.p2p: P2P | ChannelP2P = (
            P2P(timeout_s, torch.device("cpu"), setting="--dist-timeout") if ends is None
            else ChannelP2P(rank, ends, timeout_s))
        self.dim = model.config.dim
        self.vocab = model.config.vocab_size
        self.dtype = model.embed_tokens.weight.dtype

    def settle(self) -> None:
        """Wait for this stage's sends of earlier steps, at the start of a step. gloo calls a
        send complete only once it is waited on, so sends never waited on - and the tensors
        they hold, the deciding logits ``(k, V)`` among them - piled up for as long as the
        pipeline ran (memory growing with every token, and every send scanning the pile).
        Those sends were received long ago in the normal flow; a stage therefore runs at most
        one step ahead of the next one, which cannot start that step sooner anyway. Only stage
        0 waits with a deadline: a later stage held up by a stalled one waits, and stage 0,
        held up in turn, names the stalled stage (as for :meth:`recv_command`)."""
        self.p2p.flush(idle=self.rank > 0)

    def send_down(self, cmd: int, rows: Rows, hidden: torch.Tensor,
                  checks: tuple[int, ...] = ()) -> None:
        """A ``STEP`` (``hidden`` ``(n, 1, D)`` rides in the rows table) or a ``PREFILL``
        (``hidden`` ``(n, T, D)`` and ``checks`` follow the table) to the next stage."""
        dst = self.rank + 1
        n, t = hidden.shape[0], hidden.shape[1]
        head = torch.tensor([cmd, n, t, len(checks)], dtype=torch.float64)
        self.p2p.send(head, dst, _HDR, "a command")
        table = rows.to_tensor()
        if cmd == STEP:
            table = torch.cat([table, hidden.detach().reshape(n, self.dim).double()], dim=1)
        self.p2p.send(table, dst, _ROWS, "the rows table")
        if cmd == PREFILL:
            if checks:
                self.p2p.send(torch.tensor(checks, dtype=torch.long), dst, _CHECKS,
                              "exit list")
            self.p2p.send(hidden.detach().cpu(), dst, _HIDDEN, "hidden states")

    def send_stop(self) -> None:
        self.p2p.send(torch.tensor([STOP, 0, 0, 0], dtype=torch.float64), self.rank + 1,
                      _HDR, "a command")

    def recv_command(self) -> tuple[int, int, int, int]:
        """``(command, rows, prompt length, number of checks)``. Waits as long as it takes:
        a server's pipeline idles between requests; stage 0 bounds every wait of its own, so
        a stalled stage is still found (by stage 0, which names it)."""
        head = self.p2p.recv((_HEADER,), torch.float64, self.rank - 1, _HDR, "the next command",
                             idle=True)
        cmd, n, t, n_checks = (int(x) for x in head.tolist())
        return cmd, n, t, n_checks

    def recv_rows(self, n: int, step: bool) -> tuple[Rows, torch.Tensor | None]:
        """The rows table and, on a step, the hidden states ``(n, 1, D)`` it carries."""
        width = _ROW + (self.dim if step else 0)
        t = self.p2p.recv((n, width), torch.float64, self.rank - 1, _ROWS, "the rows table")
        hidden = t[:, _ROW:].to(self.dtype).reshape(n, 1, self.dim) if step else None
        return Rows.from_tensor(t), hidden

    def recv_checks(self, n: int) -> tuple[int, ...]:
        if n == 0:
            return ()
        t = self.p2p.recv((n,), torch.long, self.rank - 1, _CHECKS, "exit list")
        return tuple(int(x) for x in t.tolist())

    def recv_hidden(self, n: int, length: int) -> torch.Tensor:
        return self.p2p.recv((n, length, self.dim), self.dtype, self.rank - 1, _HIDDEN,
                             "hidden states")

    def reply(self, layers: list[int], logits: list[torch.Tensor]) -> None:
        """Tell stage 0 which of the rows that arrived undecided this stage decided:
        ``layers[j]`` is row ``j``'s exit layer (0: not here); ``logits`` those rows' logits
        ``(V,)`` each, in order."""
        head = torch.tensor([[float(x > 0), float(x)] for x in layers], dtype=torch.float32)
        self.p2p.send(head.reshape(-1, 2), 0, _REPLY, "a decision")
        if logits:
            self.p2p.send(torch.stack(logits).float(), 0, _LOGITS, "the deciding logits")

    def recv_reply(self, stage: int, n: int) -> tuple[list[int], torch.Tensor]:
        """Stage ``stage``'s reply about ``n`` undecided rows: each row's exit layer (0: not
        decided there) and the logits ``(k, V)`` of the decided ones, in row order."""
        head = self.p2p.recv((n, 2), torch.float32, stage, _REPLY, f"stage {stage}'s decision")
        layers = [int(layer) if flag else 0 for flag, layer in head.tolist()]
        k = sum(x > 0 for x in layers)
        if not k:
            return layers, torch.zeros(0, self.vocab, dtype=self.dtype)
        logits = self.p2p.recv((k, self.vocab), torch.float32, stage, _LOGITS,
                               f"stage {stage}'s logits")
        return layers, logits.to(self.dtype)


class StageRows:
    """A later stage's KV cache: one row per sequence, named by the slot id stage 0 gave it.

    A prefill appends rows; a step names the sequences it carries in the engine's row order,
    and the rows are reordered to match (rows of sequences that left are dropped), the way
    the engine's pool compacts (:meth:`~exitlm.model.kv_cache.KVCache.move_row`)."""

    def __init__(self, model: EarlyExitLM) -> None:
        self.model = model
        self.cache: KVCache | None = None
        self.order: list[int] = []

    def _reserve(self, rows: int, length: int) -> KVCache:
        if self.cache is None:
            self.cache = self.model.new_cache(rows, length)
        elif rows > self.cache.batch_size or length > self.cache.max_seq_len:
            cap = self.cache.max_seq_len
            self.cache.resize(max(rows, self.cache.batch_size),
                              max(length, 2 * cap) if length > cap else cap)
        return self.cache

    def admit(self, slots: list[int], length: int) -> KVCache:
        """Fresh rows for the prompts of ``slots`` (``length`` positions each, with room to
        grow), after the rows held."""
        m = len(self.order)
        cache = self._reserve(m + len(slots), 2 * length + 16)
        self.order += slots
        view = cache.rows(m, m + len(slots))
        view.crop(0)
        return view

    def arrange(self, slots: list[int], length: int) -> KVCache:
        """The rows of ``slots``, in that order, with room for ``length`` positions."""
        n = len(slots)
        if self.order[:n] != slots:
            where = {s: r for r, s in enumerate(self.order)}
            missing = [s for s in slots if s not in where]
            if missing:
                raise RuntimeError(f"pipeline protocol: step names slots {missing} that no "
                                   "prefill gave this stage")
            cache = self.cache
            assert cache is not None
            idx = torch.tensor([where[s] for s in slots])
            for t in (*cache.keys, *cache.values):
                t[:n] = t[idx]  # advanced indexing copies first: any permutation is safe
            cache.lengths[:n] = cache.lengths[idx].clone()
            cache.fill[:, :n] = cache.fill[:, idx].clone()
        self.order = list(slots)
        return self._reserve(n, length).rows(0, n)


def serve_stage(runner: Runner, rank: int, world: int,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run stage ``rank >= 1`` of a ``world``-stage pipeline until stage 0 says stop (the
    joined default group carries the transfers)."""
    model = runner.model
    a, b = stage_bounds(model.num_layers, world)[rank]
    last = rank == world - 1
    links = Links(rank, world, timeout_s, model)
    held = StageRows(model)
    checks: tuple[int, ...] = ()
    with torch.inference_mode():
        while True:
            cmd, n, length, n_checks = links.recv_command()
            if cmd == STOP:
                if not last:
                    links.send_stop()
                links.p2p.flush()
                return
            links.settle()
            prefill = cmd == PREFILL
            rows, h = links.recv_rows(n, step=not prefill)
            if prefill:
                checks = links.recv_checks(n_checks)
                h = links.recv_hidden(n, length)
                cache = held.admit(rows.slots, length)
                positions = torch.arange(length).expand(n, length)
            else:
                assert h is not None
                cache = held.arrange(rows.slots, max(rows.pos) + 1)
                positions = torch.tensor(rows.pos)[:, None]
            h = run_stage(runner, links, rows, h, cache, positions, (a, b), last,
                           stage_checks(checks, a, b, model.num_layers), prefill)
            if not last:
                links.send_down(cmd, rows, h, checks)
            if prefill:
                lens = torch.tensor(rows.pos)
                cache.lengths = lens
                cache.crop(lens)
            else:
                cache.lengths = positions[:, 0] + 1


def run_stage(runner: Runner, links: Links, rows: Rows, h: torch.Tensor, cache: KVCache,
              positions: torch.Tensor, bounds: tuple[int, int], last: bool,
              stops: tuple[int, ...], prefill: bool) -> torch.Tensor:
    """Run one command's rows through this stage's layers ``[a, b)``: the rows that arrived
    undecided and may exit are checked at the stage's exits, the last stage decides the rest
    with the final layer, the decisions go to stage 0 (the reply of the module docstring) and
    are marked in ``rows``. Returns the hidden states after layer ``b``."""
    a, b = bounds
    undecided = [i for i in range(len(rows)) if not rows.decided[i]]
    owed = owes_reply(bool(stops), last, rows, undecided)
    layer_of: dict[int, int] = {}
    logits_of: dict[int, torch.Tensor] = {}

    def answer() -> None:
        links.reply([layer_of.get(i, 0) for i in undecided],
                    [logits_of[i] for i in undecided if i in logits_of])

    for layer, h_at, ctx in runner.walk(h, a, b, stops, positions, cache):
        h = h_at
        if layer in stops:
            asked = [rows.threshold[i] if owed and i in undecided and i not in layer_of
                     and rows.may_exit(i) else None for i in range(len(rows))]
            got, logits = runner.probe(h, layer, asked, cache=cache, ctx=ctx)
            for j, i in enumerate(got):
                layer_of[i], logits_of[i] = layer, logits[j]
            if owed and (len(layer_of) == len(undecided) or (not last and layer == stops[-1])):
                answer()  # before the rest of the stage runs
                owed = False
    if owed:  # the last stage: the final layer decides the rest
        rest = [i for i in undecided if i not in layer_of]
        ends = torch.tensor(rows.pos) if prefill else torch.ones(len(rows), dtype=torch.long)
        idx = torch.tensor(rest, device=h.device)
        logits = runner.logits(last_positions(h, ends)[idx], runner.num_layers)
        for j, i in enumerate(rest):
            layer_of[i], logits_of[i] = runner.num_layers, logits[j]
        answer()
    for i in layer_of:
        rows.decided[i] = True
    return h
