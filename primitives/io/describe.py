"""What a model (folder) holds and who can read it: the logic behind ``slimkit inspect``.

Method note: docs/methods/saved-folders.md.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from slimkit.primitives.arch import ARCH_SPECS, LINEAR_ROLES, ArchSpec, ModelView
from slimkit.primitives.arch.head_widths import HeadWidths
from slimkit.primitives.arch.support import compression_support
from slimkit.primitives.io.compat import SLIMKIT_MODEL_TYPE, is_marked, structure_reasons, unmark_config
from slimkit.primitives.io.folder import read_json_object
from slimkit.primitives.io.save import MANIFEST_NAME, layer_hidden_size
from slimkit.primitives.lowrank.module import KIND as LOW_RANK_KIND
from slimkit.primitives.lowrank.module import lowrank_entries
from slimkit.primitives.projection.adapters import KIND as BASIS_CHANGE_KIND
from slimkit.primitives.projection.manifest import RMS_NORM_KIND, projection_entries

_HOOK_WORDS = {
    "input": "input of",
    "output": "output of",
    "residual": "residual input of",
    "branch": "residual branch of",
}


@dataclass(frozen=True)
class ResidualMap:
    """A residual / basis-change matrix: ``y = W x`` with ``W`` of shape ``(out, in)``."""

    path: str
    layer: int | None
    """The layer the map sits in (its host is the layer or inside it), None outside the layers."""
    host: str
    hook: str
    shape: tuple[int, int]

    @property
    def where(self) -> str:
        return f"{_HOOK_WORDS.get(self.hook, self.hook)} {self.host}"

    def short(self) -> str:
        """``input 48->40`` style, for a per-layer table cell."""
        return f"{self.hook} {self.shape[1]}->{self.shape[0]}"


@dataclass
class Structure:
    """What a model holds beyond stock Hugging Face modules (from manifest records)."""

    ranks: dict[int, dict[str, int]] = field(default_factory=dict)
    """Per layer, the rank of each low-rank pair by projection role (``q``, ``k``, ..., ``down``)."""
    other_low_rank: dict[str, int] = field(default_factory=dict)
    """Low-rank pairs that are not a layer's projection: path -> rank."""
    residual_maps: list[ResidualMap] = field(default_factory=list)
    rms_norms: list[str] = field(default_factory=list)
    """Paths of LayerNorms converted to RMSNorm."""

    @property
    def empty(self) -> bool:
        return not (self.ranks or self.other_low_rank or self.residual_maps or self.rms_norms)

    def maps_in_layer(self, layer: int) -> list[ResidualMap]:
        return [m for m in self.residual_maps if m.layer == layer]

    def summary(self) -> str:
        """One line: how many low-rank pairs (rank range per role), residual maps, converted norms."""
        parts = []
        pairs = sum(len(r) for r in self.ranks.values()) + len(self.other_low_rank)
        if pairs:
            by_role: dict[str, list[int]] = {}
            for ranks in self.ranks.values():
                for role, rank in ranks.items():
                    by_role.setdefault(role, []).append(rank)
            spans = [
                f"{role} {min(v)}" if min(v) == max(v) else f"{role} {min(v)}-{max(v)}"
                for role in LINEAR_ROLES
                if (v := by_role.get(role))
            ]
            parts.append(f"{pairs} low-rank pair(s)" + (f" (ranks: {', '.join(spans)})" if spans else ""))
        if self.residual_maps:
            layers = sorted({m.layer for m in self.residual_maps if m.layer is not None})
            outside = sum(m.layer is None for m in self.residual_maps)
            where = [f"layer(s) {', '.join(map(str, layers))}"] if layers else []
            where += [f"{outside} outside the layers"] if outside else []
            parts.append(f"{len(self.residual_maps)} residual map(s) ({'; '.join(where)})")
        if self.rms_norms:
            parts.append(f"{len(self.rms_norms)} LayerNorm(s) converted to RMSNorm")
        return "; ".join(parts) if parts else "no low-rank pairs, residual maps or converted norms"

    def as_dict(self) -> dict[str, Any]:
        return {
            "ranks": {str(k): v for k, v in self.ranks.items()},
            "other_low_rank": dict(self.other_low_rank),
            "residual_maps": [{**asdict(m), "shape": list(m.shape), "where": m.where} for m in self.residual_maps],
            "rms_norms": list(self.rms_norms),
        }


def _locate(path: str, spec: ArchSpec | None) -> tuple[int | None, str]:
    """``(layer index, path inside the layer)`` of a module path, or ``(None, path)`` outside the layers."""
    if spec is None:
        return None, path
    match = re.search(rf"(?:^|\.){re.escape(spec.layers)}\.(\d+)(?:\.(.*))?$", path)
    if match is None:
        return None, path
    return int(match.group(1)), match.group(2) or ""


