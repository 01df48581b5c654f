import re

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
    assert cfg.epsilon_high == 0.28


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


@pytest.mark.parametrize("override, field", [
    ("learning_rate=1e400", "learning_rate"),            # YAML reads 1e400 as a string, float() makes it inf
    ("temperature=.inf", "temperature"),
    ("delta=.nan", "delta"),
    ("data.weights={user: .nan}", "data.weights.user"),
    ("stages.rollout.retry_delay_seconds=.inf", "stages.rollout.retry_delay_seconds"),
])
def test_infinite_or_nan_values_are_refused(override, field):
    with pytest.raises(ConfigError, match=rf"config field '{field}': must be a finite number"):
        load_config(None, [override])


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
    for bad in (".max_digits=2", "data..max_digits=2", "data.=3"):
        with pytest.raises(ConfigError, match=rf"override '{re.escape(bad)}': .* has an empty part; write "
                                              r"section.field=value"):
            load_config(None, [bad])
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"learning_rate: 1.0e-4\nrun_name: caf\xe9\n")     # saved as Latin-1, not UTF-8
    with pytest.raises(ConfigError, match=r"latin1.yaml' is not UTF-8 text \(byte 0xe9 .*\); save it as UTF-8"):
        load_config(latin1)


def test_flat_params_cover_sections():
    flat = GRPOConfig().flat()
    assert flat["beta"] == 0.04 and flat["data.prompts_per_iteration"] == 8
    sections = {"data", "eval", "sandbox", "stages", "tracking", "gate", "monitors", "warmstart", "kernels"}
    assert all("." not in k or k.split(".")[0] in sections for k in flat)


def test_shipped_configs_validate(monkeypatch):
    from pathlib import Path
    root = Path(__file__).parent.parent
    for example in ("openenv", "verifiers"):      # configs/<example>.yaml run with examples/<example> on PYTHONPATH
        monkeypatch.syspath_prepend(str(root / "examples" / example))
    for p in sorted(root.joinpath("configs").glob("*.yaml")):
        load_config(p)


def test_trl_defaults_are_resolved_on_validation():
    cfg = GRPOConfig(epsilon=0.3, reward_funcs=["accuracy", "format", "overlong"])
    assert cfg.epsilon_high == 0.3 and cfg.reward_weights == [1.0, 1.0, 1.0]
    explicit = GRPOConfig(epsilon_high=0.28, reward_weights=[1.0, 0.2])
    assert explicit.epsilon_high == 0.28 and explicit.reward_weights == [1.0, 0.2]
    cfg.run_name = "r"                                   # assignment re-validates; the resolved values stay
    assert cfg.epsilon_high == 0.3 and load_config(None, ["epsilon=0.1"]).epsilon_high == 0.1


def test_help_renders_and_states_no_speed_figures():
    import re
    from grpo_core.config import field_help
    text = field_help()
    assert "epsilon_high" in text and "cpu_onednn_linear" in text
    assert not re.search(r"\d\s*x faster|faster than|fastest|GFLOP", text), text


