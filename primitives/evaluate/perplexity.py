"""Perplexity over non-overlapping windows of a tokenised corpus.

The corpus (see :mod:`slimkit.primitives.datasets.textdata`) is tokenised once, cut into consecutive
windows of ``seq_len`` tokens, and the first ``max_tokens // seq_len`` windows are scored
(``max_tokens=None``: all of them). Every window is scored independently (no context carried
over), each predicting its tokens 2..L, as GPTQ/SparseGPT/Wanda-style evaluation does; the
result states windows, length and tokens used.

A tokenizer that puts a BOS token before every text it encodes (Gemma's, Llama 2's) gets its BOS as each window's
first token, followed by ``L - 1`` corpus tokens (:func:`bos_prefix`): such models are trained with it and predict
poorly from a window that starts mid-text. Every window still predicts ``L - 1`` tokens; a tokenizer that adds no
BOS (SmolLM2's) gets the windows above unchanged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch.nn import functional as F

from slimkit.primitives.arch.output_logits import HeadPath, head_path
from slimkit.primitives.datasets import textdata
from slimkit.primitives.device.moves import to_input_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.eval_settings import PERPLEXITY_BATCH_SIZE, PERPLEXITY_MAX_TOKENS, PERPLEXITY_SEQ_LEN


@dataclass(frozen=True)
class PerplexityResult:
    dataset: str
    perplexity: float
    windows: int
    seq_len: int
    tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


def bos_prefix(tokenizer) -> int | None:
    """The BOS id ``tokenizer`` puts before every text it encodes, or None when it adds none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True).input_ids
    return int(bos) if len(ids) and int(ids[0]) == int(bos) else None


def windows_of(ids: torch.Tensor, seq_len: int, max_tokens: int | None, bos: int | None = None) -> torch.Tensor:
    """``[count, seq_len]`` consecutive windows of ``ids`` (at most ``max_tokens`` tokens in all); with ``bos``,
    each window is ``bos`` followed by the next ``seq_len - 1`` corpus tokens."""
    body = seq_len - (bos is not None)
    count = ids.numel() // body if body > 0 else 0
    if max_tokens is not None:
        count = min(count, max_tokens // seq_len)
    if count < 1:
        raise SlimkitError(f"perplexity needs at least one window of {seq_len} tokens (budget {max_tokens})")
    windows = ids[: count * body].reshape(count, body)
    if bos is None:
        return windows
    return torch.cat([torch.full((count, 1), bos, dtype=windows.dtype), windows], dim=1)


CHECK_TOKENS = 8
"""Tokens of the first window the head path is checked on against the model's own forward."""


def _summed_nll(model, path: HeadPath | None, batch: torch.Tensor, chunk_tokens: int) -> float:
    """Sum of next-token NLL over ``batch``; the vocabulary projection runs ``chunk_tokens`` at a time.

    Full logits of a batch (tokens x vocabulary floats, 400 MB for 4 x 512 tokens of a 49k vocabulary)
    would dominate peak memory, so the base model's hidden states go through the output head and the family's output
    transform (:func:`~slimkit.primitives.arch.output_logits.output_logits`) in chunks. Without a ``path`` (a model
    whose base and head do not reproduce its forward) the model runs whole through its own forward, as few windows at
    a time as hold ``chunk_tokens`` (at least one).
    """
    batch = to_input_device(model, batch)
    targets = batch[:, 1:].reshape(-1)
    if path is None:
        rows = max(1, chunk_tokens // batch.shape[1])
        total = 0.0
        for start in range(0, batch.shape[0], rows):
            part = batch[start : start + rows]
            logits = model(part, use_cache=False).logits[:, :-1].float()
            flat = logits.reshape(-1, logits.shape[-1])
            total += F.cross_entropy(flat, part[:, 1:].reshape(-1), reduction="sum").item()
        return total
    hidden = path.hidden(batch)[:, :-1]
    hidden = hidden.reshape(-1, hidden.shape[-1])  # the head's width (may differ from the embeddings')
    total = 0.0
    for start in range(0, hidden.shape[0], chunk_tokens):
        logits = path.logits(hidden[start : start + chunk_tokens]).float()
        total += F.cross_entropy(logits, targets[start : start + chunk_tokens], reduction="sum").item()
    return total


def evaluation_path(model, windows: torch.Tensor) -> HeadPath | None:
    """How ``model``'s logits are computed for ``windows``: through its base and output transform when they give its
    forward's logits on the first window's first :data:`CHECK_TOKENS` tokens, else None (its whole forward)."""
    with torch.no_grad():
        return head_path(model, to_input_device(model, windows[:1, :CHECK_TOKENS]))


def perplexity_of_windows(
    model, windows: torch.Tensor, batch_size: int = PERPLEXITY_BATCH_SIZE, progress=None, chunk_tokens: int = 512
) -> float:
    nll, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        path = evaluation_path(model, windows)
        for start in range(0, windows.shape[0], batch_size):
            batch = windows[start : start + batch_size]
            nll += _summed_nll(model, path, batch, chunk_tokens)
            count += batch[:, 1:].numel()
            if progress is not None:
                progress(batch.shape[0])
    return math.exp(nll / count)


def corpus_ids(tokenizer, text: str, needed: int | None) -> torch.Tensor:
    """Token ids of ``text``; with a budget, only a prefix long enough for ``needed`` tokens is tokenised.

    The prefix is 8 characters per needed token (English BPE averages about 4) and
    its last token is dropped, since the cut may split a word; the full text is used if that falls short.
    """
    if needed is not None and len(text) > 8 * (needed + 1):
        ids = tokenizer(text[: 8 * (needed + 1)], return_tensors="pt", add_special_tokens=False).input_ids[0][:-1]
        if ids.numel() >= needed:
            return ids
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]


def perplexity(
    model,
    tokenizer,
    dataset: str = "wikitext2",
    seq_len: int = PERPLEXITY_SEQ_LEN,
    max_tokens: int | None = PERPLEXITY_MAX_TOKENS,
    batch_size: int = PERPLEXITY_BATCH_SIZE,
    progress=None,
) -> PerplexityResult:
    ids = corpus_ids(tokenizer, textdata.text(dataset), max_tokens)
    windows = windows_of(ids, seq_len, max_tokens, bos_prefix(tokenizer))
    value = perplexity_of_windows(model, windows, batch_size, progress)
    return PerplexityResult(dataset, value, windows.shape[0], seq_len, windows.numel())
