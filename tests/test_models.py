import pytest
import torch

from grpo_core.model.loading import DEFAULT_MODEL, ModelError, resolve_model
from tests.conftest import use_kernels


def test_hub_id_fails_at_once_with_instructions(grpo_home):
    with pytest.raises(ModelError) as e:
        resolve_model("meta-llama/Llama-3.2-1B")
    msg = str(e.value)
    assert "offline" in msg and "local Hugging Face model directory" in msg and DEFAULT_MODEL in msg


def test_bad_local_paths(tmp_path, grpo_home):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "f.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="is a file"):
        resolve_model(str(tmp_path / "f.bin"))


def test_local_dir_and_tiny_model_load(grpo_home, tiny_model_dir):
    from grpo_core.config import GRPOConfig
    from grpo_core.model.policy import load_policy
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    pol = load_policy(GRPOConfig(model=str(tiny_model_dir)))
    ids = pol.tokenizer("What is 1 + 2?")["input_ids"]
    assert pol.tokenizer.decode(ids) == "What is 1 + 2?"
    # LoRA starts as the identity: policy and reference (adapter disabled) agree exactly.
    x = torch.tensor([ids])
    with torch.no_grad():
        a = pol.model(x).logits
        with pol.reference() as ref:
            b = ref(x).logits
    assert torch.equal(a, b)
    assert 0 < sum(p.numel() for p in pol.trainable_parameters()) < sum(p.numel() for p in pol.model.parameters())


def test_auto_precision_is_bf16_for_lora_on_cpus_with_native_bf16_matmul(monkeypatch):
    from grpo_core.model.loading import cpu_bf16_matmul, describe_precision, select_dtype
    cpu = torch.device("cpu")
    use_kernels(cpu_bf16=True)
    assert select_dtype("auto", cpu, use_peft=True) == torch.bfloat16
    assert select_dtype("auto", cpu, use_peft=False) == torch.float32          # full fine-tuning trains the weights
    assert select_dtype("float32", cpu, use_peft=True) == torch.float32
    assert describe_precision("auto", cpu, True) == (
        "precision: bfloat16 base weights on cpu (auto: kernels.cpu_bf16: true; dtype: float32 forces fp32); "
        "LoRA adapter, optimizer state and loss in float32")
    use_kernels(cpu_bf16=False)
    monkeypatch.setenv("GRPO_CPU_BF16", "1")                   # the tests' pin applies to auto only
    assert select_dtype("auto", cpu, use_peft=True) == torch.float32 and cpu_bf16_matmul() is None
    assert describe_precision("auto", cpu, True) == \
        "precision: float32 base weights on cpu (auto: kernels.cpu_bf16: false)"
    use_kernels(cpu_bf16="auto")
    assert select_dtype("auto", cpu, use_peft=True) == torch.bfloat16
    assert describe_precision("auto", cpu, True).startswith(
        "precision: bfloat16 base weights on cpu (auto: GRPO_CPU_BF16=1;")
    monkeypatch.setenv("GRPO_CPU_BF16", "0")
    assert describe_precision("auto", cpu, True) == "precision: float32 base weights on cpu (auto: GRPO_CPU_BF16=0)"
    monkeypatch.delenv("GRPO_CPU_BF16")
    from grpo_core.kernels import cpu_features
    features = cpu_features.detect()
    assert cpu_bf16_matmul() == features.bf16_matmul
    assert select_dtype("auto", cpu, use_peft=True) == (torch.bfloat16 if features.bf16_matmul else torch.float32)
    if features.cap is None:                                  # the CPU's flags agree with torch's own probes
        assert bool(features.bf16_matmul) == (torch.cpu._is_amx_tile_supported()
                                              or torch.cpu._is_avx512_bf16_supported())


def test_router_aux_coef_follows_trl_for_moe_and_dense_models():
    """None: the MoE model config's own coefficient, 0 for a dense model; a value is kept for an MoE model and
    refused for a dense one, naming the field and the fix."""
    from transformers import LlamaConfig, Qwen2MoeConfig
    from grpo_core.model.loading import ModelError, router_aux_coef
    moe, dense = Qwen2MoeConfig(router_aux_loss_coef=0.003), LlamaConfig()
    assert router_aux_coef(None, moe) == 0.003 and router_aux_coef(0.5, moe) == 0.5 and router_aux_coef(0.0, moe) == 0
    assert router_aux_coef(None, dense) == 0.0 and router_aux_coef(0.0, dense) == 0.0
    with pytest.raises(ModelError, match="router_aux_loss_coef is 0.1.*not a Mixture-of-Experts.*Fix: remove"):
        router_aux_coef(0.1, dense)


def test_preflight_refuses_a_router_loss_for_a_dense_model(grpo_home):
    from flows.train import preflight
    from grpo_core.config import GRPOConfig
    from grpo_core.model.loading import ModelError
    with pytest.raises(ModelError, match="router_aux_loss_coef"):
        preflight(GRPOConfig(model="tiny-random", device="cpu", router_aux_loss_coef=0.01))
