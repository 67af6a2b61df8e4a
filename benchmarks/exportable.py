"""Which bundled LLM recipes export to llama.cpp (GGUF) and to plain Hugging Face folders, checked end to end.

    python -m benchmarks.exportable [--json PATH] [--only wanda-channels,lorap]

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import slimkit
from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.outputs import json_text, write_text
from benchmarks.core.recipes import MOE_STAGES as MOE_STAGES  # the MoE recipes' stages (tests/contracts read them)
from benchmarks.core.recipes import is_moe_recipe, llm_recipes
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.export import export
from slimkit.recipes.loading import load_recipe, validate

LAYERS = 4
"""Decoder layers of the tiny model (two SP3 groups of 2 after :data:`LAYER_SCALED`)."""
TOLERANCE = 1e-3
"""Max abs logit difference between llama.cpp (f32 GGUF) and PyTorch, as a fraction of ``max(1, max |logit|)``."""
IDS = torch.randint(3, 250, (24,), generator=torch.Generator().manual_seed(3)).tolist()
"""The fixed token ids both engines read."""
CALIBRATION = {"dataset": "c4", "samples": 4, "seq_len": 32, "batch_size": 2}
TRAINING = {"batch_size": 2, "seq_len": 16}
"""Batch settings of every training stage (lora, mask_train)."""
LAYER_SCALED = {"skip_first": 1, "skip_last": 1, "group_size": 2}
"""Layer-counting arguments, scaled from smollm2's 30 layers to 4 (see the module doc)."""
ALIGN_SCALED = 4
"""The largest ``target.align`` multiple of MLP channels on the tiny model (64 channels a layer: an alignment of 64
would leave each layer all or nothing)."""
EXPORTABLE = (
    "hf + gguf llama",
    "gguf llama",
    "hf + gguf llama (merged)",
    "gguf llama (merged)",
    "gguf deci",
    "hf + gguf qwen3moe",
    "no",
)


def _shrink_stage(stage: dict[str, Any], changes: list[str]) -> None:
    if "sequential" in stage:
        for child in stage["sequential"]:
            _shrink_stage(child, changes)
        return
    name = stage["stage"]
    args = stage.setdefault("args", {}) or {}
    stage["args"] = args
    for key, value in LAYER_SCALED.items():
        if isinstance(args.get(key), int) and args[key] > value:
            changes.append(f"{name} {key} {args[key]}->{value}")
            args[key] = value
    if name == "pca_project" and "group_size" not in args:  # the stage's default is 4 layers
        args["group_size"] = LAYER_SCALED["group_size"]
        changes.append(f"{name} group_size 4->{LAYER_SCALED['group_size']}")
    if name in ("lora", "distill"):
        args.update(steps=1, **TRAINING)
    elif name == "mask_train":
        args.update(finetune_steps=0, mask_steps=2, warmup_steps=1, **TRAINING)
    elif name == "cce":
        args.update(lora_steps=1)
    elif name == "prunenet":
        args.update(episodes=min(int(args.get("episodes", 20)), 1), save_policy=False)


def shrink(raw: dict[str, Any], model_dir: str | os.PathLike) -> tuple[dict[str, Any], list[str]]:
    """``raw`` on the tiny model in ``model_dir``, in seconds; also the structural changes (:data:`LAYER_SCALED`)."""
    raw = copy.deepcopy(raw)
    raw["model"] = str(model_dir)
    if "calibration" in raw:
        raw["calibration"] = dict(CALIBRATION)
    raw["target"] = {**raw["target"], "strict": False}
    raw["eval"] = {"perplexity": None}
    raw.pop("export", None)
    changes: list[str] = []
    align = dict(raw["target"].get("align") or {})
    if isinstance(align.get("mlp_channel"), int) and align["mlp_channel"] > ALIGN_SCALED:
        changes.append(f"target.align mlp_channel {align['mlp_channel']}->{ALIGN_SCALED}")
        raw["target"]["align"] = {**align, "mlp_channel": ALIGN_SCALED}
    for stage in raw["stages"]:
        _shrink_stage(stage, changes)
    return raw, changes


def tiny_model_dir(folder: Path, moe: bool = False) -> Path:
    """A tiny random Llama (``moe``: a Qwen3-MoE of 8 experts, top-2 renormalised) with the BPE tokenizer, saved as a
    plain Hugging Face folder."""
    from tests.tiny import bpe_tokenizer, tiny_llama, tiny_qwen3_moe

    tokenizer = bpe_tokenizer()
    torch.manual_seed(0)
    if moe:
        model = tiny_qwen3_moe(vocab_size=len(tokenizer), layers=LAYERS)
    else:
        model = tiny_llama(vocab_size=len(tokenizer), layers=LAYERS)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@dataclass
