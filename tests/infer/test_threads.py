"""The thread policy: fixed counts are kept; the measuring policy moves to more threads when
they are faster, goes back when the machine gets busy, and backs off from losing probes."""

from __future__ import annotations

import pytest
import torch

from _native import needs_native
from exitlm.infer.threads import MAX_INTERVAL, ThreadPolicy


class FakeClock:
    """Time advances by what the current thread count costs per step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(policy: ThreadPolicy, clock: FakeClock, cost: dict[int, float], steps: int) -> list[int]:
    used = []
    for _ in range(steps):
        n = policy.planned()
        used.append(n)
        with policy.step("torch", key="k"):
            clock.now += cost[n]
    return used


def test_thread_counts_are_bounded() -> None:
    from exitlm.args import check_threads, max_threads
    from exitlm.config import ConfigError
    from exitlm.infer.threads import set_threads

    assert max_threads() >= 64
    assert check_threads(max_threads()) == max_threads()
    for bad in (0, -1, max_threads() + 1, 100000):
        with pytest.raises(ConfigError, match=rf"--threads: expected .*got {bad}"):
            set_threads(bad)
        with pytest.raises(ConfigError, match=rf"threads: expected .*got {bad}"):
            ThreadPolicy(threads=bad)


def test_fixed_threads_are_kept() -> None:
    before = torch.get_num_threads()
    policy = ThreadPolicy(threads=1, max_threads=2)
    assert not policy.adaptive
    with policy.step("torch"):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    assert policy.planned() == 1


def test_policy_follows_the_faster_setting() -> None:
    clock = FakeClock()
    policy = ThreadPolicy(max_threads=2, initial=1, clock=clock)
    # a quiet machine: two threads are faster; the policy moves there after one probe
    used = _run(policy, clock, {1: 1.0, 2: 0.7}, 40)
    assert used[0] == 1 and used[-1] == 2 and policy.switches == 1
    # the machine gets busy: two threads collapse; the next probe of one thread wins
    used = _run(policy, clock, {1: 1.0, 2: 5.0}, 200)
    assert used[-1] == 1
    assert sum(n == 2 for n in used) <= 80  # at most until the next probe (64 steps)


def test_losing_probes_back_off_and_abort_early() -> None:
    clock = FakeClock()
    policy = ThreadPolicy(max_threads=2, initial=1, clock=clock)
    used = _run(policy, clock, {1: 1.0, 2: 5.0}, 4000)
    probes = sum(n == 2 for n in used)
    assert used[-1] == 1
    # every losing probe is one (aborted) step; the intervals double up to the maximum
    assert probes <= 4000 // MAX_INTERVAL + 6
    assert policy.switches == 0


def test_new_conditions_are_not_compared_with_old_ones() -> None:
    clock = FakeClock()
    policy = ThreadPolicy(max_threads=2, initial=1, clock=clock)
    for key, cost in (("b1", 1.0), ("b8", 3.0), ("b1", 1.0)):
        for _ in range(10):
            with policy.step("torch", key=key):
                clock.now += cost
    assert policy.switches == 0 and policy.current == 1


def test_a_busy_start_is_corrected() -> None:
    """Starting on all threads on a machine that is in fact busy costs a few steps only."""
    clock = FakeClock()
    policy = ThreadPolicy(max_threads=2, initial=2, clock=clock)
    used = _run(policy, clock, {1: 1.0, 2: 5.0}, 100)
    assert used[0] == 2 and used[-1] == 1
    assert sum(n == 2 for n in used) <= 12


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_sequence_steps_run_the_native_kernels_on_the_threads(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-sequence decoding step on the native runner hands ``--threads`` to the native
    kernels, for fp16 as for fp32 (fp16 steps gave them to torch and ran the kernels on one
    thread: no faster on two cores than on one)."""
    from _tiny import tiny_text_model
    from exitlm.infer import generate
    from exitlm.runtime import native as native_runner

    seen: list[int] = []
    real = native_runner._threads

    def spy() -> int:
        seen.append(real())
        return seen[-1]

    monkeypatch.setattr(native_runner, "_threads", spy)
    generate(tiny_text_model().to(dtype), None, [5, 6, 7], max_new_tokens=6, ignore_eos=True,
             threads=2)
    assert seen and seen[-1] == 2, seen
