"""Chapter 14's tokenizer (flax_ln.music) against the book's rules and its own output.

Every expected id list below is derived by hand from the rules in docs/design.md ("The chapter-14
event stream"; the derivation is in the comments), or is the book's output in ``data/ch14/expected.json``.
The MIDI files are written with pretty_midi at 120 bpm and 256 ticks per beat, so a tick is 1/512 s and every
time used here (multiples of 1/8 s) is exact in binary: a gap of 0.125 s is exactly 12.5
steps, a true half.

Id reminders: note-on = pitch, note-off = 128 + pitch, shift of k steps = 255 + k
(1 s = 355), velocity bin = 356 + v // 4 (v = 80 -> 376, 100 -> 381, 20 -> 361, 40 -> 366).
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pretty_midi
import pytest

from flax_ln import music
from flax_ln.music import EOS, PAD, Note

GOLDEN = Path(__file__).resolve().parent / "data" / "ch14"
# expected.json stores the book decoder's times rounded to a few decimals (0.15 where the book's
# float sum 0.05 + 0.05 + 0.05 is 0.15000000000000002); 1e-9 s is far below one 10 ms step.
GOLDEN_TIME_ATOL = 1e-9
# Hand-written decimal times against the decoder's float sums of (k + 1) / 100: a few ulps.
TIME_ATOL = 1e-12


def write_midi(path, *instruments, resolution=256):
    """A MIDI file from ``instruments``: each ``(program, notes, pedal)`` with notes (pitch, velocity, start,
    end) and pedal [(time, value)] control-64 changes. Returns the path; checks pretty_midi reads the times back
    exactly (the derivations rely on it)."""
    midi = pretty_midi.PrettyMIDI(resolution=resolution, initial_tempo=120.0)
    for program, notes, pedal in instruments:
        inst = pretty_midi.Instrument(program=program)
        inst.notes = [pretty_midi.Note(velocity=v, pitch=p, start=s, end=e) for p, v, s, e in notes]
        inst.control_changes = [pretty_midi.ControlChange(64, value, time) for time, value in pedal]
        midi.instruments.append(inst)
    midi.write(str(path))
    back = pretty_midi.PrettyMIDI(str(path))
    times = {t for i in back.instruments for n in i.notes for t in (n.start, n.end)}
    times |= {c.time for i in back.instruments for c in i.control_changes}
    assert all(t * 512 == int(t * 512) for t in times), times  # on the 1/512 s grid: exact
    return path


def encode(tmp_path, *instruments):
    return music.encode_midi(write_midi(tmp_path / "t.mid", *instruments)).tolist()


def notes(ids):
    return [tuple(n) for n in music.decode_notes(ids)]


def assert_notes(got, want, atol=TIME_ATOL):
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        assert g[:2] == tuple(w[:2]), (got, want)  # pitch and velocity exactly
        np.testing.assert_allclose(g[2:], w[2:], rtol=0, atol=atol)


# ---- the book's own output --------------------------------------------------------------


def golden():
    return json.loads((GOLDEN / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(golden()["encode"]))
def test_encoder_matches_the_books_ids(name):
    ids = music.encode_midi(GOLDEN / name)
    assert ids.dtype == np.int32 and ids.tolist() == golden()["encode"][name]


@pytest.mark.parametrize("case", range(len(golden()["decode"])))
def test_decoder_matches_the_books_notes(case):
    spec = golden()["decode"][case]
    assert_notes(notes(spec["ids"]), spec["notes"], atol=GOLDEN_TIME_ATOL)


# ---- encoding rules ----------------------------------------------------------------------


def test_chord_simultaneous_events_keep_note_order(tmp_path):
    # pretty_midi lists notes as their note-offs come (60 and 64 end together: by pitch); sorted by start
    # (stable): 60, 64, 67. Events by time (stable): on60 on64 @0, off60 off64 on67 @0.5, off67 @1.
    # Every note-on gets a velocity event: 80 // 4 = 20 != the previous raw velocity (0, 80, None).
    ids = encode(tmp_path, (0, [(60, 80, 0.0, 0.5), (64, 80, 0.0, 0.5), (67, 80, 0.5, 1.0)], []))
    assert ids == [376, 60, 376, 64, 305, 188, 192, 376, 67, 305, 195]


def test_simultaneous_note_ons_follow_pretty_midis_order_by_end(tmp_path):
    # 72 ends first, so pretty_midi lists it first; both start at 0, and the stable sort keeps 72 before 48
    # (a pitch or note-on order would put 48 first).
    ids = encode(tmp_path, (0, [(48, 100, 0.0, 0.5), (72, 100, 0.0, 0.25)], []))
    assert ids == [381, 72, 381, 48, 280, 200, 280, 176]


def test_overlapping_restrike_of_one_pitch(tmp_path):
    # Written: on60 @0, on60 @0.5, off60 @0.75, off60 @1. pretty_midi's first note-off closes both open
    # notes (0-0.75 and 0.5-0.75); the second finds nothing open. Events: on @0, on @0.5, off off @0.75.
    ids = encode(tmp_path, (0, [(60, 80, 0.0, 1.0), (60, 80, 0.5, 0.75)], []))
    assert ids == [376, 60, 305, 376, 60, 280, 188, 188]


def test_zero_length_note_as_pretty_midi_reads_it(tmp_path):
    # pretty_midi writes a zero-length note's note-off (velocity 0) before its note-on at the same tick; the
    # note-off finds nothing open, so the note stays open until the next note-off of 60 at 1.0, which closes
    # it and the 0.75 note: notes 60 (v40) 0.5-1.0 and 60 (v60) 0.75-1.0.
    # 0.5 s -> 305, bin 10 -> 366, on; 0.25 s -> 280, bin 15 (15 != 40) -> 371, on; 0.25 s, off, off.
    ids = encode(tmp_path, (0, [(60, 40, 0.5, 0.5), (60, 60, 0.75, 1.0)], []))
    assert ids == [305, 366, 60, 280, 371, 60, 280, 188, 188]


def test_zero_length_note_emits_note_on_then_note_off():
    # No note-off-first rule: the note's own events keep their order (on, off) with no shift between.
    ids = music.encode_notes([Note(60, 80, 0.25, 0.25), Note(62, 80, 0.25, 0.5)]).tolist()
    assert ids == [280, 376, 60, 188, 376, 62, 280, 190]


def test_several_instruments_in_file_order(tmp_path):
    # Streams are concatenated in instrument order, then sorted by start (stable): 60 (first instrument)
    # before 48 though both start at 0. Bins: 40 -> 10 (366), 100 -> 25 (381).
    ids = encode(tmp_path, (0, [(60, 40, 0.0, 0.5)], []), (1, [(48, 100, 0.0, 0.5)], []))
    assert ids == [366, 60, 381, 48, 305, 188, 176]


def test_gaps_on_a_half_step_round_to_even(tmp_path):
    # Gaps 0.125 s = 12.5 steps -> 12 (267), 0.375 s = 37.5 -> 38 (293), 0.625 s = 62.5 -> 62 (317);
    # half-up rounding would give 13, 38, 63.
    ids = encode(tmp_path, (0, [(60, 80, 0.0, 0.125), (62, 80, 0.5, 1.125)], []))
    assert ids == [376, 60, 267, 188, 293, 376, 62, 317, 190]


def test_gaps_of_a_second_or_more(tmp_path):
    # 1 s -> one 355 and no zero shift; 2 s -> 355 355; 1.25 s -> 355 then 25 steps (280); the first event
    # at 1.25 s is a gap from time 0.
    ids = encode(tmp_path, (0, [(60, 80, 1.25, 2.25), (62, 80, 4.25, 4.5)], []))
    assert ids == [355, 280, 376, 60, 355, 188, 355, 355, 376, 62, 280, 190]


def test_velocity_event_compares_the_bin_with_the_raw_previous_velocity(tmp_path):
    # 20 ends first, so it comes first: 20 // 4 = 5 != 0 -> 361. Then 80 // 4 = 20 == the previous raw
    # velocity 20: no velocity event, so the book's stream plays the second note at bin 5.
    ids = encode(tmp_path, (0, [(62, 80, 0.0, 0.5), (60, 20, 0.0, 0.25)], []))
    assert ids == [361, 60, 62, 280, 188, 280, 190]


def test_first_quiet_note_and_velocity_changes(tmp_path):
    # velocity 3: 3 // 4 = 0 == the initial 0, no event; after a note-off (None) 100 -> 381; then 101 // 4 = 25
    # != 100 -> 381 again; 72 // 4 = 18 -> 374.
    ids = encode(
        tmp_path, (0, [(60, 3, 0.0, 0.25), (64, 100, 0.5, 0.75), (67, 101, 0.5, 1.0), (69, 72, 1.0, 1.25)], [])
    )
    assert ids == [60, 280, 188, 280, 381, 64, 381, 67, 280, 192, 280, 195, 374, 69, 280, 197]


# ---- sustain pedal -------------------------------------------------------------------------


def test_pedal_still_down_at_the_end_is_ignored(tmp_path):
    # The only interval never closes, so it is dropped: no interval, the notes as they are.
    ids = encode(tmp_path, (0, [(60, 80, 0.0, 0.5)], [(0.25, 127)]))
    assert ids == [376, 60, 305, 188]


def test_pedal_holds_and_drops_the_notes_after_the_last_interval(tmp_path):
    # Interval [1, 2]. Walk (pretty_midi order = by end): 60 starts before 1 -> stream; 62 starts within ->
    # held; 64 starts after 2 -> stop: 62 is released to max(2, 1.5) = 2, and the list from 64 on (64, 65) is
    # never added. Events: on60 @0, off60 @0.5, on62 @1.25, off62 @2.
    ids = encode(
        tmp_path,
        (
            0,
            [(60, 80, 0.0, 0.5), (62, 80, 1.25, 1.5), (64, 80, 2.5, 3.0), (65, 80, 2.75, 3.25)],
            [(1.0, 127), (2.0, 0)],
        ),
    )
    assert ids == [376, 60, 305, 188, 330, 376, 62, 330, 190]


def test_pedal_walk_that_never_stops_keeps_ends(tmp_path):
    # Interval [1, 2]; no note starts after 2, so the walk never stops: 62 is held but never released and is
    # appended with its own end 1.5.
    ids = encode(tmp_path, (0, [(60, 80, 0.0, 0.5), (62, 80, 1.25, 1.5)], [(1.0, 127), (2.0, 0)]))
    assert ids == [376, 60, 305, 188, 330, 376, 62, 280, 190]


def test_second_interval_walks_the_same_notes_again(tmp_path):
    # Intervals [1, 2] and [3, 4]. The first walk never stops (stream 60, held 62), so the second walks the
    # same list: 60 and 62 both start before 3 -> stream again. Stream 60 60 62 + held 62: every note twice.
    # Events: on60 on60 @0, off off @0.5, on62 on62 @1.25, off off @1.5.
    ids = encode(tmp_path, (0, [(60, 80, 0.0, 0.5), (62, 80, 1.25, 1.5)], [(1.0, 127), (2.0, 0), (3.0, 127), (4.0, 0)]))
    assert ids == [376, 60, 376, 60, 305, 188, 188, 330, 376, 62, 376, 62, 280, 190, 190]


def test_repeated_pedal_release_moves_the_interval_end(tmp_path):
    # Pedal: up at 0.5 with nothing stored (ignored), down 1, up 1.5, up again 2 -> interval [1, 2]. Held:
    # 60 (1.25-1.5) and 64 (1.75-2.25, within [1, 2] only thanks to the moved end); 67 at 2.5 stops the walk
    # and is dropped. Release, last held first: 64 -> max(2, 2.25) = 2.25; 60 -> max(2, 1.5) = 2.
    # Events: on60 @1.25, on64 @1.75, off60 @2, off64 @2.25.
    ids = encode(
        tmp_path,
        (
            0,
            [(60, 80, 1.25, 1.5), (64, 80, 1.75, 2.25), (67, 80, 2.5, 2.75)],
            [(0.5, 0), (1.0, 127), (1.5, 0), (2.0, 10)],
        ),
    )
    assert ids == [355, 280, 376, 60, 305, 376, 64, 280, 188, 280, 192]


def test_pedal_release_ends_a_note_where_its_pitch_is_struck_again(tmp_path):
    # Held: 60 (1-1.25) and 60 (1.5-1.75); 67 at 2.5 stops the walk. Release, last first: the later 60 ends
    # at max(2, 1.75) = 2; the earlier one at the later one's start, 1.5.
    # Events: on @1, off @1.5, on @1.5, off @2.
    ids = encode(tmp_path, (0, [(60, 80, 1.0, 1.25), (60, 80, 1.5, 1.75), (67, 80, 2.5, 2.75)], [(1.0, 127), (2.0, 0)]))
    assert ids == [355, 376, 60, 305, 188, 376, 60, 305, 188]


def test_pedal_release_can_make_a_zero_length_note(tmp_path):
    # Two 60s struck together at 1.25: pretty_midi's note-off at 1.5 closes both (1.25-1.5 twice). Release, last
    # first: the second ends at max(2, 1.5) = 2, the first at the second's start 1.25: zero length, so its
    # note-on and note-off follow each other with no shift.
    ids = encode(
        tmp_path, (0, [(60, 80, 1.25, 1.5), (60, 80, 1.25, 1.75), (67, 80, 2.5, 2.75)], [(1.0, 127), (2.0, 0)])
    )
    assert ids == [355, 280, 376, 60, 188, 376, 60, 330, 188]


def test_pedal_is_per_instrument(tmp_path):
    # The second instrument's interval [0.25, 1] holds its own 62 (0.5-0.75, released to 1 by 67 at 1.5, which
    # is dropped); the first instrument has no pedal and keeps all its notes.
    ids = encode(
        tmp_path,
        (0, [(60, 80, 0.0, 0.5), (64, 80, 1.5, 1.75)], []),
        (1, [(62, 80, 0.5, 0.75), (67, 80, 1.5, 1.75)], [(0.25, 127), (1.0, 0)]),
    )
    assert ids == [376, 60, 305, 188, 376, 62, 305, 190, 305, 376, 64, 280, 192]


# ---- decoding rules ----------------------------------------------------------------------


def test_decoder_pairing_rules():
    # replacement: the pending (0 s, 80) note-on is replaced by (0.05 s, 40)
    assert_notes(notes([376, 60, 260, 366, 60, 260, 188]), [(60, 40, 0.05, 0.1)])
    # note-off at the note-on's time makes nothing and leaves it pending; the later one makes the note
    assert_notes(notes([376, 60, 188, 264, 188]), [(60, 80, 0.0, 0.09)])
    # a second note-off makes a second note from the same note-on
    assert_notes(notes([376, 60, 260, 188, 260, 188]), [(60, 80, 0.0, 0.05), (60, 80, 0.0, 0.1)])
    # unmatched note-off ignored; a note-on pending at the end is dropped
    assert_notes(notes([188, 376, 61, 256, 189, 62, 300]), [(61, 80, 0.0, 0.01)])


def test_decoder_velocity_is_four_times_the_bin_and_starts_at_zero():
    assert_notes(
        notes([60, 256, 188, 387, 61, 256, 189, 356, 62, 256, 190]),
        [(60, 0, 0.0, 0.01), (61, 124, 0.01, 0.02), (62, 0, 0.02, 0.03)],
    )


def test_decoder_sorts_by_start_stably():
    # 60's note is made first (its note-off comes first) but 62 started earlier.
    assert_notes(notes([376, 62, 260, 60, 260, 188, 190]), [(62, 80, 0.0, 0.1), (60, 80, 0.05, 0.1)])
    # equal starts keep the order they were made in: 61 (off first) before 60
    assert_notes(notes([376, 60, 61, 256, 189, 188]), [(61, 80, 0.0, 0.01), (60, 80, 0.0, 0.01)])


def test_decoder_skips_end_and_padding():
    # The book would read 388/389 as velocities 128/132 (and the 61 below would carry 132); we skip them.
    assert_notes(notes([376, 60, 388, 389, 61, 256, 188, 189, 389, 389]), [(60, 80, 0.0, 0.01), (61, 80, 0.0, 0.01)])
    with pytest.raises(ValueError, match=r"ids must be in \[0, 390\)"):
        music.decode_notes([1, 390])


def test_decode_midi_writes_one_program_1_instrument(tmp_path):
    ids = [60, 256, 188, 376, 61, 300, 189, 372, 62, 355, 190]  # 60 at velocity 0 (no velocity event yet)
    path = tmp_path / "out.mid"
    returned = music.decode_midi(ids, path)
    assert_notes([tuple(n) for n in returned], [(60, 0, 0.0, 0.01), (61, 80, 0.01, 0.46), (62, 64, 0.46, 1.46)])
    midi = pretty_midi.PrettyMIDI(str(path))
    assert [(i.program, i.is_drum) for i in midi.instruments] == [(1, False)]
    # pretty_midi's default grid is 1/440 s (220 ticks per beat at 120 bpm): times within half a tick. The
    # velocity-0 note is written as a note-on of velocity 0, which MIDI reads as a note-off: it is gone.
    read = [(n.pitch, n.velocity, n.start, n.end) for n in midi.instruments[0].notes]
    assert_notes(read, [(61, 80, 0.01, 0.46), (62, 64, 0.46, 1.46)], atol=0.5 / 440)


def test_decode_of_an_encoding_gives_the_quantised_notes(tmp_path):
    # Pedal-free, no same-pitch overlap, velocities that are multiples of 4: decode(encode) is the file's notes.
    want = [(60, 80, 0.0, 0.5), (64, 100, 0.25, 1.75), (67, 40, 1.75, 4.0)]
    ids = music.encode_midi(write_midi(tmp_path / "t.mid", (0, want, [])))
    assert_notes(notes(ids), want, atol=1e-9)  # float sums of 10 ms steps vs decimal times


# ---- training data -----------------------------------------------------------------------


def test_training_pairs():
    x, y = music.training_pair([5, 6, 7], 6)
    assert x.tolist() == [5, 6, 7, PAD, PAD, PAD] and y.tolist() == [6, 7, EOS, PAD, PAD, PAD]
    x, y = music.training_pair([1, 2, 3, 4], 4)  # exactly the length: EOS is the last target
    assert x.tolist() == [1, 2, 3, 4] and y.tolist() == [2, 3, 4, EOS]
    x, y = music.training_pair(np.arange(10), 4)  # longer: no EOS
    assert x.tolist() == [0, 1, 2, 3] and y.tolist() == [1, 2, 3, 4] and x.dtype == y.dtype == np.int32
    x, y = music.training_pair([9], 3)
    assert x.tolist() == [9, PAD, PAD] and y.tolist() == [EOS, PAD, PAD]
    x, y = music.training_pair(np.arange(3000) % 388)
    assert x.shape == y.shape == (2048,) and (y[:-1] == x[1:]).all() and y[-1] == 2048 % 388
    with pytest.raises(ValueError, match="at least one id"):
        music.training_pair([], 4)


def test_prompt_length():
    assert [music.prompt_length(b) for b in (2048, 1000, 128, 64, 3)] == [250, 250, 32, 16, 1]


def test_dataset_one_window_per_piece_and_seeded_order():
    seqs = [np.arange(10, dtype=np.int32), np.arange(100, 103, dtype=np.int32), np.zeros(0, np.int32)]
    data = music.MusicDataset(seqs, seq_len=4, seed=0)
    assert data.x.tolist() == [[0, 1, 2, 3], [100, 101, 102, PAD]]  # the empty piece is left out
    assert data.y.tolist() == [[1, 2, 3, 4], [101, 102, EOS, PAD]]
    x, y, pos = data.batch(0, 3)  # 1.5 epochs
    assert x.shape == y.shape == (3, 4) and pos == 3
    assert sorted(map(tuple, x[:2])) == sorted(map(tuple, data.x))  # epoch 0 is a permutation
    x1, _, pos1 = data.batch(0, 1)
    x2, _, _ = data.batch(pos1, 2)  # resuming at the returned position continues the same stream
    assert np.array_equal(np.concatenate([x1, x2]), x)
    again = music.MusicDataset(seqs, seq_len=4, seed=0)
    assert np.array_equal(again.batch(1, 5)[1], data.batch(1, 5)[1]) and again.fingerprint == data.fingerprint
    with pytest.raises(ValueError, match="no piece has a note"):
        music.MusicDataset([np.zeros(0, np.int32)], 4, 0)


def test_bach_chorale_encodes_and_decodes(tmp_path):
    (path,) = music.render_bach_chorales(tmp_path, limit=1)
    ids = music.encode_midi(path)
    assert ids.size > 100 and ((ids >= 0) & (ids < EOS)).all()
    n_notes = sum(len(i.notes) for i in pretty_midi.PrettyMIDI(str(path)).instruments)
    decoded = music.decode_midi(ids, tmp_path / "decoded.mid")
    # no pedal: every note is encoded; unison voices re-striking one pitch can merge in decoding
    assert (ids < 128).sum() == n_notes and 0.8 * n_notes <= len(decoded) <= n_notes


def test_unreadable_midi_names_the_file(tmp_path):
    path = tmp_path / "bad.mid"
    path.write_bytes(b"RIFF not a midi file")
    with pytest.raises(ValueError, match="bad.mid: pretty_midi cannot read it"):
        music.encode_midi(path)


def test_maestro_split_reads_the_csv(tmp_path):
    assert music.maestro_split(tmp_path) is None  # no csv: not a MAESTRO folder
    (tmp_path / "2004").mkdir()
    rows = [("train", "2004/a.midi"), ("test", "2004/b.midi"), ("validation", "2004/c.midi"), ("train", "2004/d.midi")]
    for _, name in rows:
        write_midi(tmp_path / name, (0, [(60, 80, 0.0, 0.5)], []))
    lines = ["canonical_composer,canonical_title,split,year,midi_filename,audio_filename,duration"]
    lines += [f"X,Y,{split},2004,{name},{name[:-5]}.wav,1.0" for split, name in rows]
    (tmp_path / "maestro-v2.0.0.csv").write_text("\n".join(lines) + "\n")
    split = music.maestro_split(tmp_path)
    assert split["train"] == [tmp_path / "2004/a.midi", tmp_path / "2004/d.midi"]
    assert split["test"] == [tmp_path / "2004/b.midi"] and split["validation"] == [tmp_path / "2004/c.midi"]
    (tmp_path / "2004/d.midi").unlink()
    with pytest.raises(FileNotFoundError, match="lists 1 MIDI files that are not there"):
        music.maestro_split(tmp_path)


# ---- limits and argument checks (refused with a clear error, never truncated) ---------------


def _vlq(value):
    out = [value & 0x7F]
    value >>= 7
    while value:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    return bytes(reversed(out))


def hostile_midi(path, delta=9_999_999):
    """44 bytes: tempo 0xFFFFFF, 1 tick per beat, one note whose note-off comes ``delta`` ticks later."""
    track = (
        b"\x00\xff\x51\x03\xff\xff\xff"  # tempo: 16.78 s per beat
        + b"\x00\x90\x3c\x40"  # note-on 60
        + _vlq(delta)
        + b"\x80\x3c\x40"  # note-off 60, 9,999,999 ticks (1.7e8 s) later
        + b"\x00\xff\x2f\x00"
    )
    data = b"MThd" + (6).to_bytes(4, "big") + b"\x00\x00\x00\x01\x00\x01" + b"MTrk" + len(track).to_bytes(4, "big")
    path.write_bytes(data + track)
    return path


MEMORY_CHECK = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from flax_ln import music
try:
    music.encode_midi(sys.argv[1])
except ValueError as err:
    print("REFUSED", err)
"""


