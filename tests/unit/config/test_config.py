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
        ("history.metrics_lines_per_second", 0.0),
        ("spikes.warmup", -1),
        ("recovery.lr_backoff", 2.0),
        ("inputs.ignore", "mask"),
        ("health.straggler_slowdown", 1.0),
        ("rerun.suspect_host_after", -1),
        ("hang.mark_saves", "yes"),
    ],
)
def test_invalid_option_names_the_option(option: str, value: object) -> None:
    with pytest.raises(tg.ConfigError) as info:
        tg.GuardConfig.from_options({option: value})
    assert info.value.option == option
    assert option in str(info.value)


def test_guard_rejects_non_module(tmp_path: object) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(tg.ConfigError, match="model"):
        tg.Guard("not a model", opt)  # type: ignore[arg-type]


def test_keywords_beside_a_config_are_refused_not_dropped(tmp_path: object) -> None:
    """They were silently ignored: run_dir went to runs/trainguard, on_nonfinite stayed
    skip. The same keywords with their default values, or a config alone, are fine."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = tg.GuardConfig(run_dir=f"{tmp_path}/cfg", hang_timeout=0)
    with pytest.raises(
        tg.ConfigError,
        match=r"config: Guard\(\.\.\., run_dir=\.\.\., on_nonfinite=\.\.\., config=GuardConfig"
        r".*move run_dir, on_nonfinite into the GuardConfig",
    ):
        tg.Guard(model, opt, run_dir=f"{tmp_path}/kw", on_nonfinite="raise", config=config)
    with tg.Guard(model, opt, on_nonfinite="skip", config=config) as guard:
        assert str(guard.config.run_dir).endswith("cfg")


def test_every_option_goes_in_by_name_or_in_its_section(tmp_path: object) -> None:
    """The options go in as keywords, sections or ``section.option`` names, or in one config;
    a name that is none of them is refused naming the closest, an option of the flat config
    of before names its section."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"recovery.good_after": 7, "spikes.z": 5.0, "inputs.check": False}
    recovery = tg.RecoveryConfig(snapshot_every=3, good_after=7)
    run_dir = f"{tmp_path}/kw"
    with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0, recovery=recovery) as guard:
        assert (guard.config.recovery.snapshot_every, guard.config.recovery.good_after) == (3, 7)
    with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0, **options) as guard:
        config = guard.config
        assert (config.recovery.good_after, config.spikes.z, config.inputs.check) == (7, 5.0, False)
    with pytest.raises(tg.ConfigError, match=r"did you mean recovery\.good_after\?") as info:
        tg.Guard(model, opt, run_dir=f"{tmp_path}/typo", **{"recovery.good_afer": 7})
    assert info.value.option == "recovery.good_afer"
    with pytest.raises(tg.ConfigError, match=r"this option is recovery\.good_after now") as info:
        tg.Guard(model, opt, run_dir=f"{tmp_path}/old", good_after=7)
    assert info.value.option == "good_after"
    with pytest.raises(tg.ConfigError, match="no longer an option: the spike rule's LR grace"):
        tg.GuardConfig.from_options({"spike_grace": 10})
    with pytest.raises(tg.ConfigError, match=r"pass it as config=GuardConfig\(\.\.\., extra="):
        tg.Guard(model, opt, run_dir=f"{tmp_path}/extra", extra={"sha": "abc"})  # not "extra=?"
    config = tg.GuardConfig(run_dir=f"{tmp_path}/cfg", hang_timeout=0)
    with pytest.raises(tg.ConfigError, match="move spikes into the GuardConfig"):
        tg.Guard(model, opt, config=config, spikes=tg.SpikeConfig(z=5.0))


def test_an_optimizer_that_updates_none_of_the_model_is_refused(tmp_path: object) -> None:
    """A GAN's pair swapped: the guard would check the generator's gradients while the
    discriminator's optimizer steps. A model it partly updates (frozen layers) is fine."""
    gen, disc = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    with pytest.raises(tg.ConfigError, match=r"optimizer: the SGD updates none of the "
                       r"parameters of the Linear it was given with"):  # fmt: skip
        tg.Guard(gen, opt_d, run_dir=tmp_path, hang_timeout=0)
    both = torch.nn.Sequential(gen, disc)
    tg.Guard(both, opt_d, run_dir=tmp_path, hang_timeout=0).close()


def test_grad_clip_zero_is_off_as_in_the_loops_own_options(tmp_path: object) -> None:
    """nanoGPT's ``grad_clip = 0.0`` means no clipping; passed on as it is, the guard took it
    for an error. 0 and 0.0 are "off" (None); a negative value is still refused."""
    assert tg.GuardConfig(grad_clip=0.0).grad_clip is None
    assert tg.GuardConfig(grad_clip=0).grad_clip is None
    assert tg.GuardConfig(grad_clip=1.0).grad_clip == 1.0
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, opt, run_dir=f"{tmp_path}/run", grad_clip=0.0, hang_timeout=0) as guard:
        model(torch.full((4, 2), 100.0)).sum().backward()
        before = model.weight.grad.clone()
        assert guard.check(model(torch.ones(1, 2)).sum().detach())
        assert torch.equal(model.weight.grad, before)  # not clipped
