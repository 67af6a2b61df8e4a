"""PruneNet's calibration-free policy learner ("You Only Prune Once", Sengupta et al.; §4, Appendix B Algorithm 1).

A small network scores the rows of every layer's FFN1 weight and is trained with REINFORCE so the kept rows keep the
spectrum's distribution (KS distance, Eq. 6); no calibration data is read.

Method note: docs/methods/prunenet-policy.md.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.loop import Divergence, checked_backward, learning_rate_hint, non_finite_problem
from slimkit.primitives.select import keep_count, keep_top
from slimkit.primitives.spectrum import DISTANCES, SPECTRUM_METHODS, SpectrumMethod, singular_values

Selection = Literal["policy", "random", "deterministic"]
SELECTIONS: tuple[str, ...] = ("policy", "random", "deterministic")
Returns = Literal["future", "own", "to_go"]
RETURNS: tuple[str, ...] = ("future", "own", "to_go")
Update = Literal["episode", "layer"]
UPDATES: tuple[str, ...] = ("episode", "layer")
SCHEDULES: tuple[str, ...] = ("uniform", "linear")
MAX_RATIO = 0.95
_EPS_CLAMP = 1e-6
_FORMAT = "slimkit-prunenet-policy"


def _check_choice(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise SlimkitError(f"unknown {what} '{value}'; allowed: {', '.join(allowed)}")


def _check_ratio(ratio: float, where: str = "ratio") -> None:
    if not 0.0 <= float(ratio) < 1.0:
        raise SlimkitError(f"{where} must be in [0, 1), got {ratio}")


def reparameterize(logits: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Eq. 4: ``W̃ = σ(log ε − log(1−ε) + logit(W_imp))`` with ``logits = logit(W_imp)``.

    ``W̃_i > 0.5`` exactly when ``ε_i > 1 − W_imp_i``, a Bernoulli(``W_imp_i``) event (Appendix C.3).
    """
    eps = eps.clamp(_EPS_CLAMP, 1.0 - _EPS_CLAMP)
    return torch.sigmoid(torch.logit(eps) + logits)


