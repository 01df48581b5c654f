import pytest
import yaml

from grpo_core.config import ConfigError, GRPOConfig, load_config


def test_defaults_validate_and_roundtrip_yaml(tmp_path):
    cfg = GRPOConfig()
    p = tmp_path / "c.yaml"
    p.write_text(cfg.to_yaml())
    again = load_config(p)
    assert again == cfg
    assert again.config_hash() == cfg.config_hash()


def test_overrides_parse_types_and_sections(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"beta": 0.1, "data": {"max_digits": 2}}))
    cfg = load_config(p, ["learning_rate=1e-5", "data.operations=['+','-']", "use_peft=false", "epsilon_high=0.28"])
    assert cfg.beta == 0.1 and cfg.learning_rate == 1e-5 and cfg.use_peft is False
    assert cfg.data.max_digits == 2 and cfg.data.operations == ["+", "-"]
    assert cfg.epsilon_upper == 0.28


@pytest.mark.parametrize("override, field", [
    ("beta=-1", "beta"),
    ("num_generations=1", "num_generations"),
    ("loss_type=ppo", "loss_type"),
    ("data.max_digits=x", "data.max_digits"),
    ("nonsense=3", "nonsense"),
    ("reward_funcs=[accuracy, nope]", "reward_funcs"),
    ("reward_weights=[1.0]", "reward_weights"),
    ("run_name=../escape", "run_name"),
])
def test_invalid_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert field in str(e.value)


def test_cross_field_digits_order():
    with pytest.raises(ConfigError, match="min_digits"):
        load_config(None, ["data.min_digits=3", "data.max_digits=2"])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["beta"])


def test_flat_params_cover_sections():
    flat = GRPOConfig().flat()
    assert flat["beta"] == 0.04 and flat["data.prompts_per_iteration"] == 8
    assert all("." not in k or k.split(".")[0] in {"data", "eval", "sandbox", "stages", "tracking"} for k in flat)


def test_shipped_configs_validate():
    from pathlib import Path
    for p in sorted(Path(__file__).parent.parent.joinpath("configs").glob("*.yaml")):
        load_config(p)
