"""The kv_capacity benchmark's pieces at tiny settings, so it keeps working."""

import random
import statistics

from benchmarks import kv_capacity


def test_lengths_spread_with_the_mean_asked():
    got = kv_capacity.lengths(4000, 1024, random.Random(0))
    assert min(got) >= 64 and max(got) <= 1024
    assert 110 < statistics.mean(got) < 140  # max_seq_len / 8 = 128, less the clipped tail


def test_admission_timing_runs_on_a_small_queue():
    assert 0 < kv_capacity.admit_ms(waiting=40, running=8, prompt_len=64, repeats=1) < 1000
