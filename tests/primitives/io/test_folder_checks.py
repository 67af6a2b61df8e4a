"""The model-folder checks at the load boundary (:mod:`slimkit.primitives.io.folder`): transformers' config refusals as
one line naming the field, routing sizes, output scalars, required widths, stored dtypes and tokenizer files, each on
a hand-made folder or message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError
from safetensors.torch import save_file

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io.folder import check_model_folder, check_tokenizer_files, config_error_line

CONFIG = Path("m/config.json")


def test_a_class_validation_error_names_the_fields_its_message_speaks_of():
    cause = ValueError("The hidden size (48) is not a multiple of the number of attention heads (5).")
    error = StrictDataclassClassValidationError("validate_architecture", cause)
    error.__cause__ = cause
    config = {"hidden_size": 48, "num_attention_heads": 5, "vocab_size": 300}
    line = config_error_line(CONFIG, error, config)
    assert line == (
        "m/config.json: hidden_size 48, num_attention_heads 5: transformers refuses it (The hidden size (48) is not a "
        "multiple of the number of attention heads (5))"
    )


def test_a_field_validation_error_names_its_field_and_value():
    cause = TypeError(
        "Field 'head_dim' with value 3.5 doesn't match any type in (<class 'int'>, <class 'NoneType'>). Errors: ..."
    )
    error = StrictDataclassFieldValidationError("head_dim", cause)
    error.__cause__ = cause
    line = config_error_line(CONFIG, error, {"head_dim": 3.5})
    assert line == (
        "m/config.json: head_dim 3.5: transformers refuses it (Field 'head_dim' with value 3.5 doesn't match any type "
        "in (int, NoneType))"
    )


def folder(tmp_path: Path, config: dict, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    base = {
        "model_type": "llama",
        "hidden_size": 4,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 16,
    }
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    tensors = {"model.embed_tokens.weight": torch.zeros(16, 4), **(tensors or {})}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"hidden_size": None}, "hidden_size must be a positive integer, got null"),
        ({"final_logit_softcapping": -1.0, "model_type": "gemma2"}, "final_logit_softcapping must be a finite"),
        ({"logits_scaling": 0, "model_type": "granite"}, "logits_scaling must be a finite positive number or null"),
        ({"logits_scaling": "2", "model_type": "granite"}, 'got "2"'),
    ],
)
def test_config_scalars_are_refused_in_one_line(tmp_path, config, fragment):
    with pytest.raises(SlimkitError, match=r"config\.json: ") as raised:
        check_model_folder(folder(tmp_path, config))
    assert fragment in str(raised.value)


def test_a_missing_width_is_refused_where_transformers_would_use_its_default(tmp_path):
    path = folder(tmp_path, {})
    config = json.loads((path / "config.json").read_text())
    del config["vocab_size"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SlimkitError, match="no vocab_size; transformers would build the model with its default"):
        check_model_folder(path)


@pytest.mark.parametrize(("top_k", "ok"), [(1, True), (4, True), (5, False), (0, False)])
def test_a_router_picks_at_most_every_expert(tmp_path, top_k, ok):
    config = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": top_k}
    tensors = {"model.layers.0.mlp.gate.weight": torch.zeros(4, 4)}
    path = folder(tmp_path, config, tensors)
    if ok:
        check_model_folder(path)
    else:
        with pytest.raises(SlimkitError, match="num_experts_per_tok"):
            check_model_folder(path)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.bool, torch.int32])
def test_weights_stored_as_integers_are_refused(tmp_path, dtype):
    tensors = {"model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4, dtype=dtype)}
    with pytest.raises(SlimkitError, match=r"up_proj\.weight is stored as \w+, not a floating-point type"):
        check_model_folder(folder(tmp_path, {}, tensors))


def test_float_weights_of_any_width_and_integer_buffers_are_read(tmp_path):
    tensors = {
        "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 8, dtype=torch.float16),
        "model.embed_positions.position_ids": torch.arange(4),  # a saved buffer, not a weight
    }
    assert check_model_folder(folder(tmp_path, {}, tensors)).shapes["model.embed_positions.position_ids"] == (4,)


def test_a_folder_without_tokenizer_files_is_refused_for_what_needs_one(tmp_path):
    path = folder(tmp_path, {})
    with pytest.raises(SlimkitError, match=r"has no tokenizer \(none of tokenizer\.json, .*; evaluation needs"):
        check_tokenizer_files(path, "evaluation")
    (path / "tokenizer_config.json").write_text("{}")
    check_tokenizer_files(path, "evaluation")
