"""The ``search`` stage's passes over the dense model: the block library built and scored layer by layer, and the
chosen candidates applied (:mod:`slimkit.stages.search` runs them).

The library pass runs the model as it is when the stage starts layer by layer on the calibration batches (less the
held-out ones, :func:`~slimkit.engine.allocation_prepass.dense_layer_statistics`); at each layer every candidate is
read from the store or built from that layer's dense statistics (:mod:`slimkit.primitives.search.build`), scored
against the dense model's log-probabilities on the held-out batches and dropped, so one candidate's tensors are alive
at a time. The apply pass puts each chosen candidate in place of its parent, from the store or built again on the
same dense statistics (the layer's dense outputs feed the next layer before it changes), so the searched model and a
rerun of the written recipe hold the same bits.

Method note: docs/methods/search.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from slimkit.engine.allocation_prepass import dense_layer_statistics
from slimkit.engine.context import Context
from slimkit.engine.layerwise import layer_statistics
from slimkit.primitives.allocate.fitness import dense_log_probs
from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.moe import MoEBlock, moe_blocks, moe_spec
from slimkit.primitives.calibration import capture_layer_inputs, run_layer
from slimkit.primitives.device.offload import resident
from slimkit.primitives.experts.routed import ExpertWeights
from slimkit.primitives.experts.routers import route
from slimkit.primitives.search.build import BuildSettings, LayerEvidence, apply_record, build_candidate
from slimkit.primitives.search.candidates import CandidateSpec, Part, layer_specs, refused_kinds
from slimkit.primitives.search.costs import MemoryAt, memory_removed
from slimkit.primitives.search.digest import RollingDigest, settings_key
from slimkit.primitives.search.prefix import record_layer_inputs
from slimkit.primitives.search.record import CandidateRecord
from slimkit.primitives.search.scores import candidate_kl
from slimkit.primitives.search.store import LibraryStore
from slimkit.primitives.search.target_levels import with_target_levels
from slimkit.stages.search_args import SearchArgs


@dataclass
class Scored:
    """One candidate of the library: where it goes, its key, its score and its costs (no tensors)."""

    layer: int
    spec: CandidateSpec
    key: str
    kl: float = 0.0
    removed: dict[str, int] = field(default_factory=dict)
    removed_bytes: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    parent_kv_heads: int = 0

    def memory(self, at: MemoryAt) -> int:
        """Bytes of memory it removes at ``at``."""
        dropped = self.parent_kv_heads - self.kv_heads
        return memory_removed(self.spec.part, self.removed_bytes, dropped, self.head_dim, at)


@dataclass
class LibraryCost:
    """What the library cost: per layer, its candidates and seconds (built / read, scored); the store's hits."""

    layers: dict[int, dict[str, float]] = field(default_factory=dict)
    built: int = 0
    read: int = 0
    scores_measured: int = 0
    scores_read: int = 0
    skipped: list[str] = field(default_factory=list)
    """Candidates left unscored when the time limit ran out."""


