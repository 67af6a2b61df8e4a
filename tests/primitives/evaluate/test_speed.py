"""primitives/evaluate/speed.py: prefill and decode throughput."""

from __future__ import annotations

from slimkit.primitives.evaluate.speed import throughput


def test_throughput_reports_positive_rates(llama):
    result = throughput(llama, vocab_size=300, prompt_len=8, new_tokens=4, repeats=1)
    assert result.prefill_tokens_per_s > 0 and result.decode_tokens_per_s > 0
