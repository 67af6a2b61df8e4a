"""The `reconstruct` stage: least-squares refit of down_proj / o_proj inside `sequential` after pruning."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.reconstruct.consumer import DenseConsumer
from slimkit.primitives.reconstruct.refit import RefitSettings, matched_columns, refit_role
from slimkit.recipes.loading import load_recipe
from tests.conftest import saved_tiny_llama
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import model_output, tiny_llama


def test_matched_columns_finds_the_kept_dense_columns_in_order():
    dense = torch.arange(12.0).reshape(2, 6)
    assert matched_columns(dense, dense[:, [0, 3, 5]]).tolist() == [0, 3, 5]
    assert matched_columns(dense, dense).tolist() == list(range(6))
    assert matched_columns(dense, dense[:, [3, 0]]) is None  # out of order: not a pure removal
    assert matched_columns(dense, dense[:, [1]] + 0.5) is None  # changed, not removed
    twins = torch.tensor([[1.0, 1.0, 2.0]])
    assert matched_columns(twins, twins[:, [1, 2]]).tolist() == [0, 2]  # equal columns: the first free one


def _stages(groups, reconstruct: bool, ratio=None):
    prune = {"stage": "prune_layer", "args": {"groups": groups, "scorer": "activation"}}
    if ratio is not None:
        prune["args"]["ratio"] = ratio
    children = [prune] + ([{"stage": "reconstruct"}] if reconstruct else [])
    return [{"sequential": children}]


@pytest.mark.slow
@pytest.mark.parametrize("groups", [["mlp_channel"], ["attention_head"], ["mlp_channel", "attention_head"]])
def test_reconstruct_lowers_every_refitted_layers_output_error(tmp_path, tiny_llama_dir, groups):
    of = "attention" if groups == ["attention_head"] else "mlp" if groups == ["mlp_channel"] else "layers"
    raw = tiny_recipe(tiny_llama_dir, target={"ratio": 0.3, "of": of, "tolerance": 0.1}, stages=_stages(groups, True))
    report = slimkit.run(raw, tmp_path / "run").report.as_json()
    entry = report["stages"]["reconstruct"]
    roles = {"mlp_channel": "down", "attention_head": "o"}
    assert set(entry["layers"]) == {roles[g] for g in groups}
    for per_layer in entry["layers"].values():
        assert len(per_layer) == 3
        for result in per_layer.values():
            assert result["kept"] < result["of"] and result["method"] == "cholesky"
            assert result["error_after"] < result["error_before"]
    plain = slimkit.run(
        raw := tiny_recipe(tiny_llama_dir, target=raw["target"], stages=_stages(groups, False)), tmp_path / "plain"
    ).report.as_json()
    assert plain["params"]["after"] == report["params"]["after"]  # same structure, only refitted values


def test_reconstruct_leaves_an_unpruned_layer_unchanged(tmp_path, tiny_llama_dir):
    raw = tiny_recipe(
        tiny_llama_dir,
        target={"ratio": 0.0, "of": "mlp", "tolerance": 0.01},
        stages=_stages(["mlp_channel"], True, ratio=0.0),
    )
    report = slimkit.run(raw, tmp_path / "run").report.as_json()
    assert report["stages"]["reconstruct"]["layers"] == {}
    model, _ = slimkit.load(tmp_path / "run" / "model")
    original = slimkit.load(tiny_llama_dir)[0]
    ids = torch.randint(3, 200, (2, 9))
    torch.testing.assert_close(model_output(model, ids), model_output(original, ids), rtol=0, atol=0)


def test_a_changed_consumer_is_refused_in_one_line():
    model = tiny_llama()
    layer = ModelView(model).layer(0)
    dense = layer.linear("down").weight.detach().clone()
    stats = {"dense_consumers": {"down": DenseConsumer(dense, torch.eye(dense.shape[1], dtype=torch.float64))}}
    with torch.no_grad():
        layer.linear("down").weight.mul_(2.0)  # same shape: nothing removed, left alone
    settings = RefitSettings(damping=1e-6, toward="zero")
    assert refit_role(layer, "down", stats["dense_consumers"]["down"], settings) is None
    layer.linear("down").weight = torch.nn.Parameter(dense[:, :10] * 2.0)  # narrower and changed
    with pytest.raises(SlimkitError, match="columns are not a subset of its dense columns"):
        refit_role(layer, "down", stats["dense_consumers"]["down"], settings)


def test_the_bundled_recipe_validates():
    recipe, _ = load_recipe("wanda-channels+reconstruct")
    assert [c.stage for c in recipe.stages[0].sequential] == ["prune_layer", "reconstruct"]
    biased, _ = load_recipe("wanda-channels+reconstruct+bias")
    args = biased.stages[0].sequential[1].parsed_args()
    assert args.bias == "mean" and args.refit and args.target == "compressed"
    dense, _ = load_recipe("wanda-channels+reconstruct", ["stages.0.sequential.1.args.target=dense"])
    assert dense.stages[0].sequential[1].parsed_args().target == "dense"


# --- bias compensation, dense targets, bad input ------------------------------------------------------


def _recipe(
    model_dir, reconstruct_args: dict | None, groups=("mlp_channel",), ratio=0.25, of="mlp", scorer="activation"
) -> dict:
    prune = {"stage": "prune_layer", "args": {"groups": list(groups), "scorer": scorer}}
    children = [prune] + ([{"stage": "reconstruct", "args": reconstruct_args}] if reconstruct_args is not None else [])
    return tiny_recipe(
        model_dir, target={"ratio": ratio, "of": of, "tolerance": 0.05}, stages=[{"sequential": children}]
    )


def _constant_channel_llama(folder, tokenizer, channels: int = 16):
    """A tiny llama (mlp_bias on) whose first ``channels`` MLP channels are constant on any data: their gate and up
    rows are zero, so each outputs silu(gate bias) x up bias; their down columns are small, so Wanda removes them."""
    from slimkit.primitives.arch import ModelView
    from slimkit.primitives.reconstruct import consumer_bias

    model = tiny_llama(vocab_size=len(tokenizer))
    view = ModelView(model)
    consumer_bias(model, view, view.layer(0), "down")
    with torch.no_grad():
        for layer in view.layers:
            gate, up, down = layer.linear("gate"), layer.linear("up"), layer.linear("down")
            gate.weight[:channels] = 0.0
            up.weight[:channels] = 0.0
            gate.bias[:channels] = torch.linspace(0.5, 2.0, channels)
            up.bias[:channels] = torch.linspace(1.0, 3.0, channels)
            down.weight[:, :channels] *= 0.1
            down.bias.copy_(torch.randn(down.out_features) * 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("refit", [False, True])
def test_removing_constant_channels_with_mean_bias_is_lossless(tmp_path, tokenizer, refit):
    folder = _constant_channel_llama(tmp_path / "constant", tokenizer)
    ids = torch.randint(3, 200, (2, 11))
    dense = model_output(slimkit.load(folder)[0], ids)
    raw = _recipe(folder, {"bias": "mean", "refit": refit, "roles": ["down"]})
    report = slimkit.run(raw, tmp_path / "run").report.as_json()
    for result in report["stages"]["reconstruct"]["layers"]["down"].values():
        assert result["kept"] == 48 and result["error_after"] < 1e-10  # the 16 constant channels went
    pruned = model_output(slimkit.load(tmp_path / "run" / "model")[0], ids)
    torch.testing.assert_close(pruned, dense, rtol=1e-5, atol=1e-5)
    plain = _recipe(folder, None)
    slimkit.run(plain, tmp_path / "plain")
    without = model_output(slimkit.load(tmp_path / "plain" / "model")[0], ids)
    assert (without - dense).abs().max() > 1e-2  # without the bias shift the removal is not lossless


def test_mean_bias_saves_and_reloads_with_slimkit_and_stock_transformers(tmp_path, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    raw = _recipe(tiny_llama_dir, {"bias": "mean"}, groups=("mlp_channel", "attention_head"), ratio=0.3, of="layers")
    report = slimkit.run(raw, tmp_path / "run").report.as_json()
    entry = report["stages"]["reconstruct"]
    assert entry["settings"] == {"bias": "mean", "target": "compressed", "refit": True}
    assert all(r["bias_shift"] > 0 for per_layer in entry["layers"].values() for r in per_layer.values())
    folder = tmp_path / "run" / "model"
    ours, stock = slimkit.load(folder)[0], AutoModelForCausalLM.from_pretrained(folder)
    assert stock.config.mlp_bias and stock.config.attention_bias
    assert stock.model.layers[0].mlp.down_proj.bias.abs().max() > 0
    ids = torch.randint(3, 200, (2, 9))
    torch.testing.assert_close(model_output(stock, ids), model_output(ours, ids), rtol=0, atol=0)


def test_export_keeps_the_new_biases_in_a_plain_folder_and_in_gguf(tmp_path):
    """A plain Hugging Face folder carries the biases (write_hf checks the logits itself), and so does GGUF: llama.cpp
    (llama architecture) gives the same logits."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")
    from transformers import AutoModelForCausalLM

    from slimkit.primitives.evaluate.llamacpp import gguf_logits
    from slimkit.primitives.export import export, write_hf
    from tests.tiny import bpe_tokenizer, tiny_qwen3

    tokenizer = bpe_tokenizer()  # llama.cpp's gpt2 tokenizer needs BPE merges
    folder = saved_tiny_llama(tmp_path / "model", tokenizer)

    raw = _recipe(folder, {"bias": "mean"}, groups=("mlp_channel", "attention_head"), ratio=0.3, of="layers")
    slimkit.run(raw, tmp_path / "run")
    ours = slimkit.load(tmp_path / "run" / "model")[0]
    result = write_hf(ours, None, tmp_path / "hf")
    assert result.max_abs_logit_diff is not None and result.max_abs_logit_diff <= 1e-4
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    torch.testing.assert_close(plain.model.layers[1].mlp.down_proj.bias, ours.model.layers[1].mlp.down_proj.bias)
    ids = torch.randint(3, 250, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    result = export(ours, tmp_path / "m.gguf", "gguf", "f32", tokenizer=tokenizer)
    assert result.architecture == "llama"
    expected = model_output(ours, torch.tensor([ids]))[0].float()
    actual = torch.tensor(gguf_logits(tmp_path / "m.gguf", ids, threads=2))
    assert float((actual - expected).abs().max()) <= 1e-3 * max(float(expected.abs().max()), 1.0)
    qwen3 = tiny_qwen3(vocab_size=len(tokenizer))
    qwen3.config.attention_bias = True  # slimkit does not write Qwen3's o bias: refused in one line
    with pytest.raises(SlimkitError, match="writes them for llama, not qwen3"):
        export(qwen3, tmp_path / "q.gguf", "gguf", "f32", tokenizer=tokenizer)


@pytest.mark.slow
def test_dense_target_equals_compressed_target_where_nothing_upstream_is_compressed(tmp_path, tiny_llama_dir):
    """Layer 0 sees the embeddings in both streams, so its refit is the same; later layers differ."""
    weights = {}
    for target in ("compressed", "dense"):
        raw = _recipe(
            tiny_llama_dir, {"target": target}, groups=("mlp_channel", "attention_head"), ratio=0.3, of="layers"
        )
        report = slimkit.run(raw, tmp_path / target).report.as_json()
        assert report["stages"]["reconstruct"]["settings"]["target"] == target
        model = slimkit.load(tmp_path / target / "model")[0]
        weights[target] = {
            (i, role): ModelView(model).layer(i).linear(role).weight.detach()
            for i in range(3)
            for role in ("down", "o")
        }
    for role in ("down", "o"):
        torch.testing.assert_close(weights["dense"][0, role], weights["compressed"][0, role], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(weights["dense"][2, role], weights["compressed"][2, role], rtol=1e-3, atol=1e-5)


def test_a_bias_the_architecture_cannot_carry_is_refused(tmp_path, tokenizer):
    from tests.tiny import tiny_mistral

    folder = tmp_path / "mistral"
    tiny_mistral(vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    raw = _recipe(folder, {"bias": "mean"})
    with pytest.raises(SlimkitError, match="bias: mean needs a bias on down, but mistral models have no config flag"):
        slimkit.run(raw, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _snapshot(root) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


def _non_finite_llama(folder, tokenizer):
    """Layer 1's MLP norm scales by 3e38, so gate/up overflow float32 and its down_proj inputs are inf/NaN (its
    weights stay finite, so magnitude scores are)."""
    model = tiny_llama(vocab_size=len(tokenizer))
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight.fill_(3e38)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _is_progress(line: str) -> bool:
    """A progress-bar line ("0:prune_layer ━━━ 3/3 0:00:00")."""
    return line.split()[0][:1].isdigit() and ":" in line.split()[0] and line.rstrip()[-7:].count(":") == 2


BAD = [
    (
        "damping-zero",
        {"damping": 0},
        "stages.0.sequential.1: args.damping: must be at least 1e-12 (a positive ridge keeps the refit solvable), "
        "got 0",
    ),
    (
        "damping-negative",
        {"damping": -0.1},
        "stages.0.sequential.1: args.damping: must be at least 1e-12",
    ),
    ("damping-nan", {"damping": float("nan")}, "stages.0.sequential.1: args.damping: must be a finite number, got nan"),
    ("nothing-to-do", {"refit": False}, "refit: false with bias: none changes nothing"),
    (
        "target-not-produced",
        {"roles": ["o"]},
        "roles asks to refit o, but no stage before it removed the units o reads",
    ),
    ("bias-on-mistral", {"bias": "mean"}, "bias: mean needs a bias on down, but mistral models have no config flag"),
    ("non-finite-gram", {}, "no damping (damping: 0.1) makes that solvable"),
    ("first-in-block", "first", "reconstruct is the first stage of its sequential block"),
    ("top-level", "top", "reconstruct runs inside sequential"),
]


@pytest.mark.parametrize(("case", "args", "fragment"), BAD, ids=[b[0] for b in BAD])
def test_bad_reconstruct_input_is_one_line(case, args, fragment, monkeypatch, capsys, tmp_path, tokenizer):
    from tests.tiny import tiny_mistral

    folder = tmp_path / "model"
    if case == "bias-on-mistral":
        tiny_mistral(vocab_size=len(tokenizer)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    elif case == "non-finite-gram":
        _non_finite_llama(folder, tokenizer)
    else:
        saved_tiny_llama(folder, tokenizer)
    if args == "first":
        raw = tiny_recipe(folder, stages=[{"sequential": [{"stage": "reconstruct"}, {"stage": "prune_layer"}]}])
    elif args == "top":
        raw = tiny_recipe(folder, stages=[{"stage": "prune_layer"}, {"stage": "reconstruct"}])
    else:  # magnitude scores: the non-finite activations reach reconstruct, not the activation scorer
        raw = _recipe(folder, args, scorer="magnitude" if case == "non-finite-gram" else "activation")
    assert_refused_in_one_line(raw, fragment, monkeypatch, capsys, tmp_path)


def assert_refused_in_one_line(raw: dict, fragment: str, monkeypatch, capsys, tmp_path) -> None:
    """``slimkit recipe run`` of the recipe ``raw`` exits 2 with one ``error:`` line holding ``fragment``, no
    traceback, and nothing written under ``tmp_path``."""
    import yaml

    from tests.cli.test_cli import run_cli

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    before = _snapshot(tmp_path)
    code, out, err = run_cli(monkeypatch, capsys, "recipe", "run", str(path), "--out", str(tmp_path / "out"))
    # Errors raised while the stages run follow the progress bars (stderr); the error itself is one line, the last.
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if not _is_progress(line)]
    assert code == 2 and len(errors) == 1 and errors[0].startswith("error: ") and lines[-1] == errors[0], err
    assert fragment in errors[0], errors[0]
    assert "Traceback" not in err + out
    assert _snapshot(tmp_path) == before  # nothing written


def test_paired_pass_accumulates_the_dense_compressed_cross_term():
    from slimkit.primitives.calibration import LayerInputs
    from slimkit.primitives.reconstruct.consumer import paired_pass

    model = tiny_llama()
    layer = ModelView(model).layer(0)
    ids = torch.randint(3, 200, (2, 6))
    captured = []
    handle = layer.module.register_forward_pre_hook(lambda _m, a, k: captured.append((a, k)), with_kwargs=True)
    with torch.no_grad():
        model(ids)
    handle.remove()
    (args, kwargs) = captured[0]
    hidden_c = (args[0] if args else kwargs["hidden_states"]).detach()
    hidden_d = hidden_c + 0.3 * torch.randn_like(hidden_c)
    kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
    down = layer.linear("down")
    seen = []
    hook = down.register_forward_pre_hook(lambda _m, a: seen.append(a[0].reshape(-1, a[0].shape[-1]).double()))
    with torch.no_grad():
        out_d = layer.module(hidden_d, **kwargs)
        layer.module(hidden_c, **kwargs)
    hook.remove()
    paired, outputs = paired_pass(
        layer.module, {"down": down}, LayerInputs([hidden_c], [kwargs]), LayerInputs([hidden_d], [kwargs])
    )
    cross, dense_sum = paired["down"]
    torch.testing.assert_close(cross, seen[0].T @ seen[1])
    torch.testing.assert_close(dense_sum, seen[0].sum(0))
    torch.testing.assert_close(outputs[0], out_d[0] if isinstance(out_d, tuple) else out_d)