def structure_of(entries: list[dict[str, Any]], model_type: str | None) -> Structure:
    """The :class:`Structure` recorded by manifest ``modules`` entries of a ``model_type`` model."""
    spec = ARCH_SPECS.get(model_type or "")
    roles = {getattr(spec, role): role for role in LINEAR_ROLES if spec is not None and getattr(spec, role)}
    structure = Structure()
    for entry in entries:
        kind, path = entry.get("kind"), str(entry.get("path", ""))
        layer, inside = _locate(path, spec)
        if kind == LOW_RANK_KIND:
            role = roles.get(inside) if layer is not None else None
            if role is None:
                structure.other_low_rank[path] = int(entry["rank"])
            else:
                structure.ranks.setdefault(layer, {})[role] = int(entry["rank"])
        elif kind == BASIS_CHANGE_KIND:
            host = path.rpartition(".")[0]
            shape = (int(entry["out_features"]), int(entry["in_features"]))
            structure.residual_maps.append(ResidualMap(path, layer, host, str(entry.get("hook", "input")), shape))
        elif kind == RMS_NORM_KIND:
            structure.rms_norms.append(path)
    structure.ranks = {
        layer: {role: ranks[role] for role in LINEAR_ROLES if role in ranks}
        for layer, ranks in sorted(structure.ranks.items())
    }
    return structure


def model_structure(model: nn.Module) -> Structure:
    """The :class:`Structure` of a model in memory (the records :func:`slimkit.save` would write)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return structure_of(lowrank_entries(model) + projection_entries(model), model_type)


def _read_json(path: Path) -> dict[str, Any] | None:
    return read_json_object(path) if os.path.lexists(path) else None


def saved_structure(directory: str | os.PathLike) -> Structure | None:
    """The :class:`Structure` recorded in a saved folder's manifest; None without a manifest."""
    manifest = _read_json(Path(directory) / MANIFEST_NAME)
    if manifest is None:
        return None
    model_type = manifest.get("model_type")
    if model_type is None:
        config = _read_json(Path(directory) / "config.json") or {}
        model_type = unmark_config(config).get("model_type") if config.get("model_type") else None
    return structure_of(manifest.get("modules") or [], model_type)


@dataclass(frozen=True)
class LoaderVerdict:
    loader: str
    ok: bool | None
    """True: reads the folder exactly; False: cannot; None: not available yet."""
    detail: str

    @property
    def answer(self) -> str:
        return "yes" if self.ok else ("not yet" if self.ok is None else "no")


def folder_loaders(directory: str | os.PathLike) -> list[LoaderVerdict]:
    """Which loaders read ``directory`` exactly, and why not where one cannot."""
    directory = Path(directory)
    config = _read_json(directory / "config.json") or {}
    manifest = _read_json(directory / MANIFEST_NAME) or {}
    reasons = structure_reasons(config.get("per_layer_config"), manifest.get("modules"))
    verdicts = [LoaderVerdict("slimkit.load", True, "reads slimkit folders and plain Hugging Face folders exactly")]
    if is_marked(config):
        verdicts.append(
            LoaderVerdict(
                "transformers from_pretrained",
                False,
                f"config.json's model_type is '{SLIMKIT_MODEL_TYPE}', which AutoConfig refuses: the folder holds "
                f"{'; '.join(reasons) or 'modules stock transformers cannot build'}",
            )
        )
    elif reasons:
        verdicts.append(
            LoaderVerdict(
                "transformers from_pretrained",
                False,
                f"the folder holds {'; '.join(reasons)}; saved before slimkit marked such folders, so "
                "from_pretrained does not refuse it but builds a different model (re-save with slimkit.save)",
            )
        )
    else:
        verdicts.append(LoaderVerdict("transformers from_pretrained", True, "uniform widths, no slimkit-only modules"))
    from slimkit.primitives.export.plan import export_verdicts

    model_type = unmark_config(config).get("model_type", "?")
    for verdict in export_verdicts(
        model_type, config.get("per_layer_config"), manifest.get("modules"), unmark_config(config)
    ):
        if verdict.format.startswith("gguf"):
            detail = f"as {verdict.format}: {verdict.detail}" if verdict.ok else verdict.detail
            verdicts.append(LoaderVerdict("llama.cpp via slimkit export --format gguf", verdict.ok, detail))
        elif is_marked(config) or reasons:  # a plain folder needs no hf export
            verdicts.append(LoaderVerdict("transformers via slimkit export --format hf", verdict.ok, verdict.detail))
    return verdicts