@pytest.mark.parametrize("overrides, fields", [
    (["delta=1.1", "epsilon_high=0.28"], ["delta", "epsilon_high"]),            # delta <= 1 + epsilon_high
    (["delta=2.0", "loss_type=sapo"], ["delta", "loss_type"]),
    (["top_entropy_quantile=0"], ["top_entropy_quantile"]),
    (["top_entropy_quantile=1.5"], ["top_entropy_quantile"]),
    (["sapo_temperature_pos=0"], ["sapo_temperature_pos"]),
    (["sapo_temperature_neg=-1"], ["sapo_temperature_neg"]),
    (["loss_type=cispo"], ["loss_type", "epsilon_high"]),                      # cispo caps at epsilon_high itself
    (["importance_sampling_level=group"], ["importance_sampling_level"]),
    (["vllm_importance_sampling_mode=token_clip"], ["vllm_importance_sampling_mode"]),
    (["vllm_importance_sampling_cap=0.5"], ["vllm_importance_sampling_cap"]),
    (["off_policy_mask_threshold=-0.1"], ["off_policy_mask_threshold"]),
    (["entropy_coef=-0.01"], ["entropy_coef"]),
    (["loss_type=luspo2"], ["loss_type"]),
    (["vespo_lambda_pos=0"], ["vespo_lambda_pos"]),
    (["vespo_k_neg=-1"], ["vespo_k_neg"]),
    (["loss_type=vespo", "importance_sampling_level=sequence"], ["vespo", "importance_sampling_level: token"]),
    (["loss_type=vespo", "vllm_importance_sampling_correction=true"],              # default mode sequence_mask
     ["vespo", "vllm_importance_sampling_mode: token_truncate or token_mask"]),
    (["loss_type=vespo", "delta=1.5"], ["delta", "vespo"]),
    (["sync_ref_model=true", "beta=0"], ["sync_ref_model", "beta"]),
    (["ref_model_mixup_alpha=1.5"], ["ref_model_mixup_alpha"]),
    (["ref_model_sync_steps=0"], ["ref_model_sync_steps"]),
    (["reference=previous"], ["reference"]),
    (["multi_objective_aggregation=gdpo"], ["multi_objective_aggregation"]),
    (["multi_objective_aggregation=normalize_then_sum", "scale_rewards=none"],
     ["multi_objective_aggregation", "scale_rewards: group"]),
    (["use_adaptive_entropy=true", "entropy_coef_min=0.2", "entropy_coef_max=0.1"],
     ["entropy_coef_min", "entropy_coef_max"]),
    (["use_adaptive_entropy=true", "entropy_coef=0.5", "entropy_coef_max=0.1"], ["entropy_coef", "entropy_coef_max"]),
    (["entropy_coef_delta=0"], ["entropy_coef_delta"]),
    (["entropy_target=-1"], ["entropy_target"]),
    (["entropy_coef_min=-0.1"], ["entropy_coef_min"]),
    (["vllm_importance_sampling_clip_min=0.5"], ["vllm_importance_sampling_clip_min",
                                                 "vllm_importance_sampling_correction: true"]),
    (["vllm_importance_sampling_correction=true", "vllm_importance_sampling_clip_min=4"],
     ["vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap"]),
    (["vllm_importance_sampling_clip_min=0"], ["vllm_importance_sampling_clip_min"]),
    (["disable_dropout=true", "lora_dropout=0.1"], ["disable_dropout", "lora_dropout"]),
    (["cast_lm_head_to_fp32=true", "lora_target_modules=[q_proj, lm_head]"],
     ["cast_lm_head_to_fp32", "lora_target_modules"]),
    (["num_completions_to_print=0"], ["num_completions_to_print"]),
    (["log_unique_prompts=true", "tracking.log_completions=false"], ["log_unique_prompts", "tracking.log_completions"]),
])
def test_variant_options_bad_values_name_the_fields(overrides, fields):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    for field in fields:
        assert field in str(e.value), (field, str(e.value))