@pytest.mark.slow
def test_a_gap_of_years_is_refused_within_2_gib(tmp_path):
    path = hostile_midi(tmp_path / "bomb.mid")
    assert path.stat().st_size == 44
    proc = subprocess.run([sys.executable, "-c", MEMORY_CHECK, str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("REFUSED"), proc.stdout + proc.stderr[-2000:]
    assert str(path) in proc.stdout and "limit" in proc.stdout and "never truncated" in proc.stdout


def test_a_piece_or_gap_beyond_the_limits_is_refused_naming_the_time():
    day, gap = music.MAX_PIECE_SECONDS, music.MAX_GAP_SECONDS
    assert day >= 3600 and gap >= 3600  # hours, not minutes
    with pytest.raises(ValueError, match=r"piece.mid: the piece runs to 86410 s"):
        music.encode_notes([Note(60, 80, day, day + 10.0)], origin="piece.mid")
    with pytest.raises(ValueError, match=r"a gap of 21601 s before the event at 21611 s"):
        music.encode_notes([Note(60, 80, 0.0, 10.0), Note(61, 80, gap + 11.0, gap + 12.0)], origin="piece.mid")
    # just inside both limits: encoded in full (a 1 s shift per second of the gap, nothing cut)
    ids = music.encode_notes([Note(60, 80, 0.0, 1.0), Note(61, 80, gap + 1.0, gap + 2.0)])
    assert (ids == 355).sum() == gap + 2 and ids.tolist()[-1] == 128 + 61


@pytest.mark.parametrize(
    ("ids", "says"),
    [
        ([376.0, 60.5, 300.7, 188.0], "item 0 is 376.0"),
        (np.array([376.0, 60.0, 300.0, 188.0]), "dtype float64"),
        ([376, 60, True, 188], "item 2 is True"),
        (np.array([[376, 60, 300, 188], [376, 61, 300, 189]]), r"shape \(2, 4\)"),
        ([[376, 60, 300, 188]], r"item 0 is \[376"),
        (np.array([True, False]), "dtype bool"),
    ],
)
def test_decoder_takes_integer_ids_only(tmp_path, ids, says):
    with pytest.raises(ValueError, match=says):
        music.decode_notes(ids)
    with pytest.raises(ValueError, match=says):
        music.decode_midi(ids, tmp_path / "out.mid")
    assert not (tmp_path / "out.mid").exists()


def test_decoder_takes_ints_lists_and_integer_arrays():
    want = [(60, 80, 0.0, 0.45)]
    for ids in ([376, 60, 300, 188], np.array([376, 60, 300, 188], np.int32), [np.int64(376), 60, 300, 188]):
        assert_notes(notes(ids), want)
        assert all(type(n.pitch) is int and type(n.velocity) is int for n in music.decode_notes(ids))
