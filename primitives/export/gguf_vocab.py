"""A Hugging Face BPE tokenizer as GGUF ``tokenizer.ggml.*`` metadata (what llama.cpp tokenizes with).

Method note: docs/methods/export-gguf.md.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

import gguf

from slimkit.primitives.errors import SlimkitError

CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 "
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
"""llama.cpp's pre-tokenizer check text (``chktxt`` in ``convert_hf_to_gguf.py``)."""

KNOWN_PRE_TOKENIZERS = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}
"""``sha256(str(tokenizer.encode(CHECK_TEXT)))`` -> llama.cpp pre-tokenizer name."""


@dataclass
class Vocabulary:
    tokens: list[str] | list[bytes]
    token_types: list[int]
    pre: str
    check_hash: str
    special: gguf.SpecialVocab
    add_bos: bool
    warning: str | None = None
    model: str = "gpt2"
    """llama.cpp's tokenizer model: ``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece-style, with scores)."""
    scores: list[float] | None = None

    def add_to(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.token_types)
        # One add_bos_token key: the special vocabulary writes its own from tokenizer_config.json, which the measured
        # behaviour (``add_bos``) replaces; a second key would be overwritten by llama.cpp with a warning.
        self.special.add_special_token["bos"] = self.add_bos
        self.special.add_to_gguf(writer, quiet=True)


def _tokenizer_json(tokenizer: Any) -> dict[str, Any]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise SlimkitError(f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer; GGUF export needs one")
    return json.loads(backend.to_str())


def _sentencepiece_vocabulary(tokenizer: Any, vocab_size: int) -> Vocabulary:
    """A SentencePiece-style BPE tokenizer as llama.cpp's ``llama`` tokenizer (gguf's LlamaHfVocab)."""
    with tempfile.TemporaryDirectory(prefix="slimkit-vocab-") as folder:
        tokenizer.save_pretrained(folder)
        try:
            source = gguf.LlamaHfVocab(Path(folder))
        except (FileNotFoundError, TypeError) as error:
            raise SlimkitError(f"SentencePiece-style tokenizer not readable by gguf's LlamaHfVocab: {error}") from None
        tokens: list[bytes] = []
        scores: list[float] = []
        types: list[int] = []
        for text, score, kind in source.all_tokens():
            tokens.append(text)
            scores.append(float(score))
            types.append(int(kind))
        if len(tokens) > vocab_size:
            raise SlimkitError(
                f"the tokenizer has {len(tokens)} tokens but the model's embedding has {vocab_size} rows"
            )
        for index in range(len(tokens), vocab_size):
            tokens.append(f"[PAD{index}]".encode())
            scores.append(-1000.0)
            types.append(int(gguf.TokenType.UNUSED))
        special = gguf.SpecialVocab(Path(folder), n_vocab=vocab_size)
    return Vocabulary(tokens, types, "default", "", special, _adds_bos(tokenizer), model="llama", scores=scores)


def pre_tokenizer_name(tokenizer: Any) -> tuple[str | None, str]:
    """The llama.cpp pre-tokenizer name of ``tokenizer`` (None when unknown) and the check hash."""
    ids = tokenizer.encode(CHECK_TEXT)  # with the tokenizer's own special tokens, as llama.cpp's converter
    digest = sha256(str(ids).encode()).hexdigest()
    return KNOWN_PRE_TOKENIZERS.get(digest), digest


def _adds_bos(tokenizer: Any) -> bool:
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == bos


def vocabulary(tokenizer: Any, vocab_size: int) -> Vocabulary:
    """GGUF tokenizer metadata for a BPE ``tokenizer`` and a model of ``vocab_size`` rows."""
    data = _tokenizer_json(tokenizer)
    kind = str(data["model"]["type"])
    if kind != "BPE":
        raise SlimkitError(
            f"tokenizer model '{kind}': GGUF export writes BPE tokenizers (byte-level or SentencePiece-style)"
        )
    if data["model"].get("byte_fallback"):
        return _sentencepiece_vocabulary(tokenizer, vocab_size)
    vocab = tokenizer.get_vocab()
    if vocab and max(vocab.values()) >= vocab_size:
        raise SlimkitError(
            f"the tokenizer has token id {max(vocab.values())} but the model's embedding has {vocab_size} rows"
        )
    reverse = {index: token for token, index in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        token = reverse.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            special = index in decoder and decoder[index].special
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
            tokens.append(token)
        else:
            types.append(gguf.TokenType.NORMAL)
            tokens.append(token)
    pre, digest = pre_tokenizer_name(tokenizer)
    warning = None
    if pre is None:
        pre = "default"
        warning = (
            f"pre-tokenizer not recognised (check hash {digest[:12]}...): written as 'default', so llama.cpp may split "
            "text differently from the Hugging Face tokenizer (token ids fed directly are unaffected)"
        )
    with tempfile.TemporaryDirectory(prefix="slimkit-vocab-") as folder:
        tokenizer.save_pretrained(folder)
        special = gguf.SpecialVocab(Path(folder), load_merges=True, n_vocab=vocab_size)
    if not special.merges:
        raise SlimkitError("the tokenizer has no BPE merges; llama.cpp's gpt2 tokenizer needs them")
    return Vocabulary(tokens, [int(t) for t in types], pre, digest, special, _adds_bos(tokenizer), warning)


__all__ = ["CHECK_TEXT", "KNOWN_PRE_TOKENIZERS", "Vocabulary", "pre_tokenizer_name", "vocabulary"]
