"""The grid's rows (``python -m benchmarks.run``): each recipe compressed by ``slimkit recipe run`` in its own
process, its saved model evaluated, counted and timed against the dense model here; rows kept for ``--resume``.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import gc
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from benchmarks.core.engine_calls import MACS_SEQ_LEN, read_run_report
from benchmarks.core.errors import BenchError
from benchmarks.core.inputs import read_json_file, read_yaml_file
from benchmarks.core.processes import last_line, log, recipe_run, run_logged, thread_env, via_launcher
from benchmarks.core.recipes import RECOVERY_STAGES
from benchmarks.grid import DENSE, Job, Settings
from benchmarks.model_counts import layer_params, layer_widths, lowrank_params, placement_of, residual_params_in_model
from benchmarks.seeds import add_norm_mean
from slimkit.primitives.files.removal import discard

ROW_FILE = "bench-row.json"
"""Where a kept run folder records its measured row (reused by ``--resume``)."""


def row_slug(row_id: str) -> str:
    """The run folder's name of a row: ``lorap@20+ft`` -> ``lorap-r20_ft``."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", row_id.replace("@", "-r"))


def eval_config(settings: Settings) -> Any:
    """The evaluation of every row under ``settings``: perplexity and zero-shot (speed is measured apart)."""
    from slimkit.primitives.evaluate.eval_settings import EvalConfig

    perplexity = None
    if settings.ppl_datasets:
        perplexity = {
            "datasets": settings.ppl_datasets,
            "seq_len": settings.ppl_window,
            "max_tokens": settings.ppl_tokens,
        }
    zeroshot = {"tasks": settings.zeroshot_tasks, "limit": settings.zeroshot_limit} if settings.zeroshot_on else None
    return EvalConfig.model_validate({"perplexity": perplexity, "zeroshot": zeroshot, "speed": False})


def normalised_settings(stored: Any) -> Any:
    """Stored settings with the defaults of fields added since they were written (a row measured before
    ``device`` existed was measured under ``device: auto``), so such rows stay reusable."""
    from pydantic import ValidationError

    try:
        return json.loads(json.dumps(Settings.model_validate(stored).model_dump()))
    except ValidationError:  # not settings this code can read: never equal
        return stored


