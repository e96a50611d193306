"""The coverage rows of MoE (routers and their auxiliary losses, dispatchers, capacity), the DSA
indexer loss, MTP and hybrid models. Pure Python; the table is
:data:`megatron_ga_ext.config.coverage.rows.ROWS`, in this order.
"""

from __future__ import annotations

from megatron_ga_ext.config.coverage.conditions import (
    balancing,
    has_moe,
    in_microbatch_mode,
    in_token_mode,
    is_hybrid,
    quantile_balancing,
    quantile_unmasked_losses,
)
from megatron_ga_ext.config.coverage.proofs import (
    MOE_LOOP,
    MOE_MTP,
    NO_GPU,
    NOT_YET,
    verify_layouts,
)
from megatron_ga_ext.config.coverage.row import Proof, Row, Upstream

__all__ = ["MOE_ROWS"]

MTP_CP = "tests/test_mtp_context_parallel.py::"

#: The flex dispatcher's backends and their options (the dispatcher-flex row).
FLEX_DISPATCHER = (
    "--moe-flex-dispatcher-backend",
    "--moe-enable-deepep",
    "--moe-deepep-num-sms",
    "--moe-hybridep-num-sms",
    "--moe-flex-dispatcher-num-sms",
    "--moe-hybridep-num-blocks-permute",
    "--moe-hybridep-num-blocks-unpermute",
    "--moe-hybridep-num-sms-preprocessing",
    "--moe-hybridep-pad-uneven-dispatch-inputs",
    "--moe-permute-fusion-into-hybridep",
    "--moe-ncclep-zero-copy",
    "--moe-dispatch-fwd-dtype",
    "--moe-combine-bwd-dtype",
)