class Row:
    recipe: str
    exportable: str = "no"
    why: str = ""
    rel_diff: float | None = None
    """llama.cpp vs PyTorch: max abs logit difference / max(1, max |logit|)."""
    abs_diff: float | None = None
    run_error: str | None = None
    """The recipe did not run on the tiny model (one line)."""
    gguf: dict[str, Any] | None = None
    gguf_error: str | None = None
    hf: dict[str, Any] | None = None
    hf_error: str | None = None
    gguf_crash: bool = False
    """The GGUF export raised something other than a :class:`SlimkitError` (a bug, not a refusal)."""
    hf_crash: bool = False
    llamacpp_error: str | None = None
    """llama.cpp could not load or run the GGUF."""
    predicted_gguf: str | None = None
    """What the run report's loaders section (from the folder's config and manifest) says about GGUF."""
    predicted_hf: str | None = None
    """The same for ``--format hf`` (listed only for folders stock transformers cannot read)."""
    scaled: list[str] = field(default_factory=list)
    """Layer-counting arguments scaled to the tiny model (:data:`LAYER_SCALED`)."""
    widths: list[dict[str, int]] = field(default_factory=list)
    target: dict[str, Any] | None = None
    seconds: float = 0.0

    @property
    def gguf_ok(self) -> bool:
        """The GGUF export matched PyTorch in llama.cpp, or was refused with a one-line :class:`SlimkitError`."""
        if self.run_error is not None or self.gguf_crash:
            return False
        if self.gguf is None:
            return self.gguf_error is not None and self.gguf_error != "" and "\n" not in self.gguf_error
        return self.rel_diff is not None and self.rel_diff <= TOLERANCE

    @property
    def hf_ok(self) -> bool:
        """The HF export was written (verified by the exporter) or refused with a one-line :class:`SlimkitError`."""
        if self.run_error is not None or self.hf_crash:
            return False
        return self.hf is not None or (self.hf_error is not None and self.hf_error != "" and "\n" not in self.hf_error)

    @property
    def ok(self) -> bool:
        return self.gguf_ok and self.hf_ok


def _varying(widths: list[dict[str, int]]) -> list[str]:
    return sorted({key for w in widths for key in w if len({str(x.get(key)) for x in widths}) > 1})


def _crash(error: BaseException) -> str:
    """An unexpected exception in one line (its lines joined)."""
    text = " / ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {text}"


def _short(message: str) -> str:
    """The reason of a refusal without its advice (what follows the first '; ')."""
    return message.split("; ")[0]


def _llamacpp_diff(folder: Path, gguf_path: Path) -> tuple[float, float]:
    from slimkit.primitives.evaluate.llamacpp import gguf_logits

    model, _ = slimkit.load(folder)
    with torch.no_grad():
        expected = model(torch.tensor([IDS])).logits[0].float()
    actual = torch.tensor(gguf_logits(gguf_path, IDS, threads=2))
    if actual.shape != expected.shape:
        raise SlimkitError(f"llama.cpp logits {tuple(actual.shape)} != PyTorch {tuple(expected.shape)}")
    diff = float((actual - expected).abs().max())
    return diff, diff / max(1.0, float(expected.abs().max()))


def _export(
    folder: Path, target: Path, format: str, gguf_type: str | None
) -> tuple[dict[str, Any] | None, str | None, bool]:
    """``(result, error, crashed)``: a refusal is a :class:`SlimkitError`; anything else is a crash (a bug)."""
    try:
        return export(folder, target, format, gguf_type, force=True).as_dict(), None, False
    except SlimkitError as error:
        return None, str(error), False
    except Exception as error:  # recorded as a crash, never as a refusal
        return None, _crash(error), True


def check_recipe(name: str, model_dir: Path, work: Path) -> Row:
    """Run ``name`` shrunk on the tiny model in ``model_dir``, export its folder, compare in llama.cpp."""
    row = Row(name)
    start = time.perf_counter()
    out = work / name
    try:
        _, raw = load_recipe(name)
        raw, row.scaled = shrink(raw, model_dir)
        report = slimkit.run(validate(raw, name), out, force=True, evaluate=False).report.as_json()
    except Exception as error:  # any failure of a recipe on the tiny model is reported
        row.run_error = _crash(error)
        row.exportable, row.why = "not run", f"did not run on the tiny model: {row.run_error}"
        row.seconds = time.perf_counter() - start
        return row
    row.widths = report["layers"]["after"]
    row.target = {k: report["target"][k] for k in ("ratio", "achieved", "met")}
    loaders = {item["loader"]: item for item in report.get("loaders", [])}
    for attribute, loader in (("predicted_gguf", "llama.cpp"), ("predicted_hf", "transformers")):
        item = loaders.get(f"{loader} via slimkit export --format {attribute.removeprefix('predicted_')}")
        if item is not None:
            setattr(row, attribute, f"{item['answer']}: {item['detail']}")
    folder = out / "model"
    row.gguf, row.gguf_error, row.gguf_crash = _export(folder, out / "model-f32.gguf", "gguf", "f32")
    row.hf, row.hf_error, row.hf_crash = _export(folder, out / "hf", "hf", None)
    if row.gguf is not None:
        try:
            row.abs_diff, row.rel_diff = _llamacpp_diff(folder, Path(row.gguf["path"]))
        except Exception as error:  # a file llama.cpp cannot read is a failed export
            row.llamacpp_error = _crash(error)
    row.exportable, row.why = verdict(row)
    row.seconds = time.perf_counter() - start
    return row


