"""Which architectures slimkit compresses, and which it only evaluates: any causal LM transformers builds itself."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, GPT2Config

from slimkit.primitives.arch.support import (
    builtin_causal_lm,
    check_evaluable,
    check_supported,
    compression_support,
)
from slimkit.primitives.errors import SlimkitError


def test_any_builtin_causal_lm_is_evaluable():
    for model_type in ("gpt2", "gpt_neox", "phi", "falcon", "gemma3_text"):
        assert builtin_causal_lm(model_type)
        assert check_evaluable({"model_type": model_type}) == "causal-lm"
    assert check_evaluable(AutoConfig.for_model("llama")) == "causal-lm"
    assert check_evaluable({"model_type": "bert"}) == "encoder"  # an encoder keeps its adapter and its task
    assert not builtin_causal_lm("t5") and not builtin_causal_lm(None)


def test_what_is_not_a_causal_lm_is_refused_in_one_line():
    with pytest.raises(SlimkitError) as error:
        check_evaluable({"model_type": "t5"})
    text = str(error.value)
    assert "\n" not in text
    assert text.startswith("model_type 't5' is not a causal language model transformers builds")
    assert "llama, llama4_text, ministral, mistral" in text  # and names what slimkit compresses
    with pytest.raises(SlimkitError, match=r"^a config without a model_type is not a causal language model"):
        check_evaluable({})


def test_custom_code_is_refused_for_evaluation_too():
    config = {"model_type": "gpt2", "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    with pytest.raises(SlimkitError, match=r"custom code \(auto_map: AutoModelForCausalLM\), which slimkit never"):
        check_evaluable(config)
    check_evaluable({"model_type": "gpt2", "auto_map": {"AutoTokenizer": "tokenization_x.X"}})  # a tokenizer only


def test_compression_keeps_refusing_what_it_has_no_adapter_for():
    message = "model_type 'gpt2' is not supported for causal-lm recipes; supported: "
    assert compression_support(GPT2Config()).startswith(message)
    with pytest.raises(SlimkitError, match=f"^{message}"):
        check_supported(GPT2Config(), "causal-lm")
    assert compression_support(AutoConfig.for_model("llama")) is None
