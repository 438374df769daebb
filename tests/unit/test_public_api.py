"""The public surface is curated: adding or removing a name must be a deliberate change."""

from __future__ import annotations

import trainguard as tg

EXPECTED = {
    "Bundle",
    "BundleError",
    "ConfigError",
    "Decision",
    "EXIT_DO_NOT_RESTART",
    "EXIT_HANG",
    "EXIT_PEER_FAILURE",
    "EXIT_SUSPECT_HOST",
    "Guard",
    "GuardConfig",
    "HangConfig",
    "HealthConfig",
    "HistoryConfig",
    "InputConfig",
    "RecoveryConfig",
    "RerunConfig",
    "SpikeConfig",
    "LossScaleCollapseError",
    "NonFiniteError",
    "PeerFailureError",
    "ReplayError",
    "ReplayReport",
    "ReplicaDivergenceError",
    "ReplaySpec",
    "SpikeError",
    "TrainGuardError",
    "__version__",
    "load_bundle",
    "read_events",
    "replay",
    "diagnose",
    "trace",
}


def test_all_is_curated() -> None:
    assert set(tg.__all__) == EXPECTED
    for name in tg.__all__:
        assert hasattr(tg, name), name


def test_exceptions_derive_from_base() -> None:
    for name in tg.__all__:
        obj = getattr(tg, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, tg.TrainGuardError), name


def test_exceptions_survive_pickling() -> None:
    """Errors cross process boundaries (spawned workers, elastic agents) intact."""
    import pickle

    cases: list[Exception] = [
        tg.ConfigError("grad_clip", "use a positive number"),
        tg.NonFiniteError("bad", step=3, ranks=[1, 2], bundle=None),
        tg.LossScaleCollapseError("scale", step=4, ranks=[0]),
        tg.BundleError("/x", "missing manifest.json"),
        tg.PeerFailureError("rank 1 failed", rank=1),
        tg.ReplicaDivergenceError("differ", step=8, ranks=[2], params=["fc.weight"]),
    ]
    for exc in cases:
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc)
        assert str(back) == str(exc)
        assert vars(back) == vars(exc)