@pytest.mark.parametrize("overrides, fields", [
    (["sapo_temperature_pos=2"], ["sapo_temperature_pos", "loss_type: sapo"]),
    (["loss_type=dapo", "vespo_k_neg=2"], ["vespo_k_neg", "loss_type: vespo"]),
    (["loss_type=sapo", "epsilon=0.1"], ["epsilon", "loss_type"]),
    (["loss_type=vespo", "epsilon_high=0.28"], ["epsilon_high", "loss_type"]),
    (["loss_type=cispo", "epsilon_high=5", "epsilon=0.1"], ["epsilon", "loss_type"]),     # cispo: no lower bound
    (["beta=0", "use_bias_correction_kl=false"], ["use_bias_correction_kl", "beta > 0"]),
    (["beta=0", "reference=base"], ["reference", "beta > 0"]),                        # no KL: no reference
    (["vllm_importance_sampling_mode=token_mask"], ["vllm_importance_sampling_mode",
                                                    "vllm_importance_sampling_correction: true"]),
    (["vllm_importance_sampling_cap=5"], ["vllm_importance_sampling_cap", "vllm_importance_sampling_correction: true"]),
    (["ref_model_sync_steps=4"], ["ref_model_sync_steps", "sync_ref_model: true"]),
    (["ref_model_mixup_alpha=0.9"], ["ref_model_mixup_alpha", "sync_ref_model: true"]),
    (["entropy_target=1.5"], ["entropy_target", "use_adaptive_entropy: true"]),
    (["entropy_coef_delta=0.01"], ["entropy_coef_delta", "use_adaptive_entropy: true"]),
    (["vllm_gpu_memory_utilization=0.5"], ["vllm_gpu_memory_utilization", "rollout_backend: vllm"]),
    (["vllm_model_impl=transformers"], ["vllm_model_impl", "rollout_backend: vllm"]),
    (["max_extra_rollouts=5"], ["max_extra_rollouts", "dynamic_sampling: true"]),
    (["max_tool_calling_iterations=2"], ["max_tool_calling_iterations", "tools"]),       # one turn: no calls
    (["tool_calls_overlap=true"], ["tool_calls_overlap", "tools"]),
    (["rollout_timeout=60"], ["rollout_timeout", "rollout_func"]),                     # no agent loop
    (["rollout_timeout=null"], ["rollout_timeout", "rollout_func"]),
])
def test_an_option_outside_the_mode_it_acts_in_is_refused(overrides, fields):
    """Set outside its mode, an option would silently change nothing (TRL ignores it): refused, naming the mode."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    for field in fields:
        assert field in str(e.value), (field, str(e.value))


def test_more_steps_than_groups_is_refused():
    """Steps deal whole groups: with more optimizer steps than prompts some steps would silently not run (and the
    learning-rate schedule, sized by steps_per_iteration, would never finish); accumulation past a step's groups
    only leaves fewer micro-batches."""
    with pytest.raises(ConfigError, match=r"steps_per_iteration \(9\) is above data.prompts_per_iteration \(8\)"):
        load_config(None, ["steps_per_iteration=9"])
    assert load_config(None, ["steps_per_iteration=4", "gradient_accumulation_steps=2"]).steps_per_iteration == 4
    assert load_config(None, ["data.prompts_per_iteration=4", "gradient_accumulation_steps=8"])


@pytest.mark.parametrize("overrides", [
    [], ["loss_type=sapo"], ["loss_type=vespo"], ["loss_type=cispo", "epsilon_high=5"], ["beta=0"],
    ["loss_type=sapo", "sapo_temperature_pos=2", "beta=0"], ["epsilon=0.1", "entropy_coef=0.01"],
    ["dynamic_sampling=true", "max_extra_rollouts=5"], ["sync_ref_model=true", "ref_model_sync_steps=4"],
    ["use_adaptive_entropy=true", "entropy_target=1.5"],
    ["tools=[calculator]", "max_tool_calling_iterations=2", "tool_timeout=5"],
])
def test_an_option_in_its_mode_or_at_its_default_loads_and_round_trips(tmp_path, overrides):
    """In its mode an option loads; outside it, its default (epsilon_high: the epsilon it resolves to) loads, so a
    dumped config loads again, unchanged."""
    cfg = load_config(None, overrides)
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path).model_dump() == cfg.model_dump()


def test_variant_options_defaults_are_plain_grpo_and_good_values_load():
    cfg = GRPOConfig()
    assert (cfg.importance_sampling_level, cfg.loss_type, cfg.delta, cfg.top_entropy_quantile, cfg.entropy_coef,
            cfg.off_policy_mask_threshold, cfg.vllm_importance_sampling_correction, cfg.sync_ref_model) == \
        ("token", "grpo", None, 1.0, 0.0, None, False, False)
    assert cfg.reference == "init" and not cfg.needs_sampler_logprobs
    assert cfg.use_bias_correction_kl                               # TRL 1.16's default (DeepSeek-V3.2)
    good = load_config(None, ["importance_sampling_level=sequence", "loss_type=cispo", "epsilon_high=5.0",
                              "top_entropy_quantile=0.2", "entropy_coef=0.001", "off_policy_mask_threshold=0.5",
                              "vllm_importance_sampling_correction=true", "vllm_importance_sampling_mode=token_mask",
                              "sync_ref_model=true", "ref_model_sync_steps=4", "reference=base"])
    assert good.needs_sampler_logprobs and good.epsilon_high == 5.0
    assert load_config(None, ["delta=1.5", "epsilon_high=0.28"]).delta == 1.5
    assert load_config(None, ["loss_type=sapo", "sapo_temperature_neg=2"]).sapo_temperature_neg == 2.0
    assert load_config(None, ["loss_type=luspo", "importance_sampling_level=sequence", "delta=1.5"]).delta == 1.5
    vespo = load_config(None, ["loss_type=vespo", "vespo_k_pos=1", "vllm_importance_sampling_correction=true",
                               "vllm_importance_sampling_mode=token_mask", "use_bias_correction_kl=false"])
    assert (vespo.vespo_k_pos, vespo.vespo_lambda_pos, vespo.use_bias_correction_kl) == (1.0, 3.0, False)
    # reference: init without an init adapter is fine (it means the base)
    assert load_config(None, ["reference=init"]).init_adapter is None
    # the TRL options added for TRL 1.16 parity: TRL's defaults, and good values load
    assert (cfg.multi_objective_aggregation, cfg.use_adaptive_entropy, cfg.entropy_coef_min, cfg.entropy_coef_max,
            cfg.entropy_coef_delta, cfg.entropy_target, cfg.vllm_importance_sampling_clip_min, cfg.disable_dropout,
            cfg.cast_lm_head_to_fp32, cfg.log_unique_prompts, cfg.num_completions_to_print) == \
        ("sum_then_normalize", False, 0.0, 1.0, 0.005, 0.2, None, False, False, False, None)
    trl = load_config(None, ["multi_objective_aggregation=normalize_then_sum", "use_adaptive_entropy=true",
                             "entropy_coef=0.01", "entropy_coef_max=0.05", "entropy_target=1.5",
                             "vllm_importance_sampling_correction=true", "vllm_importance_sampling_clip_min=0.5",
                             "disable_dropout=true", "cast_lm_head_to_fp32=true", "log_unique_prompts=true",
                             "num_completions_to_print=4"])
    assert (trl.entropy_target, trl.vllm_importance_sampling_clip_min, trl.num_completions_to_print) == (1.5, 0.5, 4)


def test_variant_options_are_logged_and_shown_in_help():
    from grpo_core.config import field_help
    names = ["importance_sampling_level", "delta", "sapo_temperature_pos", "sapo_temperature_neg",
             "top_entropy_quantile", "entropy_coef", "off_policy_mask_threshold", "use_bias_correction_kl",
             "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
             "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap",
             "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "reference",
             "multi_objective_aggregation", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max",
             "entropy_coef_delta", "entropy_target", "vllm_importance_sampling_clip_min", "disable_dropout",
             "cast_lm_head_to_fp32", "log_unique_prompts", "num_completions_to_print"]
    flat, text = GRPOConfig().flat(), field_help()
    for name in names:
        assert name in flat, name                                  # MLflow params (tasks/tracking logs cfg.flat())
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"{name} ="))
        assert " - " in line, line                                 # with a description


def test_kernel_choices_are_a_config_section(tmp_path):
    """The kernels' switches (once GRPO_* environment variables) are fields: validated, YAML in and out, in
    `grpo train --help`, MLflow params, operational (a resume may change them), and what the kernels read."""
    import typing
    from dataclasses import asdict, fields
    from grpo_core.config import KernelsConfig, field_help
    from grpo_core.kernels import settings
    from tasks.layout import semantic_config
    cfg = load_config(None, ["kernels.decode_linear=native", "kernels.update_linear=torch", "kernels.native=false",
                             "kernels.max_cpu_isa=avx512", "kernels.cpu_bf16=false", "kernels.reuse_model=false"])
    p = tmp_path / "c.yaml"
    p.write_text(cfg.to_yaml())
    assert load_config(p) == cfg and yaml.safe_load(p.read_text())["kernels"]["cpu_bf16"] is False
    assert load_config(None, ["kernels.cpu_bf16=auto"]).kernels.cpu_bf16 == "auto"
    flat, text = cfg.flat(), field_help()
    for name in KernelsConfig.model_fields:
        assert f"kernels.{name}" in flat, name                        # MLflow params (tasks/tracking logs cfg.flat())
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"kernels.{name} ="))
        assert " - " in line, line
    assert "kernels" not in semantic_config(cfg.model_dump(mode="json"))
    # every choice the kernels read is a field, with the same defaults
    held = {f.name for f in fields(settings.KernelSettings)}
    assert held == set(KernelsConfig.model_fields) - {"reuse_model"}          # reuse_model: read from cfg (policy)
    assert asdict(settings.KernelSettings()) == KernelsConfig().model_dump(exclude={"reuse_model"})
    assert settings.KernelSettings(**cfg.kernels.model_dump(exclude={"reuse_model"})).max_cpu_isa == "avx512"
    allowed = {name: typing.get_args(f.annotation) for name, f in KernelsConfig.model_fields.items()}
    assert allowed["decode_linear"] == settings.DECODE_LINEARS and allowed["update_linear"] == settings.UPDATE_LINEARS
    assert typing.get_args(allowed["max_cpu_isa"][0]) == settings.ISA_LEVELS


@pytest.mark.parametrize("override, message", [
    ("kernels.decode_linear=fast", "config field 'kernels.decode_linear': must be 'auto', 'plain', 'onednn' or "
                                   "'native', got 'fast'"),
    ("kernels.update_linear=onednn", "config field 'kernels.update_linear': must be 'auto', 'native' or 'torch'"),
    ("kernels.max_cpu_isa=sse4", "config field 'kernels.max_cpu_isa': must be 'avx2', 'avx512', 'avx512_bf16' or "
                                 "'amx'"),
    ("kernels.cpu_bf16=maybe", "kernels.cpu_bf16 must be auto, true or false, got 'maybe'"),
    ("kernels.native=perhaps", "config field 'kernels.native': must be a valid boolean"),
    ("kernels.speed=max", "config field 'kernels.speed': unknown field"),
])
def test_bad_kernel_choices_name_the_field(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_a_key_given_twice_in_the_config_file_is_an_error_naming_it(tmp_path):
    """YAML keeps the last of two equal keys silently: the first learning rate would be ignored."""
    p = tmp_path / "dup.yaml"
    p.write_text("learning_rate: 1.0e-4\nseed: 1\nlearning_rate: 2.0e-4\n")
    with pytest.raises(ConfigError, match=r"dup.yaml': line 3, column 1: duplicate key 'learning_rate' \(first given "
                                          r"at line 1\); keep one of the two"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"override 'data.weights=\{a: 1, a: 2\}': duplicate key 'a'"):
        load_config(None, ["data.weights={a: 1, a: 2}"])