# fmt: off
MOE_ROWS: tuple[Row, ...] = (
    # MoE
    Row(id="router-aux-loss", flags=("--moe-router-load-balancing-type", "--moe-aux-loss-coeff"),
        given="--moe-router-load-balancing-type aux_loss (the default)", support="supported",
        text="token mode: each micro-batch's load-balancing and z-loss terms are computed over "
            "its loss tokens and "
        "weighted by its share of the global batch's loss tokens. install() corrects the "
            "router's count, which "
        "megatron-core reads back after an in-place all-reduce once a padding mask is given "
            "(Megatron-LM #7452, "
        "finding 10: TP x CP times the target from 0.19), and before 0.19 gives the z-loss its "
            "missing TP x CP "
        "factor: exact under TP (sequence parallel) and CP, with uneven loss tokens across the "
            "shards; a micro-batch "
        "without loss tokens adds no term. Microbatch mode: as upstream.",
        proofs=(*MOE_LOOP, *verify_layouts("DP2 x GA4 (MoE)", "EP2 x DP2 x GA4 (MoE)",
                                    "TP2 x DP2 x GA4 (MoE, sequence parallel)", "CP2 x DP2 x GA4 "
                                        "(MoE, position-wise)"),
                Proof(test="tests/test_verify_aux.py::test_install_meets_the_token_mode_target"),
                Proof(test="tests/test_moe_empty_microbatch.py::test_the_step_matches_the_token_reference")),
        applies=balancing("aux_loss"),
        upstream=(
            Upstream(
                given="MoE with --calculate-per-token-loss",
                effect="pretrain_gpt gives the router no padding mask, so it counts every "
                    "position: its load-balancing "
                "and z-loss gradients are (positions / loss tokens) times the per-token target "
                    "wherever tokens are "
                "masked",
                severity="careful", fix="Run the script through -m megatron_ga_ext (install() "
                    "routes with the loss "
                "mask).",
                brief="MoE with --calculate-per-token-loss: the router counts padding too, so "
                    "load-balancing gradients "
                "are (positions / loss tokens) times the target. Fix: -m megatron_ga_ext.",
                applies=lambda s: s.on("calculate_per_token_loss") and has_moe(s), entry=True),
            Upstream(
                given="MoE with --moe-z-loss-coeff, --calculate-per-token-loss and TP x CP > 1",
                effect="on megatron-core 0.16 to 0.18 the z-loss gradient is 1 / (TP x CP) of "
                    "the per-token target "
                "(0.19 adds the missing factor)",
                severity="careful", fix="Run the script through -m megatron_ga_ext, or use "
                    "megatron-core >= 0.19.",
                brief="MoE z-loss under tensor or context parallelism: on megatron-core "
                    "0.16-0.18 its gradient is 1 / "
                "(TP x CP) of the target. Fix: -m megatron_ga_ext.",
                applies=lambda s: s.on("calculate_per_token_loss") and has_moe(s) and bool(s.value("moe_z_loss_coeff"))
                and s.number("tensor_model_parallel_size") * s.number("context_parallel_size") > 1, entry=True),
        )),
    Row(id="moe-pipeline-loss-mask", flags=("--pipeline-model-parallel-size", "--num-experts"),
        given="MoE with --pipeline-model-parallel-size N (N > 1), token mode", support="limited",
        brief="MoE under pipeline parallelism: stages given no loss mask count padding in their "
            "load-balancing "
              "gradients; the first step names them.", severity="careful",
        text="MoE layers on a stage that is given no loss mask route without a padding mask, so "
            "their aux and z-loss "
        "gradients keep the (routed positions / loss tokens) factor: the first step names those "
            "stages. Megatron-LM's "
        "get_batch gives the mask to the last stage only (0.18 and later), and before 0.18 also "
            "to the first "
        "stage's TP rank 0 alone, so with TP > 1 that stage's TP ranks route with different "
            "masks. A loop that "
        "gives every stage the mask (verify's) is exact, also under TP with sequence parallelism.",
        proofs=(Proof(test="tests/test_unmasked_moe_note.py::test_the_note_names_the_stages_that_got_no_mask"),
                Proof(test="tests/test_verify_fuzz.py::test_a_fixed_seed_passes")),
        applies=in_token_mode(lambda s: has_moe(s) and s.number("pipeline_model_parallel_size") > 1)),
    Row(id="router-global-aux-loss", flags=("--moe-router-load-balancing-type",),
        given="--moe-router-load-balancing-type global_aux_loss", support="limited",
        brief="global_aux_loss: every token weighs the same, but upstream's running expert "
            "average divides by the "
              "current micro-batch's count (#7213).", severity="careful",
        text="token mode: a micro-batch's global load-balancing loss (statistics over every DP "
            "rank) weighted "
        "T(m) / (DP x N), its loss tokens over every DP rank, on every rank's piece, so every "
            "token of the "
        "micro-batch weighs the same; install() corrects the router's count, which with a "
            "padding mask is T(m) "
        "itself (#7452 finding 10: DP times the target). The z-loss per micro-batch of each DP "
            "rank, as for "
        "aux_loss. Not corrected: the router's running average of tokens per expert is "
            "normalised by the current "
        "micro-batch's count (#7213). Microbatch mode: as upstream.",
        proofs=(*verify_layouts("DP2 x GA4 (MoE global_aux_loss)", "DP2 x GA4 (MoE "
            "global_aux_loss + z-loss)"),
                Proof(test="tests/test_verify_aux.py::test_install_meets_the_token_mode_target"),
                Proof(test="tests/test_verify_fuzz.py::test_a_fixed_seed_passes")),
        applies=balancing("global_aux_loss")),
    Row(id="router-seq-aux-loss", flags=("--moe-router-load-balancing-type",),
        given="--moe-router-load-balancing-type seq_aux_loss", support="limited",
        brief="seq_aux_loss before megatron-core 0.19 with --micro-batch-size above 1: its "
            "gradient is 1 / MBS of the "
              "target.", severity="careful",
        text="token mode: computed over the loss tokens like aux_loss, with the router's count "
            "corrected, also for a "
        "sample without loss tokens (its per-sequence count stays fractional). Before 0.19 the "
            "router "
        "pre-multiplies it by a per-sequence count: with "
        "--micro-batch-size above 1 its gradient is 1 / MBS of the target there (0.19 fixed it).",
        proofs=(*verify_layouts("DP1 x GA2 (MoE seq_aux_loss, loss tokens 1, 0, 16, 5)"),
                Proof(test="tests/test_verify_fuzz.py::test_a_fixed_seed_passes")),
        # the per-sequence count is 1 at MBS 1 (router.py before 0.19): the note holds above it only
        applies=lambda s: balancing("seq_aux_loss")(s) and s.number("micro_batch_size") != 1),
    Row(id="router-sinkhorn-none", flags=("--moe-router-load-balancing-type",),
        given="--moe-router-load-balancing-type sinkhorn or none", support="limited",
        brief="sinkhorn or no load balancing: no balancing loss; the z-loss and bias counts skip "
            "padding. Not run by "
              "a test here.", severity="info",
        text="no load-balancing loss; in token mode the z-loss and the expert-bias counts "
            "exclude padding; "
        f"{NOT_YET}.",
        applies=balancing("sinkhorn", "none")),
    Row(id="router-quantile-balancing-token", flags=("--moe-router-load-balancing-type",
                                                     "--moe-router-quantile-balancing-ema"),
        given="--moe-router-load-balancing-type quantile_balancing (0.19 and later)", when="in "
            "token mode",
        support="supported",
        text="the router is given no padding mask (quantile balancing has no load-balancing "
            "loss, and megatron-core's "
        "router refuses a padding mask there): the token count, the loss contract and its checks "
            "hold, and every "
        "step's loss and gradient equal upstream's --calculate-per-token-loss run.",
        proofs=(Proof(test=MOE_MTP + "test_quantile_balancing_token_mode_equals_upstream"),),
        applies=in_token_mode(lambda s: quantile_balancing(s) and not quantile_unmasked_losses(s))),
    Row(id="router-quantile-balancing-mixed-token",
        flags=("--moe-router-load-balancing-type", "--moe-z-loss-coeff"),
        given="--moe-router-load-balancing-type quantile_balancing with --moe-z-loss-coeff, or "
            "with an aux-loss type "
        "in the same list", when="in token mode", support="limited",
        brief="quantile balancing with a z-loss or an aux loss: those terms count padding, "
            "(positions / loss tokens) "
              "times their target.", severity="careful",
        text="the model is routed without a padding mask (upstream's router refuses one under "
            "quantile balancing), so "
        "the z-loss and any aux-loss layers count padding positions: their gradients are (routed "
            "positions / loss "
        "tokens) times their token-mode target, as with upstream's --calculate-per-token-loss; "
            f"{NOT_YET}.",
        applies=in_token_mode(lambda s: quantile_balancing(s) and quantile_unmasked_losses(s))),
    Row(id="router-quantile-balancing-microbatch", flags=("--moe-router-load-balancing-type",),
        given="--moe-router-load-balancing-type quantile_balancing", when="in microbatch mode", support="limited",
        brief="quantile balancing in microbatch mode runs as upstream does. Not run by a test "
            "here.", severity="info",
        text=f"no padding mask is passed in microbatch mode; {NOT_YET}.",
        applies=in_microbatch_mode(balancing("quantile_balancing"))),
    Row(id="router-expert-bias", flags=("--moe-router-enable-expert-bias", "--moe-router-bias-update-rate"),
        given="--moe-router-enable-expert-bias", support="supported",
        text="the router counts the tokens routed to each expert, in token mode under the "
            "padding mask, and finalize "
        "moves the bias from those counts summed over TP x CP x DP; the bias steers routing and "
            "weighs no loss token. "
        "On every tested source before main@d98e8a64ddf3 (core_v0.16.1 to core_v0.19.0, "
            "main@9f3fe8c925fb, "
        "main@dd8c825b3ad5) the router masks its [tokens, experts] routing map with the "
            "flattened [tokens] padding "
        "mask (a shape error at the first step, or, where a micro-batch routes as many tokens as "
            "there are experts, "
        "experts masked instead of padding): install() gives it the mask per token there.",
        proofs=(Proof(test="tests/test_moe_expert_bias.py::test_the_expert_bias_counts_exclude_the_padding_tokens"),
                Proof(test="tests/test_moe_expert_bias.py::test_a_step_with_the_expert_bias_meets_both_references")),
        applies=lambda s: has_moe(s) and s.on("moe_router_enable_expert_bias")),
    Row(id="router-fusion", flags=("--moe-router-fusion",), given="--moe-router-fusion", support="limited",
        brief="--moe-router-fusion: the fused kernels get the same mask and counts; not run here "
            "(needs a GPU and "
              "Transformer Engine).", severity="info",
        text="Transformer Engine's fused kernels compute the router's top-k and its "
            "auxiliary-loss terms, given the "
        f"padding mask and the token counts as the unfused path is; {NO_GPU} (Transformer Engine "
            "2.7 or later).",
        applies=lambda s: has_moe(s) and s.on("moe_router_fusion")),
    Row(id="dispatcher-allgather-alltoall", flags=("--moe-token-dispatcher-type", "--expert-model-parallel-size"),
        given="--moe-token-dispatcher-type allgather or alltoall, --expert-model-parallel-size N",
        support="supported", text="the token count, the loss contract and the auxiliary-loss "
            "weights hold.",
        proofs=MOE_LOOP + verify_layouts("EP2 x DP2 x GA4 (MoE)"),
        applies=lambda s: has_moe(s) and s.value("moe_token_dispatcher_type") in ("allgather", "alltoall")),
    Row(id="dispatcher-flex", flags=("--moe-token-dispatcher-type", *FLEX_DISPATCHER),
        given="--moe-token-dispatcher-type flex",
        support="limited",
        brief="the flex dispatcher moves tokens without touching the loss or its count; not run "
            "here (needs a GPU).",
        severity="info", text="the dispatch does not touch the loss or the token count, whatever "
            "its backend and "
        "its options (its payload dtypes change the precision of what is sent, not its weight); "
            f"{NO_GPU} (DeepEP, "
        "HybridEP, NCCL EP).",
        applies=lambda s: has_moe(s) and s.value("moe_token_dispatcher_type") == "flex"),
    Row(id="rank-capacity-stash", flags=("--moe-expert-rank-capacity-factor", "--moe-paged-stash",
                                         "--moe-paged-stash-page-size", "--moe-paged-stash-buffer-size-factor-cuda",
                                         "--moe-paged-stash-buffer-size-factor-cpu"),
        given="--moe-expert-rank-capacity-factor (0.18 and later)", support="limited",
        brief="an overflowing expert stash reruns the step, and each attempt is checked. Not run "
            "here (needs a GPU).",
        severity="info",
        text="Megatron wraps the forward/backward in a PagedStashRunner that, when a static "
            "buffer overflows, resets "
        "the gradients and runs the step's forward/backward once more (synced dropless): each "
            "attempt runs the "
        "extension's schedule hook and finalize and is checked on its own (under --ga-checks "
            "sync a broken first "
        "attempt stops the run before the retry); --moe-paged-stash (which needs the factor) and "
            "its page and buffer "
        f"sizes only size the stash; {NO_GPU} (HybridEP).",
        applies=lambda s: s.value("moe_expert_rank_capacity_factor") is not None),
    Row(id="dsa-indexer-loss-token", flags=("--experimental-attention-variant", "--dsa-indexer-loss-coeff",
                                            "--dsa-indexer-use-sparse-loss"),
        given="--experimental-attention-variant dsa", when="in token mode", support="limited",
        brief="the DSA indexer loss is scaled as upstream's per-token loss scales it, not "
            "reweighted by the "
              "extension. Not run by a test.", severity="careful",
        text="the extension does not reweight the DSA indexer loss: it is scaled as upstream's "
        "--calculate-per-token-loss scales it (its scaler is given the loss scale, and finalize "
            "divides by N); "
        f"{NOT_YET}.",
        applies=in_token_mode(lambda s: "dsa" in s.names("experimental_attention_variant"))),
    # MTP and hybrid models
    Row(id="mtp", flags=("--mtp-num-layers", "--mtp-loss-scaling-factor"), given="--mtp-num-layers "
        "N",
        support="supported",
        text="token mode: every MTP token weighs its scaling factor / (MTP depth x N), the "
            "global count every term is "
        "divided by; install() attaches each depth's sum from its per-token loss and rolled mask "
            "in place of "
        "process_mtp_loss's local n_u / m_u weighting (0.17+, Megatron-LM #7452 finding 3), "
            "which gives a CP shard "
        "without LM tokens no MTP gradient (#7498); 0.16 attaches the sum already. Where labels "
            "are not given (the "
        "RL path) upstream's weighting stands. Microbatch mode: as upstream.",
        proofs=(Proof(test=MOE_MTP + "test_mtp_token_mode_weighs_every_mtp_token_by_n"),
                *verify_layouts("DP2 x GA4 (MTP)", "DP2 x GA4 (MoE + MTP)"),
                Proof(test="tests/test_verify_aux.py::test_install_meets_the_token_mode_target"),
                Proof(test=MTP_CP + "test_a_shard_without_lm_tokens_keeps_its_rolled_mtp_token")),
        applies=lambda s: s.number("mtp_num_layers") > 0,
        upstream=(Upstream(
            given="--mtp-num-layers N with --calculate-per-token-loss",
            effect="from megatron-core 0.17 each MTP token is weighed by its own rank's count "
                "ratio (#7452 finding 3), "
            "not 1 / N: MTP gradients differ from the per-token target where ranks mask "
                "different numbers of tokens",
            severity="careful", fix="Run the script through -m megatron_ga_ext (install() weighs "
                "every MTP token by "
            "1 / N).",
            brief="MTP with --calculate-per-token-loss: from megatron-core 0.17 each rank weighs "
                "its MTP tokens by its "
            "own count, not the global one. Fix: -m megatron_ga_ext.",
            applies=lambda s: s.on("calculate_per_token_loss") and s.number("mtp_num_layers") > 0, entry=True),)),
    Row(id="moe-in-mtp-token", flags=("--mtp-num-layers", "--num-experts", "--sequence-parallel"),
        given="MoE with --mtp-num-layers N, token mode", support="limited",
        brief="MoE inside MTP layers: their load-balancing gradients can count a padding "
            "position per sequence, "
              "more under sequence parallelism.", severity="careful",
        text="the MTP layer's own MoE routes with the padding mask upstream rolls (roll_tensor): "
            "the rolled-in last "
        "position is filled as a loss token, and under sequence parallelism each TP rank rolls "
            "its own shard, so "
        "that router's counts differ from the rolled loss tokens where a sample has none or "
            "under SP, and its aux "
        "and z-loss gradients differ from the target by that count ratio (verify --fuzz marks "
            "such draws limited; "
        "up to 45% on that router's weight). install()'s padding mask turns the roll on; it is "
            "not corrected. "
        "Without SP and with a loss token in every sample the counts agree (verify's MoE + MTP "
            "row).",
        proofs=(*verify_layouts("DP2 x GA4 (MoE + MTP)"),),
        applies=in_token_mode(lambda s: has_moe(s) and s.number("mtp_num_layers") > 0)),
    Row(id="hybrid-moe-token", flags=("--hybrid-override-pattern", "--hybrid-layer-pattern", "--is-hybrid-model"),
        given="a hybrid (Mamba) model with MoE layers", when="in token mode", support="limited",
        brief="a hybrid model's MoE layers route without the padding mask: their load-balancing "
            "gradients are "
              "(positions / loss tokens) times the target.", severity="careful",
        text="the extension's MoE correction wraps GPTModel.forward only: a hybrid model's MoE "
            "layers route "
        "without a padding mask, so their load-balancing and z-loss gradients are (routed "
            "positions / loss tokens) "
        "times their target weight, as with upstream's --calculate-per-token-loss.",
        applies=in_token_mode(lambda s: is_hybrid(s) and has_moe(s))),
    Row(id="hybrid", flags=("--hybrid-override-pattern", "--hybrid-layer-pattern", "--is-hybrid-model"),
        given="a hybrid (Mamba) model", support="limited",
        brief="a hybrid (Mamba) model's loss takes the same checked path as a GPT's. Not run by "
            "a test here.",
        severity="info",
        text="its loss goes through forward_step_calc_loss and finalize as a GPT's does; "
            f"{NOT_YET}.",
        applies=lambda s: is_hybrid(s) and not (s.token and has_moe(s))),
)
# fmt: on
