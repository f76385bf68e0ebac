"""Chapter 14's performance-event tokenizer, a minimal MIDI reader/writer, and the music training data.

Token ids (vocabulary 390), as in the book::

    ids   0..127  note-on,  pitch = id
    ids 128..255  note-off, pitch = id - 128
    ids 256..355  time shift of (id - 256 + 1) steps of 10 ms: 10 ms .. 1 s
    ids 356..387  velocity bin b = id - 356 for the note-ons that follow; b = velocity * 32 // 128,
                  decoded as velocity 4 b + 2 (never 0, which MIDI reads as a note-off)
    id  388       end of sequence (EOS)
    id  389       padding (PAD); the loss ignores it (``GPTConfig.music().ignore_index``)

Encoding (:func:`encode_notes`): note times are quantised to 10 ms steps; a note lasts at
least one step; a note is cut where the next note of the same pitch starts (of two
same-pitch notes starting on the same step, the longer one is kept). Every note becomes a
note-on and a note-off event; events are ordered by (time, note-offs before note-ons,
pitch). Before each event the time since the previous one is written as time shifts
(as many full 1 s shifts as needed, then the rest); a velocity event precedes a note-on
whenever the velocity bin changes (and before the first note-on). Instruments and
channels are merged, as the book does; pedals, pitch bends and programs are dropped.

Decoding (:func:`decode_notes`) accepts any id sequence: it stops at EOS, skips PAD,
ignores note-offs of silent pitches, ends a sounding note when its pitch is struck
again, ends notes still sounding at the last time, and drops zero-length notes. For
ids produced by the encoder, ``encode_notes(decode_notes(ids)) == ids``.

MIDI files are read and written by a small standard-MIDI-file codec in this module
(formats 0 and 1, running status, tempo changes), so the tokenizer needs neither torch
nor music21; music21 only renders the default training data, the Bach chorales in its
corpus (:func:`render_bach_chorales`), and is imported there.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

NOTE_ON, NOTE_OFF, TIME_SHIFT, VELOCITY = 0, 128, 256, 356  # first id of each event kind
N_PITCHES, N_SHIFTS, N_VELOCITIES = 128, 100, 32
EOS, PAD, VOCAB_SIZE = 388, 389, 390
STEP_SECONDS = 0.01  # one time-shift step
SEQ_LEN = 2048  # the book's sequence length
DEFAULT_VELOCITY_BIN = 16  # for note-ons before any velocity event (velocity 66)

_TICKS_PER_BEAT, _TEMPO = 500, 500_000  # written files: 120 bpm, one tick = 1 ms exactly


class Note(NamedTuple):
    """One note: MIDI ``pitch`` and ``velocity`` (1..127), ``start`` and ``end`` in seconds."""

    pitch: int
    velocity: int
    start: float
    end: float


# ---------------------------------------------------------------------------------------
# events <-> ids


def _quantise(notes: Iterable[Note]) -> list[tuple[int, int, int, int]]:
    """Notes as (start_step, end_step, pitch, velocity), normalised as the module docstring says."""
    by_pitch: dict[int, list[list[int]]] = {}
    for n in notes:
        if not (0 <= n.pitch < N_PITCHES and 1 <= n.velocity <= 127 and n.start >= 0 and n.end >= n.start):
            raise ValueError(f"encode: expected pitch 0..127, velocity 1..127 and 0 <= start <= end, got {n}")
        s = round(n.start / STEP_SECONDS)
        by_pitch.setdefault(n.pitch, []).append([s, max(round(n.end / STEP_SECONDS), s + 1), n.pitch, n.velocity])
    out = []
    for group in by_pitch.values():
        group.sort()
        for cur, nxt in zip(group, [*group[1:], None]):
            if nxt is not None and nxt[0] == cur[0]:
                continue  # the same pitch struck twice on one step: keep the later note
            if nxt is not None:
                cur[1] = min(cur[1], nxt[0])  # end where the same pitch sounds again (nxt starts later)
            out.append(tuple(cur))
    return out


def encode_notes(notes: Iterable[Note]) -> np.ndarray:
    """Token ids (int32, no EOS) of ``notes``; see the module docstring for the exact rules."""
    events = []  # (step, kind 0 = off / 1 = on, pitch, velocity)
    for s, e, pitch, velocity in _quantise(notes):
        events += [(s, 1, pitch, velocity), (e, 0, pitch, 0)]
    events.sort(key=lambda ev: ev[:3])
    ids, now, bin_now = [], 0, None
    for step, kind, pitch, velocity in events:
        shift = step - now
        while shift > 0:
            k = min(shift, N_SHIFTS)
            ids.append(TIME_SHIFT + k - 1)
            shift -= k
        now = step
        if kind == 1:
            b = velocity * N_VELOCITIES // 128
            if b != bin_now:
                ids.append(VELOCITY + b)
                bin_now = b
            ids.append(NOTE_ON + pitch)
        else:
            ids.append(NOTE_OFF + pitch)
    return np.asarray(ids, np.int32)


def decode_notes(ids: Sequence[int] | np.ndarray) -> list[Note]:
    """Notes of a token-id sequence, sorted by (start, pitch); any ids in [0, 390) are accepted."""
    ids = np.asarray(ids).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
        raise ValueError(f"decode: token ids must be in [0, {VOCAB_SIZE}), got min {ids.min()} max {ids.max()}")
    notes: list[tuple[int, int, int, int]] = []
    sounding: dict[int, tuple[int, int]] = {}  # pitch -> (start step, velocity)
    now, velocity = 0, 4 * DEFAULT_VELOCITY_BIN + 2

    def end(pitch):
        start, vel = sounding.pop(pitch)
        if now > start:
            notes.append((start, now, pitch, vel))

    for i in ids.tolist():
        if i == EOS:
            break
        if i < NOTE_OFF:
            if i in sounding:
                end(i)
            sounding[i] = (now, velocity)
        elif i < TIME_SHIFT:
            if i - NOTE_OFF in sounding:
                end(i - NOTE_OFF)
        elif i < VELOCITY:
            now += i - TIME_SHIFT + 1
        elif i < EOS:
            velocity = 4 * (i - VELOCITY) + 2
    for pitch in list(sounding):
        end(pitch)
    notes.sort(key=lambda n: (n[0], n[2]))
    return [Note(p, v, s * STEP_SECONDS, e * STEP_SECONDS) for s, e, p, v in notes]


def fit_length(ids: Sequence[int] | np.ndarray, length: int = SEQ_LEN) -> np.ndarray:
    """``ids + [EOS]`` cut to ``length`` or padded with PAD to it (int32), as the book prepares sequences."""
    if length < 1:
        raise ValueError(f"fit_length: length must be >= 1, got {length}")
    seq = np.concatenate([np.asarray(ids, np.int32).reshape(-1), [EOS]])[:length]
    return np.pad(seq, (0, length - seq.size), constant_values=PAD).astype(np.int32)


# ---------------------------------------------------------------------------------------
# standard MIDI files


def _varlen(data: bytes, i: int) -> tuple[int, int]:
    """A variable-length quantity at ``data[i]``: (value, index after it)."""
    value = 0
    while True:
        if i >= len(data):
            raise ValueError("truncated variable-length quantity")
        b = data[i]
        i += 1
        value = (value << 7) | (b & 0x7F)
        if not b & 0x80:
            return value, i


def _write_varlen(value: int) -> bytes:
    out = [value & 0x7F]
    while value > 0x7F:
        value >>= 7
        out.append(0x80 | (value & 0x7F))
    return bytes(reversed(out))


def _parse_track(body: bytes, track: int, events: list, tempos: list) -> None:
    """Append (tick, track, index, kind 'on'/'off', channel, pitch, velocity) and (tick, tempo) from one MTrk."""
    tick, i, status = 0, 0, None
    while i < len(body):
        delta, i = _varlen(body, i)
        tick += delta
        b = body[i]
        if b == 0xFF:  # meta event
            kind = body[i + 1]
            size, i = _varlen(body, i + 2)
            if kind == 0x51 and size == 3:
                tempos.append((tick, int.from_bytes(body[i:i + 3], "big")))
            i += size
            if kind == 0x2F:
                return
            continue
        if b in (0xF0, 0xF7):  # sysex
            size, i = _varlen(body, i + 1)
            i += size
            continue
        if b & 0x80:
            status, i = b, i + 1
        elif status is None:
            raise ValueError(f"track {track}: data byte without a status byte")
        kind, channel = status & 0xF0, status & 0x0F
        n = 1 if kind in (0xC0, 0xD0) else 2
        data = body[i:i + n]
        i += n
        if kind == 0x90 and data[1] > 0:
            events.append((tick, track, len(events), "on", channel, data[0], data[1]))
        elif kind == 0x80 or kind == 0x90:
            events.append((tick, track, len(events), "off", channel, data[0], 0))


def read_midi(path: str | os.PathLike) -> list[Note]:
    """The notes of a standard MIDI file (format 0 or 1), times in seconds after the tempo map.

    Note-ons and note-offs are paired per (channel, pitch) first-in first-out; notes still
    sounding at the end close at the file's last note event.
    """
    data = Path(path).read_bytes()
    try:
        if data[:4] != b"MThd":
            raise ValueError("missing the MThd header")
        header_len = int.from_bytes(data[4:8], "big")
        _, _, division = struct.unpack(">HHH", data[8:14])
        if division & 0x8000:
            raise ValueError("SMPTE time division is not supported")
        events: list = []
        tempos: list = []
        i, track = 8 + header_len, 0
        while i + 8 <= len(data):
            size = int.from_bytes(data[i + 4:i + 8], "big")
            if data[i:i + 4] == b"MTrk":
                _parse_track(data[i + 8:i + 8 + size], track, events, tempos)
                track += 1
            i += 8 + size
    except (ValueError, IndexError, struct.error) as e:
        raise ValueError(f"read_midi: {path} is not a valid standard MIDI file: {e}") from None

    # tick -> seconds through the tempo map (default 120 bpm until the first tempo event)
    tempos = sorted([(0, 500_000), *tempos], key=lambda t: t[0])
    marks = []  # (tick, seconds at tick, seconds per tick from there)
    seconds = 0.0
    for k, (tick, tempo) in enumerate(tempos):
        if marks:
            seconds += (tick - marks[-1][0]) * marks[-1][2]
        marks.append((tick, seconds, tempo / 1e6 / division))
    starts = [m[0] for m in marks]

    def to_seconds(tick):
        m = marks[int(np.searchsorted(starts, tick, side="right")) - 1]
        return m[1] + (tick - m[0]) * m[2]

    events.sort(key=lambda e: e[:3])
    sounding: dict[tuple[int, int], list[tuple[int, int]]] = {}
    notes = []
    for tick, _, _, kind, channel, pitch, velocity in events:
        queue = sounding.setdefault((channel, pitch), [])
        if kind == "on":
            queue.append((tick, velocity))
        elif queue:
            start, vel = queue.pop(0)
            notes.append((start, tick, pitch, vel))
    last = events[-1][0] if events else 0
    notes += [(start, last, pitch, vel) for (_, pitch), queue in sounding.items() for start, vel in queue]
    notes.sort(key=lambda n: (n[0], n[2]))
    return [Note(p, v, to_seconds(s), to_seconds(e)) for s, e, p, v in notes]


def write_midi(notes: Iterable[Note], path: str | os.PathLike) -> None:
    """Write ``notes`` as a format-0 MIDI file on channel 0: 120 bpm, 500 ticks per beat (1 tick = 1 ms)."""
    events = []  # (tick, 0 = off / 1 = on, pitch, velocity)
    for n in notes:
        s, e = round(n.start * 1000), round(n.end * 1000)
        if e <= s:
            continue
        events += [(s, 1, n.pitch, n.velocity), (e, 0, n.pitch, 0)]
    events.sort()
    track = bytearray(b"\x00\xff\x51\x03" + _TEMPO.to_bytes(3, "big"))
    now = 0
    for tick, on, pitch, velocity in events:
        track += _write_varlen(tick - now) + bytes([0x90 if on else 0x80, pitch, velocity if on else 0])
        now = tick
    track += b"\x00\xff\x2f\x00"  # end of track
    header = b"MThd" + struct.pack(">IHHH", 6, 0, 1, _TICKS_PER_BEAT)
    Path(path).write_bytes(header + b"MTrk" + struct.pack(">I", len(track)) + bytes(track))


def encode_midi(path: str | os.PathLike) -> np.ndarray:
    """Token ids (int32, no EOS) of a MIDI file: :func:`encode_notes` of :func:`read_midi`."""
    return encode_notes(read_midi(path))


def decode_midi(ids: Sequence[int] | np.ndarray, path: str | os.PathLike) -> list[Note]:
    """Write the notes of ``ids`` to a MIDI file at ``path``; returns the notes."""
    notes = decode_notes(ids)
    write_midi(notes, path)
    return notes


# ---------------------------------------------------------------------------------------
# data


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
            except Exception as e:  # e.g. music21's ExpanderException on malformed repeats
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


class MusicDataset:
    """Fixed-length training examples cut from tokenised MIDI files, served in a seeded order.

    Each file's ids plus EOS are cut into windows of ``seq_len + 1`` tokens with stride
    ``seq_len`` (consecutive windows share one token, so every token is a target once);
    the last window is padded with PAD. ``x = window[:-1]``, ``y = window[1:]``.

    The order is a stream: epoch ``e`` is a permutation of all examples seeded by
    ``(seed, e)``, and the stream is epoch 0, epoch 1, ... The *data position* is the
    number of examples consumed so far, so a checkpoint that stores it resumes the exact
    order, whatever the batch size.
    """

    def __init__(self, sequences: Sequence[np.ndarray], seq_len: int, seed: int):
        if seq_len < 1:
            raise ValueError(f"MusicDataset: seq_len must be >= 1, got {seq_len}")
        windows = []
        for ids in sequences:
            seq = np.concatenate([np.asarray(ids, np.int32), [EOS]])
            for start in range(0, seq.size - 1, seq_len):  # every window has at least one target
                window = seq[start:start + seq_len + 1]
                windows.append(np.pad(window, (0, seq_len + 1 - window.size), constant_values=PAD))
        if not windows:
            raise ValueError("MusicDataset: no sequence has a note; nothing to train on")
        self.examples = np.stack(windows).astype(np.int32)  # (N, seq_len + 1)
        self.seq_len = seq_len
        self.seed = seed
        self.fingerprint = hashlib.sha256(self.examples.tobytes()).hexdigest()[:16]
        self._perms: dict[int, np.ndarray] = {}

    @classmethod
    def from_files(cls, files: Sequence[str | os.PathLike], seq_len: int, seed: int) -> MusicDataset:
        """Tokenise ``files`` (unreadable ones raise with their path) and cut them into examples."""
        return cls([encode_midi(f) for f in files], seq_len, seed)

    def __len__(self) -> int:
        return len(self.examples)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.clear()
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self))
        return self._perms[epoch]

    def batch(self, position: int, batch_size: int) -> tuple[np.ndarray, np.ndarray, int]:
        """``(x, y, next_position)``: examples ``position .. position + batch_size - 1`` of the stream, each (B, T)."""
        n = len(self)
        rows = [self._order(k // n)[k % n] for k in range(position, position + batch_size)]
        windows = self.examples[rows]  # (B, T + 1)
        return windows[:, :-1], windows[:, 1:], position + batch_size
