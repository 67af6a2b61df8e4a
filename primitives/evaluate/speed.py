"""Throughput of prefill and greedy decode on the model's own device, in tokens per second.

Prefill: one forward over ``batch x prompt_len`` tokens. Decode: ``new_tokens`` greedy steps with
the KV cache, one token per sequence per step. Each is the median of ``repeats`` timed runs after
one warm-up. Compare models by running them in the same process (benchmarks/ interleaves runs).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from slimkit.primitives.device.moves import input_device


@dataclass(frozen=True)
class Throughput:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    batch: int
    prompt_len: int
    new_tokens: int
    repeats: int

    def as_dict(self) -> dict:
        return asdict(self)


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":  # kernels are asynchronous: wait for them before reading the clock
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device | None = None) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def throughput(model, vocab_size: int, batch: int = 1, prompt_len: int = 128, new_tokens: int = 32, repeats: int = 3):
    generator = torch.Generator().manual_seed(0)
    device = input_device(model)
    prompt = torch.randint(3, vocab_size, (batch, prompt_len), generator=generator).to(device)
    mask = torch.ones_like(prompt)

    def prefill():
        with torch.no_grad():
            model(prompt, use_cache=False)

    def decode():
        with torch.no_grad():
            model.generate(
                prompt, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )

    prefill()
    decode()
    prefill_s = statistics.median(_timed(prefill, device) for _ in range(repeats))
    generate_s = statistics.median(_timed(decode, device) for _ in range(repeats))
    decode_s = max(generate_s - prefill_s, 1e-9)
    return Throughput(
        batch * prompt_len / prefill_s, batch * new_tokens / decode_s, batch, prompt_len, new_tokens, repeats
    )
