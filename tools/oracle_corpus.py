"""Write tests/oracle/corpus.jsonl: the launch lines the oracle tier holds ``megatron-ga check`` to
(make oracle).

    python tools/oracle_corpus.py [CAPTURES]

Three kinds of line, each a JSON object {"id", "kind", "line", "world", "why"} (``world``: the ranks
the launcher starts, which upstream reads from WORLD_SIZE):

* ``example``: Megatron-LM's own example scripts (examples/**/*.sh at core_v0.19.0 and d98e8a64), as
  torchrun runs them (CAPTURES: a directory of ``<ref>__<name>.txt`` files, each the argv the script
  handed its launcher, NUL-separated, captured by running the script with stub launchers), at their
  own node count and at more nodes;
* ``violation``: a valid line with one rule of upstream's validation broken;
* ``edge``: valid and invalid layouts around the batch arithmetic (DP, GA, schedules).

The corpus is data; this script is how it was made, rerun only to extend it.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "oracle" / "corpus.jsonl"
#: A small GPT every synthetic line starts from (24 layers divide PP 1-4, 6, 8; 16 heads divide TP
#: 1-16).
MODEL = (
    "--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048"
)
TRAIN = "--train-iters 1000 --lr 3e-4 --bf16"


def gpt(world: int, flags: str, train: str = TRAIN, model: str = MODEL) -> tuple[str, int]:
    """A torchrun line of ``world`` ranks (8 a node) running pretrain_gpt.py with the model and
    ``flags``."""
    nodes, per_node = (world // 8, 8) if world % 8 == 0 else (1, world)
    return (
        f"torchrun --nnodes {nodes} --nproc-per-node {per_node} pretrain_gpt.py {model} {flags} "
        f"{train}",
        world,
    )


def examples(captures: Path) -> list[dict]:
    """Each captured example line at its own node count and at 2, 4 and 16 nodes of 8."""
    found: dict[str, dict] = {}
    for path in sorted(captures.glob("*.txt")):
        words = [w for w in path.read_text().split("\0") if w]
        if (
            "torch.distributed.run" in words
        ):  # [uv run] python -m torch.distributed.run: torchrun's options follow
            words = ["torchrun", *words[words.index("torch.distributed.run") + 1 :]]
        words = words[words.index("torchrun") :]
        for nodes, edit in _VARIANTS:
            line = _edited(_with_nodes(words, nodes), edit)
            world = int(_option(line, "--nproc_per_node")) * int(_option(line, "--nnodes") or 1)
            text = shlex.join(line)
            if text not in {e["line"] for e in found.values()}:
                name = (
                    f"example-{path.stem}"
                    + ("" if nodes is None else f"-{nodes}nodes")
                    + (edit and f"-{edit}")
                )
                found[name] = {
                    "id": name,
                    "kind": "example",
                    "line": text,
                    "world": world,
                    "why": f"Megatron-LM {path.stem.replace('__', ': ')}",
                }
    return list(found.values())


#: (nodes, edit): the script as it is, at more nodes, and with the batch flags a user edits first.
_VARIANTS = [(None, ""), (2, ""), (4, ""), (16, ""), (2, "mbs2"), (None, "gbs-plus-1")]


def _edited(words: list[str], edit: str) -> list[str]:
    """``mbs2``: --micro-batch-size 2; ``gbs-plus-1``: one more than the script's
    --global-batch-size."""
    words = list(words)
    if edit == "mbs2" and "--micro-batch-size" in words:
        words[words.index("--micro-batch-size") + 1] = "2"
    if edit == "gbs-plus-1" and "--global-batch-size" in words:
        at = words.index("--global-batch-size") + 1
        words[at] = str(int(words[at]) + 1)
    return words


def _option(words: list[str], flag: str) -> str | None:
    return words[words.index(flag) + 1] if flag in words else None


def _with_nodes(words: list[str], nodes: int | None) -> list[str]:
    words = list(words)
    if nodes is not None:
        if "--nnodes" in words:
            words[words.index("--nnodes") + 1] = str(nodes)
        else:
            words[1:1] = ["--nnodes", str(nodes)]
    return words


FSDP2 = (
    "--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights "
    "--ckpt-format torch_dist"
)
MOE = "--num-experts 8 --moe-router-topk 2"
#: (id, world, flags, why): a valid line with one rule broken, or the valid line beside it.
VIOLATIONS = [
    (
        "fsdp2-valid",
        8,
        f"{FSDP2} --micro-batch-size 1 --global-batch-size 64",
        "FSDP2 with every requirement met",
    ),
    (
        "fsdp2-pp2",
        8,
        f"{FSDP2} --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 64",
        "FSDP2 with PP 2 (arguments.py:999)",
    ),
    (
        "fsdp2-ep2",
        8,
        f"{FSDP2} {MOE} --expert-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 64",
        "FSDP2 with EP 2 (arguments.py:1001)",
    ),
    (
        "fsdp2-tied",
        8,
        "--use-torch-fsdp2 --no-gradient-accumulation-fusion --ckpt-format torch_dist "
        "--micro-batch-size 1 --global-batch-size 64",
        "FSDP2 with tied embeddings (arguments.py:1010)",
    ),
    (
        "fsdp2-dist-opt",
        8,
        f"{FSDP2} --use-distributed-optimizer --micro-batch-size 1 --global-batch-size 64",
        "FSDP2 with the distributed optimizer (arguments.py:1003)",
    ),
    (
        "fsdp2-grad-acc-fusion",
        8,
        "--use-torch-fsdp2 --untie-embeddings-and-output-weights --ckpt-format torch_dist "
        "--micro-batch-size 1 --global-batch-size 64",
        "FSDP2 with gradient-accumulation fusion, on by default (:1005)",
    ),
    (
        "fsdp2-ckpt-torch",
        8,
        "--use-torch-fsdp2 --no-gradient-accumulation-fusion "
        "--untie-embeddings-and-output-weights --ckpt-format torch --micro-batch-size 1 "
        "--global-batch-size 64",
        "FSDP2 with --ckpt-format torch (:1007)",
    ),
    (
        "eval-gbs-valid",
        16,
        "--micro-batch-size 1 --global-batch-size 64 --eval-micro-batch-size 2 "
        "--eval-global-batch-size 32",
        "eval GBS divisible by eval MBS x DP",
    ),
    (
        "eval-gbs-not-divisible",
        16,
        "--micro-batch-size 1 --global-batch-size 64 --eval-micro-batch-size 2 "
        "--eval-global-batch-size 20",
        "eval GBS 20 at eval MBS 2 x DP 8 (arguments.py:694)",
    ),
    (
        "seq-cp8-1000",
        8,
        "--context-parallel-size 8 --micro-batch-size 1 --global-batch-size 8",
        "seq 1000 at CP 8: not a multiple of 2 x CP (arguments.py:1296)",
    ),
    (
        "heads-12-tp8",
        8,
        "--tensor-model-parallel-size 8 --micro-batch-size 1 --global-batch-size 8",
        "12 heads at TP 8 (transformer_config.py)",
    ),
    (
        "layout-mtp-without-layers",
        16,
        "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et*6|t*6m|t*6|t*6L' "
        "--micro-batch-size 1 --global-batch-size 64",
        "a layout with an MTP stage and no --mtp-num-layers (pipeline_parallel_layer_layout.py)",
    ),
    (
        "layout-13-t-for-12",
        16,
        "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et*7|t*6L' "
        "--micro-batch-size 1 --global-batch-size 64",
        "13 t for --num-layers 12",
    ),
    (
        "layout-valid",
        16,
        "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et*6|t*6L' "
        "--micro-batch-size 1 --global-batch-size 64",
        "a layout of 12 t on PP 2",
    ),
    (
        "hierarchical-cp-product",
        8,
        "--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes "
        "2 4 --micro-batch-size 1 --global-batch-size 8",
        "hierarchical CP sizes whose product is not CP (arguments.py:564)",
    ),
    (
        "hierarchical-cp-missing",
        8,
        "--context-parallel-size 4 --cp-comm-type a2a+p2p --micro-batch-size 1 "
        "--global-batch-size 8",
        "a2a+p2p without hierarchical sizes (arguments.py:566)",
    ),
    (
        "hierarchical-cp-valid",
        8,
        "--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes "
        "2 2 --micro-batch-size 1 --global-batch-size 8",
        "hierarchical CP 2 x 2",
    ),
    (
        "batch-size",
        8,
        "--batch-size 8 --micro-batch-size 1 --global-batch-size 8",
        "--batch-size (arguments.py:573)",
    ),
    (
        "vpp-pp2-no-overlap",
        8,
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 6 "
        "--no-overlap-p2p-communication --micro-batch-size 1 --global-batch-size 16",
        "VPP at PP 2 with --no-overlap-p2p-communication (arguments.py:971)",
    ),
    (
        "vpp-pp2-overlap",
        8,
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 6 "
        "--micro-batch-size 1 --global-batch-size 16",
        "VPP at PP 2 with p2p overlap (the default)",
    ),
    (
        "vpp-pp4",
        8,
        "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
        "--micro-batch-size 1 --global-batch-size 16",
        "VPP 2 at PP 4",
    ),
    (
        "overlap-param-gather-no-dist-opt",
        8,
        "--overlap-grad-reduce --overlap-param-gather --micro-batch-size 1 --global-batch-size 16",
        "--overlap-param-gather without the distributed optimizer (arguments.py:991)",
    ),
    (
        "overlap-param-gather-no-grad-reduce",
        8,
        "--use-distributed-optimizer --overlap-param-gather --micro-batch-size 1 "
        "--global-batch-size 16",
        "--overlap-param-gather without --overlap-grad-reduce (:994)",
    ),
    (
        "overlap-param-gather-valid",
        8,
        "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
        "--micro-batch-size 1 --global-batch-size 16",
        "param gather overlap with what it needs",
    ),
    (
        "lr-warmup-fraction-and-iters",
        8,
        "--lr-warmup-fraction 0.01 --lr-warmup-iters 100 --micro-batch-size 1 "
        "--global-batch-size 16",
        "--lr-warmup-fraction with --lr-warmup-iters",
    ),
    (
        "seq-over-positions",
        8,
        "--micro-batch-size 1 --global-batch-size 16 --seq-length 4096",
        "seq 4096 over --max-position-embeddings 2048 (arguments.py:1314)",
    ),
    (
        "hybrid-cp-valid",
        8,
        "--context-parallel-size 2 --hybrid-context-parallel --calculate-per-token-loss "
        "--micro-batch-size 1 --global-batch-size 16",
        "hybrid CP with per-token loss",
    ),
    (
        "hybrid-cp-no-per-token",
        8,
        "--context-parallel-size 2 --hybrid-context-parallel --micro-batch-size 1 "
        "--global-batch-size 16",
        "hybrid CP without --calculate-per-token-loss (arguments.py:1409)",
    ),
    (
        "hybrid-cp-pp2",
        8,
        "--context-parallel-size 2 --pipeline-model-parallel-size 2 --hybrid-context-parallel "
        "--calculate-per-token-loss --micro-batch-size 1 --global-batch-size 16",
        "hybrid CP with PP 2 (:1405)",
    ),
    (
        "hybrid-cp-mfsdp",
        8,
        "--context-parallel-size 2 --hybrid-context-parallel --calculate-per-token-loss "
        "--use-megatron-fsdp --use-distributed-optimizer --ckpt-format fsdp_dtensor "
        "--micro-batch-size 1 --global-batch-size 16",
        "hybrid CP with Megatron-FSDP (:1407)",
    ),
    (
        "ep-without-experts",
        8,
        "--expert-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16",
        "EP 2 without --num-experts",
    ),
    (
        "ep2-valid",
        8,
        f"{MOE} --expert-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16",
        "8 experts on EP 2",
    ),
    (
        "ep-over-experts",
        16,
        f"{MOE} --expert-model-parallel-size 16 --micro-batch-size 1 --global-batch-size 16",
        "EP 16 for 8 experts",
    ),
    (
        "ckpt-torch-dcp-no-fsdp",
        8,
        "--ckpt-format torch_dcp --micro-batch-size 1 --global-batch-size 16",
        "torch_dcp without FSDP2 (arguments.py:1613)",
    ),
    (
        "ckpt-torch-dcp-fsdp2-tp2",
        8,
        "--use-torch-fsdp2 --no-gradient-accumulation-fusion "
        "--untie-embeddings-and-output-weights --ckpt-format torch_dcp "
        "--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16",
        "torch_dcp under TP (arguments.py:1615)",
    ),
    (
        "ckpt-fsdp-dtensor-no-mfsdp",
        8,
        "--ckpt-format fsdp_dtensor --micro-batch-size 1 --global-batch-size 16",
        "fsdp_dtensor without Megatron-FSDP (arguments.py:1621)",
    ),
    (
        "mfsdp-valid",
        8,
        "--use-megatron-fsdp --use-distributed-optimizer --ckpt-format fsdp_dtensor "
        "--micro-batch-size 1 --global-batch-size 16",
        "Megatron-FSDP with its optimizer and format",
    ),
    (
        "mfsdp-ckpt-torch-dist",
        8,
        "--use-megatron-fsdp --use-distributed-optimizer --ckpt-format torch_dist "
        "--micro-batch-size 1 --global-batch-size 16",
        "Megatron-FSDP with torch_dist (arguments.py:1146)",
    ),
    (
        "mfsdp-no-dist-opt",
        8,
        "--use-megatron-fsdp --ckpt-format fsdp_dtensor --micro-batch-size 1 --global-batch-size "
        "16",
        "Megatron-FSDP without the distributed optimizer",
    ),
    (
        "decrease-batch-size",
        32,
        "--micro-batch-size 1 --global-batch-size 100 --decrease-batch-size-if-needed",
        "GBS 100 at MBS x DP 32: Megatron trains at 96",
    ),
    (
        "no-decrease-batch-size",
        32,
        "--micro-batch-size 1 --global-batch-size 100",
        "GBS 100 at MBS x DP 32",
    ),
    (
        "schedule-out-of-order",
        8,
        "--micro-batch-size 1 --step-batch-size-schedule '1M:32 0:16'",
        "a schedule written out of order, which upstream sorts",
    ),
    (
        "schedule-and-gbs",
        8,
        "--micro-batch-size 1 --global-batch-size 32 --step-batch-size-schedule '0:16 1M:32'",
        "a schedule with --global-batch-size (arguments.py:680)",
    ),
    (
        "schedule-and-decrease",
        8,
        "--micro-batch-size 1 --step-batch-size-schedule '0:16 1M:32' "
        "--decrease-batch-size-if-needed",
        "a schedule with --decrease-batch-size-if-needed (calculator)",
    ),
    (
        "schedule-stage-not-divisible",
        8,
        "--micro-batch-size 2 --step-batch-size-schedule '0:16 1M:20'",
        "a stage GBS 20 not divisible by MBS 2 x DP 8",
    ),
    (
        "schedule-valid",
        16,
        "--micro-batch-size 1 --step-batch-size-schedule '0:16 100M:32 1B:64'",
        "a three-stage schedule in tokens",
    ),
    (
        "rampup",
        8,
        "--micro-batch-size 1 --global-batch-size 64 --rampup-batch-size 16 16 100000",
        "a rampup, which megatron-core >= 0.18 drops",
    ),
    (
        "world-not-divisible",
        12,
        "--tensor-model-parallel-size 8 --micro-batch-size 1 --global-batch-size 16",
        "world 12 at TP 8",
    ),
    (
        "gbs-not-divisible",
        8,
        "--micro-batch-size 2 --global-batch-size 20",
        "GBS 20 at MBS 2 x DP 8",
    ),
    (
        "layers-not-divisible-pp",
        8,
        "--pipeline-model-parallel-size 8 --num-layers 20 --micro-batch-size 1 "
        "--global-batch-size 8",
        "20 layers on PP 8",
    ),
    (
        "query-groups-tp",
        8,
        "--group-query-attention --num-query-groups 2 --tensor-model-parallel-size 4 "
        "--micro-batch-size 1 --global-batch-size 8",
        "2 query groups at TP 4 (transformer_config.py)",
    ),
    (
        "rl-packing-mbs2",
        8,
        "--perform-rl-step --rl-use-sequence-packing --micro-batch-size 2 --global-batch-size 16",
        "RL sequence packing at MBS 2 (arguments.py:546)",
    ),
    (
        "etp-world",
        8,
        f"{MOE} --expert-model-parallel-size 4 --expert-tensor-parallel-size 4 "
        "--micro-batch-size 1 --global-batch-size 8",
        "EP 4 x ETP 4 over 8 ranks",
    ),
    ("no-mbs", 8, "--global-batch-size 8", "no --micro-batch-size (Megatron's default 1)"),
    (
        "uneven-pp-valid",
        16,
        "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 5 "
        "--decoder-last-pipeline-num-layers 5 --micro-batch-size 1 --global-batch-size 16",
        "5 + 7 + 7 + 5 layers",
    ),
    (
        "uneven-pp-middle",
        16,
        "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 4 "
        "--decoder-last-pipeline-num-layers 5 --micro-batch-size 1 --global-batch-size 16",
        "15 middle layers on 2 middle stages",
    ),
    (
        "account-embedding-loss",
        8,
        "--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split "
        "--account-for-loss-in-pipeline-split --micro-batch-size 1 --global-batch-size 16",
        "24 + 2 on PP 2",
    ),
    (
        "vpp-layers-not-divisible",
        8,
        "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 5 "
        "--micro-batch-size 1 --global-batch-size 16",
        "24 layers in chunks of 5 on PP 4",
    ),
    (
        "etp-not-dividing",
        8,
        f"{MOE} --expert-model-parallel-size 2 --expert-tensor-parallel-size 3 "
        "--micro-batch-size 1 --global-batch-size 16",
        "ETP 3 on 8 ranks",
    ),
    (
        "sequence-parallel-tp1",
        8,
        "--sequence-parallel --micro-batch-size 1 --global-batch-size 16",
        "--sequence-parallel at TP 1, which upstream turns off",
    ),
    (
        "layout-mtp-valid",
        16,
        "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et*6|t*6mL' "
        "--mtp-num-layers 1 --position-embedding-type rope --micro-batch-size 1 "
        "--global-batch-size 64",
        "a layout with its MTP stage",
    ),
    ("gbs-below-dp", 16, "--micro-batch-size 1 --global-batch-size 8", "GBS 8 at DP 16"),
]
B = "--micro-batch-size 1 --global-batch-size 16"
A2A_EP2 = (
    f"{MOE} --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
    "--disable-bias-linear --overlap-moe-expert-parallel-comm"
)
#: More rules of the parallel layout, batch and schedule, each on the valid line beside it where
#: there is one.
VIOLATIONS += [
    ("delay-wgrad-local", 8, f"{A2A_EP2} --delay-wgrad-compute --transformer-impl local {B}",
     "--delay-wgrad-compute with the local implementation"),
    ("delay-wgrad-te", 8, f"{A2A_EP2} --delay-wgrad-compute {B}",
     "--delay-wgrad-compute with transformer_engine (the default)"),
    ("tp-comm-overlap-no-sp", 8, f"--tensor-model-parallel-size 2 --tp-comm-overlap {B}",
     "--tp-comm-overlap without --sequence-parallel (arguments.py:1401)"),
    ("tp-comm-overlap-sp", 8, "--tensor-model-parallel-size 2 --tp-comm-overlap "
        f"--sequence-parallel {B}",
     "TP overlap with sequence parallelism"),
    ("dist-opt-instances-dp", 8, "--use-distributed-optimizer "
        f"--num-distributed-optimizer-instances 3 {B}",
     "3 optimizer instances at DP 8 (parallel_state)"),
    ("dist-opt-instances-valid", 8, "--use-distributed-optimizer "
        f"--num-distributed-optimizer-instances 2 {B}",
     "2 optimizer instances at DP 8"),
    ("expert-grid-over-world", 8, f"{MOE} --expert-model-parallel-size 8 "
        f"--pipeline-model-parallel-size 2 {B}",
     "EP 8 x PP 2 over 8 ranks (parallel_state)"),
    ("experts-not-divisible-ep", 8, "--num-experts 6 --moe-router-topk 2 "
        "--expert-model-parallel-size 4 "
     f"{B}", "6 experts on EP 4"),
    ("etp-over-tp", 8, f"{MOE} --tensor-model-parallel-size 2 --expert-tensor-parallel-size 4 "
     f"--expert-model-parallel-size 2 --disable-bias-linear {B}", "ETP 4 above TP 2"),
    ("query-groups-tp16", 16, "--group-query-attention --num-query-groups 8 "
        f"--tensor-model-parallel-size 16 {B}",
     "8 query groups at TP 16"),
    ("query-groups-over-heads", 8, f"--group-query-attention --num-query-groups 32 {B}", "32 "
        "groups for 16 heads"),
    ("eval-mbs-only", 16, "--micro-batch-size 1 --global-batch-size 64 --eval-micro-batch-size 3",
     "eval MBS 3 with eval GBS defaulting to GBS 64 at DP 16"),
    ("decrease-below-one-step", 32, "--micro-batch-size 1 --global-batch-size 16 "
        "--decrease-batch-size-if-needed",
     "GBS 16 at MBS x DP 32 with --decrease-batch-size-if-needed"),
    ("decrease-eval-set", 32, "--micro-batch-size 1 --global-batch-size 100 "
        "--decrease-batch-size-if-needed "
     "--eval-global-batch-size 96", "GBS 100 rounded to 96, eval GBS 96"),
    ("no-gbs", 8, "--micro-batch-size 2", "no --global-batch-size: MBS x DP"),
    ("vpp-without-pp", 8, f"--num-layers-per-virtual-pipeline-stage 4 {B}", "VPP chunks at PP 1"),
    ("first-stage-layers-pp1", 8, f"--decoder-first-pipeline-num-layers 4 {B}", "a first-stage "
        "split at PP 1"),
    ("overlap-param-gather-opt-step-no-vpp", 8, "--use-distributed-optimizer --overlap-grad-reduce "
     f"--overlap-param-gather --overlap-param-gather-with-optimizer-step {B}",
     "param gather with the optimizer step without VPP (arguments.py:1027)"),
    ("schedule-and-rampup", 8, "--micro-batch-size 1 --step-batch-size-schedule '0:16 1M:32' "
     "--rampup-batch-size 16 16 1000", "a schedule and a rampup"),
    ("cp-a2a-heads", 8, f"--context-parallel-size 8 --cp-comm-type a2a {B}", "a2a CP 8 over 16 "
        "heads"),
    ("cp-a2a-heads-bad", 8, f"--context-parallel-size 8 --cp-comm-type a2a --num-query-groups 4 "
     f"--group-query-attention {B}", "a2a CP 8 with 4 query groups"),
    ("mbs-zero", 8, "--micro-batch-size 0 --global-batch-size 16", "MBS 0"),
    ("schedule-thresholds-samples-pp4-vpp", 16, "--pipeline-model-parallel-size 4 "
     "--num-virtual-stages-per-pipeline-rank 2 --micro-batch-size 1 --step-batch-size-schedule "
         "'0:8 1M:32'",
     "a schedule under interleaving: GA 2 then 8 at PP 4"),
    ("moe-grouped-gemm", 8, f"{MOE} --expert-model-parallel-size 4 --moe-grouped-gemm {B}",
     "grouped GEMM on the stand-in H100"),
    ("ep-etp-pp-valid", 32, f"{MOE} --expert-model-parallel-size 4 --expert-tensor-parallel-size 2 "
     f"--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --disable-bias-linear {B}",
     "EP 4 x ETP 2 x PP 2 on 32"),
    ("fsdp2-with-mfsdp", 8, f"{FSDP2} --use-megatron-fsdp {B}", "both FSDPs"),
]  # fmt: skip


def violations() -> list[dict]:
    lines = []
    for name, world, flags, why in VIOLATIONS:
        model = MODEL
        if name in ("seq-cp8-1000",):
            model = MODEL.replace("--seq-length 2048", "--seq-length 1000")
        if name in ("heads-12-tp8",):
            model = MODEL.replace("--num-attention-heads 16", "--num-attention-heads 12").replace(
                "1024", "768", 1
            )
        if name.startswith("layout-"):
            model = MODEL.replace("--num-layers 24", "--num-layers 12")
        if "--num-layers 20" in flags:
            model, flags = (
                MODEL.replace("--num-layers 24", "--num-layers 20"),
                flags.replace("--num-layers 20 ", ""),
            )
        if "--seq-length 4096" in flags:
            model, flags = (
                MODEL.replace("--seq-length 2048", "--seq-length 4096"),
                flags.replace(" --seq-length 4096", ""),
            )
        train = (
            TRAIN.replace("--train-iters 1000", "--train-samples 100000")
            if "schedule" in flags
            else TRAIN
        )
        train = train.replace(" --bf16", "") if "fsdp2-fp16" in name else train
        line, world = gpt(world, flags, train, model)
        lines.append({"id": name, "kind": "violation", "line": line, "world": world, "why": why})
    fp16 = gpt(
        8, f"{FSDP2} --micro-batch-size 1 --global-batch-size 64", TRAIN.replace("--bf16", "--fp16")
    )
    lines.append(
        {
            "id": "fsdp2-fp16",
            "kind": "violation",
            "line": fp16[0],
            "world": 8,
            "why": "FSDP2 with fp16",
        }
    )
    return lines


def edges() -> list[dict]:
    """A grid of layouts: world, TP, PP, CP, MBS, GBS, the valid and the invalid alike."""
    lines = []
    grid = [
        (1, 1, 1, 1, 1, 1),
        (1, 1, 1, 1, 4, 32),
        (2, 1, 1, 1, 2, 8),
        (4, 2, 1, 1, 1, 4),
        (4, 1, 2, 1, 1, 6),
        (8, 1, 1, 1, 1, 8),
        (8, 1, 1, 1, 4, 128),
        (8, 2, 1, 1, 2, 64),
        (8, 2, 2, 1, 1, 16),
        (8, 4, 2, 1, 1, 3),
        (8, 8, 1, 1, 1, 7),
        (8, 1, 8, 1, 1, 32),
        (8, 1, 1, 2, 1, 16),
        (8, 2, 1, 2, 2, 16),
        (8, 1, 1, 8, 1, 5),
        (16, 2, 2, 1, 1, 16),
        (16, 4, 2, 1, 2, 16),
        (16, 4, 4, 1, 1, 1),
        (16, 1, 1, 1, 3, 48),
        (16, 1, 1, 1, 3, 50),
        (16, 2, 4, 2, 1, 8),
        (24, 2, 2, 1, 1, 24),
        (24, 8, 1, 1, 1, 6),
        (24, 4, 3, 1, 1, 10),
        (32, 8, 4, 1, 1, 512),
        (32, 4, 4, 2, 1, 64),
        (32, 2, 2, 1, 4, 1024),
        (32, 1, 1, 1, 1, 31),
        (48, 4, 2, 1, 2, 96),
        (48, 8, 2, 1, 1, 45),
        (64, 8, 8, 1, 1, 1024),
        (64, 8, 4, 2, 1, 128),
        (64, 4, 1, 1, 2, 96),
        (64, 16, 1, 1, 1, 64),
        (128, 8, 8, 1, 1, 2048),
        (128, 8, 16, 1, 1, 1536),
        (128, 4, 4, 1, 2, 200),
        (256, 8, 4, 2, 1, 512),
        (512, 8, 8, 1, 1, 4096),
        (512, 8, 8, 2, 1, 4000),
        (1024, 8, 16, 1, 1, 8192),
        (8, 3, 1, 1, 1, 8),
        (2, 2, 1, 1, 1, 2),
        (2, 1, 2, 1, 2, 4),
        (4, 1, 1, 4, 1, 4),
        (4, 4, 1, 1, 2, 2),
        (8, 1, 4, 2, 1, 8),
        (8, 2, 4, 1, 2, 8),
        (8, 1, 2, 1, 2, 12),
        (8, 4, 1, 2, 1, 4),
        (16, 8, 2, 1, 1, 1),
        (16, 2, 1, 4, 1, 10),
        (16, 1, 16, 1, 1, 64),
        (16, 16, 1, 1, 1, 16),
        (32, 8, 1, 4, 1, 32),
        (32, 2, 8, 1, 2, 24),
        (32, 4, 8, 1, 1, 4),
        (40, 8, 1, 1, 1, 40),
        (40, 4, 2, 1, 1, 15),
        (64, 8, 2, 1, 4, 256),
        (64, 2, 4, 4, 1, 8),
        (64, 4, 4, 1, 1, 6),
        (80, 8, 2, 1, 1, 100),
        (96, 4, 6, 1, 2, 128),
        (128, 8, 4, 2, 2, 64),
        (128, 2, 8, 1, 1, 24),
        (192, 8, 6, 1, 1, 512),
        (256, 8, 8, 1, 1, 64),
        (256, 4, 2, 2, 2, 96),
        (384, 8, 12, 1, 1, 1024),
        (768, 8, 24, 1, 1, 1536),
        (1024, 8, 8, 4, 1, 512),
        (2048, 8, 8, 1, 1, 4096),
        (2048, 8, 16, 2, 2, 4096),
        (8, 1, 3, 1, 1, 8),
        (16, 2, 6, 1, 1, 12),
        (6, 2, 1, 1, 1, 9),
        (6, 2, 3, 1, 1, 12),
        (12, 4, 3, 1, 1, 8),
        (96, 8, 12, 1, 1, 96),
    ]
    for world, tp, pp, cp, mbs, gbs in grid:
        flags = f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}"
        flags += f" --context-parallel-size {cp} --micro-batch-size {mbs} --global-batch-size {gbs}"
        line, _ = gpt(world, flags)
        name = f"grid-w{world}-tp{tp}-pp{pp}-cp{cp}-mbs{mbs}-gbs{gbs}"
        lines.append(
            {"id": name, "kind": "edge", "line": line, "world": world, "why": "layout grid"}
        )
    return lines + _launcher_edges() + _schedule_edges()


def _launcher_edges() -> list[dict]:
    """How the world is given: WORLD_SIZE, srun, torchrun spellings, python -m
    torch.distributed.run."""
    body = (
        f"pretrain_gpt.py {MODEL} --tensor-model-parallel-size 2 --micro-batch-size 1 "
        f"--global-batch-size 32 {TRAIN}"
    )
    forms = [
        ("world-size-env", "WORLD_SIZE=16 python " + body, 16),
        ("torchrun-underscores", "torchrun --nnodes=2 --nproc_per_node=8 " + body, 16),
        (
            "torch-distributed-run",
            "python -m torch.distributed.run --nnodes 4 --nproc-per-node 8 " + body,
            32,
        ),
        ("srun-tasks", "srun --nodes 2 --ntasks-per-node 8 python " + body, 16),
        ("srun-ntasks", "srun -N 4 -n 32 python " + body, 32),
        ("torchrun-one-node", "torchrun --nproc-per-node 4 " + body, 4),
        (
            "srun-pyxis-bash-c",
            "srun --nodes 2 --ntasks-per-node 8 --container-image img.sqsh bash -c "
            f"{shlex.quote('python ' + body)}",
            16,
        ),
    ]
    return [
        {"id": n, "kind": "edge", "line": line, "world": w, "why": "launcher form"}
        for n, line, w in forms
    ]


def _schedule_edges() -> list[dict]:
    cases = [
        (
            "schedule-samples-mbs2",
            16,
            "--micro-batch-size 2 --step-batch-size-schedule '0:32 1000:64 5000:128'",
        ),
        ("schedule-one-stage", 8, "--micro-batch-size 1 --step-batch-size-schedule '0:64'"),
        (
            "schedule-k-suffix",
            8,
            "--micro-batch-size 1 --step-batch-size-schedule '0:8 500K:16 2M:32'",
        ),
        (
            "schedule-pp2",
            16,
            "--pipeline-model-parallel-size 2 --micro-batch-size 1 --step-batch-size-schedule "
            "'0:8 1M:16 4M:64'",
        ),
        (
            "schedule-first-not-zero",
            8,
            "--micro-batch-size 1 --step-batch-size-schedule '1M:16 2M:32'",
        ),
        (
            "schedule-first-not-divisible",
            8,
            "--micro-batch-size 1 --step-batch-size-schedule '0:12 1M:32'",
        ),
        ("schedule-decreasing", 8, "--micro-batch-size 1 --step-batch-size-schedule '0:64 1M:32'"),
        (
            "schedule-duplicate",
            8,
            "--micro-batch-size 1 --step-batch-size-schedule '0:16 1M:32 1M:64'",
        ),
        ("schedule-train-iters", 8, "--micro-batch-size 1 --step-batch-size-schedule '0:16 1M:32'"),
    ]
    lines = []
    for name, world, flags in cases:
        train = (
            TRAIN
            if name == "schedule-train-iters"
            else TRAIN.replace("--train-iters 1000", "--train-samples 100000")
        )
        line, _ = gpt(world, flags, train)
        lines.append(
            {"id": name, "kind": "edge", "line": line, "world": world, "why": "step schedule"}
        )
    return lines


def main(argv: list[str]) -> None:
    rows = (examples(Path(argv[0])) if argv else []) + violations() + edges()
    ids = [row["id"] for row in rows]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"duplicate ids: {sorted(i for i in ids if ids.count(i) > 1)}")
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{OUT}: {len(rows)} lines")


if __name__ == "__main__":
    main(sys.argv[1:])
