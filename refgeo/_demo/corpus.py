"""A word-level corpus from text that ships with every Python installation.

Two sources, both offline and deterministic for a given Python version:

* ``pydoc_data.topics``: the language reference topics that ``help()`` shows
  (about 120k word and punctuation tokens);
* docstrings of the standard-library modules (``*.py`` files directly in the
  ``stdlib`` directory), read with :mod:`ast`, so nothing is imported or executed.

Tokens are lower-cased words, digit runs and single punctuation characters.  The
vocabulary keeps the ``vocab_size - 1`` most frequent tokens (ties broken
alphabetically) plus the unknown-word token ``<unk>`` (id 0).

Examples
--------
>>> tokenize("Call f(x) 2 times.")
['call', 'f', '(', 'x', ')', '2', 'times', '.']
>>> vocab, ids = build_vocabulary(["a", "b", "a", "c", "a", "b"], vocab_size=3)
>>> vocab
['<unk>', 'a', 'b']
>>> ids.tolist()
[1, 2, 1, 0, 1, 2]
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import os
import re
import sysconfig

import numpy as np

__all__ = ["Corpus", "UNK", "build_corpus", "build_vocabulary", "tokenize"]

UNK = "<unk>"

_TOKEN = re.compile(r"[a-z]+|[0-9]+|[^\sa-z0-9]")


@dataclasses.dataclass(frozen=True, slots=True)
class Corpus:
    """A tokenized corpus.

    Attributes
    ----------
    ids : ndarray of shape (n_tokens,)
        Token ids (int32), ``0`` is ``<unk>``; read-only.
    vocab : tuple of str
        Token strings, ``vocab[0] == "<unk>"``.
    sources : dict
        Where the text came from: ``{"pydoc_data.topics": n_topics, "stdlib docstrings": n_docs,
        "stdlib files": n_files}``.
    n_types : int
        Number of distinct tokens before truncation to the vocabulary.
    unk_rate : float
        Fraction of tokens mapped to ``<unk>``.
    """

    ids: np.ndarray
    vocab: tuple[str, ...]
    sources: dict
    n_types: int
    unk_rate: float


def tokenize(text: str) -> list[str]:
    """Lower-cased words, digit runs and single punctuation characters of ``text``."""
    return _TOKEN.findall(text.lower())


def build_vocabulary(tokens: list[str], *, vocab_size: int) -> tuple[list[str], np.ndarray]:
    """Keep the ``vocab_size - 1`` most frequent tokens plus ``<unk>``; return (vocab, ids)."""
    counts = collections.Counter(tokens)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    vocab = [UNK] + [tok for tok, _ in ranked[: vocab_size - 1]]
    index = {tok: k for k, tok in enumerate(vocab)}
    ids = np.fromiter((index.get(tok, 0) for tok in tokens), dtype=np.int32, count=len(tokens))
    return vocab, ids


def _pydoc_topics() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split pydoc_data out of the stdlib
        return []
    return [topics[k] for k in sorted(topics)]


def _stdlib_docstrings(max_files: int | None) -> tuple[list[str], int]:
    stdlib = sysconfig.get_paths().get("stdlib", "")
    try:
        names = sorted(f for f in os.listdir(stdlib) if f.endswith(".py"))
    except OSError:
        return [], 0
    if max_files is not None:
        names = names[:max_files]
    docs: list[str] = []
    n_files = 0
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for name in names:
        try:
            with open(os.path.join(stdlib, name), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        n_files += 1
        for node in ast.walk(tree):
            if isinstance(node, kinds):
                doc = ast.get_docstring(node)
                if doc:
                    docs.append(doc)
    return docs, n_files


def build_corpus(*, vocab_size: int, max_files: int | None = None) -> Corpus:
    """Tokenize ``pydoc_data.topics`` and standard-library docstrings.

    Parameters
    ----------
    vocab_size : int
        Vocabulary size including ``<unk>``.
    max_files : int or None, default=None
        Read at most this many standard-library files (alphabetical order); all if None.
    """
    topics = _pydoc_topics()
    docs, n_files = _stdlib_docstrings(max_files)
    tokens: list[str] = []
    for text in topics + docs:
        tokens.extend(tokenize(text))
    if not tokens:
        raise RuntimeError("no text found: neither pydoc_data.topics nor standard-library sources are readable")
    vocab, ids = build_vocabulary(tokens, vocab_size=vocab_size)
    ids.setflags(write=False)
    return Corpus(
        ids=ids,
        vocab=tuple(vocab),
        sources={"pydoc_data.topics": len(topics), "stdlib docstrings": len(docs), "stdlib files": n_files},
        n_types=len(set(tokens)),
        unk_rate=float(np.mean(ids == 0)),
    )
