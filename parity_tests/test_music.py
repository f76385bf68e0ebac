"""Chapter 14's performance-event tokenizer, the MIDI reader/writer and the music dataset (flax_ln.music)."""

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flax_ln import music
from flax_ln.music import EOS, PAD, VOCAB_SIZE, Note


def note_lists(max_notes=40):
    """Random notes on a 1 ms grid, overlapping freely (same-pitch overlaps and zero lengths included)."""
    note = st.builds(
        lambda p, v, s, d: Note(p, v, s / 1000, (s + d) / 1000),
        st.integers(0, 127), st.integers(1, 127), st.integers(0, 5000), st.integers(0, 2500),
    )
    return st.lists(note, max_size=max_notes)


def ms(notes):
    """Notes as (pitch, velocity, start ms, end ms): compares times without float noise."""
    return [(n.pitch, n.velocity, round(n.start * 1000), round(n.end * 1000)) for n in notes]


def read_with_music21(path):
    """(pitch, velocity) of every note-on in a MIDI file, parsed by music21's independent MIDI reader."""
    from music21 import midi

    mf = midi.MidiFile()
    mf.open(str(path))
    mf.read()
    mf.close()
    return sorted((e.pitch, e.velocity) for t in mf.tracks for e in t.events
                  if isinstance(e, midi.MidiEvent) and e.isNoteOn())


def test_id_layout_of_a_known_phrase():
    # C4 at velocity 100 for 0.5 s; E4 at velocity 80 from 0.25 s to 1.5 s.
    ids = music.encode_notes([Note(60, 100, 0.0, 0.5), Note(64, 80, 0.25, 1.5)])
    expected = [
        356 + 100 * 32 // 128, 0 + 60,  # velocity bin 25, note-on 60
        256 + 25 - 1,  # shift 25 steps (250 ms)
        356 + 80 * 32 // 128, 0 + 64,  # velocity bin 20, note-on 64
        256 + 25 - 1,  # shift 250 ms
        128 + 60,  # note-off 60
        256 + 100 - 1,  # shift 1 s, the longest single shift
        128 + 64,  # note-off 64
    ]
    assert ids.tolist() == expected and ids.dtype == np.int32
    assert (EOS, PAD, VOCAB_SIZE) == (388, 389, 390)
    assert ms(music.decode_notes(ids)) == [(60, 102, 0, 500), (64, 82, 250, 1500)]  # bins decode to 4b+2


def test_long_silence_is_split_into_one_second_shifts():
    ids = music.encode_notes([Note(60, 64, 2.57, 2.58)])
    assert ids.tolist() == [355, 355, 256 + 57 - 1, 356 + 16, 60, 256, 128 + 60]


@given(note_lists())
def test_encode_decode_encode_is_stable_and_in_range(notes):
    ids = music.encode_notes(notes)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert ((ids >= 0) & (ids < EOS)).all()  # events only; EOS/PAD come from fit_length
    decoded = music.decode_notes(ids)
    assert len(decoded) == len(music._quantise(notes))  # no note lost beyond the documented normalisation
    assert np.array_equal(music.encode_notes(decoded), ids)


@given(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=300))
def test_any_ids_decode_to_a_midi_file_that_reads_back(tmp_path_factory, ids):
    path = tmp_path_factory.mktemp("midi") / "any.mid"
    notes = music.decode_midi(ids, path)
    assert ms(music.read_midi(path)) == ms(notes)  # 1 ms ticks represent 10 ms steps exactly
    assert all(n.end > n.start and 1 <= n.velocity <= 127 for n in notes)


def test_decoded_file_is_valid_for_music21(tmp_path):
    notes = [Note(60 + i % 12, 20 + 7 * i, 0.1 * i, 0.1 * i + 0.35) for i in range(15)]
    ids = music.encode_notes(notes)
    path = tmp_path / "out.mid"
    decoded = music.decode_midi(ids, path)
    assert read_with_music21(path) == sorted((n.pitch, n.velocity) for n in decoded)
    assert np.array_equal(music.encode_midi(path), ids)  # the file round-trips to the same ids


