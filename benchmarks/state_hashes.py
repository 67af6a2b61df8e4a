"""Saved state-dict hashes of every bundled causal-LM recipe run on a tiny random Llama (the mixture-of-experts
recipes on a tiny Qwen3-MoE): a behaviour fingerprint.

    python -m benchmarks.state_hashes [--only wanda-channels,lorap] [--write PATH]

Each recipe is shrunk to the tiny model as :func:`benchmarks.exportable.shrink` does (calibration, training steps and
layer-counting arguments scaled, no evaluation, target not strict), run once on one CPU thread, and its saved
``model/*.safetensors`` tensors are hashed (name, dtype, shape and bytes of each, in name order). A refactor that
leaves behaviour unchanged leaves every hash unchanged; ``tests/contracts/test_state_hashes.py`` compares them with
the recorded ``tests/contracts/state_hashes.json``. A recipe that does not run on the tiny model is recorded by its
one-line error instead.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.outputs import write_text
from benchmarks.core.recipes import is_moe_recipe, llm_recipes
from benchmarks.exportable import shrink, tiny_model_dir

RECORD = Path(__file__).resolve().parent.parent / "tests" / "contracts" / "state_hashes.json"
"""The hashes recorded on the tree before a behaviour-preserving change."""


def state_hash(folder: Path) -> str:
    """One sha256 over every tensor saved in ``folder``'s safetensors files (name, dtype, shape, bytes)."""
    digest = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
    for key in sorted(tensors):
        tensor = tensors[key].contiguous()
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def causal_lm_recipes() -> list[str]:
    """The bundled recipes that compress a dense causal LM (GLUE task models, encoders and the mixture-of-experts
    recipes left out)."""
    return [name for name, why_not in llm_recipes().items() if why_not is None and not is_moe_recipe(name)]


def moe_recipes() -> list[str]:
    """The bundled mixture-of-experts recipes (hashed on the tiny Qwen3-MoE)."""
    return [name for name, why_not in llm_recipes().items() if why_not is None and is_moe_recipe(name)]


def recipe_hash(name: str, model_dir: Path, work: Path) -> str:
    """The state hash of ``name`` shrunk and run on the tiny model in ``model_dir`` (``error: ...`` if refused)."""
    import slimkit
    from slimkit.primitives.errors import SlimkitError
    from slimkit.recipes.loading import load_recipe, validate

    _, raw = load_recipe(name)
    raw, _changes = shrink(raw, model_dir)
    for stage in raw["stages"]:  # a timed search stops on evaluations only, so its result does not depend on speed
        for child in stage.get("sequential", [stage]):
            allocation = (child.get("args") or {}).get("allocation")
            search = allocation.get("search") if isinstance(allocation, dict) else None
            if isinstance(search, dict):
                search["budget_s"] = 1e9
    torch.manual_seed(0)
    try:
        slimkit.run(validate(raw, name), work / name, force=True, evaluate=False)
    except SlimkitError as error:
        return f"error: {error}"
    return state_hash(work / name / "model")


def all_hashes(names: list[str]) -> dict[str, str]:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        model_dir = tiny_model_dir(work / "tiny-llama")
        moe_dir = tiny_model_dir(work / "tiny-qwen3-moe", moe=True)
        return {name: recipe_hash(name, moe_dir if is_moe_recipe(name) else model_dir, work) for name in names}


def versions() -> dict[str, str]:
    """The library versions the hashes depend on (other versions may compute other bits)."""
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def main_body(argv: list[str]) -> None:
    parser = OneLineParser("benchmarks.state_hashes", __doc__)
    parser.add_argument("--only", type=arg.recipes, help="comma-separated recipe names (default: every causal-LM one)")
    parser.add_output_file("--write", help="write the hashes as JSON here")
    options = parser.parse(argv)
    hashes = all_hashes(options.only or causal_lm_recipes() + moe_recipes())
    text = json.dumps({"versions": versions(), "hashes": hashes}, indent=1, sort_keys=True) + "\n"
    if options.write:
        write_text(options.write, text, "--write")
    sys.stdout.write(text)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    raise SystemExit(main())
