"""benchmarks/corpus.py: the real-text corpus written by megatron-core's own builder reads back,
through megatron-core's own reader, as the package's source files byte for byte, one document each
ending in EOD; and the tokenizer flags give NullTokenizer that end-of-document id on every tested
Megatron-LM tree of this Python."""

from __future__ import annotations

import importlib.util

import numpy
import pytest

pytest.importorskip("megatron.core.datasets.indexed_dataset")

from benchmarks import corpus
from tools.regress import NO_SOURCE, sources


def test_the_corpus_reads_back_as_the_sources_one_document_each(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    described = corpus.build(tmp_path)
    version, files = corpus.sources()
    dataset = IndexedDataset(str(corpus.prefix(tmp_path)))
    assert len(files) > 100 and len(dataset) == described["documents"] == len(files)
    assert list(dataset.document_indices) == list(
        range(len(files) + 1)
    )  # one sequence per document
    for index in (0, len(files) // 2, len(files) - 1):
        ids = dataset[index]
        assert (
            ids[-1] == corpus.EOD
            and bytes(ids[:-1].astype(numpy.uint8)) == files[index].read_bytes()
        ), files[index]
    assert sum(len(dataset[i]) for i in range(len(dataset))) == described["tokens"]
    assert int(max(dataset[i].max() for i in range(len(dataset)))) == corpus.EOD  # bytes below it
    assert described["source"].startswith(f"megatron-core {version}")
    stamp = (tmp_path / f"megatron-core-{version}.json").stat().st_mtime_ns
    assert corpus.build(tmp_path) == described  # cached: found, not written again
    assert (tmp_path / f"megatron-core-{version}.json").stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    "tree",
    sources([]) or [pytest.param(None, marks=pytest.mark.skip(reason=NO_SOURCE))],
    ids=lambda tree: getattr(tree, "name", "none"),
)
def test_the_tokenizer_flags_give_nulltokenizer_the_corpus_eod(tree):
    """The tree's own NullTokenizer (the module loaded from its source), built as Megatron-LM builds
    it from --vocab-size: its end-of-document id is the corpus's."""
    flags = corpus.tokenizer_flags(tree)
    assert flags[:2] == ["--tokenizer-type", "NullTokenizer"]
    path = tree / "megatron/core/tokenizers/text/libraries/null_tokenizer.py"
    spec = importlib.util.spec_from_file_location(
        f"null_tokenizer_{tree.name.replace('-', '_')}", path
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokenizer = module.NullTokenizer(int(flags[flags.index("--vocab-size") + 1]))
    assert tokenizer.eod == corpus.EOD and tokenizer.vocab_size == corpus.EOD + 1