def test_bach_chorale_round_trip(tmp_path):
    (path,) = music.render_bach_chorales(tmp_path, limit=1)
    ids = music.encode_midi(path)
    assert ids.size > 100 and ((ids >= 0) & (ids < EOS)).all()
    out = tmp_path / "decoded.mid"
    notes = music.decode_midi(ids, out)
    assert np.array_equal(music.encode_midi(out), ids)
    assert len(read_with_music21(out)) == len(notes) > 50


def test_read_midi_tempo_map_running_status_and_two_tracks(tmp_path):
    # Format 1, 96 ticks per beat: track 0 sets 120 bpm, then 60 bpm at tick 192; track 1 plays
    # two notes with running status (the second note-on/off omit the status byte; off = on vel 0).
    tempo_track = b"\x00\xff\x51\x03\x07\xa1\x20" + b"\x81\x40\xff\x51\x03\x0f\x42\x40" + b"\x00\xff\x2f\x00"
    notes_track = (b"\x00\x91\x3c\x50" + b"\x60\x3c\x00"  # ch 1: C4 on at 0, off at 96 (running status)
                   + b"\x81\x40\x40\x64" + b"\x60\x40\x00"  # E4 on at 288, off at 384
                   + b"\x00\xff\x2f\x00")
    data = b"MThd" + struct.pack(">IHHH", 6, 1, 2, 96)
    for body in (tempo_track, notes_track):
        data += b"MTrk" + struct.pack(">I", len(body)) + body
    path = tmp_path / "handmade.mid"
    path.write_bytes(data)
    # ticks 0..192 at 0.5 s/beat, after that 1 s/beat: tick 96 = 0.5 s, 288 = 1.0 + 1.0, 384 = 3.0 s
    assert ms(music.read_midi(path)) == [(60, 80, 0, 500), (64, 100, 2000, 3000)]


def test_read_midi_rejects_garbage(tmp_path):
    path = tmp_path / "bad.mid"
    path.write_bytes(b"RIFF not a midi file")
    with pytest.raises(ValueError, match="bad.mid is not a valid standard MIDI file"):
        music.read_midi(path)


def test_decode_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match=r"\[0, 390\)"):
        music.decode_notes([1, 390])


def test_fit_length_pads_and_truncates():
    assert music.fit_length([5, 6, 7], 6).tolist() == [5, 6, 7, EOS, PAD, PAD]
    assert music.fit_length(np.arange(10), 4).tolist() == [0, 1, 2, 3]
    assert music.fit_length([1, 2, 3], 4).tolist() == [1, 2, 3, EOS]
    out = music.fit_length(np.arange(3000) % EOS)
    assert out.shape == (music.SEQ_LEN,) and out.dtype == np.int32 and ((out >= 0) & (out < VOCAB_SIZE)).all()


def test_dataset_windows_and_order():
    seqs = [np.arange(10, dtype=np.int32), np.arange(100, 103, dtype=np.int32)]
    data = music.MusicDataset(seqs, seq_len=4, seed=0)
    # file 0 + EOS = 11 tokens -> windows at 0, 4, 8; file 1 + EOS = 4 tokens -> one padded window
    assert data.examples.tolist() == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9, EOS, PAD, PAD],
                                      [100, 101, 102, EOS, PAD]]
    x, y, pos = data.batch(0, 6)  # 1.5 epochs
    assert x.shape == y.shape == (6, 4) and pos == 6 and (x[:, 1:] == y[:, :-1]).all()
    assert sorted(map(tuple, x[:4])) == sorted(map(tuple, data.examples[:, :-1]))  # epoch 0 is a permutation
    x1, _, pos1 = data.batch(0, 3)
    x2, _, _ = data.batch(pos1, 3)  # resuming at the returned position continues the same stream
    assert np.array_equal(np.concatenate([x1, x2]), x)
    again = music.MusicDataset(seqs, seq_len=4, seed=0)
    assert np.array_equal(again.batch(2, 5)[0], data.batch(2, 5)[0]) and again.fingerprint == data.fingerprint
    orders = {tuple(music.MusicDataset(seqs, 4, seed).batch(0, 4)[0][:, 0]) for seed in range(6)}
    assert len(orders) > 1  # the seed changes the order
