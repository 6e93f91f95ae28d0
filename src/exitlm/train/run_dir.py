"""The output directory of a training run: one writer at a time, one run per directory, and
nothing left behind by a killed run.

* **Lock.** A run holds an exclusive ``fcntl.flock`` on the directory itself while it
  writes (the operating system releases it when the process dies, ``kill -9`` included; no
  lock file is left behind). A second run into the same directory fails at once, naming the
  process that holds it (from ``run.json``).
* **Identity.** ``OUT/run.json`` records the run's id when it starts, and every checkpoint
  records it too. A new run refuses a directory that already holds a run's outputs (unless
  ``--overwrite``, which removes exactly those outputs and nothing else); ``--resume`` refuses
  checkpoints of another run (see :mod:`exitlm.train.run_state`). Files with the outputs'
  names in a directory without ``run.json`` are not a run's: they are refused, never removed.
  A directory that cannot be created is one line naming it (:func:`exitlm.io.dirs.ensure_dir`).
* **Leftovers.** What a killed write leaves - temporary directories ``.step-*.tmp-*``,
  moved-aside ``.NAME.old-*``, ``.latest.tmp-*`` and other temporary files, checkpoints a
  prune had half deleted - is removed when the next run starts. Only names exitlm itself
  creates are ever removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from exitlm.errors import ConfigError, ExitlmError
from exitlm.io.dirs import check_creatable, ensure_dir
from exitlm.paths import file_ancestor, remove_path, temp_target, write_text_atomic

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, runs are not guarded
    fcntl = None  # type: ignore[assignment]

RUN_FILE = "run.json"
CHECKPOINTS = "checkpoints"
# Everything a run writes into OUT.
OUTPUTS = (RUN_FILE, "train_config.json", "log.jsonl", "loss.png", "tb", CHECKPOINTS, "model",
           "exits")
STEP_DIR = re.compile(r"step-\d{8}")
"""The name of one checkpoint's directory under ``checkpoints/`` (``step-`` and the step)."""
_OUT_NAMES = frozenset(OUTPUTS) | {"log.jsonl.tmp"}
_CHECKPOINT_NAMES = frozenset({"latest"})
_LOG_TAIL = 64 * 1024  # bytes of log.jsonl read to find the last step


def dir_step(name: str) -> int:
    """The step of a checkpoint directory named ``name`` (:data:`STEP_DIR`)."""
    return int(name.removeprefix("step-"))