@dataclass
class Description:
    """Everything ``slimkit inspect`` shows about a model."""

    name: str
    model_type: str
    hidden_size: int
    tied: bool
    parts: dict[str, int]
    layers: list[dict[str, Any]]
    structure: Structure
    loaders: list[LoaderVerdict]
    compression: str | None = None
    """Why no compression recipe runs on this model (None: slimkit has an adapter for it); its parts are then
    ``embeddings``, ``layers``, ``head``, ``other`` and ``total`` only, and unknown widths are None."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "tied": self.tied,
            "parameters": self.parts,
            "layers": self.layers,
            "structure": self.structure.as_dict(),
            "loaders": [{**asdict(v), "answer": v.answer} for v in self.loaders],
            "compression": self.compression or "supported",
        }

    def renderables(self) -> list[Any]:
        """Rich tables and lines: per-layer widths (with ranks and maps), residual maps, loaders, totals."""
        from rich.table import Table

        per_layer_hidden = any(row["hidden"] != self.hidden_size for row in self.layers)
        columns = ["layer", "heads", "kv heads", "head dim", "mlp width"]
        columns += ["hidden"] if per_layer_hidden else []
        columns += ["low-rank (role: rank)"] if self.structure.ranks else []
        columns += ["residual map"] if any(m.layer is not None for m in self.structure.residual_maps) else []
        columns += ["parameters"]
        table = Table(*columns, title=self.name)
        for row in self.layers:
            cells = [_cell(row["layer"]), _cell(row["heads"]), _cell(row["kv_heads"]), head_dim_cell(row)]
            cells.append(_cell(row["mlp_width"]))
            if per_layer_hidden:
                cells.append(str(row["hidden"]))
            if self.structure.ranks:
                ranks = self.structure.ranks.get(row["layer"], {})
                cells.append(", ".join(f"{role}: {rank}" for role, rank in ranks.items()) or "-")
            if "residual map" in columns:
                maps = self.structure.maps_in_layer(row["layer"])
                cells.append(", ".join(m.short() for m in maps) or "-")
            cells.append(f"{row['parameters']:,}")
            table.add_row(*cells)
        items: list[Any] = [table]
        if self.structure.residual_maps:
            map_table = Table("residual / basis-change map", "where", "shape (out x in)", title="residual maps")
            for m in self.structure.residual_maps:
                map_table.add_row(m.path, m.where, f"{m.shape[0]} x {m.shape[1]}")
            items.append(map_table)
        if self.structure.other_low_rank:
            other = Table("low-rank pair outside the layers", "rank")
            for path, rank in self.structure.other_low_rank.items():
                other.add_row(path, str(rank))
            items.append(other)
        if self.structure.rms_norms:
            items.append(f"LayerNorms converted to RMSNorm: {len(self.structure.rms_norms)}")
        if self.loaders:
            loaders = Table("loader", "reads it", "why", title="loaders")
            for verdict in self.loaders:
                loaders.add_row(verdict.loader, verdict.answer, verdict.detail)
            items.append(loaders)
        p = self.parts
        if self.compression is not None:
            items.append(
                f"{self.model_type}: hidden {self.hidden_size}, {len(self.layers)} layers, {p['total']:,} parameters "
                f"(embeddings {p['embeddings']:,}, layers {p['layers']:,}, tied head: {self.tied})"
            )
            items.append(f"compression: no recipe runs on it ({self.compression}); slimkit eval and inspect do")
            return items
        items.append(
            f"{self.model_type}: hidden {self.hidden_size}, {len(self.layers)} layers, {p['total']:,} parameters "
            f"(embeddings {p['embeddings']:,}, attention {p['attention']:,}, mlp {p['mlp']:,}, tied head: {self.tied})"
        )
        return items


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _head_widths(widths: HeadWidths | None) -> dict[str, list[int]] | None:
    """Each head's kept q/k and v/o widths when the layer's heads differ (SP3's MHA-intermediate masks), else None."""
    return None if widths is None else {"qk": list(widths.qk), "vo": list(widths.vo)}


def head_dim_cell(row: dict[str, Any]) -> str:
    """The ``head dim`` cell: the one width, or each head's q/k and v/o widths as ranges (``qk 9-64, vo 3-64``)."""
    widths = row.get("head_widths")
    if not widths:
        return _cell(row["head_dim"])

    def span(values: list[int]) -> str:
        return str(values[0]) if min(values) == max(values) else f"{min(values)}-{max(values)}"

    return f"qk {span(widths['qk'])}, vo {span(widths['vo'])}"


def describe_model(model: nn.Module, folder: str | os.PathLike | None = None, name: str | None = None) -> Description:
    """Describe a loaded model; ``folder`` (where it was loaded from) adds the loader verdicts. A model slimkit
    has no adapter for is described by :func:`describe_plain`."""
    from slimkit.primitives.evaluate.counting import params_by_part

    reason = compression_support(model.config, "encoder" if _is_encoder(model) else "causal-lm")
    if reason is not None:
        return describe_plain(model, reason, folder, name)
    view = ModelView(model)
    layers = [
        {
            "layer": layer.index,
            "heads": layer.num_heads,
            "kv_heads": layer.num_kv_heads,
            "head_dim": layer.head_dim,
            "head_widths": _head_widths(layer.head_widths),
            "mlp_width": layer.mlp_width,
            "hidden": layer_hidden_size(layer, view.hidden_size),
            "parameters": layer.num_params(),
        }
        for layer in view.layers
    ]
    return Description(
        name=name or (str(folder) if folder is not None else view.spec.model_type),
        model_type=view.spec.model_type,
        hidden_size=view.hidden_size,
        tied=view.tied,
        parts=params_by_part(model),
        layers=layers,
        structure=model_structure(model),
        loaders=folder_loaders(folder) if folder is not None else [],
    )


def _is_encoder(model: nn.Module) -> bool:
    from slimkit.primitives.arch.support import task_of

    return task_of(model.config) == "encoder"


def _config_width(config: Any, *names: str) -> int | None:
    """The first of ``names`` the config sets to a positive integer (None: the config does not say)."""
    for name in names:
        value = getattr(config, name, None)
        if type(value) is int and value > 0:
            return value
    return None


def _layer_list(model: nn.Module, count: int | None) -> nn.ModuleList | None:
    """The module list of ``count`` blocks holding the most parameters (a transformer's layers), if any."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == count and count]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def describe_plain(
    model: nn.Module, reason: str, folder: str | os.PathLike | None = None, name: str | None = None
) -> Description:
    """Describe a model slimkit has no adapter for, from its config and module tree (``reason``: why no recipe
    compresses it). Widths the config does not name are None; parameters are split into the input embeddings,
    the layer list, an untied output head and the rest."""
    config = model.config.get_text_config()
    hidden = _config_width(config, "hidden_size", "n_embd", "d_model") or 0
    layers = _layer_list(model, _config_width(config, "num_hidden_layers", "n_layer", "num_layers"))
    heads = _config_width(config, "num_attention_heads", "n_head")
    kv_heads = _config_width(config, "num_key_value_heads")
    head_dim = _config_width(config, "head_dim") or (hidden // heads if heads and hidden % heads == 0 else None)
    mlp_width = _config_width(config, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
    embeddings = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and embeddings is not None and head.weight is embeddings.weight
    seen: set[int] = set()

    def count(params) -> int:
        fresh = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        return sum(p.numel() for p in fresh)

    parts = {"embeddings": count(embeddings.parameters()) if embeddings is not None else 0}
    parts["layers"] = count(layers.parameters()) if layers is not None else 0
    parts["head"] = count(head.parameters()) if head is not None else 0
    parts["other"] = count(model.parameters())
    parts["total"] = sum(parts.values())
    rows = [
        {
            "layer": index,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "head_widths": None,
            "mlp_width": mlp_width,
            "hidden": hidden,
            "parameters": sum(p.numel() for p in layer.parameters()),
        }
        for index, layer in enumerate(layers if layers is not None else [])
    ]
    return Description(
        name=name or (str(folder) if folder is not None else str(config.model_type)),
        model_type=str(model.config.model_type),
        hidden_size=hidden,
        tied=tied,
        parts=parts,
        layers=rows,
        structure=Structure(),
        loaders=folder_loaders(folder) if folder is not None else [],
        compression=reason,
    )


def describe_source(source: str) -> Description:
    """Load a model source (name or folder) with :func:`slimkit.load_source` and describe it (any causal LM
    transformers builds with its own classes: inspecting needs no adapter)."""
    from slimkit.primitives.io.model_sources import load_source

    model, _tokenizer, info = load_source(source, purpose="evaluate")
    return describe_model(model, Path(info.path), info.name)


__all__ = [
    "Description",
    "LoaderVerdict",
    "ResidualMap",
    "Structure",
    "describe_model",
    "describe_plain",
    "describe_source",
    "folder_loaders",
    "head_dim_cell",
    "model_structure",
    "saved_structure",
    "structure_of",
]
