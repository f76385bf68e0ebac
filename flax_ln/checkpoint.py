"""Resumable training: orbax checkpoints of a train state plus metadata, a JSON-lines metrics log, the loss plot.

A checkpoint (``Checkpointer.save``) holds every array of the state (for a
:class:`~flax_ln.train.TrainState`: parameters, optimizer state and the dropout RNG keys
and counters in ``rest``) and a JSON ``meta`` dictionary (step, data position, config,
...). Orbax's ``CheckpointManager`` writes each step into a temporary folder and renames
it when complete, so a process killed mid-write leaves the previous checkpoints intact,
and the unfinished folder is ignored (and cleaned up) next time. Arrays are restored
onto the shardings of the abstract state passed to :meth:`Checkpointer.restore`, so a run
saved on one device mesh can resume on another.

A checkpoint that was damaged after it was written (truncated or deleted array data, a
broken metadata file) raises :class:`UnreadableCheckpointError` with a one-line reason
(TensorStore's own, without the array spec orbax attaches to it);
:meth:`Checkpointer.restore_newest_readable` falls back to the newest checkpoint that does
read, and can set the damaged ones aside so that a resumed run can write those steps again.
:func:`check_writable_folder` tells, before a run starts, whether it can write its outputs.

orbax-checkpoint and matplotlib are imported inside the functions that need them
(``pip install flax-ln[examples]``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np

FORMAT = 1  # bump when the layout of what save() writes changes


class CheckpointError(Exception):
    """A checkpoint folder that cannot be resumed from: missing, empty, unreadable or incompatible."""


class UnreadableCheckpointError(CheckpointError):
    """One checkpoint whose metadata or arrays cannot be read back (damaged or partly deleted files).

    Attributes:
      step: the checkpoint's step.
      reason: one line saying what failed.
    """

    def __init__(self, folder, step: int, reason: str):
        super().__init__(f"{folder}: unreadable checkpoint: {reason}")
        self.step = step
        self.reason = reason


class FolderNotWritableError(CheckpointError):
    """An output or checkpoint folder that this process cannot create or write into."""


def _one_line(error: BaseException, limit: int = 400) -> str:
    """The innermost cause of ``error`` on one line, e.g. TensorStore's ``OUT_OF_RANGE: Error reading ...``.

    Orbax wraps that precise message in an exception whose text is a ~60-line dump of the
    array's TensorStore spec; the cause chain keeps the useful part.
    """
    chain = [error]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and cause not in chain:
        chain.append(cause)
    inner = chain[-1]
    text = " ".join(str(inner).split()) or type(inner).__name__
    return f"{type(inner).__name__}: {text if len(text) <= limit else text[:limit] + ' ...'}"


def _is_closed_loop_error(unraisable) -> bool:
    error = unraisable.exc_value
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def _from_orbax(record: logging.LogRecord) -> bool:
    """A record of asyncio's "exception was never retrieved" for a future of an orbax read."""
    error = record.exc_info[1] if record.exc_info else None
    frames = traceback.extract_tb(error.__traceback__) if error is not None else []
    return "never retrieved" in record.getMessage() and any("orbax" in frame.filename for frame in frames)


class _FailedReadNoise(logging.Filter):
    """Silences the aftermath of an orbax read that failed, and nothing else.

    When orbax gives up on a damaged checkpoint it closes its asyncio event loop while
    TensorStore still has reads in flight. As they complete, TensorStore's threads post to
    the closed loop, and Python reports each ``RuntimeError: Event loop is closed`` through
    ``sys.unraisablehook`` (the default hook prints a traceback), up to dozens of times,
    during the read and after it returned; the futures of the other failed reads are
    logged by asyncio as "exception was never retrieved". None of it adds to the one error
    the caller reports. Installed, this drops exactly those two kinds of report (as a
    ``sys.unraisablehook`` wrapper and a filter on the ``asyncio`` logger) and passes every
    other one to the previous hook.
    """

    def __init__(self):
        super().__init__()
        self._previous_hook = sys.unraisablehook

    def hook(self, unraisable) -> None:
        if not _is_closed_loop_error(unraisable):
            self._previous_hook(unraisable)

    def filter(self, record: logging.LogRecord) -> bool:
        return not _from_orbax(record)

    def install(self) -> None:
        sys.unraisablehook = self.hook
        logging.getLogger("asyncio").addFilter(self)

    def uninstall(self) -> None:
        if sys.unraisablehook == self.hook:
            sys.unraisablehook = self._previous_hook
        logging.getLogger("asyncio").removeFilter(self)