class RunDir:
    """``train.out_dir`` of one run: checks, lock, identity file and cleanup."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self._fd: int | None = None

    # ----- checks (read-only) ------------------------------------------------------------------
    def outputs(self) -> list[str]:
        """The run outputs present in the directory."""
        if not self.path.is_dir():
            return []
        return [name for name in OUTPUTS if (self.path / name).exists()]

    def check(self, *, resume: bool, overwrite: bool) -> None:
        """Refuse a start that would mix two runs or write into something else: ``out_dir``
        a file, another process writing there, or (a new run) another run's outputs."""
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"train.out_dir: {self.path} is a file, expected a directory")
        blocker = file_ancestor(self.path)
        if blocker is not None:
            raise ConfigError(f"train.out_dir: {self.path} cannot be created: {blocker} is a "
                              "file, expected a directory")
        if resume and overwrite:
            raise ConfigError("--resume continues the run in train.out_dir and --overwrite "
                              "replaces it; pass one of them")
        if self.locked_by_other():
            raise self._busy()
        found = self.outputs()
        if found and not resume:
            self.check_is_run(found)
        if found and not resume and not overwrite:
            raise ExitlmError(
                f"train.out_dir {self.path} already holds a training run "
                f"({', '.join(found)})",
                hint="pass --resume to continue it, --overwrite to replace its outputs "
                     "(nothing else in the directory is touched), or set train.out_dir to a "
                     "new directory",
            )
        if found and resume and not self.has_checkpoint():
            self.check_is_run(found)  # no run at all: say so, not "the run there finished"
            raise self._nothing_to_resume(found)
        # before the model is loaded and the data prepared; creates nothing (/proc, /sys, a
        # read-only file system)
        check_creatable(self.path, "train.out_dir")

    def check_is_run(self, found: list[str]) -> None:
        """Refuse to replace ``found`` (names of :data:`OUTPUTS` in the directory) unless an
        exitlm run wrote them: the directory must hold a run's ``run.json``. Files of the
        same names that someone else put there are never deleted, not even by --overwrite."""
        if self.read_run() is not None:
            return
        raise ExitlmError(
            f"train.out_dir {self.path} holds {', '.join(found)} but no {RUN_FILE}: not the "
            "outputs of an exitlm run; refusing to replace them",
            hint="move them away or set train.out_dir to a new directory (--overwrite "
                 f"replaces only the outputs of an exitlm run, recorded in {RUN_FILE})",
        )

    def has_checkpoint(self) -> bool:
        """Whether ``OUT/checkpoints`` holds a complete checkpoint (one with ``state.json``)."""
        root = self.path / CHECKPOINTS
        return root.is_dir() and any(
            STEP_DIR.fullmatch(p.name) and (p / "state.json").is_file() for p in root.iterdir())

    def last_logged_step(self) -> int | None:
        """The step of the last record in ``log.jsonl`` (its tail is read, so the cost is
        bounded whatever the log's size); ``None`` when there is none."""
        log = self.path / "log.jsonl"
        try:
            with open(log, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - _LOG_TAIL))
                tail = f.read().decode("utf-8", errors="replace")
        except OSError:
            return None
        for line in reversed(tail.splitlines()):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                return int(rec["step"])
        return None

    def _nothing_to_resume(self, found: list[str]) -> ExitlmError:
        """``--resume`` of a run that wrote no checkpoint: starting over would replace it."""
        step = self.last_logged_step()
        at = "" if step is None else f" at step {step}"
        result = next((name for name in ("model", "exits") if name in found), None)
        if result is not None:
            what = f"the run there finished{at} (its result is in {self.path / result})"
            reuse = (f"; to train further from its result, start a new run with "
                     f"model.init={self.path / result}" if result == "model" else "")
        else:
            what = f"the run there stopped{at} before its first checkpoint"
            reuse = ""
        return ExitlmError(
            f"--resume: no checkpoint in {self.path / CHECKPOINTS}: {what}; nothing to "
            "resume, and starting over would replace it",
            hint="set train.out_dir to a new directory" + reuse + ", or pass --overwrite "
                 "instead of --resume to replace the run (set train.checkpoint_every to make "
                 "a run resumable)")

    def read_run(self) -> dict[str, Any] | None:
        """``run.json`` (``None`` when the directory has none)."""
        file = self.path / RUN_FILE
        if not file.is_file():
            return None
        try:
            info = json.loads(file.read_text(encoding="utf-8"))
        except (ValueError, OSError) as err:
            raise ExitlmError(f"{file}: unreadable run identity ({err})",
                              hint="delete the file to adopt the run's checkpoints") from None
        if not isinstance(info, dict) or not isinstance(info.get("run_id"), str):
            raise ExitlmError(f"{file}: expected an object with a 'run_id' string",
                              hint="delete the file to adopt the run's checkpoints")
        return info

    # ----- lock --------------------------------------------------------------------------------
    def lock(self) -> None:
        """Take the directory's lock for this process (an error if another holds it)."""
        if fcntl is None or self._fd is not None:
            return
        ensure_dir(self.path, "train.out_dir")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise self._busy() from None
        self._fd = fd

    def unlock(self) -> None:
        """Release the lock."""
        if self._fd is not None and fcntl is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def locked_by_other(self) -> bool:
        """Whether another process holds the directory's lock right now."""
        if fcntl is None or self._fd is not None or not self.path.is_dir():
            return False
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        finally:
            os.close(fd)

    def _busy(self) -> ExitlmError:
        pid = None
        with contextlib.suppress(ExitlmError):
            pid = (self.read_run() or {}).get("pid")
        who = f"process {pid}" if isinstance(pid, int) else "another process"
        return ExitlmError(f"train.out_dir {self.path} is in use by another exitlm run ({who})",
                           hint="wait for it to finish, or set train.out_dir to another "
                                "directory")

    # ----- writes (under the lock) -------------------------------------------------------------
    def start(self, run_id: str | None = None) -> str:
        """Record the run's identity (and the writing process) in ``run.json``; returns the
        run id (a new one unless given)."""

        rid = run_id or uuid.uuid4().hex
        info = {"run_id": rid, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "pid": os.getpid()}
        ensure_dir(self.path, "train.out_dir")
        write_text_atomic(self.path / RUN_FILE, json.dumps(info, indent=2) + "\n")
        return rid

    def remove_outputs(self) -> list[Path]:
        """``--overwrite``: remove the previous run's outputs (and only those); an error when
        the directory holds files of those names but no run (:meth:`check_is_run`)."""
        found = self.outputs()
        if found:
            self.check_is_run(found)
        removed = []
        for name in OUTPUTS:
            p = self.path / name
            if p.exists() or p.is_symlink():
                remove_path(p)
                removed.append(p)
        return removed + self.clean_leftovers()

    def clean_leftovers(self) -> list[Path]:
        """Remove what killed writes left: temporaries with exitlm's names and checkpoints
        without ``state.json`` (half written or half pruned). Call with the lock held."""
        removed: list[Path] = []
        for folder, in_checkpoints in ((self.path, False), (self.path / CHECKPOINTS, True)):
            if not folder.is_dir():
                continue
            for entry in sorted(folder.iterdir()):
                if _leftover(entry, in_checkpoints):
                    remove_path(entry)
                    removed.append(entry)
        return removed


def _leftover(entry: Path, in_checkpoints: bool) -> bool:
    """Whether ``entry`` (in OUT, or in OUT/checkpoints) is debris of a killed exitlm write."""
    name = entry.name
    temp = temp_target(name)  # a temporary of an atomic write (exitlm.paths)
    if temp is not None:
        target = temp[0]
        if in_checkpoints:
            return target in _CHECKPOINT_NAMES or STEP_DIR.fullmatch(target) is not None
        return target in _OUT_NAMES
    if in_checkpoints:  # a checkpoint without state.json: half written or half pruned
        return STEP_DIR.fullmatch(name) is not None and entry.is_dir() \
            and not (entry / "state.json").is_file()
    return name == "log.jsonl.tmp"  # written by older versions when truncating the log


