"""Frames stage: the sampling rule and real videos."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import MEDIA

from batchgen.core.errors import RowError
from batchgen.media.frames import extract_frames, frame_indices


def test_frame_indices_of_the_sample_video():
    # 24 frames at 8 fps = 3 s → 6 frames at 2 fps, evenly spaced from first to last.
    assert frame_indices(24, 8.0, 2.0, 4, 128) == [0, 5, 9, 14, 18, 23]
    assert frame_indices(24, 8.0, 4.0, 4, 128) == [0, 2, 4, 6, 8, 10, 13, 15, 17, 19, 21, 23]
    assert frame_indices(24, 8.0, 4.0, 4, 8) == [0, 3, 7, 10, 13, 16, 20, 23]


def test_frame_indices_rules():
    assert len(frame_indices(300, 30.0, 2.0, 4, 128)) == 20  # 10 s at 2 fps
    assert len(frame_indices(30, 30.0, 2.0, 4, 128)) == 4  # 1 s → raised to the minimum
    assert len(frame_indices(30 * 600, 30.0, 2.0, 4, 128)) == 128  # capped
    assert len(frame_indices(3, 30.0, 2.0, 4, 128)) == 2  # never more than the video has, even
    assert len(frame_indices(45, 30.0, 2.0, 3, 128)) == 2  # 1.5 s → 3 → rounded down to even
    assert frame_indices(90, 0.0, 2.0, 4, 128) == [0, 18, 36, 53, 71, 89]  # no fps: assume 30 → 3 s
    assert frame_indices(0, 30.0, 2.0, 4, 128) == []


def test_sample_video_frames_are_rgb_at_the_expected_indices():
    frames = extract_frames(MEDIA / "moving_dot.mp4", 2.0, 4, 128)
    assert frames.shape == (6, 64, 64, 3) and frames.dtype == np.uint8
    # The dot is red in RGB (written as BGR red) and moves right.
    xs = [np.argwhere((f[..., 0] > 150) & (f[..., 2] < 100))[:, 1].mean() for f in frames]
    assert xs == sorted(xs) and xs[-1] - xs[0] > 30


def test_non_video_is_a_frames_error(tmp_path):
    bad = tmp_path / "random.mp4"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(RowError) as e:
        extract_frames(bad, 2.0, 4, 128)
    assert e.value.stage == "frames"
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(RowError, match="frames|video"):
        extract_frames(empty, 2.0, 4, 128)
