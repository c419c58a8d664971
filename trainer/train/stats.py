"""The training statistics: the layout of the additive per-batch statistics vector the loss fills, and its reduction
(across batches and processes) to the teacher-forced acceptance and confidence metrics the Trainer logs.
"""

import math

import torch


def stat_names(block_size: int) -> list[str]:
    """Layout of the per-batch statistics vector: additive sums, reduced across batches and processes.

    Acceptance sums are against the full-vocabulary teacher (what the verifier accepts); `restricted_*` against
    the teacher renormalised over the draft vocabulary (the pre-full-vocabulary meaning, kept to show the gap);
    `conf_*` compare the confidence head with its target (`ObjectiveConfig.confidence_target`)."""
    names = ["slots", "blocks", "loss_sum", "ce_sum", "tv_sum", "kl_sum", "bce_sum", "accept_len_sum",
             "greedy_len_sum", "accept_rate_sum", "greedy_sum", "restricted_len_sum", "restricted_rate_sum",
             "coverage_sum", "conf_target_sum", "conf_target_len_sum", "conf_abs_err_sum", "conf_pred_sum",
             "conf_cumprod_bias_sum"]
    for k in range(block_size):
        names += [f"slots_{k}", f"accept_rate_sum_{k}", f"greedy_sum_{k}", f"pos_sum_{k}", f"conf_pred_sum_{k}",
                  f"conf_target_sum_{k}", f"conf_cumprod_bias_sum_{k}"]
    return names


def reduce_stats(stats: torch.Tensor, block_size: int) -> dict[str, float]:
    """Turn summed statistics (over batches and processes) into metrics.

    Acceptance is what the verifier would give, against its full-vocabulary distribution `p_full`:
    `accept_rate_k` = mean `sum_{v in Vd} min(p_full, q)` = `1 - TV(p_full, q)` (sampled drafts);
    `accept_len` = mean over blocks of `1 + sum_k prod_{j<=k} accept_j` (expected accepted length under teacher
    forcing, bonus included); `pos_k` = mean survival to slot k (vLLM's per-position acceptance); the greedy
    variants count argmax agreement with the verifier's full-vocabulary argmax (a draft can only match when that
    argmax is a draft token). `restricted_accept_*` are the same against the teacher renormalised over the draft
    vocabulary (an upper bound that ignores the verifier's mass elsewhere); `draft_vocab_coverage` is the mean of
    that mass inside the draft vocabulary. `confidence_*` compare `sigmoid(confidence)` with the confidence
    target; `confidence_target_accept_len` is the accepted length that target implies (the configured drafting
    mode), `confidence_cumprod_bias_k` the mean over blocks reaching slot k of
    `prod_{j<=k} sigmoid(c_j) - prod_{j<=k} target_j`.
    """
    s = dict(zip(stat_names(block_size), stats.double().tolist()))
    slots, blocks = max(s["slots"], 1.0), max(s["blocks"], 1.0)
    out = {
        "loss": s["loss_sum"] / slots,
        "accept_len": s["accept_len_sum"] / blocks,
        "accept_rate": s["accept_rate_sum"] / slots,
        "greedy_accept_len": s["greedy_len_sum"] / blocks,
        "greedy_accept_rate": s["greedy_sum"] / slots,
        "restricted_accept_len": s["restricted_len_sum"] / blocks,
        "restricted_accept_rate": s["restricted_rate_sum"] / slots,
        "draft_vocab_coverage": s["coverage_sum"] / slots,
        "ce": s["ce_sum"] / slots,
        "tv": s["tv_sum"] / slots,
        "kl": s["kl_sum"] / slots,
        "confidence_bce": s["bce_sum"] / slots,
        "confidence_abs_error": s["conf_abs_err_sum"] / slots,
        "confidence_pred_mean": s["conf_pred_sum"] / slots,
        "confidence_target_mean": s["conf_target_sum"] / slots,
        "confidence_target_accept_len": s["conf_target_len_sum"] / blocks,
        "confidence_cumprod_bias": s["conf_cumprod_bias_sum"] / blocks,
        "supervised_slots": s["slots"],
        "blocks": s["blocks"],
    }
    for k in range(block_size):
        n_k = max(s[f"slots_{k}"], 1.0)
        out[f"accept_rate_{k}"] = s[f"accept_rate_sum_{k}"] / n_k
        out[f"greedy_accept_rate_{k}"] = s[f"greedy_sum_{k}"] / n_k
        out[f"pos_{k}"] = s[f"pos_sum_{k}"] / blocks
        out[f"confidence_pred_mean_{k}"] = s[f"conf_pred_sum_{k}"] / n_k
        out[f"confidence_target_mean_{k}"] = s[f"conf_target_sum_{k}"] / n_k
        out[f"confidence_cumprod_bias_{k}"] = s[f"conf_cumprod_bias_sum_{k}"] / n_k
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in out.items()}
