"""Named local text corpora, read through the ``datasets`` library from the shipped files.

* ``wikitext2``: ``wikitext2/wiki.test.raw``, the raw test split with CRLF normalised to LF. This
  copy has no blank lines, so the text equals ``"".join(test["text"])`` of the HF release, not
  the ``"\n\n".join`` of GPTQ-style scripts: perplexities are close to, not equal to, published ones.
* ``ptb``: ``ptb/ptb.test.txt`` (split ``valid``: ``ptb.valid.txt``), sentences stripped and
  joined by a space, as ``" ".join(sentence)`` over ptb_text_only.
* ``c4``: ``c4/c4_validation_2k.jsonl``, 2,000 validation documents.
* ``alpaca``: ``alpaca/alpaca_5000.json``, each record rendered as instruction / input / response.

``documents(name)`` returns the list of documents (one for the streams wikitext2 and ptb);
``text(name)`` the whole corpus as one string.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from slimkit.primitives.datasets.data_paths import data_file, datasets_cache
from slimkit.primitives.errors import SlimkitError


@dataclass(frozen=True)
class Corpus:
    name: str
    files: dict[str, str]
    kind: str  # "stream" (one running text) or "documents"


CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in (
        Corpus("wikitext2", {"test": "wikitext2/wiki.test.raw"}, "stream"),
        Corpus("ptb", {"test": "ptb/ptb.test.txt", "valid": "ptb/ptb.valid.txt"}, "stream"),
        Corpus("c4", {"validation": "c4/c4_validation_2k.jsonl"}, "documents"),
        Corpus("alpaca", {"train": "alpaca/alpaca_5000.json"}, "documents"),
    )
}


def corpus(name: str) -> Corpus:
    if name not in CORPORA:
        raise SlimkitError(f"unknown dataset '{name}'; known: {', '.join(CORPORA)}")
    return CORPORA[name]


def _split(c: Corpus, split: str | None) -> str:
    split = split or next(iter(c.files))
    if split not in c.files:
        raise SlimkitError(f"dataset '{c.name}' has no split '{split}'; available: {', '.join(c.files)}")
    return split


def alpaca_text(record: dict) -> str:
    prompt = f"### Instruction:\n{record['instruction']}\n\n"
    if record.get("input"):
        prompt += f"### Input:\n{record['input']}\n\n"
    return prompt + f"### Response:\n{record['output']}"


@cache
def documents(name: str, split: str | None = None) -> tuple[str, ...]:
    import datasets

    c = corpus(name)
    split = _split(c, split)
    path = str(data_file(c.files[split]))
    cache_dir = str(datasets_cache())  # under slimkit's cache folder, not the home folder's
    datasets.disable_progress_bars()
    try:
        if c.kind == "stream":
            lines = datasets.load_dataset(
                "text", data_files=path, split="train", keep_linebreaks=True, cache_dir=cache_dir
            )["text"]
            if name == "ptb":
                return (" ".join(line.strip() for line in lines),)
            return ("".join(lines).replace("\r\n", "\n"),)
        records = datasets.load_dataset("json", data_files=path, split="train", cache_dir=cache_dir)
    except SlimkitError:
        raise
    except Exception as error:
        raise SlimkitError(f"cannot read dataset '{name}' from {path}: {type(error).__name__}: {error}") from error
    if name == "alpaca":
        return tuple(alpaca_text(r) for r in records)
    return tuple(records["text"])


def text(name: str, split: str | None = None) -> str:
    return "\n\n".join(documents(name, split))