_quiet: _FailedReadNoise | None = None  # installed for good after a read failed


@contextlib.contextmanager
def _quiet_if_it_fails():
    """Silence a failed orbax read's noise (:class:`_FailedReadNoise`) during the read, and for good if it fails.

    The noise starts during the read and goes on after it returns.
    """
    global _quiet
    if _quiet is not None:
        yield
        return
    quiet = _FailedReadNoise()
    quiet.install()
    try:
        yield
    except BaseException:
        _quiet = quiet
        raise
    quiet.uninstall()


def check_writable_folder(path: str | os.PathLike, name: str) -> None:
    """Raise :class:`FolderNotWritableError` unless this process can write files into folder ``path``.

    An existing folder is probed by creating and deleting a temporary file in it (which
    also catches read-only mounts and ACLs, and lets root write into mode 555 as the
    system does); a missing one, through the nearest existing folder above it, which
    must let it be created. URLs (``gs://...``) are not checked. Nothing is left behind.

    Args:
      path: the folder.
      name: what the folder is to the user, for the message (e.g. ``"--out"``).
    """
    path = os.fspath(path)
    if "://" in path:
        return
    folder = Path(os.path.abspath(path))
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise FolderNotWritableError(f"{name} {folder}: {probe} is not a folder; choose another path")
    try:
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".flax_ln-write-test-")
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        what = "this folder" if probe == folder else f"{probe}, where it would be created,"
        raise FolderNotWritableError(
            f"{name} {folder} is not writable: {what} does not let this user ({_user()}) create files "
            f"({type(e).__name__}: {e.strerror or e}); choose another folder, or give this user write "
            f"permission on {probe}"
        ) from None


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return f"uid {os.geteuid()}" if hasattr(os, "geteuid") else "the current user"


def _key_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def state_names(tree: Any) -> list[str]:
    """Dotted names of the leaves of ``tree`` in flatten order, e.g. ``params.lm_head.kernel.value``."""
    return [".".join(_key_name(e) for e in path) for path, _ in jax.tree.flatten_with_path(tree)[0]]


