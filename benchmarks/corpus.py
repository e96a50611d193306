"""The real-text corpus of the critical-batch benchmark: the Python sources of the installed
megatron-core wheel (its version pinned per leg by constraints/), byte-level, written as Megatron's
indexed dataset by megatron-core's own builder (``IndexedDatasetBuilder``). Every machine that
installs the project has it, without a download.

One document per ``.py`` file under ``megatron/core``, in the sorted order of its path inside the
package: its bytes as token ids 0-255, then the end-of-document id EOD = 256. pretrain_gpt.py reads
it with

    --data-path DIR/<name>_text_document --split 98,2,0 --tokenizer-type NullTokenizer --vocab-size
    V --eod-mask-loss

where V makes NullTokenizer's end-of-document id 256 on that Megatron-LM tree
(:func:`tokenizer_flags`: 257 where the tree's NullTokenizer takes ``eod_id`` and defaults it to
``vocab_size - 1``, 256 where it is ``vocab_size``). Megatron's ``--split`` gives the validation
documents.

    python -m benchmarks.corpus [--out DIR]      (make corpus; DIR defaults to .cache/corpus)

writes ``<name>_text_document.{bin,idx}`` and ``<name>.json`` (files, documents, tokens, the sha256
of the token stream), ``<name>`` = ``megatron-core-<version>``; a second call finds them and writes
nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".cache" / "corpus"
EOD = 256
SPLIT = "98,2,0"


def sources() -> tuple[str, list[Path]]:
    """The installed megatron-core's version and its ``.py`` files under megatron/core, sorted by
    relative path."""
    import megatron.core

    from megatron_ga_ext.integration.compat import megatron_core_version

    package = Path(megatron.core.__file__).resolve().parent
    files = sorted(package.rglob("*.py"), key=lambda path: path.relative_to(package).as_posix())
    return megatron_core_version(), files


def prefix(out: Path = DEFAULT_OUT) -> Path:
    """The path prefix ``--data-path`` takes (without .bin / .idx)."""
    version, _ = sources()
    return out / f"megatron-core-{version}_text_document"


def build(out: Path = DEFAULT_OUT) -> dict:
    """Write the corpus under ``out`` unless it is there; its description (the JSON beside it)."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    version, files = sources()
    name = f"megatron-core-{version}"
    described = out / f"{name}.json"
    data = prefix(out)
    if described.is_file() and all(
        Path(f"{data}{suffix}").is_file() for suffix in (".bin", ".idx")
    ):
        return json.loads(described.read_text())
    out.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(data) + ".bin", dtype=numpy.uint16)
    digest, tokens = hashlib.sha256(), 0
    for path in files:
        ids = numpy.frombuffer(path.read_bytes(), dtype=numpy.uint8).astype(numpy.uint16)
        ids = numpy.append(ids, numpy.uint16(EOD))
        builder.add_item(torch.from_numpy(ids.astype(numpy.int64)))
        builder.end_document()
        digest.update(ids.tobytes())
        tokens += len(ids)
    builder.finalize(str(data) + ".idx")
    description = {
        "source": f"megatron-core {version}: megatron/core/**/*.py, sorted",
        "files": len(files),
        "documents": len(files),
        "tokens": tokens,
        "eod": EOD,
        "sha256": digest.hexdigest(),
        "data_path": str(data),
        "split": SPLIT,
    }
    described.write_text(json.dumps(description, indent=1) + "\n")
    return description


#: The held-out validation set of :func:`heldout_flags`: of every HELDOUT_STRIDE-th file (sorted
#: order), those of at most HELDOUT_TOKENS / 2 bytes, until it holds at least HELDOUT_TOKENS tokens;
#: the training set is every other file.
HELDOUT_STRIDE = 37
HELDOUT_TOKENS = 8192


def heldout(out: Path = DEFAULT_OUT) -> dict:
    """Write the corpus split by files into a training and a held-out validation dataset, unless
    they are there: ``<name>-train_text_document`` and ``<name>-valid_text_document``; their
    description (the JSON beside them). Every run of the critical-batch sweep evaluates on all of
    the validation set (``--full-validation``), the same set in every run; its iterator cycles
    across the DP ranks, so not exactly the same samples at each evaluation (the same weights
    evaluated twice differ by a median 0.0028 nats: docs/critical-batch.md)."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    version, files = sources()
    name = f"megatron-core-{version}-heldout"
    described = out / f"{name}.json"
    if described.is_file():
        return json.loads(described.read_text())
    valid, tokens = [], 0
    for path in files[::HELDOUT_STRIDE]:
        if tokens >= HELDOUT_TOKENS:
            break
        if path.stat().st_size > HELDOUT_TOKENS // 2:
            continue
        valid.append(path)
        tokens += path.stat().st_size + 1
    out.mkdir(parents=True, exist_ok=True)
    description = {"source": f"megatron-core {version}: megatron/core/**/*.py, sorted", "eod": EOD}
    for split, chosen in (("train", [p for p in files if p not in valid]), ("valid", valid)):
        data = out / f"{name}-{split}_text_document"
        builder = IndexedDatasetBuilder(str(data) + ".bin", dtype=numpy.uint16)
        digest, count = hashlib.sha256(), 0
        for path in chosen:
            ids = numpy.append(
                numpy.frombuffer(path.read_bytes(), dtype=numpy.uint8).astype(numpy.uint16), EOD
            )
            builder.add_item(torch.from_numpy(ids.astype(numpy.int64)))
            builder.end_document()
            digest.update(ids.astype(numpy.uint16).tobytes())
            count += len(ids)
        builder.finalize(str(data) + ".idx")
        description[split] = {
            "documents": len(chosen),
            "tokens": count,
            "sha256": digest.hexdigest(),
            "data_path": str(data),
        }
    description["valid"]["files"] = [p.name for p in valid]
    described.write_text(json.dumps(description, indent=1) + "\n")
    return description


def heldout_flags(megatron_lm: Path, out: Path = DEFAULT_OUT) -> list[str]:
    """pretrain_gpt.py's data flags for :func:`heldout`'s split (built if it is not there): train on
    the training files, evaluate on all of the held-out ones at every evaluation."""
    description = heldout(out)
    return [
        "--train-data-path",
        description["train"]["data_path"],
        "--valid-data-path",
        description["valid"]["data_path"],
        "--full-validation",
        # 0.19's --full-validation indexes eval_iters as a list, which only this makes
        "--multiple-validation-sets",
        *tokenizer_flags(megatron_lm),
        "--eod-mask-loss",
    ]


def tokenizer_flags(megatron_lm: Path) -> list[str]:
    """NullTokenizer with end-of-document id EOD on the Megatron-LM tree ``megatron_lm`` (read from
    its source: 0.18 and later take ``eod_id``, defaulting it to vocab_size - 1; earlier ones use
    vocab_size itself)."""
    null = megatron_lm / "megatron/core/tokenizers/text/libraries/null_tokenizer.py"
    newer = (
        null.is_file()
        and re.search(r"def __init__\(self, vocab_size, eod_id\b", null.read_text()) is not None
    )
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(EOD + 1 if newer else EOD)]


def data_flags(megatron_lm: Path, out: Path = DEFAULT_OUT) -> list[str]:
    """pretrain_gpt.py's data and tokenizer flags for the corpus (built if it is not there)."""
    build(out)
    return [
        "--data-path",
        str(prefix(out)),
        "--split",
        SPLIT,
        *tokenizer_flags(megatron_lm),
        "--eod-mask-loss",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.corpus", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="where to write it (default: .cache/corpus)"
    )
    description = build(parser.parse_args(argv).out)
    print(json.dumps(description, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
