"""kill -9 at random times, then --resume: the record and the final state equal an uninterrupted run's
(the reduced CI set of scripts/kill_resume_trials.py, which runs >= 50 kill points)."""

import importlib.util
import random
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "kill_resume_trials", Path(__file__).resolve().parents[1] / "scripts" / "kill_resume_trials.py")
trials = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trials)


@pytest.mark.slow
def test_random_sigkills_then_resume_give_the_uninterrupted_record_and_state(tmp_path):
    ref, duration = trials.reference(tmp_path / "ref", epochs=2)
    result = trials.trial(tmp_path / "t", duration, kills=3, rng=random.Random(7), epochs=2)
    assert result["kills"] >= 1
    assert trials.compare(result["record"], ref) == []
