"""``distill`` (model scope): recovery trained against the dense teacher's logits (KL): LoRA adapters merged into the
weights, or (``adapter: none``) every weight, replicated or sharded over the launched processes (``sharding: fsdp``).

The ``lora`` stage with its loss replaced: the same arguments and budget, so a ``distill`` row and a ``lora`` row
compare at equal steps and tokens. The teacher (``teacher: dense``) is the recipe's model, reloaded from its source
for the stage: on the student's device by default, whole on every process (or on ``teacher_device``, offloaded
within ``teacher_max_memory``, or sharded with the student: ``teacher_sharding``). A teacher that cannot be loaded is
one error line. With ``tokens``, it trains through the token-budgeted loop (validation,
checkpoints, resume). It removes no parameters (budget ``none``) and trains (refused with float16 weights).

Method note: docs/methods/finetune-lora-distill.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from torch import nn

from slimkit.engine.context import Context
from slimkit.engine.processes import launched_world
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.engine.stage_memory import MemoryInputs
from slimkit.primitives.arch.view import ModelView
from slimkit.primitives.datasets.data_paths import cache_root
from slimkit.primitives.device.memory_model import (
    FLOAT32,
    ModelShape,
    StageMemory,
    full_training_bytes,
    gathered_params,
    gathered_unit_bytes,
    weights_bytes,
)
from slimkit.primitives.device.placement import parse_size
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune import LoraConfig, lora_recover
from slimkit.primitives.finetune.distill import DistillConfig, distill_recover
from slimkit.primitives.finetune.recovery import DistillationObjective
from slimkit.primitives.finetune.sharding import shard_frozen
from slimkit.primitives.finetune.teacher_cache import TopKCache, TopKDistillationObjective, teacher_fingerprint
from slimkit.recipes.schema import DeviceName, Recipe, SizeText
from slimkit.recipes.stage_args import ReadsData
from slimkit.stages.dense_source import dense_of, release_memory, reload_dense
from slimkit.stages.lora import LoraArgs, lora_config
from slimkit.stages.recovery_settings import run_token_budget

PROJECTING_STAGES = ("pca_project", "pca_project_post")
TRAINING = ("adapter", "sharding", "teacher_sharding")
"""What trains and how it is spread (not LoRA's settings)."""
TEACHER = ("teacher", "top_k", "teacher_device", "teacher_max_memory")
"""Which teacher and where it runs (not LoRA's settings)."""
LORA_ONLY = ("rank", "alpha", "dropout", "target_modules")
"""The adapters' settings (refused with ``adapter: none``, which trains no adapters)."""


class DistillArgs(LoraArgs, ReadsData):
    temperature: float = Field(1.0, gt=0)
    """Softmax temperature T of both models' logits (> 0, finite); the KL is multiplied by T**2."""
    hidden_weight: float = Field(0.0, ge=0.0)
    """Weight of the hidden-state term (per-layer squared error / teacher's mean squared norm); 0: logits only."""
    teacher: Literal["dense"] = "dense"
    """The teacher: dense = the recipe's model source reloaded (the uncompressed model)."""
    top_k: int | None = Field(None, ge=1)
    """Offline teacher (tokens only): the teacher's top_k logits per token, computed once per window and cached on
    disk (keyed by the teacher's weights, the window and k), reused by later runs; the KL is over those k tokens and
    the teacher is loaded only when a window is not cached. None: the full logits, online. Not with hidden_weight."""
    adapter: Literal["lora", "none"] = "lora"
    """What trains: lora = LoRA adapters (rank, alpha, dropout, target_modules), merged into the weights at the end;
    none = every weight of the student (full-parameter distillation; tokens only): trained in float32 (a bfloat16
    model's forward passes under bfloat16 autocast) and cast back to the model's dtype."""
    teacher_device: DeviceName | None = None
    """Where the dense teacher runs: None = the student's device; cpu; cuda:N (a GPU of its own, beside the student's;
    one process only). Its logits are moved to the student's device for the loss."""
    teacher_max_memory: SizeText | None = None
    """Offload the teacher: at most this much of its weights on its device (e.g. 4GiB), its other decoder layers in
    CPU memory (on a GPU) or on disk (on a CPU), moved in layer by layer for each forward (accelerate's hooks): less
    device memory, slower steps. None: the whole teacher on its device."""
    sharding: Literal["none", "fsdp"] = "none"
    """How the student is spread over the processes of torchrun / accelerate launch: none = a whole copy on each
    (gradients all-reduced); fsdp = each process holds 1/N of every float32 weight, gradient and AdamW moment (torch
    FSDP2, one unit per decoder layer; needs adapter: none and several launched processes). The teacher stays whole
    on each process unless teacher_sharding: fsdp."""
    teacher_sharding: Literal["none", "fsdp"] = "none"
    """none = a whole teacher on each process (its forward needs no communication); fsdp = the online teacher
    sharded like the student, 1/N of its weights on each process and every layer gathered for each forward (less
    memory, an all-gather of the teacher per micro-batch: for a teacher that does not fit beside the student's
    shards). Needs sharding: fsdp; not with top_k, teacher_device or teacher_max_memory."""

    @model_validator(mode="after")
    def _top_k_needs_tokens(self) -> DistillArgs:
        if self.top_k is not None and self.tokens is None:
            raise ValueError("top_k: only with tokens (the token-budgeted loop); set tokens")
        if self.top_k is not None and self.hidden_weight > 0:
            raise ValueError("top_k and hidden_weight: the cached teacher keeps logits only; set hidden_weight: 0")
        return self

    @field_validator("teacher_device")
    @classmethod
    def _teacher_device(cls, value: str | None) -> str | None:
        if value == "auto":
            raise ValueError("a device: cpu, cuda or cuda:N (unset: the student's)")
        return value

    @model_validator(mode="after")
    def _full_parameters(self) -> DistillArgs:
        if self.adapter == "none":
            fields = type(self).model_fields
            given = [name for name in LORA_ONLY if getattr(self, name) != fields[name].default]
            if given:
                raise ValueError(f"{', '.join(given)}: LoRA's settings; adapter: none trains every weight, no adapters")
            if self.tokens is None and self.trains():
                raise ValueError("adapter: none: only with tokens (the token-budgeted loop); set tokens")
        if self.teacher_sharding == "fsdp":
            if self.sharding != "fsdp":
                raise ValueError("teacher_sharding: fsdp needs sharding: fsdp (the teacher sharded beside the student)")
            placed = [name for name in ("top_k", "teacher_device", "teacher_max_memory") if getattr(self, name)]
            if placed:
                raise ValueError(f"teacher_sharding: fsdp shards the online teacher; {placed[0]} places it otherwise")
        if self.sharding == "fsdp" and self.adapter != "none":
            raise ValueError(
                "sharding: fsdp shards a student trained whole; set adapter: none (LoRA adapters are small enough to "
                "replicate: sharding: none)"
            )
        return self

    def check_model(self, model: Any) -> None:
        """LoRA's checks; a teacher on a GPU of its own in one process only; with ``sharding: fsdp`` several
        launched processes and the student on one device."""
        if self.adapter == "lora":
            super().check_model(model)
        if not self.trains():
            return
        world = launched_world()
        if world > 1 and (self.teacher_device or "").startswith("cuda"):
            raise SlimkitError(
                f"distill: teacher_device {self.teacher_device} would put every launched process's teacher on one GPU; "
                "leave it unset (each process's own device) or set teacher_max_memory to offload it"
            )
        if self.sharding != "fsdp":
            return
        if world < 2:
            raise SlimkitError(
                "distill: sharding: fsdp shards the student over launched processes and this run is one process; "
                "launch it with torchrun --nproc-per-node N or accelerate launch --num-processes N, or set "
                "sharding: none"
            )
        devices = set((getattr(model, "hf_device_map", None) or {}).values())
        if len(devices) > 1:
            raise SlimkitError(
                f"distill: sharding: fsdp needs the whole student on each process's device; it is spread over "
                f"{', '.join(sorted(map(str, devices)))} (model.max_memory / several GPUs per process): remove that"
            )

    def shards_teacher(self) -> bool:
        """Whether the teacher is sharded over the processes (``teacher_sharding: fsdp``)."""
        return self.teacher_sharding == "fsdp"

    def reloads_dense(self) -> bool:
        return self.trains()  # the teacher is loaded only to train against

    def check_source(self, recipe: Recipe, source: dict[str, Any]) -> None:
        super().check_source(recipe, source)  # the training data (recovery_settings)
        check_hidden_term(recipe, source, self)

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """LoRA's training memory and the dense teacher's weights (offloaded: within ``teacher_max_memory`` and one
        layer; sharded: this process's share and what it holds gathered; on a ``teacher_device`` other than the
        planned one: not counted there). With ``adapter: none``, every weight's float32 training state instead of the
        adapters, per device (divided among the launched processes under ``sharding: fsdp``, with what a sharded
        model holds gathered); that state replaces the model's own weights, which the stage releases while it
        trains. A sharded student's end, when it is larger: the whole model gathered back in its dtype beside this
        process's float32 shards and the teacher."""
        memory = super().memory(stage, inputs)
        weights = weights_bytes(inputs.shape, inputs.dtype_bytes)  # the student's own, and the dense teacher's
        if self.adapter == "none":
            del memory.parts["adapters"]
            world = launched_world() if self.sharding == "fsdp" else 1
            params = inputs.shape.total_params()
            memory.parts["student training"] = full_training_bytes(params, world)
            memory.released = weights
            if self.sharding == "fsdp":
                memory.parts["gathered units"] = gathered_unit_bytes(inputs.shape, inputs.dtype_bytes)
            memory.advice = f"{memory.advice}, or shard the student over more processes (sharding: fsdp)"
        # counted even for a cached top_k teacher, which a cache miss loads
        if self.shards_teacher():  # this process's shards, the root and two layers gathered, in the teacher's dtype
            gathered = gathered_params(inputs.shape) * inputs.dtype_bytes
            memory.parts["teacher"] = -(-weights // launched_world()) + gathered
        elif same_device(self.teacher_device, inputs.device):
            memory.parts["teacher"] = teacher_bytes(inputs.shape, weights, self.teacher_max_memory)
        tokens = (self.micro_batch_size or self.batch_size) * self.seq_len
        memory.parts["logits"] = 2 * tokens * inputs.shape.vocab * inputs.dtype_bytes  # the student's and the teacher's
        if self.adapter == "none" and self.sharding == "fsdp":
            end = {"float32 shards while gathering back": -(-params // world) * FLOAT32}
            if "teacher" in memory.parts:
                end["teacher"] = memory.parts["teacher"]
            if sum(end.values()) > memory.net:
                memory.parts, memory.released = end, 0
        return memory


def same_device(teacher_device: str | None, device: str | None) -> bool:
    """Whether the teacher shares the planned device: unset, the plan's device not known, or the same device
    (``cuda`` is ``cuda:0``)."""
    if teacher_device is None or device is None:
        return True
    return normal_device(teacher_device) == normal_device(device)


def normal_device(name: str) -> str:
    return "cuda:0" if name == "cuda" else name


def teacher_bytes(shape: ModelShape, weights: int, max_memory: str | None) -> int:
    """The teacher's weights on its device: all of them, or offloaded within ``max_memory`` plus the decoder layer
    moved in for its forward."""
    if max_memory is None:
        return weights
    layer = weights * shape.layer_params() // max(shape.total_params(), 1)
    return min(weights, parse_size(max_memory, "teacher_max_memory") + layer)


def check_hidden_term(recipe: Recipe, source: dict[str, Any], args: DistillArgs) -> None:
    """The hidden-state term compares residual streams coordinate by coordinate: refuse it after a PCA projection
    (the student's stream is in another basis, even at full width), in this recipe or in an earlier run that made
    the input model (``source["compressed_from"]["stages"]``). The runner calls it before any compute."""
    if args.hidden_weight <= 0:
        return
    projected = [s.stage for s in recipe.flat_stages() if s.stage in PROJECTING_STAGES]
    if projected:
        raise SlimkitError(
            f"distill: hidden_weight > 0 compares hidden states with the dense teacher's, but this recipe's "
            f"{projected[0]} stage changes the hidden-state basis; set hidden_weight: 0"
        )
    earlier = [name for name in (source.get("compressed_from") or {}).get("stages", []) if name in PROJECTING_STAGES]
    if earlier:
        raise SlimkitError(
            f"distill: hidden_weight > 0 compares hidden states with the dense teacher's, but the input model "
            f"was made by a {earlier[0]} stage, which changes the hidden-state basis; set hidden_weight: 0"
        )


def load_teacher(ctx: Context, args: DistillArgs) -> tuple[nn.Module, dict[str, object]]:
    """The dense teacher in the student's dtype (on the student's device, or ``teacher_device``; offloaded within
    ``teacher_max_memory``), and what the report records about it."""
    if ctx.recipe.task is not None:
        raise SlimkitError(
            f"distill: needs a causal language model's logits; this recipe makes a {ctx.recipe.task} task model"
        )
    dense = reload_dense(
        ctx,
        "distill",
        what="dense teacher",
        device=args.teacher_device,
        max_memory=args.teacher_max_memory,
        why="teacher: dense",
        instead="use the lora stage",
        holds="the stage holds two models at once: the teacher needs about {need} beside the student",
    )
    info = {
        "teacher": "dense",
        "teacher_device": args.teacher_device or "the student's",
        "teacher_offloaded": args.teacher_max_memory is not None,
        "teacher_source": dense.source,
        "teacher_load_seconds": dense.load_seconds,
        "teacher_weights": dense.weights,
    }
    return dense.model, info


@register_stage(
    "distill",
    args=DistillArgs,
    trains=True,
    paper="LoRA recovery by knowledge distillation (Hinton et al. 2015 KL at temperature T) from the dense model",
)
class Distill:
    """Recover by matching the dense teacher's logits (KL): LoRA adapters merged into the weights, or every weight."""

    def run_model(self, ctx: Context, args: DistillArgs) -> StageResult:
        return distill(ctx, args)


def distill(ctx: Context, args: DistillArgs) -> StageResult:
    """The distillation on ``ctx.model``: steps 0 (no teacher), the offline top-k teacher, or the teacher alongside."""
    config = lora_config(ctx, args, exclude={"temperature", "hidden_weight", *TEACHER, *TRAINING})
    settings = DistillConfig(temperature=args.temperature, hidden_weight=args.hidden_weight)
    if config.steps == 0:  # nothing to train (a "without recovery" row): the teacher is not loaded
        ctx.model, report = lora_recover(ctx.model, ctx.tokenizer, config)
        skipped: dict[str, Any] = {
            "kl_first": None,
            "kl_last": None,
            "kls": [],
            "teacher": args.teacher,
            "teacher_load_seconds": 0.0,
        }
        return StageResult({**report, **skipped, "note": "steps 0: no training, teacher not loaded"})
    if args.top_k is not None:
        return distill_offline(ctx, args, config)
    teacher, info = load_teacher(ctx, args)
    cuda = any(p.device.type == "cuda" for p in teacher.parameters())
    try:
        if args.tokens is not None:
            objective = DistillationObjective(teacher, settings.temperature, settings.hidden_weight)
            teacher.eval()
            teacher.requires_grad_(False)
            if args.shards_teacher():
                shard_frozen(teacher, list(ModelView(teacher).layer_list))
            info["teacher_sharded"] = args.shards_teacher()
            lora, units = trained(ctx, args, config)
            ctx.model, report, artifacts = run_token_budget(
                ctx, "distill", args, lora, objective, "distill training", units
            )
            return StageResult({**report, **info}, artifacts=artifacts)
        with ctx.tracker.task("distill", config.steps) as advance:
            ctx.model, report = distill_recover(
                ctx.model, teacher, ctx.tokenizer, config, settings, progress=lambda _step: advance(1)
            )
    finally:
        del teacher
        release_memory(cuda)
    return StageResult({**report, **info})


def trained(ctx: Context, args: DistillArgs, config: LoraConfig) -> tuple[LoraConfig | None, list[nn.Module] | None]:
    """What the token-budgeted loop trains: ``(config, None)``: LoRA adapters; ``(None, None)``: every weight,
    replicated; ``(None, decoder layers)``: every weight, sharded with the layers as FSDP units."""
    if args.adapter == "lora":
        return config, None
    return None, list(ctx.view.layer_list) if args.sharding == "fsdp" else None


def distill_offline(ctx: Context, args: DistillArgs, config: LoraConfig) -> StageResult:
    """The token-budgeted distillation on cached top-k teacher logits; the teacher is loaded on the first window the
    cache does not hold, and freed at the end."""
    path = dense_of(ctx.source).get("path")
    if path is None:
        raise SlimkitError("distill: top_k keys its cached logits by the teacher's folder; this run has none")
    loaded: dict[str, object] = {}

    def load() -> nn.Module:
        teacher, info = load_teacher(ctx, args)
        loaded.update(info)
        return teacher

    if args.top_k is None:
        raise SlimkitError("distill: the offline teacher needs top_k")
    cache = TopKCache(cache_root() / "teacher-topk", teacher_fingerprint(path), args.top_k, load)
    objective = TopKDistillationObjective(cache, args.temperature)
    cuda = False
    try:
        lora, units = trained(ctx, args, config)
        ctx.model, report, artifacts = run_token_budget(
            ctx, "distill", args, lora, objective, "distill training", units
        )
        cuda = cache.teacher is not None and any(p.device.type == "cuda" for p in cache.teacher.parameters())
    finally:
        cache.release()
        release_memory(cuda)
    if (note := cache.note("distill")) is not None:
        ctx.notes.append(note)
    teacher: dict[str, Any] = {"teacher": "dense", "top_k": args.top_k, "cached_windows_read": cache.hits}
    teacher.update(windows_computed=cache.misses, teacher_load_seconds=loaded.get("teacher_load_seconds", 0.0))
    return StageResult({**report, **teacher}, artifacts=artifacts)
