"""primitives/datasets/textdata.py: the bundled text corpora as read."""

from __future__ import annotations

from slimkit.primitives.datasets import textdata


def test_textdata_quirks():
    wiki = textdata.text("wikitext2")
    assert "\r" not in wiki and wiki.startswith(" = Robert Boulter = \n")
    assert textdata.text("ptb").startswith("no it was n't black monday but while")
    assert len(textdata.documents("c4")) == 2000 and len(textdata.documents("alpaca")) == 5000
