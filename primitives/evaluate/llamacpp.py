"""Evaluate a GGUF file in llama.cpp (through llama-cpp-python): perplexity on token ids, and speed.

Token ids, not text, go in: the same window slimkit evaluates, so a perplexity difference is the
model's, not the tokenizers'. :func:`gguf_perplexity` runs one window with logits for every position
and computes ``exp(mean NLL)`` of tokens 2..n exactly as :func:`slimkit.primitives.evaluate.perplexity`
does for one window. :func:`gguf_throughput` times prefill (``prompt_len`` tokens) and greedy decode
(``new_tokens``) with a fixed thread count.

llama-cpp-python is an optional dependency (``pip install "slimkit[llamacpp]"``; it builds llama.cpp
from source); without it these functions raise one line saying so.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slimkit.primitives.errors import SlimkitError


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as error:  # pragma: no cover - depends on the install
        raise SlimkitError(
            "llama-cpp-python is not installed (pip install 'slimkit[llamacpp]'; it builds llama.cpp from source)"
        ) from error
    return llama_cpp


@contextmanager
def _quiet_stderr():
    """llama.cpp logs to the C-level stderr even with verbose=False during loading; keep it for errors only."""
    try:
        saved = os.dup(2)
    except OSError:  # pragma: no cover
        yield
        return
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


F32_TYPE = 0
"""ggml's type id of float32 (``GGML_TYPE_F32``), for the KV cache."""


def load_gguf(
    path: str | os.PathLike,
    n_ctx: int,
    threads: int | None = None,
    logits_all: bool = False,
    f32_cache: bool = False,
) -> Any:
    """A ``llama_cpp.Llama`` for ``path`` on the CPU; one line if llama.cpp refuses the file. ``f32_cache``: keys
    and values cached in float32 instead of llama.cpp's float16 (to tell an export's error from the cache's)."""
    llama_cpp = _llama_cpp()
    threads = threads or max(1, os.cpu_count() or 1)
    try:
        with _quiet_stderr():
            return llama_cpp.Llama(
                model_path=str(Path(path)),
                n_ctx=n_ctx,
                n_batch=n_ctx,
                n_ubatch=n_ctx,
                n_threads=threads,
                n_threads_batch=threads,
                logits_all=logits_all,
                n_gpu_layers=0,
                **({"type_k": F32_TYPE, "type_v": F32_TYPE} if f32_cache else {}),
                verbose=False,
            )
    except ValueError as error:
        raise SlimkitError(f"llama.cpp could not load {path}: {error}") from error


def gguf_logits(
    path: str | os.PathLike, ids: list[int], threads: int | None = None, f32_cache: bool = False
) -> np.ndarray:
    """llama.cpp's logits (``len(ids) x vocab``, float32) for one sequence of token ids."""
    model = load_gguf(path, n_ctx=len(ids), threads=threads, logits_all=True, f32_cache=f32_cache)
    try:
        model.eval(list(ids))
        return np.array(model.scores[: len(ids)], dtype=np.float32)
    finally:
        model.close()


def nll_perplexity(logits: np.ndarray | torch.Tensor, ids: list[int] | torch.Tensor) -> float:
    """``exp`` of the mean next-token NLL of ``ids[1:]`` under ``logits[:-1]`` (computed in float64)."""
    logits = torch.as_tensor(np.asarray(logits), dtype=torch.float64)
    targets = torch.as_tensor(list(ids), dtype=torch.long)
    log_probs = torch.log_softmax(logits[:-1], dim=-1)
    nll = -log_probs.gather(1, targets[1:, None]).mean()
    return math.exp(float(nll))


def gguf_perplexity(path: str | os.PathLike, ids: list[int], threads: int | None = None) -> float:
    """Perplexity of one window of token ids in llama.cpp."""
    return nll_perplexity(gguf_logits(path, ids, threads), ids)


def gguf_perplexity_of_windows(
    path: str | os.PathLike, windows: torch.Tensor, threads: int | None = None, f32_cache: bool = False
) -> float:
    """Perplexity of ``windows`` (``[count, seq_len]`` token ids) in llama.cpp, scored as
    :func:`slimkit.primitives.evaluate.perplexity.perplexity_of_windows` scores them in PyTorch: each window from an
    empty cache, its ``seq_len - 1`` next tokens, NLL summed over all windows then averaged."""
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise SlimkitError(f"windows must be [count, seq_len >= 2] token ids, got shape {tuple(windows.shape)}")
    seq_len = int(windows.shape[1])
    model = load_gguf(path, n_ctx=seq_len, threads=threads, logits_all=True, f32_cache=f32_cache)
    nll = 0.0
    try:
        for window in windows.tolist():
            model.reset()
            model.eval(window)
            logits = torch.from_numpy(np.array(model.scores[: seq_len - 1], dtype=np.float32)).double()
            targets = torch.tensor(window[1:])
            nll -= float(torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum())
    finally:
        model.close()
    return math.exp(nll / (windows.shape[0] * (seq_len - 1)))


def gguf_throughput(
    model: Any, prompt_len: int = 128, new_tokens: int = 32, threads: int | None = None, repeats: int = 3
) -> dict[str, float]:
    """Median prefill and decode tokens/s in llama.cpp (batch 1, greedy from fixed random ids).

    ``model`` is a GGUF path (loaded and closed here) or a loaded ``llama_cpp.Llama`` with a context of at
    least ``prompt_len + new_tokens``. Decode feeds one token per call, as a chat client does.
    """
    owned = not hasattr(model, "eval")
    if owned:
        model = load_gguf(model, n_ctx=prompt_len + new_tokens, threads=threads)
    vocab = model.n_vocab()
    prompt = [int(i) for i in torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0))]
    prefill, decode = [], []
    try:
        for _ in range(repeats):
            model.reset()
            start = time.perf_counter()
            model.eval(prompt)
            prefill.append(prompt_len / (time.perf_counter() - start))
            start = time.perf_counter()
            for _ in range(new_tokens):
                token = int(np.argmax(model.scores[model.n_tokens - 1]))
                model.eval([token])
            decode.append(new_tokens / (time.perf_counter() - start))
    finally:
        if owned:
            model.close()
    return {"prefill_tokens_per_s": float(np.median(prefill)), "decode_tokens_per_s": float(np.median(decode))}


__all__ = ["gguf_logits", "gguf_perplexity", "gguf_throughput", "load_gguf", "nll_perplexity"]
