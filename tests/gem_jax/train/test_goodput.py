"""The run's clock: buckets that sum to the wall time, late compiles taken out of the open bucket."""

import time

import pytest
from jax import monitoring

from gem_jax.train import goodput

SLEEP_SLACK = 0.5  # a sleep overshoots on a loaded machine


def test_buckets_sum_to_the_wall_time_and_goodput_is_the_train_share():
    chrono = goodput.Chrono(start=time.time() - 1.0)  # a second of imports before it
    with chrono.measure(goodput.DATA):
        time.sleep(0.05)
    with chrono.measure(goodput.TRAIN_STEP):
        time.sleep(0.1)
    time.sleep(0.02)  # in no bucket: other
    before = chrono.wall()
    seconds = chrono.seconds()
    after = chrono.wall()
    assert seconds[goodput.IMPORTS] == pytest.approx(1.0, abs=0.01)
    assert 0.05 <= seconds[goodput.DATA] < 0.05 + SLEEP_SLACK
    assert 0.1 <= seconds[goodput.TRAIN_STEP] < 0.1 + SLEEP_SLACK
    assert seconds[goodput.OTHER] >= 0.02
    assert before - 1e-9 <= sum(seconds.values()) <= after + 1e-9  # the wall time at the call (up to the sum's rounding)
    record = chrono.record()
    assert record["goodput"] == pytest.approx(record["time_train_step_s"] / record["wall_s"])
    assert record["time_startup_data_s"] == seconds[goodput.DATA]


def test_measurements_do_not_nest_and_buckets_are_named():
    chrono = goodput.Chrono()
    with pytest.raises(ValueError, match="unknown time bucket 'steps'"):
        with chrono.measure("steps"):
            pass
    with chrono.measure(goodput.EVAL):
        with pytest.raises(ValueError, match="do not nest"):
            with chrono.measure(goodput.CHECKPOINT):
                pass


def test_a_compile_after_the_first_step_moves_to_its_own_bucket_with_its_reason():
    chrono = goodput.Chrono()
    monitoring.record_event_duration_secs(goodput.BACKEND_COMPILE_EVENT, 5.0, fun_name="jit(before)")  # not watched yet
    chrono.watch_compiles()
    try:
        with chrono.measure(goodput.TRAIN_STEP):
            time.sleep(0.01)
            monitoring.record_event_duration_secs(goodput.BACKEND_COMPILE_EVENT, 0.004, fun_name="jit(train_step)")
    finally:
        chrono.close()
    monitoring.record_event_duration_secs(goodput.BACKEND_COMPILE_EVENT, 5.0, fun_name="jit(after)")  # no longer watched
    before = chrono.wall()
    seconds = chrono.seconds()
    after = chrono.wall()
    assert seconds[goodput.COMPILE_AFTER_START] == pytest.approx(0.004)
    assert 0.006 <= seconds[goodput.TRAIN_STEP] < 0.006 + SLEEP_SLACK
    assert chrono.compiles_after_start == [("first use of jit(train_step)", 0.004)]
    assert before - 1e-9 <= sum(seconds.values()) <= after + 1e-9


def test_process_start_is_before_now_and_after_boot():
    start = goodput.process_start_time()
    assert start <= time.time()
    assert start > time.time() - 24 * 3600 * 365  # a real timestamp, not ticks


def test_a_late_compile_inside_a_step_is_taken_out_of_it():
    chrono = goodput.Chrono()
    chrono.watch_compiles()
    try:
        with chrono.measure(goodput.TRAIN_STEP):
            time.sleep(0.02)
            with chrono.late_compile("train step, token capacity 896"):
                time.sleep(0.05)
                monitoring.record_event_duration_secs(goodput.BACKEND_COMPILE_EVENT, 0.04, fun_name="jit(train_step)")  # counted once
    finally:
        chrono.close()
    seconds = chrono.seconds()
    assert 0.05 <= seconds[goodput.COMPILE_AFTER_START] < 0.05 + SLEEP_SLACK
    assert 0.02 <= seconds[goodput.TRAIN_STEP] < 0.02 + SLEEP_SLACK
    assert [reason for reason, _ in chrono.compiles_after_start] == ["train step, token capacity 896"]
