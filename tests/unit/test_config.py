from __future__ import annotations

import pytest
import torch

import trainguard as tg


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("on_nonfinite", "explode"),
        ("max_consecutive", 0),
        ("grad_clip", -1.0),
        ("hang_timeout", -5),
        ("accumulation_steps", 0),
        ("min_loss_scale", 0.0),
        ("metrics_lines_per_second", 0.0),
    ],
)
def test_invalid_option_names_the_option(option: str, value: object) -> None:
    with pytest.raises(tg.ConfigError) as info:
        tg.GuardConfig(**{option: value})  # type: ignore[arg-type]
    assert info.value.option == option
    assert option in str(info.value)


def test_guard_rejects_non_module(tmp_path: object) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(tg.ConfigError, match="model"):
        tg.Guard("not a model", opt)  # type: ignore[arg-type]
