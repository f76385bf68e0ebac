"""Chapter 14's MIDI event tokenizer, exactly as the book's processor, and the music training data.

Token ids (vocabulary 390), as in the book::

    ids   0..127  note-on,  pitch = id
    ids 128..255  note-off, pitch = id - 128
    ids 256..355  time shift of (id - 256 + 1) steps of 10 ms: 10 ms .. 1 s
    ids 356..387  velocity bin b = id - 356 = velocity // 4 for the note-ons that follow
    id  388       end of sequence (EOS), the last target of a piece
    id  389       padding (PAD); the loss ignores it (``GPTConfig.music().ignore_index``)

MIDI is read and written with pretty_midi, as the book does. :func:`encode_midi` and
:func:`decode_notes` reproduce the book's processor token for token and note for note
(``docs/music.md`` lists its rules and ``docs/design.md`` gives them step by step; the book's own output in
``parity_tests/data/ch14`` pins them).
A model trained with the book's code saw exactly this stream, so its quirks are kept:

1. Instruments are merged in pretty_midi's order; each instrument's notes are taken in
   pretty_midi's order (by end, not start) before the stable sorts below.
2. Sustain pedal (control 64): a value >= 64 opens an interval, a value < 64 closes it; a
   value < 64 with none open moves the last closed interval's end; an interval still open
   at the end of the file is dropped.
3. With at least one interval, the notes that start after the stop of the last interval's
   walk are **dropped**; an interval whose walk never meets a note starting after its end
   releases nothing (its notes keep their ends) and leaves the list as it was, so the next
   interval walks the same notes again and notes can appear twice. A released note ends
   where the next held note of its pitch starts, else at max(pedal release, its end).
4. Simultaneous events keep the order note-on, note-off of the notes sorted by start (no
   note-off-first rule).
5. Gaps are ``round((t - t_prev) * 100)`` steps from the previous event's exact time,
   halves to even (Python's ``round``); 1 s shifts first, then the rest.
6. A velocity event precedes a note-on when ``velocity // 4`` differs from the previous
   event's *raw* velocity (0 at the start, None after a note-off): in practice almost every
   note-on, but e.g. velocity 80 after a note-on of velocity 20 gets none (80 // 4 == 20),
   and a first note of velocity < 4 gets none.
7. Decoding: a velocity bin decodes to ``4 * bin`` (not the bin's centre; bin 0 and
   note-ons before any velocity event give velocity 0, which a MIDI player treats as a
   note-off); times are sums of ``(k + 1) / 100`` in float. A note-on replaces a pending
   note-on of its pitch; a note-off makes a note from the pending note-on unless both
   times are equal, and leaves it pending, so a second note-off makes a second note;
   unmatched note-offs and note-ons still pending at the end are dropped.

One choice is ours: the book's decoder reads ids 388 and 389 as velocity bins 32 and 33
(velocities 128 and 132), which MIDI cannot store and pretty_midi refuses to write.
:func:`decode_notes` skips them (they change nothing). So its notes equal the book's
for every sequence in which no note-on follows a 388/389 before the next velocity
event: every sequence without them, and every training target (388 then only 389s).

There is no "corrected" mode: every model this tokenizer serves was trained on the
book's stream, and any correction changes the ids such a model expects.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

NOTE_ON, NOTE_OFF, TIME_SHIFT, VELOCITY = 0, 128, 256, 356  # first id of each event kind
N_PITCHES, N_SHIFTS, N_VELOCITIES = 128, 100, 32
N_EVENTS = VELOCITY + N_VELOCITIES  # 388: the ids a model may draw
EOS, PAD, VOCAB_SIZE = 388, 389, 390
STEPS_PER_SECOND = 100  # one time-shift step is 10 ms
SEQ_LEN = 2048  # the book's sequence length
SUSTAIN_PEDAL = 64  # MIDI control number; values >= 64 press it
PROMPT_LEN = 250  # the book's prompt: the first 250 ids of a test piece
MAX_PIECE_SECONDS = 24 * 3600  # the encoder refuses a piece whose last event is later (a day: no real piece is)
MAX_GAP_SECONDS = 6 * 3600  # ... or with a silence longer than this between two events


class Note(NamedTuple):
    """One note: MIDI ``pitch`` and ``velocity``, ``start`` and ``end`` in seconds."""

    pitch: int
    velocity: int
    start: float
    end: float


def _pretty_midi():
    try:
        import pretty_midi
    except ImportError:
        raise ImportError(
            "flax_ln.music reads and writes MIDI with pretty_midi, as the book does: "
            "pip install pretty_midi (or flax-ln[examples])"
        ) from None
    return pretty_midi


# ---------------------------------------------------------------------------------------
# encoding


def sustain_intervals(control_changes: Iterable) -> list[list[float]]:
    """The book's sustain-pedal intervals ``[start, end]`` (seconds) from one instrument's control changes.

    Control changes other than number 64 are ignored. Value >= 64 with no interval open
    opens one; value < 64 with one open closes and stores it; value < 64 with none open
    moves the last stored interval's end. An interval still open at the end is dropped.

    Args:
      control_changes: objects with ``number``, ``value`` and ``time`` (pretty_midi's
        ``ControlChange``), in file order.
    """
    intervals: list[list[float]] = []
    opened = None
    for cc in control_changes:
        if cc.number != SUSTAIN_PEDAL:
            continue
        if cc.value >= SUSTAIN_PEDAL and opened is None:
            opened = cc.time
        elif cc.value < SUSTAIN_PEDAL and opened is not None:
            intervals.append([opened, cc.time])
            opened = None
        elif cc.value < SUSTAIN_PEDAL and intervals:
            intervals[-1][1] = cc.time
    return intervals


def _release(held: list, pedal_end: float) -> None:
    """End the notes an interval held (in place): at the next held same-pitch start, else max(pedal_end, end)."""
    next_start: dict[int, float] = {}  # pitch -> start of the later held note of that pitch
    for note in reversed(held):
        note.end = next_start[note.pitch] if note.pitch in next_start else max(pedal_end, note.end)
        next_start[note.pitch] = note.start


def apply_sustain(notes: list, intervals: Sequence[Sequence[float]]) -> list:
    """One instrument's notes after the book's sustain-pedal pass (quirks 2-3 of the module docstring).

    Each interval walks the current note list: notes starting before it go to the
    stream, notes starting within it are held, and the first note starting after its end
    stops the walk (the list continues from that note) and releases the held notes. After
    the last interval the held notes of every interval are appended; what is left of the
    list is dropped. Without intervals the stream is ``notes``. Sorted by start (stable).

    Args:
      notes: mutable notes with ``pitch``, ``start``, ``end`` (pretty_midi ``Note``), in
        pretty_midi's order; released notes get new ends in place, and one object may
        appear more than once in the result (as in the book).
      intervals: from :func:`sustain_intervals`.
    """
    if not intervals:
        stream = list(notes)
    else:
        stream, held_by_interval = [], []
        for start, end in intervals:
            held: list[Any] = []
            for i, note in enumerate(notes):
                if note.start < start:
                    stream.append(note)
                elif note.start > end:
                    notes = notes[i:]
                    _release(held, end)
                    break
                else:
                    held.append(note)
            held_by_interval.append(held)
        for held in held_by_interval:
            stream += held
    return sorted(stream, key=lambda n: n.start)


def _check_duration(events: Sequence[tuple], origin: str) -> None:
    """Refuse a piece longer than :data:`MAX_PIECE_SECONDS` or with a gap longer than :data:`MAX_GAP_SECONDS`.

    Checked before any id is made: a 1 s shift per second of silence would otherwise fill
    memory (a 44-byte file can hold a gap of years). Never truncated: the stream stays the book's.
    """
    hint = (
        "far beyond real music (hours, not minutes), so most likely a corrupt tempo or tick value; "
        "it is refused, never truncated, because the book's token stream must stay exact"
    )
    if not events:
        return
    end = max(e[0] for e in events)
    if not end <= MAX_PIECE_SECONDS:  # also refuses NaN
        raise ValueError(
            f"{origin}: the piece runs to {end:.6g} s, longer than the encoder's limit of "
            f"{MAX_PIECE_SECONDS} s ({MAX_PIECE_SECONDS // 3600} h); {hint}"
        )
    prev = 0.0
    for time, *_ in events:
        if time - prev > MAX_GAP_SECONDS:
            raise ValueError(
                f"{origin}: a gap of {time - prev:.6g} s before the event at {time:.6g} s is longer than the "
                f"encoder's limit of {MAX_GAP_SECONDS} s ({MAX_GAP_SECONDS // 3600} h); {hint}"
            )
        prev = time


def encode_notes(notes: Iterable, *, origin: str = "encode_notes") -> np.ndarray:
    """Token ids (int32, no EOS) of notes, by the book's event rules (quirks 4-6 of the module docstring).

    The notes are sorted by start (stable); each gives a note-on at its start and a
    note-off at its end; the events are sorted by time (stable). Before each event,
    ``round((t - t_prev) * 100)`` steps become 1 s shifts (id 355) while >= 100, then
    one shift of the rest if positive; before a note-on, ``356 + v // 4`` unless
    ``v // 4`` equals the previous event's raw velocity (None after a note-off).

    Args:
      notes: objects with ``pitch``, ``velocity``, ``start``, ``end`` (seconds).
      origin: what the notes came from (a file name), named in errors.

    Raises:
      ValueError: the piece runs longer than :data:`MAX_PIECE_SECONDS` or has a gap longer
        than :data:`MAX_GAP_SECONDS` (refused before any id is made, never truncated).
    """
    events = []  # (time, pitch, velocity or None for a note-off)
    for n in sorted(notes, key=lambda n: n.start):
        events += [(n.start, n.pitch, n.velocity), (n.end, n.pitch, None)]
    events.sort(key=lambda e: e[0])
    _check_duration(events, origin)
    ids, prev_time, prev_velocity = [], 0, 0
    for time, pitch, velocity in events:
        steps = round((time - prev_time) * STEPS_PER_SECOND)
        while steps >= N_SHIFTS:
            ids.append(TIME_SHIFT + N_SHIFTS - 1)
            steps -= N_SHIFTS
        if steps > 0:
            ids.append(TIME_SHIFT + steps - 1)
        if velocity is None:
            ids.append(NOTE_OFF + pitch)
        else:
            if velocity // 4 != prev_velocity:
                ids.append(VELOCITY + velocity // 4)
            ids.append(NOTE_ON + pitch)
        prev_time, prev_velocity = time, velocity
    return np.asarray(ids, np.int32)


def encode_pretty_midi(midi, *, origin: str = "encode_pretty_midi") -> np.ndarray:
    """Token ids (int32, no EOS) of a ``pretty_midi.PrettyMIDI``, exactly as the book's encoder.

    Every instrument (in pretty_midi's order, drums included) goes through
    :func:`apply_sustain` with its own pedal; the streams are concatenated and encoded by
    :func:`encode_notes`. ``midi`` is not modified (its notes are copied first).
    ``origin`` (a file name) is named in errors.
    """
    pretty_midi = _pretty_midi()
    notes = []
    for instrument in midi.instruments:
        copies = [pretty_midi.Note(n.velocity, n.pitch, n.start, n.end) for n in instrument.notes]
        notes += apply_sustain(copies, sustain_intervals(instrument.control_changes))
    return encode_notes(notes, origin=origin)


def encode_midi(path: str | os.PathLike) -> np.ndarray:
    """Token ids (int32, no EOS) of the MIDI file at ``path``, read with pretty_midi, as the book's encoder.

    Raises:
      ValueError: naming ``path`` when pretty_midi cannot read it, or when the piece is longer
        than :data:`MAX_PIECE_SECONDS` or holds a gap longer than :data:`MAX_GAP_SECONDS`.
    """
    pretty_midi = _pretty_midi()
    try:
        midi = pretty_midi.PrettyMIDI(str(path))
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - pretty_midi/mido raise OSError, EOFError, KeyError, ValueError... on bad files
        raise ValueError(f"{path}: pretty_midi cannot read it as a MIDI file ({type(e).__name__}: {e})") from None
    return encode_pretty_midi(midi, origin=str(path))


# ---------------------------------------------------------------------------------------
# decoding


def _integer_ids(ids, caller: str) -> np.ndarray:
    """``ids`` as a one-dimensional int64 array, or a ValueError saying what was expected."""
    if isinstance(ids, (list, tuple)):
        for i, value in enumerate(ids):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(
                    f"{caller}: ids must be integer token ids; item {i} is {value!r} ({type(value).__name__}): "
                    "pass ints (e.g. the model's sampled ids), one piece at a time"
                )
        return np.asarray(ids, np.int64).reshape(-1)
    array = np.asarray(ids)
    if array.dtype.kind not in "iu":
        raise ValueError(
            f"{caller}: ids must be an integer array, got dtype {array.dtype}; convert with .astype(int) only if "
            "every value is a token id (floats are refused, even integral ones)"
        )
    if array.ndim != 1:
        raise ValueError(
            f"{caller}: ids must be one-dimensional (one piece), got shape {array.shape}; decode each row of a "
            "batch separately"
        )
    return array.astype(np.int64)


def decode_notes(ids: Sequence[int] | np.ndarray) -> list[Note]:
    """The book decoder's notes of a token-id sequence, sorted by start (stable).

    A running time (float, + (k + 1) / 100 per time shift) and a running velocity
    (``4 * bin``, 0 at the start) stamp note-ons and note-offs. A note-on replaces the
    pending note-on of its pitch; a note-off makes ``Note(pitch, on velocity, on time,
    this time)`` unless both times are equal, and the note-on stays pending. Ids 388
    (EOS) and 389 (PAD) are skipped (see the module docstring).

    Args:
      ids: token ids in [0, 390): a sequence of ints, or a one-dimensional integer array.

    Raises:
      ValueError: an id outside [0, 390), a float or bool id (even an integral float), or
        an array that is not one-dimensional (decode one piece at a time).
    """
    ids = _integer_ids(ids, "decode_notes")
    if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
        raise ValueError(
            f"decode_notes: ids must be in [0, {VOCAB_SIZE}), got min {ids.min()} max {ids.max()}; "
            "pass the model's output token ids"
        )
    notes: list[Note] = []
    pending: dict[int, tuple[float, int]] = {}  # pitch -> (time, velocity) of its note-on
    time, velocity = 0, 0
    for i in ids.tolist():
        if i < NOTE_OFF:
            pending[i] = (time, velocity)
        elif i < TIME_SHIFT:
            pitch = i - NOTE_OFF
            if pitch in pending and pending[pitch][0] != time:
                start, vel = pending[pitch]
                notes.append(Note(pitch, vel, start, time))
        elif i < VELOCITY:
            time += (i - TIME_SHIFT + 1) / STEPS_PER_SECOND
        elif i < N_EVENTS:
            velocity = 4 * (i - VELOCITY)
    return sorted(notes, key=lambda n: n.start)


def decode_midi(ids: Sequence[int] | np.ndarray, path: str | os.PathLike) -> list[Note]:
    """Write :func:`decode_notes` of ``ids`` to the MIDI file ``path`` and return them.

    As the book: pretty_midi's defaults (120 bpm, 220 ticks per beat), one instrument,
    program 1, not a drum. Notes of velocity 0 are written as they are (quirk 7).

    Raises:
      ValueError: ``ids`` that :func:`decode_notes` refuses (nothing is written then).
    """
    pretty_midi = _pretty_midi()
    notes = decode_notes(ids)
    midi = pretty_midi.PrettyMIDI()
    instrument = pretty_midi.Instrument(program=1, is_drum=False)
    instrument.notes = [pretty_midi.Note(n.velocity, n.pitch, n.start, n.end) for n in notes]
    midi.instruments.append(instrument)
    midi.write(str(path))
    return notes


# ---------------------------------------------------------------------------------------
# training data


def training_pair(ids: Sequence[int] | np.ndarray, length: int = SEQ_LEN) -> tuple[np.ndarray, np.ndarray]:
    """The book's ``(x, y)`` of one piece (int32, each ``(length,)``).

    ``x`` is the first ``length`` ids, padded with PAD. For a piece of ``L <= length``
    ids, ``y[:L-1] = ids[1:]``, ``y[L-1] = EOS`` and the rest PAD; a longer piece gives
    ``y = ids[1:length+1]`` (no EOS).

    Args:
      ids: the piece's event ids (at least one).
      length: the sequence length (the book: 2048, the model's block size).
    """
    ids = np.asarray(ids, np.int32).reshape(-1)
    if length < 1 or ids.size < 1:
        raise ValueError(f"training_pair: need length >= 1 and at least one id, got length {length}, {ids.size} ids")
    x = np.full(length, PAD, np.int32)
    y = np.full(length, PAD, np.int32)
    if ids.size <= length:
        x[: ids.size] = ids
        y[: ids.size - 1] = ids[1:]
        y[ids.size - 1] = EOS
    else:
        x[:] = ids[:length]
        y[:] = ids[1 : length + 1]
    return x, y


def prompt_length(block_size: int) -> int:
    """The book's prompt length, 250 ids, capped at a quarter of a shorter context (at least 1)."""
    return max(1, min(PROMPT_LEN, block_size // 4))


def render_bach_chorales(cache_dir: str | os.PathLike, limit: int | None = None) -> list[Path]:
    """Render the Bach chorales of music21's corpus to MIDI files in ``cache_dir``, once.

    Chorales already rendered are reused; each file is written to a temporary name and
    renamed, so an interrupted render leaves no partial file. The few chorales music21
    fails to render (malformed repeats) are skipped and remembered in ``NAME.skip`` with the
    reason. ``limit`` takes the first ``limit`` chorales in the corpus's (fixed) order
    (skipped ones included). Returns the paths of the rendered files sorted, like
    :func:`midi_files`. Needs ``pip install music21``.
    """
    try:
        from music21 import corpus
    except ImportError:
        raise RuntimeError(
            "the default music data is the Bach chorales in music21's corpus: pip install music21 "
            "(or flax-ln[examples]), or pass --data DIR with your own .mid files"
        ) from None
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    names = list(corpus.chorales.Iterator(returnType="filename"))[:limit]
    paths = []
    for name in names:
        path = cache / (name.replace("/", "_") + ".mid")
        skip = path.with_suffix(".skip")  # a chorale music21 cannot render, remembered with the reason
        if not path.exists() and not skip.exists():
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            try:
                corpus.parse(name).write("midi", fp=str(tmp))
                os.replace(tmp, path)
            except Exception as e:  # noqa: BLE001 - a chorale music21 cannot render is skipped; e.g. music21's ExpanderException on malformed repeats
                tmp.unlink(missing_ok=True)
                skip.write_text(f"{type(e).__name__}: {e}\n")
        if path.exists():
            paths.append(path)
    return sorted(paths)  # the order of midi_files(cache_dir), so --data on the cache gives the same data


def midi_files(folder: str | os.PathLike, limit: int | None = None) -> list[Path]:
    """The ``.mid``/``.midi`` files under ``folder`` (recursively), sorted by path; the first ``limit``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in (".mid", ".midi") and p.is_file())[:limit]
    if not files:
        raise FileNotFoundError(f"no .mid or .midi files under {folder}")
    return files


def maestro_split(folder: str | os.PathLike) -> dict[str, list[Path]] | None:
    """The MAESTRO split of ``folder`` (the book's data set), or None when it holds no ``maestro-v*.csv``.

    Returns ``{"train": [...], "validation": [...], "test": [...]}``: the csv's
    ``midi_filename`` entries (relative to ``folder``) by its ``split`` column, in csv order.

    Raises:
      FileNotFoundError: a listed MIDI file is missing (the first few are named).
      ValueError: the csv lacks the ``split`` or ``midi_filename`` column.
    """
    import csv

    folder = Path(folder)
    tables = sorted(folder.glob("maestro-v*.csv"))
    if not tables:
        return None
    with open(tables[-1], newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if rows and not {"split", "midi_filename"} <= rows[0].keys():
        raise ValueError(f"{tables[-1]}: expected the columns 'split' and 'midi_filename', got {list(rows[0])}")
    split: dict[str, list[Path]] = {"train": [], "validation": [], "test": []}
    for row in rows:
        split.setdefault(row["split"], []).append(folder / row["midi_filename"])
    missing = [str(p) for files in split.values() for p in files if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{tables[-1]} lists {len(missing)} MIDI files that are not there, e.g. "
            f"{missing[:3]}; pass the unpacked maestro-v2.0.0 folder"
        )
    if not split["train"] or not split["test"]:
        raise ValueError(f"{tables[-1]}: expected 'train' and 'test' pieces in the split column")
    return split


class MusicDataset:
    """The book's training examples, one ``(x, y)`` per piece (:func:`training_pair`), in a seeded order.

    Pieces without any event (no notes) are left out: the book would train on an all-PAD
    ``x`` whose ``y`` has EOS in the last position.

    The order is a stream: epoch ``e`` is a permutation of all examples seeded by
    ``(seed, e)``, and the stream is epoch 0, epoch 1, ... The *data position* is the
    number of examples consumed so far, so a checkpoint that stores it resumes the exact
    order, whatever the batch size.
    """

    def __init__(self, sequences: Sequence[np.ndarray], seq_len: int, seed: int):
        if seq_len < 1:
            raise ValueError(f"MusicDataset: seq_len must be >= 1, got {seq_len}")
        pairs = [training_pair(ids, seq_len) for ids in sequences if len(ids)]
        if not pairs:
            raise ValueError("MusicDataset: no piece has a note; nothing to train on")
        self.x = np.stack([x for x, _ in pairs])  # (N, seq_len)
        self.y = np.stack([y for _, y in pairs])  # (N, seq_len)
        self.seq_len = seq_len
        self.seed = seed
        self.fingerprint = hashlib.sha256(self.x.tobytes() + self.y.tobytes()).hexdigest()[:16]
        self._perms: dict[int, np.ndarray] = {}

    @classmethod
    def from_files(cls, files: Sequence[str | os.PathLike], seq_len: int, seed: int) -> MusicDataset:
        """Tokenise ``files`` with :func:`encode_midi` (unreadable ones raise with their path)."""
        return cls([encode_midi(f) for f in files], seq_len, seed)

    def __len__(self) -> int:
        return len(self.x)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.clear()
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self))
        return self._perms[epoch]

    def batch(
        self, position: int, batch_size: int, part: Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """``(x, y, next_position)``: examples ``position .. position + batch_size - 1`` of the stream, each (B, T).

        ``part`` (row numbers in ``[0, batch_size)``) reads only those rows of that batch, in that
        order: one process's share of a global batch (:func:`flax_ln.sharding.process_rows`).
        """
        n = len(self)
        ks = range(position, position + batch_size)
        rows = [self._order(ks[i] // n)[ks[i] % n] for i in (range(batch_size) if part is None else part)]
        return self.x[rows], self.y[rows], position + batch_size
