import pytest
import torch

from grpo_core.models import DEFAULT_MODEL, ModelError, resolve_model


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
    from grpo_core.policy import load_policy
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