def flatten_state(tree: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """``({name: array}, {name: prng impl})``: PRNG key arrays become their raw key data (orbax stores plain arrays)."""
    flat, impls = {}, {}
    for name, x in zip(state_names(tree), jax.tree.leaves(tree)):
        if _is_key(x):
            impls[name] = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
        flat[name] = x
    return flat, impls


def _mismatches(meta: dict, expect: dict | None) -> list[str]:
    return [
        f"{key}: checkpoint has {meta.get(key)!r}, this run has {value!r}"
        for key, value in (expect or {}).items()
        if meta.get(key) != value
    ]


def _describe(x) -> list:
    return [list(x.shape), str(x.dtype)]


class Checkpointer:
    """Orbax ``CheckpointManager`` over ``directory`` for one pytree state plus JSON metadata.

    Args:
      directory: the checkpoint folder (one sub-folder per saved step); a local path, or a
        URL such as ``gs://bucket/run`` where orbax can write (several hosts must share it).
      max_to_keep: keep only the newest this many checkpoints.
      create: create ``directory`` if missing (False to resume, so a typo is an error).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3, create: bool = True):
        import orbax.checkpoint as ocp
        from etils import epath  # orbax's path type: local paths and gs:// alike

        directory = os.fspath(directory)
        self.directory = epath.Path(directory if "://" in directory else os.path.abspath(directory))
        if not create and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: no such folder, so there is no checkpoint to resume from")
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create, cleanup_tmp_directories=True)
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None if there is none."""
        return self._manager.latest_step()

    def steps(self) -> list[int]:
        """The steps of every complete checkpoint, newest first."""
        return sorted(self._manager.all_steps(), reverse=True)

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start writing ``state`` and ``meta`` as checkpoint ``step`` (asynchronously; see :meth:`wait`).

        The arrays are copied off the devices before this returns, so ``state`` may be
        donated to the next train step right away.
        """
        ocp = self._ocp
        flat, impls = flatten_state(state)
        meta = {
            **meta,
            "format": FORMAT,
            "step": step,
            "prng_impls": impls,
            "arrays": {name: _describe(x) for name, x in flat.items()},
        }
        self._manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta))
        )

    def _no_checkpoint(self) -> CheckpointError:
        return CheckpointError(
            f"{self.directory}: no complete checkpoint in this folder (it is empty or holds only unfinished writes)"
        )

    def read_meta(self, step: int | None = None) -> dict:
        """The metadata of checkpoint ``step`` (default: the latest).

        Raises :class:`CheckpointError` if there is no checkpoint or it is not a flax-ln
        one, :class:`UnreadableCheckpointError` if its metadata cannot be read.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise self._no_checkpoint()
        try:
            with _quiet_if_it_fails():
                meta = self._manager.restore(step, args=self._ocp.args.Composite(meta=self._ocp.args.JsonRestore()))
            meta = meta["meta"]
        except Exception as e:  # noqa: BLE001 - orbax raises several types for missing or corrupt items
            raise UnreadableCheckpointError(
                self.directory / str(step), step, f"cannot read the checkpoint metadata ({_one_line(e)})"
            ) from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"{self.directory / str(step)}: not a flax-ln checkpoint of format {FORMAT}")
        return meta

    def newest_readable_meta(self) -> dict:
        """The metadata of the newest checkpoint whose metadata reads (see :meth:`restore_newest_readable`)."""
        return self._newest_readable(self.read_meta)[0]

    def check(self, meta: dict, expect: dict) -> None:
        """Raise :class:`CheckpointError` listing every ``expect`` entry that differs from ``meta``'s."""
        problems = _mismatches(meta, expect)
        if problems:
            raise CheckpointError(
                f"{self.directory / str(meta['step'])} is incompatible with this run:\n  " + "\n  ".join(problems)
            )

    def restore(self, abstract_state: Any, *, expect: dict | None = None, step: int | None = None) -> tuple[Any, dict]:
        """``(state, meta)`` of checkpoint ``step`` (default: the latest), placed as ``abstract_state`` says.

        Args:
          abstract_state: a pytree like the saved state, of ``jax.ShapeDtypeStruct`` (with
            ``sharding`` set to place the restored arrays) or of arrays.
          expect: metadata entries that must equal the saved ones (e.g. the model config);
            every mismatch is listed in one :class:`CheckpointError`.
          step: which checkpoint.

        Raises :class:`UnreadableCheckpointError` if its metadata or arrays cannot be read,
        :class:`CheckpointError` if it is missing or incompatible.
        """
        meta = self.read_meta(step)
        where = self.directory / str(meta["step"])
        problems = _mismatches(meta, expect)
        names, leaves = state_names(abstract_state), jax.tree.leaves(abstract_state)
        saved = meta["arrays"]
        wanted = {}
        for name, x in zip(names, leaves):
            if _is_key(x):
                x = jax.ShapeDtypeStruct(
                    jax.eval_shape(jax.random.key_data, x).shape, np.uint32, sharding=getattr(x, "sharding", None)
                )
            wanted[name] = x
        missing, unexpected = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
        if missing:
            problems.append(
                f"arrays this run needs but the checkpoint lacks: {', '.join(missing[:8])}"
                + (" ..." if len(missing) > 8 else "")
            )
        if unexpected:
            problems.append(
                f"arrays in the checkpoint this run does not have: {', '.join(unexpected[:8])}"
                + (" ..." if len(unexpected) > 8 else "")
            )
        problems += [
            f"{name}: checkpoint has shape/dtype {saved[name]}, this run {_describe(x)}"
            for name, x in wanted.items()
            if name in saved and saved[name] != _describe(x)
        ]
        if problems:
            raise CheckpointError(f"{where} is incompatible with this run:\n  " + "\n  ".join(problems))
        target = {
            name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
            for name, x in wanted.items()
        }
        ocp = self._ocp
        try:
            with _quiet_if_it_fails():
                flat = self._manager.restore(
                    meta["step"], args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
                )
        except Exception as e:  # noqa: BLE001 - orbax raises several types for unreadable arrays
            raise UnreadableCheckpointError(where, meta["step"], f"cannot read the arrays ({_one_line(e)})") from None
        values = []
        for name in names:
            x = flat["state"][name]
            values.append(
                jax.random.wrap_key_data(x, impl=meta["prng_impls"][name]) if name in meta["prng_impls"] else x
            )
        return jax.tree.unflatten(jax.tree.structure(abstract_state), values), meta

    def _newest_readable(self, read):
        """``(read(step), skipped)`` for the newest step that ``read`` does not find unreadable.

        ``skipped``: the :class:`UnreadableCheckpointError` of each newer step. Any other
        :class:`CheckpointError` (e.g. an incompatible checkpoint) is raised at once.
        """
        skipped: list[UnreadableCheckpointError] = []
        for step in self.steps():
            try:
                return read(step), skipped
            except UnreadableCheckpointError as e:
                skipped.append(e)
        if not skipped:
            raise self._no_checkpoint()
        raise CheckpointError(f"{self.directory}: no checkpoint can be read:\n  " + "\n  ".join(map(str, skipped)))

    def restore_newest_readable(
        self, abstract_state: Any, *, expect: dict | None = None
    ) -> tuple[Any, dict, list[UnreadableCheckpointError]]:
        """``(state, meta, skipped)``: :meth:`restore` of the newest checkpoint that reads back.

        Checkpoints are tried newest first; each one whose metadata or arrays cannot be
        read is skipped and returned in ``skipped`` (newest first), so the caller can say
        so. A checkpoint that reads but is incompatible with ``expect`` or
        ``abstract_state`` is an error, not a reason to fall back: older ones would be
        just as incompatible. A training run resumed this way should :meth:`set_aside` the
        skipped checkpoints, or saving those steps again fails.

        Args:
          abstract_state, expect: as :meth:`restore`.
        """
        (state, meta), skipped = self._newest_readable(
            lambda step: self.restore(abstract_state, expect=expect, step=step)
        )
        return state, meta, skipped

    def set_aside(self, step: int) -> str:
        """Rename checkpoint ``step``'s folder to ``STEP.unreadable``; returns its path.

        Orbax then no longer sees that step: it can be written again, and it is never
        deleted by ``max_to_keep``. The files are kept for inspection; delete them by hand.
        If ``STEP.unreadable`` exists, ``STEP.unreadable-2`` (``-3``, ...) is used. With several
        processes every one calls it: process 0 renames, and all wait for that before they reload.
        """
        self._manager.wait_until_finished()
        source = self.directory / str(step)
        target, n = self.directory / f"{step}.unreadable", 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}.unreadable-{n}"
        several = jax.process_count() > 1
        if several:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"flax_ln set_aside {step}: named")  # before process 0 renames
        if jax.process_index() == 0:
            source.rename(target)
        if several:
            multihost_utils.sync_global_devices(f"flax_ln set_aside {step}: renamed")
        self._manager.reload()
        return str(target)

    def wait(self) -> None:
        """Block until every started save is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release the manager's resources; later calls do nothing."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            # Orbax removes unfinished folders of earlier runs in a background thread that only save()
            # waits for; wait here too, or a run that ends without saving dies with that thread's error.
            getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
            self._manager.close()
            self._manager = None


# ---------------------------------------------------------------------------------------
# metrics


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a JSON-lines metrics file; a truncated last line (a killed writer) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsLog:
    """A JSON-lines log, one object per step, flushed per line so a killed run keeps what it logged.

    Args:
      path: the ``.jsonl`` file.
      keep_through: on resume, the restored step: earlier records (``step <= keep_through``)
        are kept and later ones, which the resumed run will redo, are dropped (the file is
        rewritten atomically). ``None`` starts an empty file.
      enabled: False makes every call a no-op (e.g. on all but the first host).
    """

    def __init__(self, path: str | os.PathLike, *, keep_through: int | None = None, enabled: bool = True):
        self.path = Path(path)
        self._file = None
        if not enabled:
            return
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= keep_through] if keep_through else []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def plot_loss(records: Iterable[dict], path: str | os.PathLike, *, title: str = "training loss") -> None:
    """Plot ``loss`` against ``step`` from metrics records into an image at ``path`` (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in records if "loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