class Bench:
    """The grid's rows measured one at a time beside the dense model (loaded on first use): each row compressed in
    its own process, evaluated and timed here; with a kept folder, rows stored for ``--resume``."""

    def __init__(
        self,
        settings: Settings,
        runs: Path,
        keep: bool,
        resume: bool,
        threads: int | None = None,
        reuse_only: bool = False,
    ) -> None:
        import torch

        if threads is not None:
            torch.set_num_threads(threads)
        self.thread_env = thread_env(threads)
        self.settings = settings
        self.runs = runs
        self.keep = keep
        self.resume = resume
        self.reuse_only = reuse_only
        """Only collect rows measured earlier (``--reuse-only``); never compress or measure a row."""
        self.config = eval_config(settings)
        self._dense: tuple[Any, Any, list[int]] | None = None
        self.dense_speed: list[tuple[float, float]] = []

    def _loaded(self) -> tuple[Any, Any, list[int]]:
        """The dense model, its tokenizer and its layers' parameter counts, loaded on first use (assembling
        stored rows with ``--reuse-only`` needs none of them, so rows measured on a GPU can be assembled
        on a machine without one)."""
        if self._dense is None:
            model, tokenizer = self.load(self.settings.model)
            self._dense = (model, tokenizer, layer_params(model))
        return self._dense

    def load(self, source: str) -> tuple[Any, Any]:
        """``(model, tokenizer)`` of ``source`` on the settings' device and dtype."""
        import slimkit

        model, tokenizer, _info = slimkit.load_source(source, device=self.settings.device, dtype=self.settings.dtype)
        return model, tokenizer

    @property
    def dense(self) -> Any:
        return self._loaded()[0]

    @property
    def tokenizer(self) -> Any:
        return self._loaded()[1]

    @property
    def dense_layer_params(self) -> list[int]:
        return self._loaded()[2]

    def evaluate(self, model: Any, config: Any = None) -> tuple[dict[str, float], dict[str, Any], float]:
        """Perplexity and zero-shot of ``model`` under ``config`` (default: the settings')."""
        from slimkit.primitives.evaluate.run import evaluate_model

        start = time.perf_counter()
        evaluation = evaluate_model(model, self.tokenizer, config or self.config)
        metrics, details = evaluation.metrics, evaluation.details
        add_norm_mean(metrics)
        details["seconds"] = dict(evaluation.seconds)  # per evaluation (eval:wikitext2, eval:zeroshot, ...)
        return metrics, details, time.perf_counter() - start

    def speed(self, row_id: str, model: Any) -> dict[str, Any]:
        from benchmarks.speed import measure

        s = self.settings.speed
        vocab = len(self.tokenizer)
        dense, row = measure(
            [(DENSE, self.dense, vocab), (row_id, model, vocab)], s.rounds, s.prompt_len, s.new_tokens, s.batch
        )
        self.dense_speed.append((dense["prefill_tokens_per_s"], dense["decode_tokens_per_s"]))
        return {
            "prefill_tokens_per_s": row["prefill_tokens_per_s"],
            "decode_tokens_per_s": row["decode_tokens_per_s"],
            "dense_prefill_tokens_per_s": dense["prefill_tokens_per_s"],
            "dense_decode_tokens_per_s": dense["decode_tokens_per_s"],
            "prefill_ratio": row["prefill_ratio"],
            "decode_ratio": row["decode_ratio"],
        }

    def dense_row(self) -> dict[str, Any]:
        from slimkit.primitives.evaluate.counting import count_macs, params_by_part

        metrics, details, seconds = self.evaluate(self.dense)
        total = params_by_part(self.dense)["total"]
        macs = count_macs(self.dense, MACS_SEQ_LEN)
        return {
            "id": DENSE,
            "recipe": DENSE,
            "placement": placement_of(self.dense),
            "ratio": None,
            "recovery": False,
            "status": "ok",
            "params": {"before": total, "after": total, "removed_ratio": 0.0},
            "macs": {"before": macs, "after": macs, "seq_len": MACS_SEQ_LEN},
            "metrics": metrics,
            "evaluation": details,
            "eval_s": seconds,
            "layers": {
                "widths": layer_widths(self.dense),
                "params": self.dense_layer_params,
                "dense_params": self.dense_layer_params,
            },
        }

    def read_row(self, path: Path, settings: Settings | None = None) -> dict[str, Any] | None:
        """The row stored at ``path`` if it was measured under ``settings`` (default these; marked as
        reused), else None."""
        if not os.path.lexists(path):
            return None
        stored = read_json_file(path, "a kept row")
        if not isinstance(stored.get("row"), dict):
            raise BenchError(f"a kept row: {path} holds no 'row' object; delete it to measure the row again")
        if normalised_settings(stored.get("settings")) != json.loads(
            json.dumps((settings or self.settings).model_dump())
        ):
            return None
        return {**stored["row"], "evaluation_reused": True}

    def write_row(self, path: Path, row: dict[str, Any], settings: Settings | None = None) -> None:
        """Store ``row`` with ``settings`` (default these), for a later ``--resume``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"settings": (settings or self.settings).model_dump(), "row": row}
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")

    def kept_dense_row(self) -> dict[str, Any]:
        """The dense row; with ``--keep``, stored in DIR/dense (without its speed) and, with ``--resume``,
        reused when it was measured under the same settings."""
        path = self.runs / DENSE / ROW_FILE
        stored = self.read_row(path) if self.resume else None
        if stored is not None:
            log(f"  reusing the dense row measured in {path.parent}")
            return stored
        row = self.dense_row()
        if self.keep:
            self.write_row(path, row)
        return row

    def finish_dense(self, row: dict[str, Any]) -> None:
        """The dense row's speed: the medians of its measurements in every pair (or its own if none ran)."""
        import statistics

        from benchmarks.speed import measure

        if not self.dense_speed:
            s = self.settings.speed
            (only,) = measure([(DENSE, self.dense, len(self.tokenizer))], s.rounds, s.prompt_len, s.new_tokens, s.batch)
            self.dense_speed.append((only["prefill_tokens_per_s"], only["decode_tokens_per_s"]))
        prefill = statistics.median(x[0] for x in self.dense_speed)
        decode = statistics.median(x[1] for x in self.dense_speed)
        row["speed"] = {
            "prefill_tokens_per_s": prefill,
            "decode_tokens_per_s": decode,
            "dense_prefill_tokens_per_s": prefill,
            "dense_decode_tokens_per_s": decode,
            "prefill_ratio": 1.0,
            "decode_ratio": 1.0,
        }

    def prepare(self, job: Job) -> tuple[dict[str, Any], list[str] | None, dict[str, Any] | None]:
        """The row's skeleton and the run's overrides, or a "not run"/"failed" row (overrides None)."""
        from slimkit.primitives.errors import SlimkitError
        from slimkit.recipes.loading import bundled_recipes, load_recipe

        row: dict[str, Any] = {
            "id": job.id,
            "recipe": job.name,
            **({"recipe_source": job.recipe} if job.label else {}),
            "ratio": job.ratio,
            "recovery": job.recovery,
            **({"seed": job.seed, "seed_of": job.group} if job.seed is not None else {}),
            "status": "ok",
        }
        if job.recipe not in bundled_recipes() and not Path(job.recipe).is_file():
            return {**row, "status": "not run", "reason": f"recipe '{job.recipe}' does not exist (yet)"}, None, None
        # Not strict: a row that misses its target (granularity, an explicit stage ratio) is still measured,
        # and flagged with the report's target.met.
        s = self.settings
        placement = [f"model.{k}={v}" for k, v in (("device", s.device), ("dtype", s.dtype)) if v != "auto"]
        overrides = [f"model={s.model}", *placement, f"target.ratio={job.ratio}", "target.strict=false", *job.overrides]
        try:
            recipe, _raw = load_recipe(job.recipe, overrides)
            lora = [i for i, s in enumerate(recipe.stages) if getattr(s, "stage", None) in RECOVERY_STAGES]
            if job.recovery and not lora:
                reason = "the recipe has no top-level lora stage (nor distill), so there is no recovery variant"
                return {**row, "status": "not run", "reason": reason}, None, None
            if not job.recovery:
                overrides += [f"stages.{i}.args.steps=0" for i in lora]
            recipe, raw = load_recipe(job.recipe, overrides)
        except SlimkitError as error:
            return {**row, "status": "failed", "reason": f"recipe does not load: {error}"}, None, None
        row.update(of=recipe.target.of, overrides=overrides, recovery_stages=lora)
        return row, overrides, raw

    def reusable(self, folder: Path, raw: dict[str, Any]) -> bool:
        """With ``--resume``: ``folder`` holds a finished run of exactly this recipe (after overrides)."""
        if not (self.resume and (folder / "report.json").is_file() and (folder / "model" / "recipe.yaml").is_file()):
            return False
        return read_yaml_file(folder / "model" / "recipe.yaml", "a kept recipe") == raw

    def stored_row(self, folder: Path, raw: dict[str, Any], settings: Settings | None = None) -> dict[str, Any] | None:
        """With ``--resume``: the row measured earlier on this run folder under the same settings, if any."""
        return self.read_row(folder / ROW_FILE, settings) if self.reusable(folder, raw) else None

    def compress(self, job: Job, overrides: list[str], raw: dict[str, Any]) -> tuple[Path, float | None, str | None]:
        """Run the recipe in its own process; ``(run folder, wall seconds or None if reused, error)``."""

        folder = self.runs / row_slug(job.id)
        if self.reusable(folder, raw):
            if read_run_report(folder) is not None:
                log(f"  reusing {folder}")
                return folder, None, None
            log(f"  compressing again: {folder / 'report.json'} is not a run report this code reads")
        # The old run's row goes with it: --force replaces only a folder holding nothing but a run's output.
        (folder / ROW_FILE).unlink(missing_ok=True)
        command = via_launcher(recipe_run(job.recipe, folder, ["--no-eval", "--force"], overrides))
        log_path = self.runs / f"{row_slug(job.id)}.log"
        code, wall = run_logged(command, log_path, self.thread_env)
        if code != 0:
            return folder, wall, f"slimkit recipe run exited with {code}: {last_line(log_path)}"
        return folder, wall, None

    def run_job(self, job: Job) -> dict[str, Any]:
        from slimkit.primitives.evaluate.counting import count_macs
        from slimkit.primitives.io import read_manifest

        row, overrides, raw = self.prepare(job)
        if overrides is None or raw is None:
            return row
        settings = self.settings.for_job(job)  # without zero-shot for a `zeroshot: false` entry
        if not job.zeroshot:
            row["zeroshot"] = "skipped (zeroshot: false in the grid)"
        stored = self.stored_row(self.runs / row_slug(job.id), raw, settings)
        if stored is not None:
            log(f"  reusing the row measured on {self.runs / row_slug(job.id)}")
            if "placement" not in stored:  # rows stored before rows recorded it: their run's report has it
                report = read_run_report(self.runs / row_slug(job.id))
                stored["placement"] = report.placement.model_dump() if report is not None else None
            speed = stored.get("speed") or {}
            if speed.get("dense_prefill_tokens_per_s") and speed.get("dense_decode_tokens_per_s"):
                # the dense model's measurements in that row's pair count towards the dense row's speed
                self.dense_speed.append((speed["dense_prefill_tokens_per_s"], speed["dense_decode_tokens_per_s"]))
            return stored
        if self.reuse_only:
            reason = f"no row measured under these settings in {self.runs} (--reuse-only)"
            return {**row, "status": "not run", "reason": reason}
        folder, wall, error = self.compress(job, overrides, raw)
        if error:
            return {**row, "status": "failed", "reason": error}
        report = read_run_report(folder)
        if report is None:
            return {**row, "status": "failed", "reason": f"{folder / 'report.json'} is not a slimkit run report"}
        manifest = read_manifest(folder / "model") or {}
        stored = report.as_json()
        timings = report.timings_s.stages
        row.update(
            {
                "achieved": report.target.achieved,
                "target_met": report.target.met,
                "params": {k: v for k, v in stored["params"].items() if k != "by_part_before"},
                "macs": stored["macs"],
                "cost": {
                    "compress_s": report.timings_s.compress_seconds(),
                    "stages_s": {k: v for k, v in timings.items() if not k.startswith("eval:")},
                    "process_wall_s": wall,
                    "reused": wall is None,
                    "peak_rss_mb": report.peak_rss_mb,
                    "calibration": report.calibration,
                    "extra_calibration_tokens": report.stage_sum("calibration_tokens"),
                    "recovery_tokens": report.stage_sum("training_tokens", tuple(RECOVERY_STAGES)),
                },
                "stages": stored["stages"],
                "notes": report.notes,
                "placement": stored["placement"],
                "versions": report.versions,
                "run_folder": str(folder) if self.keep else None,
            }
        )
        model = None
        try:
            model, _tokenizer = self.load(str(folder / "model"))
            metrics, details, seconds = self.evaluate(model, eval_config(settings))
            # counted here, on the saved model, so a reused run folder is counted by this code too
            row["macs"] = {**(row["macs"] or {}), "after": count_macs(model, MACS_SEQ_LEN), "seq_len": MACS_SEQ_LEN}
            reported = report.stage_sum("params_added")
            row["structure"] = {
                "residual_params": reported if reported is not None else residual_params_in_model(model),
                "residual_source": "stage report" if reported is not None else "model",
                "lowrank_params": lowrank_params(model),
            }
            row["metrics"], row["evaluation"], row["eval_s"] = metrics, details, seconds
            row["layers"] = {
                "widths": layer_widths(model, manifest.get("layer_widths") or stored["layers"]["after"]),
                "params": layer_params(model),
                "dense_params": self.dense_layer_params,
            }
            row["speed"] = self.speed(job.id, model)
        except Exception as exc:  # a saved model that does not load or evaluate is a failed row, not a crash
            row.update(status="failed", reason=f"evaluation: {type(exc).__name__}: {exc}"[:300])
        del model
        gc.collect()
        if not self.keep:
            discard(folder / "model")
        elif row["status"] == "ok":  # --resume continues an interrupted grid without measuring this row again
            self.write_row(folder / ROW_FILE, row, settings)
        return row
