"""The doctor's flight-recorder check: on, off with the way to turn it on, unavailable, and
the default trainguard's own import set taken back out of the job's environment."""

from __future__ import annotations

from trainguard.doctor.flight_recorder import (
    CHECK,
    flight_recorder_finding,
    job_environment,
    recorder_available,
)


def test_unset_is_on_by_trainguards_default_with_the_hint_to_export_it() -> None:
    found = flight_recorder_finding({}, available=True)
    assert (found.check, found.status) == (CHECK, "ok")
    assert "importing trainguard before init_process_group" in found.message
    assert "TORCH_FR_BUFFER_SIZE=2000" in found.message


def test_zero_is_off_and_the_fix_says_how_to_turn_it_on() -> None:
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        found = flight_recorder_finding({name: "0"}, available=True)
        assert found.status == "info" and not found.counts  # a choice, not a failure
        assert f"flight recorder off ({name}=0)" in found.message
        assert found.fix is not None and "export TORCH_FR_BUFFER_SIZE=2000" in found.fix


def test_a_size_is_on_and_a_torch_without_the_dump_is_said() -> None:
    assert flight_recorder_finding({"TORCH_FR_BUFFER_SIZE": "500"}, True).status == "ok"
    assert flight_recorder_finding({"TORCH_FR_BUFFER_SIZE": "lots"}, True).status == "info"
    old = flight_recorder_finding({}, available=False)
    assert old.status == "info" and "Python stack only" in old.message
    assert recorder_available()  # torch 2.13 here


def test_the_default_of_trainguards_import_is_not_the_jobs_setting() -> None:
    ours = {"TORCH_FR_BUFFER_SIZE": "2000", "TRAINGUARD_FR_DEFAULTED": "1", "HOME": "/h"}
    assert job_environment(ours) == {"HOME": "/h"}
    theirs = {"TORCH_FR_BUFFER_SIZE": "2000"}
    assert job_environment(theirs) == theirs
    changed = {"TORCH_FR_BUFFER_SIZE": "0", "TRAINGUARD_FR_DEFAULTED": "1"}
    assert job_environment(changed) == {"TORCH_FR_BUFFER_SIZE": "0"}
