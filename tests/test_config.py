import pytest
from specbus.core.config import build_config, dump_config, load_config
from specbus.core.errors import ConfigError


def test_defaults_validate_and_overrides_apply(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run: demo\ntraining:\n  lr: 1.0e-3\nstore:\n  uri: 'mem://'\n")
    cfg = load_config(
        path, ["training.lr=2e-4", "bus.max_deliver=3", "strategy.draft.draft_vocab_size=512"]
    )
    assert cfg.run == "demo" and cfg.training.lr == 2e-4 and cfg.bus.max_deliver == 3
    assert cfg.store.uri == "mem://" and cfg.strategy.draft.draft_vocab_size == 512
    assert load_config(None).training.lr == 1e-4
    # the dump is a valid config again
    (tmp_path / "dump.yaml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "dump.yaml") == cfg


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["training.lrr=1"], "training.lrr"),
        (["training.lr=abc"], "training.lr"),
        (["training.lr=-1"], "training.lr"),
        (["store.budget_bytes=0"], "store.budget_bytes"),
        (["deployment.mode=sideways"], "deployment.mode"),
        (["run=has.dots"], "run name"),
        (["training.lr"], "section.key=value"),
        (["training.lr.x=1"], "training.lr"),
    ],
)
def test_errors_name_the_key_and_value(overrides, needle):
    with pytest.raises(ConfigError) as e:
        build_config({}, overrides)
    assert needle in str(e.value)


def test_bad_files_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "typo.yaml").write_text("trainig:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="trainig"):
        load_config(tmp_path / "typo.yaml")


def test_a_choice_that_is_not_built_is_refused_at_load_and_a_registered_one_accepted():
    from specbus.core.registry import MODES

    with pytest.raises(
        ConfigError,
        match="deployment.mode 'offline' is not registered; built: colocated, disaggregated, live",
    ):
        build_config({}, ["deployment.mode=offline"])
    assert build_config({}, ["deployment.mode=live"]).deployment.mode == "live"
    MODES.register("test-mode", "nowhere:nothing")  # resolved only when built
    try:
        assert build_config({}, ["deployment.mode=test-mode"]).deployment.mode == "test-mode"
    finally:
        MODES.unregister("test-mode")
    for removed in ("training.eval_every=5", "deployment.producers=2", "deployment.trainers=2"):
        with pytest.raises(ConfigError, match=removed.split("=")[0]):
            build_config({}, [removed])
