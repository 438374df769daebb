"""The doctor's flight-recorder check: on, off with the way to turn it on, unavailable."""

from __future__ import annotations

from trainguard.doctor.flight_recorder import CHECK, flight_recorder_finding, recorder_available


def test_unset_is_torchs_default_with_the_hint_to_export_it() -> None:
    found = flight_recorder_finding({}, available=True)
    assert (found.check, found.status) == (CHECK, "ok")
    assert "torch's default applies" in found.message
    assert "export TORCH_FR_BUFFER_SIZE=2000" in found.message


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
