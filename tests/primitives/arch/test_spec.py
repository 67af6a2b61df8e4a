"""Architecture data: what each family's spec says about the runtimes that read it."""

from __future__ import annotations


def test_the_export_lists_are_the_architecture_datas():
    from slimkit.primitives.arch.spec import ARCH_SPECS, SAME_AS_LLAMA, gguf_model_types, hf_model_types
    from slimkit.primitives.export import EXPORTABLE_MODEL_TYPES, HF_MODEL_TYPES

    assert EXPORTABLE_MODEL_TYPES == gguf_model_types() and HF_MODEL_TYPES == hf_model_types()
    gguf = {model_type: spec.gguf for model_type, spec in ARCH_SPECS.items()}
    assert gguf["llama"] == gguf["mistral"] == gguf["mixtral"] == "llama"
    assert (gguf["gemma3_text"], gguf["olmo3"], gguf["qwen3_moe"]) == ("gemma3", "olmo2", "qwen3moe")
    assert all(gguf[model_type] is None for model_type in (*SAME_AS_LLAMA, "bert", "opt", "deepseek_v3"))
    assert {"bert", "opt"}.isdisjoint(HF_MODEL_TYPES) and {"llama", "smollm3", "gpt_oss"} <= set(HF_MODEL_TYPES)