def sequential_log_prob(log_p: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``log P`` of drawing ``order`` (in that order) without replacement from probabilities ``exp(log_p)``.

    ``Σ_t [log p_{o_t} − log Σ_{i ∉ {o_1..o_{t-1}}} p_i]``, computed with log-sum-exps.
    """
    chosen = log_p[order]
    rest_mask = torch.ones_like(log_p, dtype=torch.bool)
    rest_mask[order] = False
    if bool(rest_mask.any()):
        rest = torch.logsumexp(log_p[rest_mask], dim=0)
    else:
        rest = log_p.new_tensor(float("-inf"))
    remaining = torch.logaddexp(torch.logcumsumexp(chosen.flip(0), dim=0).flip(0), rest)
    return (chosen - remaining).sum()


def _event_log_probs(logits: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``log p`` with ``p = W̃ / Σ W̃`` and ``W̃`` from Eq. 4 (in log space, footnote 5's normalisation)."""
    log_w_tilde = F.logsigmoid(torch.logit(eps.clamp(_EPS_CLAMP, 1.0 - _EPS_CLAMP)) + logits)
    return log_w_tilde - torch.logsumexp(log_w_tilde, dim=0)


class PruneNetPolicy(nn.Module):
    """The policy learner of §4.1: ``W_inter ∈ R^{n×d}``, ``W_proj ∈ R^{1×n}``, no biases.

    ``forward(W)`` gives ``W_imp ∈ (0, 1)^n`` (Eq. 3, one score per row of ``W``; see the module
    docstring for the product used). One policy serves every layer, so every weight it sees must be
    ``n×d``. ``selection`` is the default for :func:`policy_keep_indices`. Its parameters are float32 (on
    the weights' device once moved there); weights of any dtype are upcast before they are scored.
    """

    def __init__(self, n: int, d: int, selection: Selection = "policy", generator: torch.Generator | None = None):
        super().__init__()
        _check_choice(selection, SELECTIONS, "selection")
        self.n, self.d, self.selection = int(n), int(d), selection
        self.w_inter = nn.Parameter(torch.empty(self.n, self.d))
        self.w_proj = nn.Parameter(torch.empty(1, self.n))
        with torch.no_grad():
            bound_inter, bound_proj = 1.0 / math.sqrt(self.d), 1.0 / math.sqrt(self.n)
            self.w_inter.copy_((torch.rand(self.n, self.d, generator=generator) * 2 - 1) * bound_inter)
            self.w_proj.copy_((torch.rand(1, self.n, generator=generator) * 2 - 1) * bound_proj)

    def extra_repr(self) -> str:
        return f"n={self.n}, d={self.d}, selection={self.selection}"

    def check(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != (self.n, self.d):
            raise SlimkitError(
                f"the policy scores {self.n}x{self.d} weights, got {tuple(weight.shape)}; every layer's FFN1 "
                "must have the shape the policy was built for"
            )

    def direction(self) -> torch.Tensor:
        """``v = W_interᵀ W_projᵀ ∈ R^d``: the logits of Eq. 3 are ``W v = (W W_interᵀ) W_projᵀ``."""
        return (self.w_proj @ self.w_inter).squeeze(0)

    def logits(self, weight: torch.Tensor, direction: torch.Tensor | None = None) -> torch.Tensor:
        """``logit(W_imp) = W' W_projᵀ`` with ``W' = W W_interᵀ`` (Eq. 3), computed as ``W v``."""
        self.check(weight)
        v = self.direction() if direction is None else direction
        return weight.detach().to(v.device, v.dtype) @ v

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        """``W_imp = σ(W_proj W'ᵀ)`` (Eq. 3), one importance in (0, 1) per row of ``weight``."""
        return torch.sigmoid(self.logits(weight))

    def sample(
        self,
        weight: torch.Tensor,
        count: int,
        generator: torch.Generator | None = None,
        logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw ``count`` distinct rows (Eq. 4 + multinomial); returns ``(order, log P(order))``.

        ``order`` is in draw order (unsorted); the log-probability carries gradients to the parameters.
        """
        order, log_prob, _eps = self.sample_with_noise(weight, count, generator, logits)
        return order, log_prob

    def sample_with_noise(
        self,
        weight: torch.Tensor,
        count: int,
        generator: torch.Generator | None = None,
        logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`sample`, also returning Eq. 4's noise ``ε`` so :meth:`log_prob` can score the draw again."""
        logits = self.logits(weight) if logits is None else logits
        n = logits.numel()
        if not 0 < count <= n:
            raise SlimkitError(f"cannot keep {count} of {n} rows")
        eps = torch.rand(n, generator=generator, dtype=torch.float64).to(logits.device, logits.dtype)
        log_p = _event_log_probs(logits, eps)
        uniform = torch.rand(n, generator=generator, dtype=torch.float64).clamp(1e-12, 1.0 - 1e-12)
        gumbel = (-torch.log(-torch.log(uniform))).to(logits.device)
        order = torch.topk(log_p.detach().to(torch.float64) + gumbel, count, sorted=True).indices
        return order, sequential_log_prob(log_p, order), eps

    def log_prob(self, weight: torch.Tensor, order: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """``log P(order)`` under the current parameters for Eq. 4's noise ``eps`` (from :meth:`sample_with_noise`)."""
        logits = self.logits(weight)
        return sequential_log_prob(_event_log_probs(logits, eps.to(logits.device, logits.dtype)), order)

    def select(
        self,
        weight: torch.Tensor,
        count: int,
        selection: Selection | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sorted indices of ``count`` rows to keep, by ``selection`` (default: the policy's own)."""
        selection = self.selection if selection is None else selection
        _check_choice(selection, SELECTIONS, "selection")
        self.check(weight)
        with torch.no_grad():
            if selection == "random":
                return torch.randperm(self.n, generator=generator)[:count].sort().values
            if selection == "deterministic":
                return keep_top(self.logits(weight).cpu(), count)
            order, _ = self.sample(weight, count, generator)
            return order.sort().values.cpu()


def policy_keep_indices(
    policy: PruneNetPolicy,
    weight: torch.Tensor,
    ratio: float,
    selection: Selection | None = None,
    generator: torch.Generator | None = None,
) -> torch.LongTensor:
    """Sorted rows of ``weight`` to keep when ``ratio`` of them are removed (``round((1−r)·n)`` kept, >= 1).

    Apply them to FFN1 rows, FFN2 columns and biases together, e.g. with
    ``remove_units(model, build_groups(model, "mlp_channel", [i])[0], keep)``. The ratio may differ
    from the one the policy was trained at (the paper's Table 6 reuses policies across ratios).
    """
    _check_ratio(ratio)
    return policy.select(weight, keep_count(policy.n, float(ratio)), selection, generator)


def discounted_penalties(penalties: Sequence[float], gamma: float, returns: Returns = "future") -> list[float]:
    """``G_l`` from per-layer penalties ``D_1..D_L`` (the readings are in the module docstring).

    ``future`` (Eq. 7, Algorithm 1 line 19 as printed): ``G_l = Σ_{k≥0} γ^k D_{l+k+1}``, ``D`` past
    the last layer being 0, so the last layer's ``G`` is 0. ``own`` (the released code's
    ``_discount_rewards``): ``G_l = γ^l D_l`` with ``l`` counted from 0. ``to_go``:
    ``G_l = Σ_{k≥0} γ^k D_{l+k}``.
    """
    _check_choice(returns, RETURNS, "returns")
    if returns == "own":
        return [gamma**layer * float(d) for layer, d in enumerate(penalties)]
    out = [0.0] * len(penalties)
    running = 0.0
    for layer in range(len(penalties) - 1, -1, -1):
        if returns == "future":
            out[layer] = running
            running = float(penalties[layer]) + gamma * running
        else:
            running = float(penalties[layer]) + gamma * running
            out[layer] = running
    return out


def layer_ratios(
    average: float,
    num_layers: int,
    schedule: str = "uniform",
    spread: float | None = None,
    max_ratio: float = MAX_RATIO,
) -> list[float]:
    """Per-layer removal ratios whose mean is ``average``, each in ``[0, max_ratio]`` (§5.2, Table 7).

    ``uniform``: every layer gets ``average``. ``linear``: a straight ramp from
    ``average + spread/2`` at the first layer to ``average − spread/2`` at the last, so a positive
    ``spread`` removes less from later layers (§4.3: later layers carry the most semantic
    information); a negative one reverses it. The paper's Table 7 uses ratios in [0, 40%] around a
    20% mean without saying which layers get more; the default ``spread`` is that widest
    symmetric ramp, ``2·min(average, max_ratio − average)``. Values are clamped to
    ``[0, max_ratio]`` and the ramp is shifted (bisection) so the mean stays exactly ``average``.
    """
    _check_choice(schedule, SCHEDULES, "schedule")
    if num_layers < 1:
        raise SlimkitError(f"num_layers must be at least 1, got {num_layers}")
    if not 0.0 <= max_ratio < 1.0:
        raise SlimkitError(f"max_ratio must be in [0, 1), got {max_ratio}")
    if not 0.0 <= average <= max_ratio:
        raise SlimkitError(f"average ratio must be in [0, {max_ratio}], got {average}")
    if schedule == "uniform" or num_layers == 1:
        return [float(average)] * num_layers
    spread = 2.0 * min(average, max_ratio - average) if spread is None else float(spread)
    base = torch.tensor(
        [average + spread * (0.5 - i / (num_layers - 1)) for i in range(num_layers)], dtype=torch.float64
    )

    def clamped(shift: float) -> torch.Tensor:
        return (base + shift).clamp(0.0, max_ratio)

    low, high = -abs(spread) - 1.0, abs(spread) + 1.0
    for _ in range(200):
        mid = (low + high) / 2.0
        if float(clamped(mid).mean()) < average:
            low = mid
        else:
            high = mid
    return [float(x) for x in clamped((low + high) / 2.0)]


@dataclass
class PolicyReport:
    """What :func:`train_policy` measured: the mean spectral penalty ``D`` per episode and more."""

    episode_penalty: list[float] = field(default_factory=list)
    """Mean over layers of ``D_l`` in each episode (the curve to watch)."""
    layer_penalty: list[list[float]] = field(default_factory=list)
    """``D_l`` per layer, per episode."""
    loss: list[float] = field(default_factory=list)
    """The REINFORCE surrogate ``Σ_l log P(S_l|W_l) · (G_l − b_l)`` per episode."""
    kept: list[int] = field(default_factory=list)
    """Rows kept per layer."""
    episode_seconds: list[float] = field(default_factory=list)
    """Wall time of each episode (sampling, spectra, update)."""
    optimizer_steps: int = 0
    """AdamW steps taken: one per episode (``update="episode"``) or one per layer per episode (``"layer"``)."""
    seconds: float = 0.0
    """Wall time of the whole run, including the reference spectra."""
    options: dict = field(default_factory=dict)


def _layer_ratio_list(ratio: float | Sequence[float], layers: int) -> list[float]:
    ratios = [float(ratio)] * layers if isinstance(ratio, int | float) else [float(r) for r in ratio]
    if len(ratios) != layers:
        raise SlimkitError(f"got {len(ratios)} ratios for {layers} layers")
    for value in ratios:
        _check_ratio(value)
    return ratios


def _step(
    policy: PruneNetPolicy, optimizer: torch.optim.Optimizer, loss: torch.Tensor, episode: int, lr: float
) -> None:
    """One AdamW step on ``loss``; a non-finite loss or parameter fails loudly (lower the learning rate)."""
    divergence = Divergence("prunenet policy training", learning_rate_hint(lr), unit="episode")
    checked_backward(loss, episode + 1, divergence, [optimizer])
    optimizer.step()
    # checked after every update: the next sampling cannot use a NaN policy
    problem = non_finite_problem(policy.named_parameters(), "policy tensors")
    if problem:
        raise divergence.error(episode + 1, problem)


def train_policy(
    weights: Sequence[torch.Tensor],
    ratio: float | Sequence[float],
    episodes: int = 20,
    lr: float = 5e-4,
    gamma: float = 0.99,
    baseline: bool = False,
    seed: int = 0,
    spectrum_dtype: torch.dtype = torch.float32,
    distance: str = "ks",
    returns: Returns = "future",
    weight_decay: float = 0.01,
    update: Update = "episode",
    policy: PruneNetPolicy | None = None,
    spectrum_method: SpectrumMethod = "gram",
) -> tuple[PruneNetPolicy, PolicyReport]:
    """Train one policy over all layers' FFN1 weights with REINFORCE (§4.2–4.3, Algorithm 1).

    Per episode, for each layer ``l``: ``S_l`` is sampled (Eqs. 3–4 and the multinomial) and
    ``D_l = distance(σ(W_l), σ(W_l[S_l]))``, ``σ`` the singular values (``ks``: Eq. 6; ``ad``: the
    Anderson–Darling statistic of Table 18). Then ``G_l`` per ``returns`` (default Eq. 7, see
    :func:`discounted_penalties` and the module docstring: with it the expected update is zero),
    ``loss = Σ_l log P(S_l|W_l) · (G_l − b_l)`` and one AdamW step (``lr``, ``weight_decay``) per
    episode (``update="episode"``) or one per layer on that layer's term (``update="layer"``, the
    released code's loop; see the module docstring).
    ``ratio`` is one removal ratio or one per layer (:func:`layer_ratios`). Hyper-parameter
    defaults are the paper's (§5.1: γ = 0.99, AdamW lr 5e-4, 20 episodes). Deterministic for a
    given ``seed`` (initialisation and sampling use one ``torch.Generator``). An existing
    ``policy`` is trained further instead of a new one. ``episodes=0`` returns the initial policy
    untrained (the ablation that separates what training adds from what the linear logit ``W v`` does).
    ``spectrum_method``: how the singular values are computed (:func:`~slimkit.primitives.spectrum.singular_values`);
    each layer's full spectrum is computed once, the kept rows' once per layer per episode.
    """
    if not weights:
        raise SlimkitError("train_policy needs at least one weight matrix")
    _check_choice(distance, tuple(DISTANCES), "distance")
    _check_choice(returns, RETURNS, "returns")
    _check_choice(update, UPDATES, "update")
    _check_choice(spectrum_method, SPECTRUM_METHODS, "spectrum method")
    if episodes < 0:
        raise SlimkitError(f"episodes must be at least 0 (0 keeps the initial, untrained policy), got {episodes}")
    shape = tuple(weights[0].shape)
    if len(shape) != 2 or any(tuple(w.shape) != shape for w in weights):
        raise SlimkitError(f"all weights must be matrices of one shape, got {[tuple(w.shape) for w in weights]}")
    ratios = _layer_ratio_list(ratio, len(weights))
    generator = torch.Generator().manual_seed(seed)
    if policy is None:
        policy = PruneNetPolicy(shape[0], shape[1], generator=generator)
    policy.to(weights[0].device)
    for w in weights:
        policy.check(w)
    measure = DISTANCES[distance]
    counts = [keep_count(shape[0], r) for r in ratios]
    start = time.perf_counter()
    reference = [singular_values(w, spectrum_dtype, spectrum_method) for w in weights]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=weight_decay)
    report = PolicyReport(
        kept=counts,
        options={
            "ratios": ratios,
            "episodes": episodes,
            "lr": lr,
            "gamma": gamma,
            "baseline": baseline,
            "seed": seed,
            "distance": distance,
            "returns": returns,
            "update": update,
            "spectrum_dtype": str(spectrum_dtype).removeprefix("torch."),
            "spectrum_method": spectrum_method,
        },
    )
    past_returns = torch.zeros(len(weights), dtype=torch.float64)
    policy.train()
    for episode in range(episodes):
        episode_start = time.perf_counter()
        log_probs, penalties, draws = [], [], []
        with torch.set_grad_enabled(update == "episode"):  # per-layer updates score each draw again below
            direction = policy.direction()
            for w, count, ref in zip(weights, counts, reference, strict=True):
                logits = policy.logits(w, direction)
                order, log_prob, eps = policy.sample_with_noise(w, count, generator, logits=logits)
                kept = order.sort().values.to(w.device)
                penalties.append(measure(ref, singular_values(w.detach()[kept], spectrum_dtype, spectrum_method)))
                log_probs.append(log_prob)
                draws.append((order, eps))
        returns_now = torch.tensor(discounted_penalties(penalties, gamma, returns), dtype=torch.float64)
        advantage = returns_now - (past_returns / episode if baseline and episode else 0.0)
        past_returns += returns_now
        if update == "episode":
            loss = (torch.stack(log_probs) * advantage.to(log_probs[0].device, log_probs[0].dtype)).sum()
            _step(policy, optimizer, loss, episode, lr)
            report.optimizer_steps += 1
        else:
            loss = torch.zeros(())  # the sum of the layers' terms, each after the previous layer's step
            for w, (order, eps), adv in zip(weights, draws, advantage.tolist(), strict=True):
                layer_loss = policy.log_prob(w, order, eps) * adv
                _step(policy, optimizer, layer_loss, episode, lr)
                report.optimizer_steps += 1
                loss = loss + layer_loss.detach().cpu()
        report.episode_penalty.append(sum(penalties) / len(penalties))
        report.layer_penalty.append(penalties)
        report.loss.append(float(loss.detach()))
        report.episode_seconds.append(time.perf_counter() - episode_start)
    report.seconds = time.perf_counter() - start
    policy.eval()
    return policy, report


def layer_penalties(
    policy: PruneNetPolicy,
    weights: Sequence[torch.Tensor],
    ratio: float | Sequence[float],
    selection: Selection | None = None,
    generator: torch.Generator | None = None,
    spectrum_dtype: torch.dtype = torch.float32,
    distance: str = "ks",
    spectrum_method: SpectrumMethod = "gram",
) -> list[float]:
    """``D_l`` per layer for the rows ``selection`` keeps (to compare policy, random and top-k)."""
    _check_choice(distance, tuple(DISTANCES), "distance")
    _check_choice(spectrum_method, SPECTRUM_METHODS, "spectrum method")
    ratios = _layer_ratio_list(ratio, len(weights))
    out = []
    for w, r in zip(weights, ratios, strict=True):
        keep = policy_keep_indices(policy, w, r, selection, generator).to(w.device)
        full = singular_values(w, spectrum_dtype, spectrum_method)
        out.append(DISTANCES[distance](full, singular_values(w.detach()[keep], spectrum_dtype, spectrum_method)))
    return out


def ffn_weights(model: nn.Module, source: str = "up") -> list[torch.Tensor]:
    """Each layer's policy input, rows = MLP channels: ``up``/``gate`` weights, or ``down`` transposed.

    ``up`` is the paper's FFN1 (``up_proj``, OPT ``fc1``); ``down`` gives FFN2's columns as rows
    (``down.weight.T``), the Table 19 variant; ``gate`` is what the authors' released code reads
    for llama models.
    """
    from slimkit.primitives.arch import ModelView

    _check_choice(source, ("up", "gate", "down"), "policy source")
    view = ModelView(model)
    out = []
    for layer in view.layers:
        if not layer.has_mlp:  # a hybrid's layer without the MLP (as build_groups gives no group for it)
            continue
        if source == "gate" and "gate" not in layer.mlp_input_roles:
            raise SlimkitError(f"{view.spec.model_type} MLPs have no gate projection; use source 'up' or 'down'")
        weight = layer.linear(source).weight.detach()
        out.append(weight.T if source == "down" else weight)
    return out


def save_policy(policy: PruneNetPolicy, path: str | Path) -> Path:
    """Write ``policy.safetensors`` (``w_inter``, ``w_proj``) and ``policy.json`` (n, d, options) into ``path``."""
    from safetensors.torch import save_file

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().cpu().contiguous() for name, p in policy.named_parameters()}
    save_file(tensors, str(directory / "policy.safetensors"))
    meta = {"format": _FORMAT, "version": 1, "n": policy.n, "d": policy.d, "selection": policy.selection}
    (directory / "policy.json").write_text(json.dumps(meta, indent=2) + "\n")
    return directory


def load_policy(path: str | Path) -> PruneNetPolicy:
    """Read a policy written by :func:`save_policy` (no pickle)."""
    from safetensors.torch import load_file

    directory = Path(path)
    meta_file, weights_file = directory / "policy.json", directory / "policy.safetensors"
    if not meta_file.is_file() or not weights_file.is_file():
        raise SlimkitError(f"{directory} holds no saved policy (policy.json and policy.safetensors)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != _FORMAT:
        raise SlimkitError(f"{meta_file} is not a slimkit PruneNet policy")
    policy = PruneNetPolicy(meta["n"], meta["d"], selection=meta.get("selection", "policy"))
    policy.load_state_dict(load_file(str(weights_file)))
    return policy.eval()


__all__ = [
    "MAX_RATIO",
    "RETURNS",
    "SELECTIONS",
    "UPDATES",
    "PolicyReport",
    "PruneNetPolicy",
    "discounted_penalties",
    "ffn_weights",
    "layer_penalties",
    "layer_ratios",
    "load_policy",
    "policy_keep_indices",
    "reparameterize",
    "save_policy",
    "sequential_log_prob",
    "train_policy",
]