def verdict(row: Row) -> tuple[str, str]:
    """The table's "exportable as" and its short reason."""
    if row.gguf is None:
        return "no", ("GGUF export crashed: " if row.gguf_crash else "") + _short(row.gguf_error or "")
    merged = row.gguf["merged"]
    if row.gguf["architecture"] == "deci":
        varying = _varying(row.widths)
        kind, why = "gguf deci", "; ".join([f"per-layer {', '.join(varying) or 'widths'}", *merged])
    else:
        kind = (
            ("hf + " if row.hf is not None else "")
            + f"gguf {row.gguf['architecture']}"
            + (" (merged)" if merged else "")
        )
        why = "; ".join(merged) if merged else "uniform widths"
    if row.llamacpp_error:
        why += f" (llama.cpp failed: {row.llamacpp_error})"
    if row.hf_crash:
        why += f" (hf export crashed: {(row.hf_error or '').split(' / ')[-1]})"
    elif row.hf is None and row.gguf["architecture"] != "deci":
        why += f" (hf refused: {_short(row.hf_error or '')})"
    return kind, why


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(rows: list[Row], skipped: dict[str, str]) -> str:
    lines = [
        "| recipe | exportable as | why / what was merged | llama.cpp max abs logit diff (relative) |",
        "|---|---|---|---|",
    ]
    for row in rows:
        why = row.why + (f" [tiny: {', '.join(row.scaled)}]" if row.scaled else "")
        diff = "-" if row.abs_diff is None else f"{row.abs_diff:.1e} ({row.rel_diff:.1e})"
        if row.rel_diff is not None and row.rel_diff > TOLERANCE:
            diff += f" EXCEEDS {TOLERANCE:g}"
        lines.append(f"| {row.recipe} | {row.exportable} | {_cell(why)} | {diff} |")
    for name, reason in skipped.items():
        lines.append(f"| {name} | not checked | {_cell(reason)}: no decoder to export | - |")
    return "\n".join(lines)


def run(names: list[str] | None = None, work: str | os.PathLike | None = None) -> tuple[list[Row], dict[str, str]]:
    """Check ``names`` (default: every LLM recipe); returns the rows and the recipes not checked, with why."""
    recipes = llm_recipes()
    if names:
        unknown = [n for n in names if n not in recipes]
        if unknown:
            raise SlimkitError(f"unknown recipe(s) {', '.join(unknown)}; bundled: {', '.join(recipes)}")
        chosen = names
        skipped = {}
    else:
        chosen = [n for n, reason in recipes.items() if reason is None]
        skipped = {n: reason for n, reason in recipes.items() if reason is not None}
    with tempfile.TemporaryDirectory(prefix="slimkit-exportable-", dir=work) as tmp:
        model_dir = tiny_model_dir(Path(tmp) / "tiny-llama")
        moe_dir: Path | None = None
        rows = []
        for name in chosen:
            why_not = recipes[name]
            if why_not is not None:
                skipped[name] = why_not
                continue
            if is_moe_recipe(name):
                moe_dir = moe_dir or tiny_model_dir(Path(tmp) / "tiny-qwen3-moe", moe=True)
                rows.append(check_recipe(name, moe_dir, Path(tmp) / "runs"))
                continue
            rows.append(check_recipe(name, model_dir, Path(tmp) / "runs"))
    return rows, skipped


def main_body(argv: list[str]) -> int:
    parser = OneLineParser("benchmarks.exportable", __doc__)
    parser.add_output_file("--json", help="write every row (export results, refusals) to this file")
    parser.add_argument("--only", type=arg.recipes, help="comma-separated recipe names (default: every LLM recipe)")
    args = parser.parse(argv)
    start = time.perf_counter()
    rows, skipped = run(args.only)
    print(table(rows, skipped))
    print(f"\n{len(rows)} recipes in {time.perf_counter() - start:.0f} s on a tiny random Llama ({LAYERS} layers)")
    if args.json:
        dumped = [{**asdict(row), "gguf_ok": row.gguf_ok, "hf_ok": row.hf_ok} for row in rows]
        write_text(args.json, json_text({"tolerance": TOLERANCE, "rows": dumped, "not_checked": skipped}), "--json")
    return 0 if all(row.ok for row in rows) else 1


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    raise SystemExit(main())