@contextmanager
def expert_counts(model: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Inside: how often each routed expert of each MoE layer is picked, counted as the layers run."""
    counts: dict[int, torch.Tensor] = {}
    blocks = moe_blocks(model) if moe_spec(model) is not None else []

    def hook(block: MoEBlock) -> Callable[[nn.Module, tuple, Any], None]:
        index, experts = block.index, block.num_experts

        def count(_module: nn.Module, args: tuple, _output: Any) -> None:
            # recomputed from the router's input by the family's rule (routers return different tuples)
            x = args[0].reshape(-1, args[0].shape[-1])
            picked = route(ExpertWeights.of(block).rule, x).index.reshape(-1).to("cpu")
            counts[index] = counts.get(index, torch.zeros(experts)) + torch.bincount(picked, minlength=experts)

        return count

    handles = [b.router.register_forward_hook(hook(b)) for b in blocks]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def split_batches(ctx: Context, args: SearchArgs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The calibration batches the library is built on, and the held-out ones it is scored on (the last ones)."""
    batches = ctx.calibration_batches()
    held = args.holdout
    return batches[:-held], batches[-held:]


def candidate_key(digest: RollingDigest, layer: int, spec: CandidateSpec, build: BuildSettings, batch: int) -> str:
    """The store's key of a candidate: everything it is computed from."""
    return settings_key(
        {"layers": digest.layer_key(layer), "batch": batch, "candidate": f"{spec.part}/{spec.name}", **asdict(build)}
    )


def _evidence(layer_index: int, stats: Mapping, counts: Mapping[int, torch.Tensor]) -> LayerEvidence:
    return LayerEvidence(stats["input_norms"], stats.get("dense_consumers") or {}, counts.get(layer_index))


def build_settings(args: SearchArgs) -> BuildSettings:
    return BuildSettings(damping=args.damping, toward=args.toward)


@dataclass
class _Pass:
    """What the library pass shares across layers."""

    ctx: Context
    args: SearchArgs
    store: LibraryStore
    digest: RollingDigest
    build: BuildSettings
    batch: int
    held: list[torch.Tensor]
    dense: list[torch.Tensor]
    hidden: list[list[torch.Tensor]]
    cost: LibraryCost
    deadline: float | None

    def key(self, index: int, spec: CandidateSpec) -> str:
        return candidate_key(self.digest, index, spec, self.build, self.batch)

    def score_key(self, key: str) -> str:
        return settings_key(
            {"model": self.digest.model_key(), "held_out": self.args.holdout, "batch": self.batch, "candidate": key}
        )

    def record(self, index: int, spec: CandidateSpec, evidence: Callable[[], LayerEvidence]) -> CandidateRecord | None:
        """The candidate from the store, else built (and stored); None when it is its parent."""
        key = self.key(index, spec)
        record = self.store.read_candidate(key)
        if record is not None:
            self.cost.read += 1
            return record
        record = build_candidate(self.ctx.model, index, spec, evidence(), self.build)
        if record is not None:
            self.store.write_candidate(key, record)
            self.cost.built += 1
        return record

    def score(self, record: CandidateRecord, key: str) -> float:
        score_key = self.score_key(key)
        kl = self.store.read_score(score_key)
        if kl is not None:
            self.cost.scores_read += 1
            return kl
        kl = candidate_kl(self.ctx.model, record, self.held, self.dense, self.hidden[record.layer])
        self.store.write_score(score_key, kl)
        self.cost.scores_measured += 1
        return kl

    def layer_slots(
        self, index: int, specs: list[CandidateSpec], evidence: Callable[[], LayerEvidence]
    ) -> list[list[Scored]]:
        """One layer's slots: each present sub-block's parent and its candidates, each scored."""
        start = time.perf_counter()
        parent_kv = self.ctx.view.layer(index).num_kv_heads
        by_part: dict[Part, list[Scored]] = {}
        built = scored = 0.0
        for spec in specs:
            key = self.key(index, spec)
            entry = Scored(index, spec, key, parent_kv_heads=parent_kv, kv_heads=parent_kv)
            if spec.kind != "dense":
                if self.deadline is not None and time.perf_counter() > self.deadline:
                    self.cost.skipped.append(f"{index}.{spec.part}/{spec.name}")
                    continue
                tick = time.perf_counter()
                record = self.record(index, spec, evidence)
                built += time.perf_counter() - tick
                if record is None:  # the same as its parent (a factorisation keeping every matrix dense)
                    continue
                tick = time.perf_counter()
                entry.kl = self.score(record, key)
                scored += time.perf_counter() - tick
                entry.removed, entry.removed_bytes = record.removed, record.removed_bytes
                entry.kv_heads, entry.head_dim = record.kv_heads, record.head_dim
                del record
            by_part.setdefault(spec.part, []).append(entry)
        self.hidden[index] = []
        row = self.cost.layers[index] = {
            "candidates": sum(len(v) - 1 for v in by_part.values()),
            "build_seconds": round(built, 3),
            "score_seconds": round(scored, 3),
            "seconds": round(time.perf_counter() - start, 3),
        }
        self.ctx.tracker.log(
            f"search: layer {index}: {row['candidates']} candidates, {row['build_seconds']:.1f} s built or read, "
            f"{row['score_seconds']:.1f} s scored"
        )
        return [by_part[part] for part in ("attention", "mlp") if part in by_part]


def _given(evidence: LayerEvidence) -> LayerEvidence:
    return evidence


def _on_demand(ctx: Context, args: SearchArgs, index: int, counts: Mapping[int, torch.Tensor]) -> LayerEvidence:
    """Layer ``index``'s dense statistics from a pass of its own (a stored candidate of a layer after the pass's
    last turned out damaged)."""
    fit, _held = split_batches(ctx, args)
    for layer, stats in dense_layer_statistics(ctx, fit, args.refit_roles(), index):
        if layer.index == index:
            return _evidence(index, stats, counts)
    raise AssertionError("the statistics pass ended before its last layer")


def library_pass(
    ctx: Context, args: SearchArgs, store: LibraryStore, deadline: float | None
) -> tuple[list[list[Scored]], LibraryCost, list[torch.Tensor]]:
    """Every layer's candidates, built or read, each scored alone (see the module docstring): one slot per present
    sub-block of every layer, its parent first; what it cost; the dense log-probabilities on the held-out batches.
    The dense statistics pass runs only as far as the last layer with a candidate the store lacks."""
    model = ctx.model
    fit, held = split_batches(ctx, args)
    view = ctx.view
    digest = RollingDigest(model, list(view.layer_list), torch.cat(ctx.calibration_batches()))
    batch = ctx.calibration_batches()[0].shape[0]
    dense = dense_log_probs(model, held)
    work = _Pass(
        ctx, args, store, digest, build_settings(args), batch, held, dense, record_layer_inputs(model, held),
        LibraryCost(), deadline,
    )  # fmt: skip
    align = ctx.recipe.target.multiples(["mlp_channel", "attention_head", "kv_group"])
    refused = refused_kinds(model)
    for kind, reason in sorted(refused.items()):
        if kind in args.candidates.kinds():
            ctx.notes.append(f"search: no {kind} candidates ({reason})")
    specs = {i: layer_specs(model, i, args.candidates, align, refused) for i in range(view.num_layers)}
    if args.uniform and args.candidates.target_levels:
        wanted, part = ctx.params_to_remove(), ctx.recipe.target.part
        specs = with_target_levels(model, specs, args.uniform, wanted, align, part, work.build)
    missing = [
        i
        for i, found in specs.items()
        if any(s.kind != "dense" and not store.has_candidate(work.key(i, s)) for s in found)
    ]
    last = max(missing, default=-1)
    statistics = iter(dense_layer_statistics(ctx, fit, args.refit_roles(), last)) if last >= 0 else iter(())
    slots: list[list[Scored]] = []
    with expert_counts(model) as counts, ctx.tracker.task("search: library", view.num_layers) as advance:
        for index in range(view.num_layers):
            if index <= last:
                _layer, stats = next(statistics)
                evidence = _evidence(index, stats, counts)
                slots += work.layer_slots(index, specs[index], partial(_given, evidence))
                del stats, evidence
            else:
                slots += work.layer_slots(index, specs[index], partial(_on_demand, ctx, args, index, counts))
            advance(1)
    return slots, work.cost, dense


def apply_choice(
    ctx: Context, args: SearchArgs, choice: Mapping[tuple[int, str], CandidateSpec], store: LibraryStore
) -> dict[str, int]:
    """Put each chosen candidate in place of its parent: read from the store where it is there (by the key it had
    when the library was built), else built again on the dense statistics in one more pass. Returns how many were
    read and built."""
    model = ctx.model
    build = build_settings(args)
    batch = ctx.calibration_batches()[0].shape[0]
    view = ctx.view
    digest = RollingDigest(model, list(view.layer_list), torch.cat(ctx.calibration_batches()))
    keys = {where: candidate_key(digest, where[0], spec, build, batch) for where, spec in choice.items()}
    wanted = {where: spec for where, spec in choice.items() if spec.kind != "dense"}
    records: dict[tuple[int, str], CandidateRecord] = {}
    for where in wanted:
        record = store.read_candidate(keys[where])
        if record is not None and record.spec == wanted[where] and record.layer == where[0]:
            records[where] = record
    missing = [where for where in wanted if where not in records]
    done = {"read": len(records), "built": 0}
    if not missing:
        for record in records.values():
            apply_record(model, record)
        return done
    fit, _held = split_batches(ctx, args)
    last = max(where[0] for where in missing)
    with expert_counts(model) as counts:
        for layer, stats in dense_layer_statistics(ctx, fit, args.refit_roles(), ModelView(model).num_layers - 1):
            here = sorted(where for where in wanted if where[0] == layer.index)
            for where in here:
                record = records.pop(where, None)
                if record is None:
                    record = build_candidate(
                        model, where[0], wanted[where], _evidence(layer.index, stats, counts), build
                    )
                    if record is None:
                        continue
                    done["built"] += 1
                    store.write_candidate(keys[where], record)
                apply_record(model, record)
            if layer.index >= last and not records:
                break
    for record in records.values():  # chosen layers after the last one built again
        apply_record(model, record)
    return done


def apply_sequential(
    ctx: Context, args: SearchArgs, choice: Mapping[tuple[int, str], CandidateSpec], store: LibraryStore
) -> dict[str, int]:
    """Each chosen candidate made again layer by layer on the inputs the layers before it (already replaced) give
    it, refit against its parent's outputs there (as ``reconstruct`` refits inside ``sequential``); read from the
    store where it was made before from the same model and inputs. Returns how many were read and built."""
    model = ctx.model
    build = build_settings(args)
    batch = ctx.calibration_batches()[0].shape[0]
    view = ctx.view
    digest = RollingDigest(model, list(view.layer_list), torch.cat(ctx.calibration_batches()))
    wanted = {where: spec for where, spec in choice.items() if spec.kind != "dense"}
    done = {"read": 0, "built": 0}
    if not wanted:
        return done
    fit, _held = split_batches(ctx, args)
    last = max(layer for layer, _part in wanted)
    inputs = capture_layer_inputs(model, view.layer(0).module, fit)
    names = {id(module): name for name, module in model.named_modules()}
    with expert_counts(model) as counts:
        for layer in view.layers[: last + 1]:
            here = sorted(where for where in wanted if where[0] == layer.index)
            with resident(model, names[id(layer.module)], layer.module):
                keys = {where: candidate_key(digest, layer.index, wanted[where], build, batch) for where in here}
                records = {where: store.read_candidate(keys[where]) for where in here}
                evidence = None
                if any(record is None for record in records.values()):
                    stats, _outputs = layer_statistics(view, layer, inputs, args.refit_roles())
                    evidence = _evidence(layer.index, stats, counts)
                for where in here:
                    record = records[where]
                    if record is None and evidence is not None:
                        record = build_candidate(model, layer.index, wanted[where], evidence, build)
                        if record is not None:
                            store.write_candidate(keys[where], record)
                            done["built"] += 1
                    elif record is not None:
                        done["read"] += 1
                    if record is not None:
                        apply_record(model, record)
                if layer.index < last:
                    inputs.hidden = run_layer(ctx.view.layer(layer.index).module, inputs)
    return done


__all__ = [
    "LibraryCost",
    "Scored",
    "apply_choice",
    "apply_sequential",
    "build_settings",
    "library_pass",
    "split_batches",
]
